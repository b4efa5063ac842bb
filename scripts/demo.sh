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
# `make demo` builds the wasm module and the store first; this script builds the
# payments example. Run from anywhere; it works from the repository root.
# ENVOY_BIN=/path/to/envoy uses another Envoy (tested: 1.36 to 1.40); IDEMGATE_PYTHON
# another Python with grpcio and grpcio-status (default: scripts/setup.sh's
# .tools/venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${ENVOY_BIN:-.tools/venv/bin/envoy}
STORE=target/debug/idempotency-store
PAYMENTS=target/debug/payments
PYTHON=${IDEMGATE_PYTHON:-.tools/venv/bin/python}
LEDGER=examples/ledger/ledger.py
DIR=.demo
API_TOKEN=demo-api-token     # the same as store.token in envoy/demo.yaml
ADMIN_TOKEN=demo-admin-token

say() { printf '[demo] %s\n' "$*"; }

cargo build --quiet -p payments --bins
[[ -f target/idemgate.wasm ]] || scripts/wasm.sh >/dev/null
[[ -x $STORE ]] || cargo build --quiet -p idemgate-store
if ! "$PYTHON" -c 'import grpc, grpc_status' 2>/dev/null; then
    say "$PYTHON cannot import grpcio and grpcio-status, which the gRPC ledger needs; run scripts/setup.sh" >&2
    exit 1
fi

for port in 10000 9901 8787 8080 50051; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        say "port $port is already in use (another demo still running?); stop that first" >&2
        exit 1
    fi
done

# A fresh store each time: the upstream's payments live in memory, so records
# from an earlier run would replay payments it no longer knows.
mkdir -p "$DIR"
rm -f "$DIR"/store.db "$DIR"/store.db-* "$DIR"/store.sock

pids=()    # the four services
loggers=() # one line-prefixing sed per service
start() { # name command...
    local name=$1 fifo="$DIR/$1.out"
    shift
    rm -f "$fifo"
    mkfifo "$fifo"
    sed -u "s/^/[$name] /" <"$fifo" &
    loggers+=($!)
    "$@" >"$fifo" 2>&1 &
    pids+=($!)
    echo $! >"$DIR/$name.pid"
}

stopping=0
stop() {
    ((stopping)) && return
    stopping=1
    say "stopping"
    local pid i
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for ((i = 0; i < 100; i++)); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    wait "${pids[@]}" 2>/dev/null || true
    # The loggers end when their service's output closes; wait so no line is lost.
    wait "${loggers[@]}" 2>/dev/null || true
    rm -f "$DIR"/*.pid "$DIR"/*.out
    say "stopped"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

ready() { # name url: poll until it answers 200, fail if the process died
    local name=$1 url=$2 i
    for ((i = 0; i < 300; i++)); do
        curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null && return 0
        kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null || {
            say "$name exited during start-up; its log is above" >&2
            exit 1
        }
        sleep 0.1
    done
    say "$name did not become ready at $url within 30 s" >&2
    exit 1
}
listening() { # name port: poll until it accepts connections (a gRPC server)
    local name=$1 port=$2 i
    for ((i = 0; i < 300; i++)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null || {
            say "$name exited during start-up; its log is above" >&2
            exit 1
        }
        sleep 0.1
    done
    say "$name did not listen on 127.0.0.1:$port within 30 s" >&2
    exit 1
}

start store env RUST_LOG="${RUST_LOG:-info}" "$STORE" serve --listen 127.0.0.1:8787 --listen unix:"$DIR"/store.sock \
    --database-url "sqlite://$DIR/store.db" --api-token "$API_TOKEN" --admin-token "$ADMIN_TOKEN"
start payments "$PAYMENTS" --listen 127.0.0.1:8080
start ledger "$PYTHON" -u "$LEDGER" serve 50051
ready store http://127.0.0.1:8787/readyz
ready payments http://127.0.0.1:8080/_demo/executions
listening ledger 50051
envoy_path=$(command -v "$ENVOY" || echo "$ENVOY")
say "Envoy: $envoy_path ($("$ENVOY" --version 2>/dev/null | sed -n 's/.*version: [0-9a-f]*\/\([^/]*\)\/.*/\1/p' | head -1)); the filter is tested on Envoy 1.36 to 1.40"
start envoy "$ENVOY" -c envoy/demo.yaml --disable-hot-restart --concurrency 2 \
    -l warn --component-log-level wasm:info --log-format '%l: %v'
ready envoy http://127.0.0.1:9901/ready

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

# Until Ctrl-C, or until one of them stops on its own.
wait -n "${pids[@]}" || true
say "a process exited on its own; its log is above"
exit 1
