#!/usr/bin/env bash
# `make bench`: every scenario side by side, in one run, on loopback, at one
# fixed concurrency, then bench/report.py turns the numbers into
# bench/results/latest.{md,svg,json} (and latest-scale.svg) and the README's
# Performance section.
#
#   1 baseline     Envoy without the filter -> upstream, run just before each
#                  of 2-5 and 7 (the ratios of each are to its own baseline run)
#   1c callout     the callout microbenchmark: a trivial filter (bench/callout)
#                  making 0, 1 or 2 sequential callouts per request to a trivial
#                  server, in alternating rounds: Envoy's CPU per callout; and
#                  a new key's two calls where idemgate makes them, nothing
#                  else (bodies held and sent): the shape's cost to Envoy;
#                  and (C_s, with 3's store up) the same Envoy with the store
#                  in the sink's place: 0 and 2 callouts a request to the
#                  store's /healthz, its HTTP stack deciding nothing
#   2 uncovered    Envoy + filter, a route no policy covers
#   3 sqlite       Envoy + filter + store on SQLite, a new key per request
#                  (streaming forwarding: through Envoy's router)
#   3a             3 with detached forwarding (/pay-detached: the filter makes
#                  the upstream call itself), on a fresh SQLite file
#   3b             3 with SQLite synchronous=normal (what the fsync costs)
#   3c             3 with `settle: background` (/pay-background: the response
#                  goes out at once, the record is completed right after)
#   3u             3 with the store listening on a Unix socket, which a third
#                  Envoy's store cluster reaches through a `pipe` address
#   4 postgres     the same with the store on PostgreSQL; 4b with `settle:
#                  background`; 4cd 4 with the server's commit_delay=100 (and
#                  PostgreSQL's WAL flushes per new key, pg_stat_wal, for
#                  each)
#   5 replay       retries of completed keys (store on SQLite)
#   7 scale        for SQLite, then PostgreSQL: the store empty and pre-filled
#                  with each of $BENCH_SCALE records (bench/fill.py, straight
#                  into the tables), then new keys and replays again (random,
#                  UUID-shaped keys, the sweeper off), then a sweeper catching up
#                  on a day's worth of expiries (archive and purge) under load
#   6 peer         the same handler behind express-idempotency + Redis, new keys
#                  (its own baseline, "peer-base", is the handler without it);
#                  6d the same on a durable Redis (appendonly, appendfsync always);
#                  6p the same handler behind the in-app idempotency of a
#                  PostgreSQL shop (BENCH_MODE=pgpeer: a claim row committed
#                  before the handler, the response saved after it) on 4's
#                  PostgreSQL server, with its WAL syncs per new key
#   8 gRPC         gRPC unary calls (bench/grpc.yaml) through a third pair of
#                  Envoys, with and without the filter, to a trivial Rust gRPC
#                  upstream (idempotency-grpc-bench upstream), store on a fresh
#                  SQLite file: 8a new keys, 8b replays of completed keys, each
#                  alternating with its own gRPC baseline ("grpc-base": the
#                  same calls through the Envoy without the filter) in rounds.
#                  The load generator is idempotency-grpc-bench load (HTTP/2,
#                  a key per call; wrk cannot speak HTTP/2): $CONC calls in
#                  flight over BENCH_GRPC_CONNECTIONS (4) connections, and one
#                  call at a time on one connection.
#   + the duplicate-execution probe: 50 identical requests at once, one key,
#     a 200 ms handler, for the peers (6, 6p) and idemgate, in BENCH_PROBE_ROUNDS
#     (5) rounds of a key each: a race's count varies from try to try.
# The machine's floors, first: the disk's sync (bench/fsync.py) and X, a
# loopback round trip between two processes (idempotency-pingpong,
# BENCH_PINGPONG_ROUND_TRIPS (20000) of them).
# Every Envoy scenario also reads Envoy's counters of the store's cluster
# (upstream_rq_total, upstream_cx_total) and of the filter's requests around
# its measured run: store callouts and connections per covered request.
# Open loop (bench/mechanism.sh): after 5, new keys offered at BENCH_RATE (200)
# a second by idempotency-paced-load through each Envoy in alternating
# rounds, the baseline and 3: CPU per request of every process, the load
# generator's included, at the same offered work; beside them, at the same
# rate, a store call that reaches no decision and 1c's Envoy with none, one
# callout and a new key's two calls a request: what the rate's idle gaps
# make a call cost.
# 3p, pinned (bench/mechanism.sh): 3 and its baseline again at BENCH_PIN_CONCURRENCY
# (32) connections with the store alone on core 0 and wrk, the upstream and
# a pair of Envoys with one worker each on core 1 (taskset).
# Around each one-connection run with the store (bench/mechanism.sh): the
# store's context switches, its stage timers and commit counters (/metrics),
# and Envoy's upstream_rq_time of the store's cluster; for 3 and 3c, the
# store's fsync/fdatasync calls per durable commit (strace, when installed).
#
# Knobs (environment): BENCH_SECONDS (15) per measurement (split over
# BENCH_ROUNDS (3) alternating rounds for 1c-5 and 7), BENCH_WARMUP (2) per run,
# BENCH_CONCURRENCY (32 connections), BENCH_THREADS (1 wrk thread),
# BENCH_SCALE ("1e5 1e6 1e7": record counts of 7, each also with the empty
# store; "" skips 7; a size the free disk cannot hold is skipped and reported),
# BENCH_SCALE_DBS ("sqlite postgres": the databases of 7),
# BENCH_SWEEP_MAX_SECONDS (600: the longest a sweep under load may take),
# ENVOY_BIN, IDEMGATE_STORE_BIN (target/release/idempotency-store),
# IDEMGATE_WASM (target/idemgate.wasm), IDEMGATE_STACK_BIN
# (target/debug/idemgate-stack: the end-to-end tests' harness, which starts
# every Envoy, store and the upstream here), IDEMGATE_CALLOUT_WASM
# (target/callout.wasm), BENCH_OUT (bench/results), BENCH_README
# (README.md: its Performance section is rewritten), BENCH_LATENCY_SECONDS (6,
# the one-connection run after each measurement), BENCH_KEEP=1 keeps the work dir,
# IDEMGATE_GRPC_BENCH_BIN (target/release/idempotency-grpc-bench),
# BENCH_GRPC_CONNECTIONS (4). BENCH_ONLY=grpc runs scenario 8 alone (about
# 2 minutes with the defaults; needs neither wrk, Node, Redis nor PostgreSQL)
# and writes its report to bench/results/only-grpc/ (BENCH_OUT), leaving
# latest.* and the README alone. BENCH_ONLY=floor runs what the latency floor
# needs, at one connection (BENCH_CONCURRENCY defaults to 1, BENCH_SECONDS
# and BENCH_LATENCY_SECONDS to 9): the disk's sync floors, the store alone,
# 1c (the calls' own latency: the floors under 3's and 3c's goals), 3, 3c,
# 3u, 3p, 4, 4b, 4cd, 5, 6a, 6, 6d and 6p, each with its baseline, and the
# fixed-rate rounds, C_s and X, in about 19 minutes; its report goes to
# bench/results/only-floor/. BENCH_ONLY=scale runs 7 alone (BENCH_SCALE and
# BENCH_SCALE_DBS choose what; 1e7 on postgres alone takes about 15
# minutes), its report in bench/results/only-scale/. BENCH_ONLY=bodies
# (bench/bodies.sh): new keys with request and response bodies of
# BENCH_BODIES_KIB ("0.1 4 64 1024") KiB at 1 and BENCH_CONCURRENCY
# connections, store on PostgreSQL, each beside the Envoy without the filter:
# Envoy's CPU and PostgreSQL's WAL bytes per key, in bench/results/only-bodies/.
# BENCH_RATE (200 new keys a second offered in the
# open-loop rounds), BENCH_PIN_CONCURRENCY (32: connections of the pinned run),
# BENCH_STRACE_SECONDS (4: the strace runs).
# Installs what is missing (wrk via scripts/setup.sh bench; redis-server,
# Node.js, strace and the peer's npm packages here) and says what it installs.
#
# Duration with the defaults, on 2 cores: about 60 minutes (59 for the whole
# run at e469949, builds already done; longer when the machine is busy).
# Scenario 7 takes most of it: 16 paired measurements of a minute each,
# filling the stores (10^7 records: about 7 minutes on SQLite, 6 on
# PostgreSQL) and the sweeps (10^7 records: about 1 minute on SQLite, 3 on
# PostgreSQL; a sweep stops at BENCH_SWEEP_MAX_SECONDS if it is not done).
# 10^7 records take about 12 GB of disk on SQLite and 15 GB on PostgreSQL,
# one after the other; a size the free disk cannot hold is skipped.
# BENCH_SCALE="1e5 1e6" takes about 30 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ONLY=${BENCH_ONLY:-}
case $ONLY in
'' | grpc | floor | scale | bodies) ;;
*)
    echo "bench: BENCH_ONLY=$ONLY: the selections are grpc (scenario 8), floor (one connection), scale (scenario 7) and bodies" >&2
    exit 2
    ;;
