# Sourced by scripts/bench.sh for BENCH_ONLY=bodies: new keys whose request
# and response bodies are each BENCH_BODIES_KIB (0.1 4 64 1024) KiB, at one
# connection and at $BENCH_CONCURRENCY (32), through the Envoy with the filter
# (/pay-bodies: a policy that holds and stores bodies up to 2 MiB) and the
# store on PostgreSQL, each size alternating with the same requests through
# the Envoy without the filter in $ROUNDS rounds: Envoy's CPU per key (above
# the baseline's) and PostgreSQL's WAL bytes per new key. The bodies are
# post.lua's, padded (BENCH_BODY_BYTES), and the upstream pads its answer to
# the same size (x-bench-response-bytes).

# PostgreSQL's WAL insert position (bytes from the start) and the new keys the
# filter owned so far.
bodies_point() {
    printf '%s %s\n' \
        "$("$PG_BIN/psql" -X -At -h 127.0.0.1 -p "$PG_PORT" -U idem -d postgres \
            -c "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint")" \
        "$(filter_stats | awk '$1 ~ /\.outcome\.owned\./ {n += $2} END {print n + 0}')"
}
bodies_scenarios() {
    local kib bytes c conc=$CONC w0 o0 w1 o1 name
    pg_cluster
    start_store "postgres://idem@127.0.0.1:$PG_PORT/postgres"
    start_envoy without
    start_envoy with
    for kib in ${BENCH_BODIES_KIB:-0.1 4 64 1024}; do
        bytes=$(awk -v k="$kib" 'BEGIN {printf "%d", k * 1024 + 0.5}')
        for c in 1 "$conc"; do
            name=bodies-$kib-c$c
            read -r w0 o0 < <(bodies_point)
            BENCH_BODY_BYTES=$bytes CONC=$c BASE_PATH=/pay-bodies paired "$name" with /pay-bodies unique "bd$kib-$c"
            read -r w1 o1 < <(bodies_point)
            echo "PostgreSQL WAL: $((w1 - w0)) bytes for $((o1 - o0)) new keys"
            record "{\"bodies\":{\"scenario\":\"$name\",\"kib\":$kib,\"bytes\":$bytes,\"connections\":$c,\"wal_bytes\":$((w1 - w0)),\"owned\":$((o1 - o0))}}"
        done
    done
    stop "${pid_of[with]}"
    stop "${pid_of[without]}"
    stop "$store_pid"
    store_pid=
}
