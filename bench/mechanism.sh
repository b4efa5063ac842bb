# Sourced by scripts/bench.sh: what a new key costs inside the store at one
# connection, and the scenarios that isolate it (3u: the store on a Unix
# socket; 4cd: PostgreSQL's commit_delay). Uses bench.sh's helpers and state
# ($W, $store_pid, $STORE_PORT, record, paired, start_store, ...).

# Around the one-connection run of a scenario whose Envoy calls the store
# ($mech_admin: that Envoy's admin port, set by `scenario`): the store's
# context switches, its /metrics and Envoy's upstream_rq_time of the store's
# cluster (bench/mechanism.py), recorded as one "mechanism" line per run.
mech_snapshot() { # before|after
    [[ -n ${mech_admin:-} ]] || return 0
    local snap
    snap=$(python3 bench/mechanism.py "$store_pid" "http://127.0.0.1:$STORE_PORT" "$mech_admin" \
        ${store_unix:+"$STORE_SOCKET"} 2>>"$W/mechanism.log") || snap=null
    if [[ $1 == before ]]; then
        mech_before=$snap
    else
        record "{\"mechanism\":{\"scenario\":\"$name\",\"before\":${mech_before:-null},\"after\":$snap}}"
    fi
}

# The writer's commits, durable commits and WAL checkpoints so far, from the
# store's /metrics: {"commits": n, "durable": n, "checkpoints": n}.
store_counters() {
    curl -fsS ${store_unix:+--unix-socket "$STORE_SOCKET"} "http://127.0.0.1:$STORE_PORT/metrics" 2>/dev/null | awk '
        $1 == "idemgate_store_write_commits_total" {c = $2}
        $1 == "idemgate_store_write_durable_commits_total" {d = $2}
        $1 == "idemgate_store_wal_checkpoints_total" {k = $2}
        END {printf "{\"commits\":%d,\"durable\":%d,\"checkpoints\":%d}\n", c, d, k}'
}