esac
FLOOR=$([[ $ONLY == floor ]] && echo 1 || true)
SECS=${BENCH_SECONDS:-${FLOOR:+9}}
SECS=${SECS:-15}
LAT_SECS=${BENCH_LATENCY_SECONDS:-${FLOOR:+9}}
LAT_SECS=${LAT_SECS:-6}
ROUNDS=${BENCH_ROUNDS:-3}
WARMUP=${BENCH_WARMUP:-2}
CONC=${BENCH_CONCURRENCY:-${FLOOR:+1}}
CONC=${CONC:-32}
THREADS=${BENCH_THREADS:-1}
PROBE_ROUNDS=${BENCH_PROBE_ROUNDS:-5}
ENVOY=${ENVOY_BIN:-$ROOT/.tools/venv/bin/envoy}
STORE_BIN=${IDEMGATE_STORE_BIN:-$ROOT/target/release/idempotency-store}
WASM=${IDEMGATE_WASM:-$ROOT/target/idemgate.wasm}
CALLOUT_WASM=${IDEMGATE_CALLOUT_WASM:-$ROOT/target/callout.wasm}
GRPC_BIN=${IDEMGATE_GRPC_BENCH_BIN:-$ROOT/target/release/idempotency-grpc-bench}
GRPC_CONNS=${BENCH_GRPC_CONNECTIONS:-4}
STORE_BENCH_BIN=$ROOT/target/release/idempotency-store-bench
STACK_BIN=${IDEMGATE_STACK_BIN:-$ROOT/target/debug/idemgate-stack}
export ENVOY_BIN=$ENVOY IDEMGATE_WASM=$WASM # the harness's Envoy and module
PACED_BIN=$ROOT/target/release/idempotency-paced-load
PINGPONG_BIN=$ROOT/target/release/idempotency-pingpong
RATE=${BENCH_RATE:-200}
SCALE=${BENCH_SCALE-1e5 1e6 1e7}
SCALE_DBS=${BENCH_SCALE_DBS:-sqlite postgres}
SWEEP_MAX=${BENCH_SWEEP_MAX_SECONDS:-600}
# The filter's store timeout in the bench's configuration: the bound on the
# sweep's p99.9.
STORE_TIMEOUT_MS=$(sed -n 's/.*"timeout_ms": *\([0-9]*\).*/\1/p' bench/envoy.yaml | head -1)
OUT=${BENCH_OUT:-$ROOT/bench/results${ONLY:+/only-$ONLY}}
PG_BIN=${PG_BIN:-$(dirname "$(compgen -G '/usr/lib/postgresql/*/bin/initdb' | sort -V | tail -1)")}
API_TOKEN=bench-api-token
ADMIN_TOKEN=bench-admin-token

