#!/usr/bin/env bash
# Profiles the store's hot path with callgrind (instruction counts: repeatable,
# unlike wall time on a shared machine): the store, built with symbols, serves
# a real Envoy + filter while wrk sends new keys, then retries of them.
#
#   bench/profile-store.sh [sqlite|postgres-url]   -> bench/results/callgrind.*
# Needs valgrind; builds target/bench-profile (release, symbols, no LTO). The
# stack (Envoy on bench/envoy.yaml, the store under callgrind, the bench's
# Express upstream) is the end-to-end tests' harness's: `idemgate-stack bench`
# (tests/src/bin/idemgate-stack.rs). PROFILE_SECONDS (20) per run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECS=${PROFILE_SECONDS:-20}
export ENVOY_BIN=${ENVOY_BIN:-$ROOT/.tools/venv/bin/envoy}
export IDEMGATE_WASM=${IDEMGATE_WASM:-$ROOT/target/idemgate.wasm}
OUT=${BENCH_OUT:-$ROOT/bench/results}
STACK_BIN=$ROOT/target/debug/idemgate-stack
command -v valgrind >/dev/null || {
    echo "profile: installing valgrind"
    apt-get -q install -y valgrind
}
CARGO_PROFILE_RELEASE_STRIP=false CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    cargo build -q --release -p idemgate-store --bin idempotency-store --target-dir target/bench-profile
cargo build -q -p e2e --bin idemgate-stack
BIN=$ROOT/target/bench-profile/release/idempotency-store

W=$(mktemp -d /tmp/idemgate-profile.XXXXXX)
stack_pid=
cleanup() {
    if [[ -n $stack_pid ]]; then
        kill "$stack_pid" 2>/dev/null || true
        wait "$stack_pid" 2>/dev/null || true
    fi
    rm -rf "$W"
}
trap cleanup EXIT
mkfifo "$W/stack.out"
"$STACK_BIN" bench --express --database "${1:-sqlite}" --store-bin "$BIN" \
    --store-wrapper "valgrind --tool=callgrind --callgrind-out-file=$W/callgrind.out" >"$W/stack.out" 2>"$W/stack.log" &
stack_pid=$!
read -r stack <"$W/stack.out" || {
    echo "profile: the stack did not start:" >&2
    tail -n 40 "$W/stack.log" >&2
    exit 1
}
field() { python3 -c 'import json, sys; print(eval(sys.argv[2], {"s": json.loads(sys.argv[1])}))' "$stack" "$1"; }
PORT=$(field 's["envoy"]["port"]') ADMIN=$(field 's["envoy"]["admin"]')
echo "== new keys, $SECS s at 4 connections (store under callgrind)"
wrk -t1 -c4 -d"${SECS}s" -s bench/lua/post.lua "http://127.0.0.1:$PORT/pay" -- unique prof | tail -1
echo "== retries of 200 completed keys, $SECS s"
wrk -t1 -c4 -d"${SECS}s" -s bench/lua/post.lua "http://127.0.0.1:$PORT/pay" -- pool rp 200 | tail -1
curl -fsS "http://127.0.0.1:$ADMIN/stats?filter=idemgate.requests_total" | grep -v ': 0$' || true
# The harness stops the store with SIGTERM; callgrind writes its profile as it exits.
kill -TERM "$stack_pid"
wait "$stack_pid" || true
stack_pid=
mkdir -p "$OUT"
cp "$W/callgrind.out" "$OUT/callgrind.out.tmp"
callgrind_annotate --inclusive=yes "$OUT/callgrind.out.tmp" >"$W/inclusive.txt" 2>/dev/null || true
callgrind_annotate "$OUT/callgrind.out.tmp" >"$W/self.txt" 2>/dev/null || true
sed -n 1,90p "$W/inclusive.txt" | cut -c1-260 >"$OUT/callgrind-inclusive.txt"
sed -n 1,70p "$W/self.txt" | cut -c1-260 >"$OUT/callgrind-self.txt"
echo "profile: $OUT/callgrind-inclusive.txt, $OUT/callgrind-self.txt (raw: $OUT/callgrind.out.tmp)"