# Syncs per durable batch: the store's fsync and fdatasync calls (every
# thread, `strace -f`) while new keys arrive at one connection for
# $BENCH_STRACE_SECONDS, against its durable commits meanwhile, those of the
# checkpointer's thread (a checkpoint's, not a batch's) counted apart. Under
# strace every call is slower: these runs count, they time nothing.
syncs_per_batch() { # name path prefix
    if ! command -v strace >/dev/null; then
        record "{\"syncs\":{\"scenario\":\"$1\",\"error\":\"no strace\"}}"
        return 0
    fi
    local out=$W/strace-$1.txt tracer c0 c1 calls checkpointer secs=${BENCH_STRACE_SECONDS:-4}
    say "$1: the store's sync calls under strace, new keys at one connection for ${secs}s"
    strace -f -e trace=fdatasync,fsync -o "$out" -p "$store_pid" 2>>"$W/strace.log" &
    tracer=$!
    sleep 1
    c0=$(store_counters)
    wrk -t1 -c1 -d"${secs}s" -s bench/lua/post.lua "http://127.0.0.1:${port[${filter_envoy:-with}]}$2" \
        -- unique "$3" >/dev/null
    sleep 0.5 # completions after the last response (settle: background)
    c1=$(store_counters)
    # Thread names are cut to 15 characters: "sqlite-checkpointer" reads "sqlite-checkpoi".
    checkpointer=$(grep -l '^sqlite-checkpoi' /proc/"$store_pid"/task/*/comm 2>/dev/null | cut -d/ -f5 | paste -sd,)
    kill -INT "$tracer" 2>/dev/null || true
    wait "$tracer" 2>/dev/null || true
    # Each call once, where it starts: "TID fdatasync(7) = 0" or "TID fdatasync(7 <unfinished ...>".
    calls=$(awk -v ck=",$checkpointer," '
        match($2, /^(fdatasync|fsync)\(/) {
            n[(index(ck, "," $1 ",") ? "checkpointer_" : "") substr($2, 1, RLENGTH - 1)]++
        }
        END {for (k in n) printf "%s\"%s\":%d", (m++ ? "," : ""), k, n[k]}' "$out" 2>/dev/null)
    echo "sync calls {$calls}; store counters before $c0, after $c1"
    record "{\"syncs\":{\"scenario\":\"$1\",\"calls\":{$calls},\"before\":$c0,\"after\":$c1}}"
}

# 3u. 3 with the store on a Unix socket: its own Envoy (with-unix) whose
# store cluster is a `pipe` address, on a fresh SQLite file.
unix_scenario() {
    store_unix=1
    start_store "sqlite://$W/store-unix.db"
    start_envoy with-unix
    filter_envoy=with-unix
    paired sqlite-unix with-unix /pay unique su
    filter_envoy=
    stop "${pid_of[with-unix]}"
    stop "$store_pid"
    store_pid= store_unix=
}

# PostgreSQL: a server setting changed with the server running (ALTER
# SYSTEM, then a reload); without a value, back to its default.
pg_conf() { # name [value]
    local sql="ALTER SYSTEM RESET $1"
    [[ -z ${2:-} ]] || sql="ALTER SYSTEM SET $1 = $2"
    "$PG_BIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -v ON_ERROR_STOP=1 \
        -c "$sql" -c "SELECT pg_reload_conf()" >/dev/null
    echo "PostgreSQL: $1 = $("$PG_BIN/psql" -X -At -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -c "SHOW $1")"
}
# The server's WAL syncs so far (pg_stat_wal.wal_sync) and the new keys the
# filter owned so far. A backend reports its WAL counts when it turns idle,
# at most once a second, else 10 s later: the wait lets the last ones in.
pg_wal_point() {
    sleep 11
    printf '%s %s\n' \
        "$("$PG_BIN/psql" -X -At -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -c "SELECT wal_sync FROM pg_stat_wal")" \
        "$(filter_stats | awk '$1 ~ /\.outcome\.owned\./ {n += $2} END {print n + 0}')"
}
pg_wal_paired() { # name path prefix: paired, with the server's WAL syncs per new key over it
    local w0 o0 w1 o1
    read -r w0 o0 < <(pg_wal_point)
    paired "$1" with "$2" unique "$3"
    read -r w1 o1 < <(pg_wal_point)
    echo "PostgreSQL WAL syncs: $((w1 - w0)) for $((o1 - o0)) new keys"
    record "{\"pg_wal\":{\"scenario\":\"$1\",\"wal_sync\":$((w1 - w0)),\"owned\":$((o1 - o0))}}"
}

# Open loop: new keys offered at $RATE a second (idempotency-paced-load,
# whatever pace the answers come back at), in $ROUNDS alternating rounds:
# CPU per request of each process, the load generator's own included, at the
# same offered work. The Envoy without the filter and the one with it and the
# store as it is; beside them, what this rate's idle gaps make the parts
# cost: a store call that reaches no decision (straight to the store, a
# path it does not serve: 404 before any database work) and the callout
# microbenchmark's Envoy with none and one callout a request, and with a new
# key's two where idemgate makes them (callout-k).
fixed_rate() { # name url cpu-pids prefix seconds
    local before=() after=() p result cpu
    cpu_pids=$3
    "$PACED_BIN" --url "$2" --rate "$RATE" --seconds "$WARMUP" --warmup 0 --prefix "$4-warm" >/dev/null
    for p in $cpu_pids; do before+=("$(cpu_ms "${p#*=}")"); done
    result=$("$PACED_BIN" --url "$2" --rate "$RATE" --seconds "$5" --warmup 0 --prefix "$4")
    for p in $cpu_pids; do after+=("$(cpu_ms "${p#*=}")"); done
    cpu=$(cpu_json)
    echo "$1: $result; CPU ms: $cpu"
    record "{\"fixed_rate\":{\"scenario\":\"$1\",\"rate\":$RATE,\"result\":$result,\"cpu_ms\":$cpu}}"
}
fixed_rate_scenarios() { # with both Envoys and the store on SQLite up
    local r secs=$(((SECS + ROUNDS - 1) / ROUNDS)) at=http://127.0.0.1
    say "fixed rate: new keys offered at $RATE/s (open loop), the baseline, 3 and what a store call and a callout cost at this rate, $ROUNDS rounds of ${secs}s"
    start_callout
    for ((r = 1; r <= ROUNDS; r++)); do
        fixed_rate baseline "$at:${port[without]}/pay" "envoy=${pid_of[without]} upstream=$up_pid" "fb-$r" "$secs"
        fixed_rate sqlite "$at:${port[with]}/pay" "envoy=${pid_of[with]} upstream=$up_pid store=$store_pid" "fs-$r" "$secs"
        # Three times as long: a call that reaches no decision costs the
        # store so little that /proc's 10 ms ticks need that many.
        fixed_rate store-no-decision "$at:$STORE_PORT/v1/none" "store=$store_pid" "fn-$r" "$((3 * secs))"
        for n in 0 1 k; do
            fixed_rate "callout-$n" "$at:${port[callout-$n]}/pay" \
                "envoy=${pid_of[callout]} upstream=$up_pid sink=$sink_pid" "fc$n-$r" "$secs"
        done
    done
    stop_callout
}

# 1c. The callout microbenchmark: a third Envoy whose listeners run the trivial
# filter of bench/callout with 0, 1 and 2 sequential callouts per request to a
# trivial server (bench/callout/sink.js), then forward to the same upstream.
# The three alternate in $ROUNDS rounds; Envoy's CPU per request differs by
# the callouts alone (the report divides the difference by their number), and
# so does the p50 at one connection (the floors under the latency goals).
callout_scenarios() {
    local secs=$SECS lat=$LAT_SECS r n
    start_callout
    SECS=$(((secs + ROUNDS - 1) / ROUNDS)) LAT_SECS=$(((lat + ROUNDS - 1) / ROUNDS))
    for ((r = 1; r <= ROUNDS; r++)); do
        for n in 0 1 2 k; do scenario "callout-$n#$r" "callout-$n" /pay unique "c$n-$r"; done
    done
    SECS=$secs LAT_SECS=$lat
    stop_callout
}

# C_s: the callout microbenchmark's Envoy with the store where its sink was
# (the store's cluster port, no sink): 0 and 2 callouts a request to the
# store's GET /healthz, which decides nothing and reads no database, in
# $ROUNDS alternating rounds. Beside 1c's C (the same to a trivial Node
# server), what a round trip through the store's own HTTP stack costs.
store_callout_scenarios() { # with the store up
    local secs=$SECS lat=$LAT_SECS r n
    stack store-callout "$STACK_BIN" bench --bootstrap bench/callout/envoy.yaml --wasm "$CALLOUT_WASM" \
        --no-store --store-port "$STORE_PORT" --upstream-port "$UP_PORT"
    pid_of[store-callout]=$(field 's["envoy"]["pid"]')
    stack_of[${pid_of[store-callout]}]=$last_pid
    for n in 0 2; do
        port[store-callout-$n]=$(field "s['envoy']['listeners']['calls_$n']")
        admin[store-callout-$n]=$(field 's["envoy"]["admin"]')
        pid_of[store-callout-$n]=${pid_of[store-callout]}
    done
    SECS=$(((secs + ROUNDS - 1) / ROUNDS)) LAT_SECS=$(((lat + ROUNDS - 1) / ROUNDS))
    for ((r = 1; r <= ROUNDS; r++)); do
        for n in 0 2; do scenario "store-callout-$n#$r" "store-callout-$n" /pay unique "sc$n-$r"; done
    done
    SECS=$secs LAT_SECS=$lat
    stop "${pid_of[store-callout]}"
}

# The callout microbenchmark's Envoy (bench/callout): one listener each for
# 0, 1 and 2 sequential callouts a request to a trivial server
# (bench/callout/sink.js), then the request goes on to the same upstream;
# and callout-k, a new key's two calls where idemgate makes them.
start_callout() {
    stack callout "$STACK_BIN" bench --bootstrap bench/callout/envoy.yaml --wasm "$CALLOUT_WASM" \
        --callout-sink --upstream-port "$UP_PORT"
    pid_of[callout]=$(field 's["envoy"]["pid"]')
    admin[callout]=$(field 's["envoy"]["admin"]')
    sink_pid=$(field 's["services"]["sink"]["pid"]')
    stack_of[${pid_of[callout]}]=$last_pid
    stack_of[$sink_pid]=$last_pid
    local n
    for n in 0 1 2 k; do
        port[callout-$n]=$(field "s['envoy']['listeners']['calls_$n']")
        admin[callout-$n]=${admin[callout]}
        pid_of[callout-$n]=${pid_of[callout]}
    done
    # What loading any proxy-wasm module costs Envoy, beside the same figure
    # for idemgate's (start_envoy).
    record_idle callout "${pid_of[callout]}"
}
stop_callout() {
    stop "${pid_of[callout]}"
    stop "$sink_pid"
}

# Pinned: the store alone on core 0; wrk, the upstream and a pair of Envoys
# with one worker each (with and without the filter) on core 1 (taskset).
# 3 against its baseline at $BENCH_PIN_CONCURRENCY connections on a fresh
# SQLite file: what the proxy's core does with new keys when the store
# does not share it, and how many keys a second a core of the store takes.
pinned_scenario() {
    if (($(nproc) < 2)) || ! command -v taskset >/dev/null; then
        record "{\"pinned_skip\":\"$(nproc) cores, taskset $(command -v taskset || echo missing)\"}"
        return 0
    fi
    local conc=$CONC
    CONC=${BENCH_PIN_CONCURRENCY:-32}
    taskset -a -p -c 1 "$up_pid" >/dev/null
    PIN_STORE=0 start_store "sqlite://$W/store-pinned.db"
    PIN_PROXY=1 ENVOY_WORKERS=1 start_envoy pin-without
    PIN_PROXY=1 ENVOY_WORKERS=1 start_envoy pin-with
    PIN_PROXY=1 filter_envoy=pin-with BASE_NAME=pin-base BASE_ENVOY=pin-without paired pinned pin-with /pay unique pn
    stop "${pid_of[pin-with]}"
    stop "${pid_of[pin-without]}"
    stop "$store_pid"
    store_pid=
    taskset -a -p -c 0-"$(($(nproc) - 1))" "$up_pid" >/dev/null
    CONC=$conc
}
