#!/usr/bin/env bash
# `make bench`: every scenario side by side, in one run, on loopback, at one
# fixed concurrency, then bench/report.py turns the numbers into
# bench/results/latest.{md,svg,json} and the README's Performance section.
#
#   1 baseline     Envoy without the filter -> upstream, run just before each
#                  of 2-5 (the ratios of each are to its own baseline run)
#   2 uncovered    Envoy + filter, a route no policy covers
#   3 sqlite       Envoy + filter + store on SQLite, a new key per request
#                  (streaming forwarding: through Envoy's router)
#   3a             3 with detached forwarding (/pay-detached: the filter makes
#                  the upstream call itself), on a fresh SQLite file
#   3b             3 with SQLite synchronous=normal (what the fsync costs)
#   4 postgres     the same with the store on PostgreSQL
#   5 replay       retries of completed keys (store on SQLite)
#   6 peer         the same handler behind express-idempotency + Redis, new keys
#                  (its own baseline, "peer-base", is the handler without it)
#   + the duplicate-execution probe: 50 identical requests at once, one key,
#     a 200 ms handler, for the peer and for idemgate.
#
# Knobs (environment): BENCH_SECONDS (15) per measurement (split over
# BENCH_ROUNDS (3) alternating rounds for 2-5), BENCH_WARMUP (2) per run,
# BENCH_CONCURRENCY (32 connections), BENCH_THREADS (1 wrk thread),
# ENVOY_BIN, IDEMGATE_STORE_BIN (target/release/idempotency-store),
# IDEMGATE_WASM (target/idemgate.wasm), BENCH_OUT (bench/results), BENCH_README
# (README.md: its Performance section is rewritten), BENCH_LATENCY_SECONDS (6,
# the one-connection run after each measurement), BENCH_KEEP=1 keeps the work dir.
# Installs what is missing (wrk via scripts/setup.sh bench; redis-server,
# Node.js and the peer's npm packages here) and says what it installs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

