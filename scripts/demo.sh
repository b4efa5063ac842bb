#!/usr/bin/env bash
# `make demo`: the store (SQLite under .demo/), the demo upstreams (payments
# over HTTP, the ledger over gRPC) and Envoy with the idemgate filter
# (envoy/demo.yaml), in the foreground. Each process's lines are prefixed with
# its name. Ctrl-C stops everything.
#
#   Envoy     127.0.0.1:10000   (admin 127.0.0.1:9901); HTTP/1.1 and gRPC
#   payments  127.0.0.1:8080
#   ledger    127.0.0.1:50051   (gRPC, examples/ledger/ledger.py)
#   store     127.0.0.1:8787, and .demo/store.sock for Envoy's callouts
#
# The end-to-end tests' harness starts them (`idemgate-stack demo`,
# tests/src/bin/idemgate-stack.rs: the same start-up and readiness checks as
# every test's stack); this script prints the command line it ran for Envoy
# and for the store, the plain commands an operator runs, and writes the
# stack's addresses and PIDs to .demo/stack.json (and each PID to
# .demo/<name>.pid) while it runs.
#
# `make demo` builds the wasm module and the store first; this script builds the
# payments example and the harness. Run from anywhere; it works from the
# repository root. ENVOY_BIN=/path/to/envoy uses another Envoy (tested: 1.36 to
# 1.40); IDEMGATE_PYTHON another Python with grpcio and grpcio-status (default:
# scripts/setup.sh's .tools/venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${ENVOY_BIN:-.tools/venv/bin/envoy}
PYTHON=${IDEMGATE_PYTHON:-.tools/venv/bin/python}
STACK=target/debug/idemgate-stack
DIR=.demo

say() { printf '[demo] %s\n' "$*"; }

cargo build --quiet -p payments --bins
cargo build --quiet -p e2e --bin idemgate-stack
[[ -f target/idemgate.wasm ]] || scripts/wasm.sh >/dev/null
[[ -x target/debug/idempotency-store ]] || cargo build --quiet -p idemgate-store
if ! "$PYTHON" -c 'import grpc, grpc_status' 2>/dev/null; then
    say "$PYTHON cannot import grpcio and grpcio-status, which the gRPC ledger needs; run scripts/setup.sh" >&2
    exit 1
fi

mkdir -p "$DIR"
rm -f "$DIR/stack.out" "$DIR/stack.json"
mkfifo "$DIR/stack.out"
ENVOY_BIN=$ENVOY IDEMGATE_PYTHON=$PYTHON "$STACK" demo --echo >"$DIR/stack.out" &
stack_pid=$!
# The harness stops every process on SIGINT or SIGTERM, and its own start-up
# too; this script only passes the signal on and waits.
trap 'say stopping; kill -INT "$stack_pid" 2>/dev/null || true' INT
trap 'say stopping; kill -TERM "$stack_pid" 2>/dev/null || true' TERM
finish() { # until the harness has stopped everything; exits with its status
    local status=0
    wait "$stack_pid" || status=$?
    while kill -0 "$stack_pid" 2>/dev/null; do wait "$stack_pid" || status=$?; done
    rm -f "$DIR/stack.out" "$DIR/stack.json" "$DIR"/*.pid
    say "stopped"
    exit "$status"
}

# One JSON line once everything answers; nothing if the start failed.
if ! read -r stack <"$DIR/stack.out"; then
    say "the demo did not start; the reason is above" >&2
    finish
fi
printf '%s\n' "$stack" >"$DIR/stack.json"
envoy_path=$(command -v "$ENVOY" || echo "$ENVOY")
say "Envoy: $envoy_path ($("$ENVOY" --version 2>/dev/null | sed -n 's/.*version: [0-9a-f]*\/\([^/]*\)\/.*/\1/p' | head -1)); the filter is tested on Envoy 1.36 to 1.40"
say "started with:"
# The walkthrough freezes the store by its PID: .demo/<name>.pid.
"$PYTHON" -c 'import json, sys
stack = json.loads(sys.argv[1])
pids = {"envoy": stack["envoy"]["pid"], "store": stack["stores"][0]["pid"]}
pids.update((name, p["pid"]) for name, p in stack["services"].items())
for name, pid in pids.items():
    open(f"{sys.argv[2]}/{name}.pid", "w").write(f"{pid}\n")
commands = stack["commands"]
for name in ("store", "envoy"):
    print(f"[demo]   {commands[name]}")' "$stack" "$DIR"

cat <<'MSG'
[demo] ready: Envoy on http://127.0.0.1:10000 (admin http://127.0.0.1:9901)
[demo]
[demo] Try a payment, then the same request again (a replay, not a second charge):
[demo]
[demo]   TOKEN=$(cat examples/tokens/tenant-a.jwt)
[demo]   curl -si localhost:10000/v1/payments -H "authorization: Bearer $TOKEN" \
[demo]        -H 'idempotency-key: "order-1001"' -H 'content-type: application/json' \
[demo]        -d '{"amount": 4200, "currency": "EUR"}'
[demo]   curl -s localhost:10000/_demo/executions     # what the upstream really executed
[demo]
[demo] gRPC: a transfer through the same Envoy to the ledger, identity from the same
[demo] token (as `authorization: Bearer` metadata). Run it twice: the second answer is a
[demo] replay (the same message, `idempotent-replayed: true` in its metadata):
[demo]
[demo]   .tools/venv/bin/python examples/ledger/ledger.py call localhost:10000 --pretty \
[demo]        --token "$TOKEN" --key transfer-1 --body 'amount=4200;to=acct-7'
[demo]
[demo] Then the same key with another body: FAILED_PRECONDITION, reason KEY_REUSED:
[demo]
[demo]   .tools/venv/bin/python examples/ledger/ledger.py call localhost:10000 --pretty \
[demo]        --token "$TOKEN" --key transfer-1 --body 'amount=9900;to=acct-7'
[demo]   .tools/venv/bin/python examples/ledger/ledger.py call localhost:50051 --pretty \
[demo]        --executions transfer-1              # what the ledger really executed: 1
[demo]
[demo] The full walkthrough, one curl per behaviour: examples/README.md; gRPC: examples/ledger/README.md
[demo] Ctrl-C stops everything.
MSG

# Until Ctrl-C, or until a process stops on its own (the harness says which).
finish