say() { printf '\n== %s\n' "$*"; }

# ---------------------------------------------------------------- tools
install_debs() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    local sudo=()
    ((EUID == 0)) || sudo=(sudo)
    echo "bench: installing Debian packages: ${missing[*]}"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q update
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q install -y "${missing[@]}"
}
need=()
if [[ $ONLY != grpc ]]; then
    command -v strace >/dev/null || need+=(strace)
    command -v wrk >/dev/null || need+=(wrk)
    command -v redis-server >/dev/null || need+=(redis-server)
    command -v redis-cli >/dev/null || need+=(redis-tools)
    command -v node >/dev/null || need+=(nodejs)
    command -v npm >/dev/null || need+=(npm)
fi
command -v curl >/dev/null || need+=(curl)
((${#need[@]})) && install_debs "${need[@]}"
if [[ $ONLY != grpc && ! -d bench/peer/node_modules/pg ]]; then
    echo "bench: installing the peers' npm packages (express, express-idempotency, express-idempotency-redis-adapter, pg) into bench/peer/node_modules"
    (cd bench/peer && npm ci --no-audit --no-fund --loglevel=error)
fi
needed=("$STORE_BIN" "$WASM" "$STACK_BIN")
[[ $ONLY == floor || $ONLY == scale || $ONLY == bodies ]] || needed+=("$GRPC_BIN")
[[ $ONLY == grpc ]] || needed+=("$STORE_BENCH_BIN" "$PACED_BIN" "$PINGPONG_BIN")
[[ $ONLY == grpc || $ONLY == scale || $ONLY == bodies ]] || needed+=("$CALLOUT_WASM")
for f in "${needed[@]}"; do
    [[ -e $f ]] || { echo "bench: $f is missing (make bench builds it)" >&2; exit 1; }
done

# ---------------------------------------------------------------- processes
W=$(mktemp -d /tmp/idemgate-bench.XXXXXX)
chmod 755 "$W"
pids=()
pg_data=
store_db_cpu=
cleanup() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    if [[ -n $pg_data ]]; then pg pg_ctl -D "$pg_data" -m fast stop >/dev/null 2>&1 || true; fi
    if [[ -z ${BENCH_KEEP:-} ]]; then rm -rf "$W"; else echo "bench: kept $W"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Envoy, the store and the upstream are started by the end-to-end tests'
# harness (`idemgate-stack`, tests/src/bin/idemgate-stack.rs): their ports,
# bootstraps and readiness are its. It prints the stack's JSON line once
# everything answers and stops it cleanly when signalled.
stack() { # name [taskset -c N] idemgate-stack ARGS...; sets $stack (its JSON) and $last_pid (the harness's)
    local out=$W/$1.stack
    rm -f "$out"
    mkfifo "$out"
    "${@:2}" >"$out" 2>"$W/$1.log" &
    last_pid=$!
    pids+=("$last_pid")
    if ! read -r stack <"$out"; then
        echo "bench: $1 did not start ($W/$1.log):" >&2
        tail -n 40 "$W/$1.log" >&2
        BENCH_KEEP=1
        exit 1
    fi
    rm -f "$out"
}
field() { # Python expression over $stack (s) -> its value
    python3 -c 'import json, sys; print(eval(sys.argv[2], {"s": json.loads(sys.argv[1])}))' "$stack" "$1"
}
# The ports of what runs beside the stacks (the peer, Redis, PostgreSQL, the
# gRPC upstream, the callout microbenchmark) and the store's, which every
# store started in turn listens on: reserved by the harness for the whole
# run, so that no test or other stack picks one meanwhile.
stack ports "$STACK_BIN" ports 20
mapfile -t free_ports < <(field '"\n".join(map(str, s["ports"]))')
take_port() { # variable: the next reserved port
    ((${#free_ports[@]})) || { echo "bench: out of reserved ports" >&2; exit 1; }
    printf -v "$1" '%s' "${free_ports[0]}"
    free_ports=("${free_ports[@]:1}")
}
wait_http() { # url what [unix-socket]
    local i
    for ((i = 0; i < 600; i++)); do
        curl -fsS -o /dev/null ${3:+--unix-socket "$3"} "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "bench: $2 did not become ready ($1); logs in $W" >&2
    BENCH_KEEP=1
    exit 1
}
start() { # name cmd... ; sets $last_pid
    "${@:2}" >"$W/$1.log" 2>&1 &
    last_pid=$!
    pids+=("$last_pid")
}
declare -A stack_of # the harness holding each process it started, by PID
stop() { # pid (of a stack's process: its whole stack)
    local p=${stack_of[$1]:-$1}
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
}
mem() { # pid -> "rss_kb hwm_kb"
    awk '/^VmRSS:/ {r=$2} /^VmHWM:/ {h=$2} END {print r+0, h+0}' "/proc/$1/status" 2>/dev/null || echo "0 0"
}
pg() { # run a PostgreSQL tool, as the postgres user when we are root
    local tool=$1
    shift
    if ((EUID == 0)); then runuser -u postgres -- "$PG_BIN/$tool" "$@"; else "$PG_BIN/$tool" "$@"; fi
}

RAW=$W/raw.jsonl
: >"$RAW"
record() { # JSON object
    echo "$1" >>"$RAW"
}

take_port UP_PORT
take_port STORE_PORT
STORE_SOCKET=$W/store.sock
take_port REDIS_PORT
take_port PG_PORT
declare -A port admin pid_of

start_envoy() { # with|without|with-unix|pin-with|pin-without|grpc-with|grpc-without [bootstrap upstream-port]
    local flags=(--bootstrap "${2:-bench/envoy.yaml}" --upstream-port "${3:-$UP_PORT}" --no-store
        --workers "${ENVOY_WORKERS:-2}")
    [[ $1 != *without ]] || flags+=(--without-filter)
    # 3u: the store's cluster reaches it on its Unix socket.
    if [[ $1 == with-unix ]]; then flags+=(--store-socket "$STORE_SOCKET"); else flags+=(--store-port "$STORE_PORT"); fi
    stack "envoy-$1" ${PIN_PROXY:+taskset -c "$PIN_PROXY"} "$STACK_BIN" bench "${flags[@]}"
    pid_of[$1]=$(field 's["envoy"]["pid"]')
    port[$1]=$(field 's["envoy"]["port"]')
    admin[$1]=$(field 's["envoy"]["admin"]')
    stack_of[${pid_of[$1]}]=$last_pid
    record_idle "$1" "${pid_of[$1]}"
}
record_idle() { # name pid: an Envoy's resident size a second after it is ready
    local rss
    sleep 1
    read -r rss _ < <(mem "$2")
    record "{\"envoy_idle\":{\"$1\":$rss}}"
}
start_store() { # database-url [flags]; the server's CPU is counted for PostgreSQL
    store_db_cpu=
    [[ $1 == postgres://* ]] && store_db_cpu=" postgres=pg:$(head -1 "$pg_data/postmaster.pid")"
    # A fresh PostgreSQL database has no schema yet: the harness's store
    # migrates it (in production `idempotency-store migrate` does, as the
    # schema's owner). With $store_unix set, it listens on $STORE_SOCKET too.
    stack store ${PIN_STORE:+taskset -c "$PIN_STORE"} "$STACK_BIN" store --store-bin "$STORE_BIN" \
        --database "$1" --store-port "$STORE_PORT" ${store_unix:+--store-socket "$STORE_SOCKET"} \
        --api-token "$API_TOKEN" --admin-token "$ADMIN_TOKEN" -- "${@:2}"
    store_pid=$(field 's["stores"][0]["pid"]')
    stack_of[$store_pid]=$last_pid
}
# How a run is measured (load, CPU, counters, memory): bench/measure.sh.
# shellcheck source=bench/measure.sh
source bench/measure.sh

# Versions of what this run uses ("none" for what BENCH_ONLY leaves out).
v_envoy=$("$ENVOY" --version | sed -n 's/.*version: \([^ ]*\).*/\1/p')
v_wrk=$(command -v wrk >/dev/null && { wrk -v 2>&1 || true; } | head -1 | cut -d' ' -f1-2 || echo "wrk none")
v_node=$(command -v node >/dev/null && node --version || echo none)
v_redis=$(command -v redis-server >/dev/null && redis-server --version | awk '{print $3}' | cut -d= -f2 || echo none)
v_pg=$([[ -x $PG_BIN/postgres ]] && "$PG_BIN/postgres" --version | awk '{print $3}' || echo none)
say "machine: $(nproc) cores; Envoy $v_envoy; $v_wrk; node $v_node; Redis $v_redis; PostgreSQL $v_pg${ONLY:+; only: $ONLY}"
record "{\"meta\":{\"seconds\":$SECS,\"warmup\":$WARMUP,\"rounds\":$ROUNDS,\"latency_seconds\":$LAT_SECS,\"concurrency\":$CONC,\"threads\":$THREADS,\"cores\":$(nproc),\"loadavg\":\"$(cut -d" " -f1-3 /proc/loadavg)\",\"wasm_bytes\":$(stat -c %s "$WASM"),\"date\":\"$(date -u +%Y-%m-%dT%H:%MZ)\",\"envoy\":\"$(cut -d/ -f2 <<<"$v_envoy")\",\"node\":\"$v_node\",\"redis\":\"$v_redis\",\"postgres\":\"$v_pg\",\"store_timeout_ms\":$STORE_TIMEOUT_MS,\"scale\":\"$SCALE\",\"only\":\"$ONLY\",\"grpc_connections\":$GRPC_CONNS}}"

# The upstream of every HTTP Envoy scenario: the Express handler, alone.
if [[ $ONLY != grpc ]]; then
    stack upstream "$STACK_BIN" bench --express --upstream-port "$UP_PORT" --no-store --no-envoy
    up_pid=$(field 's["services"]["upstream"]["pid"]')
    stack_of[$up_pid]=$last_pid
fi

# Both Envoys run side by side (they differ by the filter only). Every filter
# scenario alternates with the baseline in $ROUNDS rounds (baseline, scenario,
# baseline, scenario, ...), each a share of $SECS; its ratios are the median of
# the per-round ratios, so load from elsewhere on a shared machine affects both
# sides alike.
paired() { # name envoy path mode prefix [pool]
    local r secs=$SECS lat=$LAT_SECS prefix
    SECS=$(((secs + ROUNDS - 1) / ROUNDS))
    LAT_SECS=$(((lat + ROUNDS - 1) / ROUNDS))
    for ((r = 1; r <= ROUNDS; r++)); do
        prefix=$5-$r
        [[ $4 == pool || $4 == spool || $4 == replay ]] && prefix=$5 # the replay keys stay the completed ones
        scenario "${BASE_NAME:-baseline}@$1#$r" "${BASE_ENVOY:-without}" "${BASE_PATH:-/pay}" unique "b-$1-$r"
        scenario "$1#$r" "$2" "$3" "$4" "$prefix" "${6:-}"
    done
    SECS=$secs LAT_SECS=$lat
}

# The mechanism of a new key at one connection: bench/mechanism.sh.
# shellcheck source=bench/mechanism.sh
source bench/mechanism.sh

# 8. gRPC unary calls: a pair of Envoys of their own (bench/grpc.yaml, with
# and without the filter) in front of a trivial Rust gRPC upstream, the store
# on a fresh SQLite file. New keys, then replays of 1000 completed keys, each
# alternating with its own baseline: the same calls (new keys) through the
# Envoy without the filter ("grpc-base@..."). The load generator is
# idempotency-grpc-bench load, and the HTTP scenarios' Express upstream is
# not in the path (its CPU is not counted).
GRPC_PATH=/bench.v1.Ledger/Transfer
grpc_scenarios() {
    local http_up_pid=${up_pid:-} grpc_up_port i
    take_port grpc_up_port
    start grpc-upstream "$GRPC_BIN" upstream --listen "127.0.0.1:$grpc_up_port"
    up_pid=$last_pid
    for ((i = 0; i < 100; i++)); do
        grep -q listening "$W/grpc-upstream.log" 2>/dev/null && break
        sleep 0.1
    done
    start_store "sqlite://$W/store-grpc.db"
    for e in grpc-without grpc-with; do
        start_envoy "$e" bench/grpc.yaml "$grpc_up_port"
    done
    LOADER=grpc filter_envoy=grpc-with BASE_NAME=grpc-base BASE_ENVOY=grpc-without BASE_PATH=$GRPC_PATH
    paired grpc-new grpc-with "$GRPC_PATH" unique gn
    say "gRPC replay: completing 1000 keys, then retrying them"
    "$GRPC_BIN" load --target "127.0.0.1:${port[grpc-with]}" --path "$GRPC_PATH" --mode pool --pool 1000 --prime \
        --prefix grp --connections "$GRPC_CONNS" --streams "$CONC" --warmup 0 --seconds 0 >/dev/null
    paired grpc-replay grpc-with "$GRPC_PATH" replay grp 1000
    LOADER= filter_envoy= BASE_NAME= BASE_ENVOY= BASE_PATH=
    stop "${pid_of[grpc-with]}"
    stop "${pid_of[grpc-without]}"
    stop "$up_pid"
    stop "$store_pid"
    store_pid=
    up_pid=$http_up_pid
}

report() { # the raw lines -> $OUT (and, for a whole run, the README's Performance section)
    say "report"
    mkdir -p "$OUT"
    cp "$RAW" "$OUT/latest.raw.jsonl"
    # Re-render without re-running: python3 bench/report.py bench/results/latest.raw.jsonl bench/results README.md
    python3 bench/report.py "$OUT/latest.raw.jsonl" "$OUT" "$1"
}

if [[ $ONLY == grpc ]]; then
    grpc_scenarios
    report "${BENCH_README:-}"
    exit 0
fi

# The scenarios themselves (peer, SQLite, PostgreSQL): bench/scenarios.sh.
# shellcheck source=bench/scenarios.sh
source bench/scenarios.sh
# shellcheck source=bench/scale.sh
source bench/scale.sh

if [[ $ONLY == scale ]]; then
    pg_cluster
    start_envoy without
    start_envoy with
    scale_points
    stop "${pid_of[with]}"
    stop "${pid_of[without]}"
    report "${BENCH_README:-}"
    exit 0
fi

if [[ $ONLY == bodies ]]; then
    # shellcheck source=bench/bodies.sh
    source bench/bodies.sh
    bodies_scenarios
    report "${BENCH_README:-}"
    exit 0
fi

if [[ $ONLY == floor ]]; then
    machine_floors
    store_alone
    callout_scenarios
    start_store "sqlite://$W/store.db"
    start_envoy without
    start_envoy with
    sqlite_new_keys
    store_callout_scenarios
    stop "$store_pid"
    fresh_sqlite sqlite-background /pay-background sg store-background.db
    unix_scenario
    pinned_scenario
    pg_cluster
    pg_scenarios
    stop "${pid_of[with]}"
    stop "${pid_of[without]}"
    peer_scenarios
    report "${BENCH_README:-}"
    exit 0
fi

callout_scenarios

start_store "sqlite://$W/store.db"
start_envoy without
start_envoy with

# 1 + 2, 1 + 3, 1 + 5: Envoy with the filter, store on SQLite.
paired uncovered with /free unique free
sqlite_new_keys
store_callout_scenarios

say "duplicate-execution probe: idemgate (50 at once, one key, 200 ms handler, $PROBE_ROUNDS rounds)"
probe=$(node bench/burst.js "http://127.0.0.1:${port[with]}/pay/slow" "burst-idemgate-$$" 50 "http://127.0.0.1:$UP_PORT/_bench/executions" "$PROBE_ROUNDS")
echo "$probe"
record "{\"probe\":\"idemgate\",\"result\":$probe}"
stop "$store_pid"

# 3a. 3 with detached forwarding: the same requests to /pay-detached, whose
# policy has the filter send the upstream request as its own call to the
# route's cluster and relay the response once the record is complete.
fresh_sqlite sqlite-detached /pay-detached sd store-detached.db
# 3b. What SQLite's fsync per group commit costs: synchronous=normal (WAL
# stays consistent; the last commits may be lost on power loss).
fresh_sqlite sqlite-normal /pay sn store-normal.db --sqlite-synchronous normal
# 3c. 3 with `settle: background`: the response is not held for the
# completion's round trip (and its commit); a new key waits for the claim only.
fresh_sqlite sqlite-background /pay-background sg store-background.db
unix_scenario
pinned_scenario

grpc_scenarios
machine_floors
store_alone
pg_cluster
pg_scenarios

if [[ -n ${SCALE// /} ]]; then scale_points; fi
stop "${pid_of[with]}"
stop "${pid_of[without]}"
peer_scenarios
report "${BENCH_README:-README.md}"
