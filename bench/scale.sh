# Sourced by scripts/bench.sh: scenario 7 (scale), which the whole run and
# BENCH_ONLY=scale take, as functions of bench.sh's helpers and state
# (start_store, paired, record, $W, $CONC, ...).

# 7. Scale: for SQLite, then PostgreSQL (a database of its own in the same
# cluster; $SCALE_DBS), the store empty and then pre-filled with each of $SCALE records
# (bench/fill.py), then new keys and replays again, with the sweeper off: both
# with UUID-shaped keys spread over the key space as clients' are (post.lua
# modes random and spool). Then, on the filled store, a sweeper catches up on a
# day's worth of expiries (what fill.py left due: every 31st record to archive,
# every 31st to purge) while new keys arrive at $CONC connections; the load
# stops when the sweeper is done (at most $SWEEP_MAX s).
declare -A est_bpr=([sqlite]=1300 [postgres]=1600) # bytes per record, until measured
declare -A arm_us=([sqlite]=120 [postgres]=120)     # µs to arm a row of the sweep's work, until measured
sweep_rows() { # -> "archived purged events_purged" so far, from the store's metrics
    curl -fsS "http://127.0.0.1:$STORE_PORT/metrics" 2>/dev/null | awk '
        /^idemgate_store_sweeper_rows_total\{action="archived"\}/ {a = $2}
        /^idemgate_store_sweeper_rows_total\{action="purged"\}/ {p = $2}
        /^idemgate_store_sweeper_rows_total\{action="events_purged"\}/ {e = $2}
        END {print a + 0, p + 0, e + 0}'
}
sweep_under_load() { # name db count url where due_archive due_purge
    local before=() after=() p s0 s1 t1 a=0 pu=0 e=0 a0 p0 done=false result cpu armed due wait_ms in
    say "$1: a sweeper archives $6 and purges $7 records while new keys arrive ($CONC connections, at most ${SWEEP_MAX}s)"
    # The parked work (the records to archive, those to purge and their three
    # events each) becomes due $in s from now: time to arm it (twice as long
    # as the last arm took a row, 120 µs before any) and start the store. The
    # load starts 1 s before it is due and stops when the sweeper is done.
    local rows=$(($6 + 4 * $7))
    in=$((5 + rows * arm_us[$2] / 1000000))
    armed=$(python3 bench/fill.py arm "$2" "$5" "$in")
    echo "armed: $armed (due in $in s)"
    due=$(python3 -c "import json; print(json.loads('$armed')['due_at_ms'])")
    arm_us[$2]=$(python3 -c "import json; print(max(20, int(json.loads('$armed')['arm_seconds'] * 2e6 / $rows)))")
    start_store "$4"
    read -r a0 p0 _ < <(sweep_rows)
    wait_ms=$((due - 1000 - $(date +%s%3N)))
    ((wait_ms <= 0)) || sleep "$((wait_ms / 1000)).$(printf %03d $((wait_ms % 1000)))"
    cpu_pids="envoy=${pid_of[with]} upstream=$up_pid store=$store_pid$store_db_cpu"
    stat_admin=${admin[with]} stat_cluster=idempotency_store
    s0=$(measured_stats)
    for p in $cpu_pids; do before+=("$(cpu_ms "${p#*=}")"); done
    wrk -t"$THREADS" -c"$CONC" -d"${SWEEP_MAX}s" -s bench/lua/post.lua "http://127.0.0.1:${port[with]}/pay" \
        -- random "sw-$2-$3" >"$W/sweep-wrk.out" &
    local wrk_pid=$!
    while kill -0 "$wrk_pid" 2>/dev/null; do
        read -r a pu e < <(sweep_rows)
        if ((a >= $6 && pu >= $7)); then
            done=true
            break
        fi
        sleep 0.25
    done
    t1=$(date +%s%3N)
    kill -INT "$wrk_pid" 2>/dev/null || true
    wait "$wrk_pid" 2>/dev/null || true
    for p in $cpu_pids; do after+=("$(cpu_ms "${p#*=}")"); done
    s1=$(measured_stats)
    cpu=$(cpu_json)
    result=$(tail -1 "$W/sweep-wrk.out")
    [[ $result == "{"* ]] || result=null
    echo "$result"
    echo "swept: archived $a, purged $pu, events purged $e, done $((t1 - due)) ms after it was due (before the load: $a0 archived, $p0 purged); done: $done"
    record "{\"sweep\":{\"name\":\"$1\",\"db\":\"$2\",\"records\":$3,\"due_archive\":$6,\"due_purge\":$7,\"archived\":$a,\"purged\":$pu,\"events_purged\":$e,\"archived_before_load\":$a0,\"purged_before_load\":$p0,\"ms\":$((t1 - due)),\"done\":$done,\"timeout_ms\":$STORE_TIMEOUT_MS,\"armed\":$armed,\"wrk\":$result,\"cpu_ms\":$cpu,\"measured\":{\"before\":$s0,\"after\":$s1}}}"
    stop "$store_pid"
    store_pid=
}
pg_scale() { # SQL... against the cluster's maintenance database
    local sql
    for sql in "$@"; do
        "$PG_BIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -v ON_ERROR_STOP=1 -c "$sql" >/dev/null
    done
}
scale_fits() { # db count: whether the free disk can hold it (else says so and records the skip)
    local need free
    ((${2} > 0)) || return 0
    need=$(($2 * est_bpr[$1] + 2 * 1024 * 1024 * 1024))
    free=$(df --output=avail -B1 "$W" | tail -1)
    ((need <= free)) && return 0
    say "scale/$1/$2: skipped: needs about $((need >> 30)) GiB of disk, $((free >> 30)) GiB free"
    record "{\"scale_skip\":{\"db\":\"$1\",\"records\":$2,\"need_bytes\":$need,\"free_bytes\":$free}}"
    return 1
}
scale_point() { # db(sqlite|postgres) count
    local db=$1 count=$2 name="scale/$1/$2" url where fill
    if [[ $db == sqlite ]]; then
        rm -f "$W"/scale.db*
        url=sqlite://$W/scale.db where=$W/scale.db
    else
        pg_scale "DROP DATABASE IF EXISTS scale" "CREATE DATABASE scale"
        url=postgres://idem@127.0.0.1:$PG_PORT/scale where="host=127.0.0.1 port=$PG_PORT user=idem dbname=scale"
    fi
    "$STORE_BIN" --database-url "$url" migrate >"$W/migrate.log" 2>&1
    if ((count > 0)); then
        say "$name: filling $count records straight into the tables"
        fill=$(python3 bench/fill.py "$db" "$where" "$count")
        echo "$fill"
        est_bpr[$db]=$(python3 -c "import json; f = json.loads('$fill'); print(int((f['bytes'] + f.get('events_bytes', 0)) / f['records'] * 1.1) + 1)")
    else
        fill='{"records":0,"due_archive":0,"due_purge":0,"seconds":0}'
    fi
    record "{\"scale_fill\":{\"db\":\"$db\",\"fill\":$fill}}"
    start_store "$url" --no-sweeper
    say "$name: completing 1000 keys for the replays"
    wrk -t1 -c"$CONC" -d2s -s bench/lua/post.lua "http://127.0.0.1:${port[with]}/pay" -- spool "rp-$db-$count" 1000 >/dev/null
    paired "$name/new" with /pay random "n-$db-$count"
    paired "$name/replay" with /pay spool "rp-$db-$count" 1000
    stop "$store_pid"
    store_pid=
    if ((count > 0)); then
        sweep_under_load "$name/sweep" "$db" "$count" "$url" "$where" \
            "$(python3 -c "import json; print(json.loads('$fill')['due_archive'])")" \
            "$(python3 -c "import json; print(json.loads('$fill')['due_purge'])")"
    fi
    if [[ $db == sqlite ]]; then rm -f "$W"/scale.db*; else pg_scale "DROP DATABASE scale"; fi
}
scale_points() { # each of $SCALE_DBS at 0 and each of $SCALE records
    local db n
    for db in $SCALE_DBS; do
        for n in 0 $SCALE; do
            n=$(python3 -c "print(int(float('$n')))")
            scale_fits "$db" "$n" || break
            scale_point "$db" "$n"
        done
    done
}
