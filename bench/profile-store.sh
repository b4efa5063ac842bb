#!/usr/bin/env bash
# Profiles the store's hot path with callgrind (instruction counts: repeatable,
# unlike wall time on a shared machine): the store, built with symbols, serves
# a real Envoy + filter while wrk sends new keys, then retries of them.
#
#   bench/profile-store.sh [sqlite|postgres-url]   -> bench/results/callgrind.*
# Needs valgrind; builds target/bench-profile (release, symbols, no LTO).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECS=${PROFILE_SECONDS:-20}
ENVOY=${ENVOY_BIN:-$ROOT/.tools/venv/bin/envoy}
WASM=${IDEMGATE_WASM:-$ROOT/target/idemgate.wasm}
OUT=${BENCH_OUT:-$ROOT/bench/results}
command -v valgrind >/dev/null || {
    echo "profile: installing valgrind"
    apt-get -q install -y valgrind
}
CARGO_PROFILE_RELEASE_STRIP=false CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    cargo build -q --release -p idemgate-store --bin idempotency-store --target-dir target/bench-profile
BIN=$ROOT/target/bench-profile/release/idempotency-store

W=$(mktemp -d /tmp/idemgate-profile.XXXXXX)
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$W"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_http() { for ((i = 0; i < 900; i++)); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; echo "profile: $1 not ready" >&2; exit 1; }
UP=$(free_port) STORE=$(free_port) PORT=$(free_port) ADMIN=$(free_port)
BENCH_MODE=plain PORT=$UP node bench/peer/app.js >"$W/upstream.log" 2>&1 &
pids+=($!)
db=${1:-sqlite}
[[ $db == sqlite ]] && db=sqlite://$W/store.db
RUST_LOG=warn IDEMGATE_MIGRATE=true valgrind --tool=callgrind --callgrind-out-file="$W/callgrind.out" \
    "$BIN" serve --listen "127.0.0.1:$STORE" --database-url "$db" \
    --api-token bench-api-token --admin-token bench-admin-token >"$W/store.log" 2>&1 &
store_pid=$!
pids+=($store_pid)
sed -e "s|@PORT@|$PORT|; s|@ADMIN_PORT@|$ADMIN|; s|@UPSTREAM_PORT@|$UP|; s|@STORE_PORT@|$STORE|; s|@WASM@|$WASM|" \
    bench/envoy.yaml >"$W/envoy.yaml"
"$ENVOY" -c "$W/envoy.yaml" --concurrency 2 --disable-hot-restart -l warn >"$W/envoy.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$UP/_bench/ready"
wait_http "http://127.0.0.1:$STORE/readyz"
wait_http "http://127.0.0.1:$ADMIN/ready"
echo "== new keys, $SECS s at 4 connections (store under callgrind)"
wrk -t1 -c4 -d"${SECS}s" -s bench/lua/post.lua "http://127.0.0.1:$PORT/pay" -- unique prof | tail -1
echo "== retries of 200 completed keys, $SECS s"
wrk -t1 -c4 -d"${SECS}s" -s bench/lua/post.lua "http://127.0.0.1:$PORT/pay" -- pool rp 200 | tail -1
curl -fsS "http://127.0.0.1:$ADMIN/stats?filter=idemgate.requests_total" | grep -v ': 0$' || true
kill -INT "$store_pid"
wait "$store_pid" 2>/dev/null || true
mkdir -p "$OUT"
cp "$W/callgrind.out" "$OUT/callgrind.out.tmp"
callgrind_annotate --inclusive=yes "$OUT/callgrind.out.tmp" >"$W/inclusive.txt" 2>/dev/null || true
callgrind_annotate "$OUT/callgrind.out.tmp" >"$W/self.txt" 2>/dev/null || true
sed -n 1,90p "$W/inclusive.txt" | cut -c1-260 >"$OUT/callgrind-inclusive.txt"
sed -n 1,70p "$W/self.txt" | cut -c1-260 >"$OUT/callgrind-self.txt"
echo "profile: $OUT/callgrind-inclusive.txt, $OUT/callgrind-self.txt (raw: $OUT/callgrind.out.tmp)"