SECS=${BENCH_SECONDS:-15}
LAT_SECS=${BENCH_LATENCY_SECONDS:-6}
ROUNDS=${BENCH_ROUNDS:-3}
WARMUP=${BENCH_WARMUP:-2}
CONC=${BENCH_CONCURRENCY:-32}
THREADS=${BENCH_THREADS:-1}
ENVOY=${ENVOY_BIN:-$ROOT/.tools/venv/bin/envoy}
STORE_BIN=${IDEMGATE_STORE_BIN:-$ROOT/target/release/idempotency-store}
WASM=${IDEMGATE_WASM:-$ROOT/target/idemgate.wasm}
OUT=${BENCH_OUT:-$ROOT/bench/results}
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
command -v wrk >/dev/null || need+=(wrk)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v curl >/dev/null || need+=(curl)
((${#need[@]})) && install_debs "${need[@]}"
if [[ ! -d bench/peer/node_modules/express-idempotency-redis-adapter ]]; then
    echo "bench: installing the peer's npm packages (express, express-idempotency, express-idempotency-redis-adapter) into bench/peer/node_modules"
    (cd bench/peer && npm ci --no-audit --no-fund --loglevel=error)
fi
for f in "$STORE_BIN" "$WASM"; do
    [[ -e $f ]] || { echo "bench: $f is missing (make bench builds it)" >&2; exit 1; }
done

# ---------------------------------------------------------------- processes
W=$(mktemp -d /tmp/idemgate-bench.XXXXXX)
chmod 755 "$W"
pids=()
pg_data=
cleanup() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    if [[ -n $pg_data ]]; then pg pg_ctl -D "$pg_data" -m fast stop >/dev/null 2>&1 || true; fi
    if [[ -z ${BENCH_KEEP:-} ]]; then rm -rf "$W"; else echo "bench: kept $W"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_http() { # url what
    local i
    for ((i = 0; i < 600; i++)); do
        curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
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
stop() { # pid
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
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

UP_PORT=$(free_port)
PEER_PORT=$(free_port)
STORE_PORT=$(free_port)
REDIS_PORT=$(free_port)
PG_PORT=$(free_port)
declare -A port admin pid_of
port[without]=$(free_port) admin[without]=$(free_port)
port[with]=$(free_port) admin[with]=$(free_port)

envoy_config() { # with|without -> path
    local f=$W/envoy-$1.yaml
    sed -e "s|@PORT@|${port[$1]}|; s|@ADMIN_PORT@|${admin[$1]}|; s|@UPSTREAM_PORT@|$UP_PORT|" \
        -e "s|@STORE_PORT@|$STORE_PORT|; s|@WASM@|$WASM|" bench/envoy.yaml >"$f"
    if [[ $1 == without ]]; then
        sed -i '/# BEGIN idemgate/,/# END idemgate/d' "$f"
    fi
    echo "$f"
}
start_envoy() { # with|without
    local cfg
    cfg=$(envoy_config "$1")
    start "envoy-$1" "$ENVOY" -c "$cfg" --concurrency 2 --disable-hot-restart -l warn
    pid_of[$1]=$last_pid
    wait_http "http://127.0.0.1:${admin[$1]}/ready" "Envoy ($1 the filter)"
    sleep 1
    read -r rss _ < <(mem "$last_pid")
    record "{\"envoy_idle\":{\"$1\":$rss}}"
}
start_store() { # database-url [flags]
    start store env RUST_LOG=warn "$STORE_BIN" serve --listen "127.0.0.1:$STORE_PORT" --database-url "$1" \
        --api-token "$API_TOKEN" --admin-token "$ADMIN_TOKEN" "${@:2}"
    store_pid=$last_pid
    wait_http "http://127.0.0.1:$STORE_PORT/readyz" "the store ($1)"
}
filter_stats() { # -> "name value" lines of the filter's counters
    curl -fsS "http://127.0.0.1:${admin[with]}/stats?filter=idemgate" 2>/dev/null |
        sed -n 's/^\(.*idemgate[^:]*\): \([0-9]*\)$/\1 \2/p' || true
}
stats_json() { # -> {"name": value, ...}
    filter_stats | awk 'BEGIN {printf "{"} {printf "%s\"%s\":%s", (NR > 1 ? "," : ""), $1, $2} END {printf "}"}'
}

TICK=$(getconf CLK_TCK)
cpu_ms() { # pid -> user+system CPU time so far, ms
    awk -v t="$TICK" '{printf "%d\n", ($14 + $15) * 1000 / t}' "/proc/$1/stat" 2>/dev/null || echo 0
}
# wrk: warm-up (unmeasured), the measurement at $CONC connections, then
# $LAT_SECS at one connection (latency without queueing). Prints three JSON
# lines: the measurement, the CPU time each process in $cpu_pids (name=pid)
# spent during it, and the one-connection run.
load() { # url mode prefix [pool]
    local before=() after=() p i cpu=
    wrk -t"$THREADS" -c"$CONC" -d"${WARMUP}s" -s bench/lua/post.lua "$1" -- "$2" "$3-warm" "${4:-1000}" >/dev/null
    for p in $cpu_pids; do before+=("$(cpu_ms "${p#*=}")"); done
    wrk -t"$THREADS" -c"$CONC" -d"${SECS}s" -s bench/lua/post.lua "$1" -- "$2" "$3" "${4:-1000}" | tail -1
    for p in $cpu_pids; do after+=("$(cpu_ms "${p#*=}")"); done
    i=0
    for p in $cpu_pids; do
        cpu+="${cpu:+,}\"${p%%=*}\":$((after[i] - before[i]))"
        i=$((i + 1))
    done
    echo "{$cpu}"
    wrk -t1 -c1 -d"${LAT_SECS}s" -s bench/lua/post.lua "$1" -- "$2" "$3-one" "${4:-1000}" | tail -1
}
scenario() { # name envoy(with|without) path mode prefix [pool]  (memory and filter counters)
    local name=$1 envoy=$2 before after result one cpu url="http://127.0.0.1:${port[$2]}$3"
    say "$name: $url ($4 keys, ${SECS}s at $CONC connections, ${LAT_SECS}s at 1)"
    before=$(stats_json)
    cpu_pids="envoy=${pid_of[$envoy]} upstream=$up_pid"
    [[ $envoy == with && -n ${store_pid:-} ]] && cpu_pids+=" store=$store_pid"
    { read -r result; read -r cpu; read -r one; } < <(load "$url" "$4" "$5" "${6:-}")
    after=$(stats_json)
    echo "$result"
    echo "$one"
    echo "CPU ms: $cpu"
    read -r e_rss e_hwm < <(mem "${pid_of[$envoy]}")
    read -r s_rss s_hwm < <(mem "${store_pid:-0}")
    record "{\"scenario\":\"$name\",\"wrk\":$result,\"wrk1\":$one,\"cpu_ms\":$cpu,\"envoy_rss_kb\":$e_rss,\"envoy_hwm_kb\":$e_hwm,\"store_rss_kb\":$s_rss,\"store_hwm_kb\":$s_hwm,\"stats_before\":$before,\"stats_after\":$after}"
}

say "machine: $(nproc) cores; Envoy $("$ENVOY" --version | sed -n 's/.*version: \([^ ]*\).*/\1/p'); $(wrk -v 2>&1 | head -1 | cut -d' ' -f1-2); node $(node --version); $(redis-server --version | cut -d' ' -f1-3); PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}')"
record "{\"meta\":{\"seconds\":$SECS,\"warmup\":$WARMUP,\"rounds\":$ROUNDS,\"latency_seconds\":$LAT_SECS,\"concurrency\":$CONC,\"threads\":$THREADS,\"cores\":$(nproc),\"loadavg\":\"$(cut -d" " -f1-3 /proc/loadavg)\",\"wasm_bytes\":$(stat -c %s "$WASM"),\"date\":\"$(date -u +%Y-%m-%dT%H:%MZ)\",\"envoy\":\"$("$ENVOY" --version | sed -n 's/.*version: \([^ ]*\).*/\1/p' | cut -d/ -f2)\",\"node\":\"$(node --version)\",\"redis\":\"$(redis-server --version | awk '{print $3}' | cut -d= -f2)\",\"postgres\":\"$("$PG_BIN/postgres" --version | awk '{print $3}')\"}}"

# The upstream of every Envoy scenario: the Express handler, alone.
start upstream env BENCH_MODE=plain PORT="$UP_PORT" node bench/peer/app.js
up_pid=$last_pid
wait_http "http://127.0.0.1:$UP_PORT/_bench/ready" "the upstream"

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
        [[ $4 == pool ]] && prefix=$5 # the replay keys stay the completed ones
        scenario "baseline@$1#$r" without /pay unique "b-$1-$r"
        scenario "$1#$r" "$2" "$3" "$4" "$prefix" "${6:-}"
    done
    SECS=$secs LAT_SECS=$lat
}
start_store "sqlite://$W/store.db"
start_envoy without
start_envoy with

# 1 + 2, 1 + 3, 1 + 5: Envoy with the filter, store on SQLite.
paired uncovered with /free unique free
paired sqlite with /pay unique sq
records=$(python3 bench/sqlite_size.py "$W/store.db")
record "{\"sqlite_size\":$records}"
echo "SQLite: $records"

say "replay: completing 1000 keys, then retrying them"
wrk -t1 -c"$CONC" -d2s -s bench/lua/post.lua "http://127.0.0.1:${port[with]}/pay" -- pool rp 1000 >/dev/null
paired replay with /pay pool rp 1000

say "duplicate-execution probe: idemgate (50 at once, one key, 200 ms handler)"
probe=$(node bench/burst.js "http://127.0.0.1:${port[with]}/pay/slow" "burst-idemgate-$$" 50 "http://127.0.0.1:$UP_PORT/_bench/executions")
echo "$probe"
record "{\"probe\":\"idemgate\",\"result\":$probe}"
stop "$store_pid"

# 3a. 3 with detached forwarding: the same requests to /pay-detached, whose
# policy has the filter send the upstream request as its own call to the
# route's cluster and relay the response once the record is complete. On a
# fresh file, as 3 started on one.
start_store "sqlite://$W/store-detached.db"
paired sqlite-detached with /pay-detached unique sd
stop "$store_pid"

# 3b. What SQLite's fsync per group commit costs: the same as 3 on a fresh file
# with synchronous=normal (WAL stays consistent; the last commits may be lost on
# power loss).
start_store "sqlite://$W/store-normal.db" --sqlite-synchronous normal
paired sqlite-normal with /pay unique sn
stop "$store_pid"

# 4. The store on PostgreSQL (same Envoy; the store's cluster points at the same port).
say "PostgreSQL: throwaway cluster on port $PG_PORT"
mkdir -p "$W/pg"
((EUID == 0)) && chown postgres "$W/pg"
pg initdb -D "$W/pg/data" -A trust -U idem >/dev/null
pg_data=$W/pg/data
pg pg_ctl -D "$pg_data" -l "$W/pg/log" -o "-p $PG_PORT -k $W/pg -c listen_addresses=127.0.0.1" -w start >/dev/null
start_store "postgres://idem@127.0.0.1:$PG_PORT/postgres"
paired postgres with /pay unique pg
pgsize=$("$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -At -F' ' \
    -c "SELECT count(*), pg_total_relation_size('idempotency_records') FROM idempotency_records")
record "{\"postgres_size\":{\"records\":${pgsize%% *},\"bytes\":${pgsize##* }}}"
echo "PostgreSQL: records and bytes: $pgsize"
stop "$store_pid"
stop "${pid_of[with]}"
stop "${pid_of[without]}"
store_pid=

# 6. The peer: the same handler behind express-idempotency + Redis, called directly.
say "peer: express-idempotency $(node -p 'require("./bench/peer/node_modules/express-idempotency/package.json").version') with express-idempotency-redis-adapter $(node -p 'require("./bench/peer/node_modules/express-idempotency-redis-adapter/package.json").version')"
start redis redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no
redis_pid=$last_pid
for ((i = 0; i < 100; i++)); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
start peer env BENCH_MODE=peer PORT="$PEER_PORT" REDIS_URL="redis://127.0.0.1:$REDIS_PORT" node bench/peer/app.js
peer_pid=$last_pid
wait_http "http://127.0.0.1:$PEER_PORT/_bench/ready" "the peer"
peer_scenario() { # name port pid
    local result one cpu
    say "$1: direct to Node on :$2 (unique keys, ${SECS}s at $CONC connections, ${LAT_SECS}s at 1)"
    cpu_pids="node=$3 redis=$redis_pid"
    { read -r result; read -r cpu; read -r one; } < <(load "http://127.0.0.1:$2/pay" unique "$1")
    echo "$result"
    echo "$one"
    echo "CPU ms: $cpu"
    read -r n_rss n_hwm < <(mem "$3")
    read -r r_rss r_hwm < <(mem "$redis_pid")
    record "{\"scenario\":\"$1\",\"wrk\":$result,\"wrk1\":$one,\"cpu_ms\":$cpu,\"node_rss_kb\":$n_rss,\"node_hwm_kb\":$n_hwm,\"redis_rss_kb\":$r_rss,\"redis_hwm_kb\":$r_hwm}"
}
peer_scenario peer-base "$UP_PORT" "$up_pid"
used0=$(redis-cli -p "$REDIS_PORT" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p')
peer_scenario peer "$PEER_PORT" "$peer_pid"
used1=$(redis-cli -p "$REDIS_PORT" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p')
keys=$(redis-cli -p "$REDIS_PORT" dbsize)
record "{\"redis_size\":{\"records\":$keys,\"used_memory_delta\":$((used1 - used0))}}"
say "duplicate-execution probe: peer"
probe=$(node bench/burst.js "http://127.0.0.1:$PEER_PORT/pay/slow" "burst-peer-$$" 50 "http://127.0.0.1:$PEER_PORT/_bench/executions")
echo "$probe"
record "{\"probe\":\"peer\",\"result\":$probe}"

say "report"
mkdir -p "$OUT"
cp "$RAW" "$OUT/latest.raw.jsonl"
# Re-render without re-running: python3 bench/report.py bench/results/latest.raw.jsonl bench/results README.md
python3 bench/report.py "$OUT/latest.raw.jsonl" "$OUT" "${BENCH_README:-README.md}"
