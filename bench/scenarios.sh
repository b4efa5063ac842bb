# Sourced by scripts/bench.sh: the scenarios that both the whole run and
# BENCH_ONLY=floor take, as functions of bench.sh's helpers and state
# (start_store, paired, record, $W, $CONC, ...).

# 6. The peer: the same handler behind express-idempotency + Redis, called
# directly, then (6d) on a Redis that syncs every write (appendonly,
# appendfsync always): like for like with a claim durable before forwarding.
peer_scenario() { # name port pid [store: redis=PID (default) or postgres=pg:PID]
    local result one cpu store=${4:-redis=$redis_pid} mem_fields
    say "$1: direct to Node on :$2 (unique keys, ${SECS}s at $CONC connections, ${LAT_SECS}s at 1)"
    cpu_pids="node=$3 $store"
    stat_admin= mech_admin=
    { read -r result; read -r cpu; read -r one; read -r _; } < <(load "http://127.0.0.1:$2/pay" unique "$1")
    echo "$result"
    echo "$one"
    echo "CPU ms: $cpu"
    read -r n_rss n_hwm < <(mem "$3")
    mem_fields="\"node_rss_kb\":$n_rss,\"node_hwm_kb\":$n_hwm"
    if [[ $store == redis=* ]]; then
        read -r r_rss r_hwm < <(mem "${store#redis=}")
        mem_fields+=",\"redis_rss_kb\":$r_rss,\"redis_hwm_kb\":$r_hwm"
    fi
    record "{\"scenario\":\"$1\",\"wrk\":$result,\"wrk1\":$one,\"cpu_ms\":$cpu,$mem_fields}"
}
start_peer() { # redis-port [redis flags]; sets $redis_pid, $peer_pid, $peer_port
    start "redis-$1" redis-server --port "$1" --bind 127.0.0.1 --save '' "${@:2}"
    redis_pid=$last_pid
    for ((i = 0; i < 100; i++)); do redis-cli -p "$1" ping >/dev/null 2>&1 && break; sleep 0.1; done
    take_port peer_port
    start "peer-$1" env BENCH_MODE=peer PORT="$peer_port" REDIS_URL="redis://127.0.0.1:$1" node bench/peer/app.js
    peer_pid=$last_pid
    wait_http "http://127.0.0.1:$peer_port/_bench/ready" "the peer"
}
peer_scenarios() {
    local used0 used1 keys durable_port
    say "peer: express-idempotency $(node -p 'require("./bench/peer/node_modules/express-idempotency/package.json").version') with express-idempotency-redis-adapter $(node -p 'require("./bench/peer/node_modules/express-idempotency-redis-adapter/package.json").version')"
    start_peer "$REDIS_PORT" --appendonly no
    peer_scenario peer-base "$UP_PORT" "$up_pid"
    used0=$(redis-cli -p "$REDIS_PORT" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p')
    peer_scenario peer "$peer_port" "$peer_pid"
    used1=$(redis-cli -p "$REDIS_PORT" info memory | sed -n 's/^used_memory:\([0-9]*\).*/\1/p')
    keys=$(redis-cli -p "$REDIS_PORT" dbsize)
    record "{\"redis_size\":{\"records\":$keys,\"used_memory_delta\":$((used1 - used0))}}"
    [[ -n $FLOOR ]] || peer_probe peer "$peer_port" "peer"
    stop "$peer_pid"
    stop "$redis_pid"
    take_port durable_port
    mkdir -p "$W/redis-aof"
    start_peer "$durable_port" --appendonly yes --appendfsync always --dir "$W/redis-aof"
    peer_scenario peer-durable "$peer_port" "$peer_pid"
    stop "$peer_pid"
    stop "$redis_pid"
    pg_peer_scenario
}

# 6p. The in-app alternative of a PostgreSQL shop (bench/peer/app.js,
# BENCH_MODE=pgpeer): the same handler behind a middleware that claims each
# key in an idempotency_keys table (INSERT ... ON CONFLICT DO NOTHING,
# committed with synchronous_commit on) before the handler runs and saves
# the response (UPDATE) before it is sent; on 4's PostgreSQL server (started
# by pg_cluster), in a database of its own. Its WAL syncs per new key as for
# 4, and the duplicate-execution probe as for the Redis peer.
pg_peer_scenario() {
    local url="postgres://idem@127.0.0.1:$PG_PORT/pgpeer" pm w0 w1 n0 n1 pg_port_peer
    say "peer on PostgreSQL: an in-app middleware on pg $(node -p 'require("./bench/peer/node_modules/pg/package.json").version')"
    "$PG_BIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -v ON_ERROR_STOP=1 -c "CREATE DATABASE pgpeer"
    take_port pg_port_peer
    start pgpeer env BENCH_MODE=pgpeer PORT="$pg_port_peer" DATABASE_URL="$url" node bench/peer/app.js
    pgpeer_pid=$last_pid
    wait_http "http://127.0.0.1:$pg_port_peer/_bench/ready" "the peer on PostgreSQL"
    pm=$(head -1 "$pg_data/postmaster.pid")
    read -r w0 n0 < <(pg_peer_point "$url")
    peer_scenario pgpeer "$pg_port_peer" "$pgpeer_pid" "postgres=pg:$pm"
    read -r w1 n1 < <(pg_peer_point "$url")
    echo "PostgreSQL WAL syncs: $((w1 - w0)) for $((n1 - n0)) new keys"
    record "{\"pg_wal\":{\"scenario\":\"pgpeer\",\"wal_sync\":$((w1 - w0)),\"owned\":$((n1 - n0))}}"
    [[ -n $FLOOR ]] || peer_probe pgpeer "$pg_port_peer" "the peer on PostgreSQL"
    stop "$pgpeer_pid"
}
# The duplicate-execution probe against a peer: 50 identical requests at
# once on one key, a 200 ms handler, PROBE_ROUNDS rounds.
peer_probe() { # name port label
    local probe
    say "duplicate-execution probe: $3"
    probe=$(node bench/burst.js "http://127.0.0.1:$2/pay/slow" "burst-$1-$$" 50 "http://127.0.0.1:$2/_bench/executions" "$PROBE_ROUNDS")
    echo "$probe"
    record "{\"probe\":\"$1\",\"result\":$probe}"
}
# The server's WAL syncs so far and the keys in the peer's table (after the
# backends have reported: pg_wal_point's wait).
pg_peer_point() { # database-url
    sleep 11
    printf '%s %s\n' \
        "$("$PG_BIN/psql" -X -At "$1" -c "SELECT wal_sync FROM pg_stat_wal")" \
        "$("$PG_BIN/psql" -X -At "$1" -c "SELECT count(*) FROM idempotency_keys")"
}

# 3 + 5: new keys on SQLite, the file's bytes per record, then replays of
# completed keys on the same store (the store is started by the caller).
sqlite_new_keys() {
    paired sqlite with /pay unique sq
    syncs_per_batch sqlite /pay sqs
    records=$(python3 bench/sqlite_size.py "$W/store.db")
    record "{\"sqlite_size\":$records}"
    echo "SQLite: $records"
    say "replay: completing 1000 keys, then retrying them"
    wrk -t1 -c"$CONC" -d2s -s bench/lua/post.lua "http://127.0.0.1:${port[with]}/pay" -- pool rp 1000 >/dev/null
    paired replay with /pay pool rp 1000
    fixed_rate_scenarios
}
# A variant of 3 on a fresh SQLite file of its own.
fresh_sqlite() { # name path prefix file [store flags]
    start_store "sqlite://$W/$4" "${@:5}"
    paired "$1" with "$2" unique "$3"
    [[ $1 != sqlite-background ]] || syncs_per_batch "$1" "$2" "$3s"
    stop "$store_pid"
    store_pid=
}
# What one durable commit costs on this disk: a small write and its fsync, the
# floor under a claim's latency at one connection (SQLite synchronous=full);
# and what one crossing between two processes costs this machine (X): a
# loopback TCP round trip, one byte each way (idempotency-pingpong).
machine_floors() {
    say "the disk's sync floors (bench/fsync.py)"
    local f x
    f=$(python3 bench/fsync.py "$W")
    echo "$f"
    record "{\"fsync\":$f}"
    say "a loopback round trip between two processes (idempotency-pingpong)"
    x=$("$PINGPONG_BIN" --round-trips "${BENCH_PINGPONG_ROUND_TRIPS:-20000}")
    echo "$x"
    record "{\"pingpong\":$x}"
}
# What a new-key claim costs the store itself at one connection, beside that
# floor: its write stages (queued, transaction, commit) and the context
# switches of all the store's threads per claim.
store_alone() {
    say "the store alone: new-key claims at one connection"
    local claims
    claims=$("$STORE_BENCH_BIN" --database-url "sqlite://$W/claims.db" \
        --concurrency 1 --seconds 5 --batch 0 --claims-only | tail -n +2)
    echo "$claims"
    record "{\"store_claims\":$(python3 -c 'import json, sys; print(json.dumps(sys.stdin.read()))' <<<"$claims")}"
}
# 4. The store on PostgreSQL (same Envoy; the store's cluster points at the
# same port): a throwaway cluster, then 4, 4b (settle: background) and 4cd (4
# with the server's commit_delay=100 µs, commit_siblings at its default), with
# the server's WAL flushes per new key for each.
pg_cluster() {
    say "PostgreSQL: throwaway cluster on port $PG_PORT"
    mkdir -p "$W/pg"
    ((EUID == 0)) && chown postgres "$W/pg"
    pg initdb -D "$W/pg/data" -A trust -U idem >/dev/null
    pg_data=$W/pg/data
    pg pg_ctl -D "$pg_data" -l "$W/pg/log" -o "-p $PG_PORT -k $W/pg -c listen_addresses=127.0.0.1" -w start >/dev/null
}
pg_scenarios() {
    local pgsize
    start_store "postgres://idem@127.0.0.1:$PG_PORT/postgres"
    pg_wal_paired postgres /pay pg
    pgsize=$("$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres -At -F' ' \
        -c "SELECT count(*), pg_total_relation_size('idempotency_records') FROM idempotency_records")
    record "{\"postgres_size\":{\"records\":${pgsize%% *},\"bytes\":${pgsize##* }}}"
    echo "PostgreSQL: records and bytes: $pgsize"
    pg_wal_paired postgres-background /pay-background pb
    pg_conf commit_delay 100
    pg_wal_paired postgres-commit-delay /pay pd
    pg_conf commit_delay
    stop "$store_pid"
    store_pid=
}
