# Sourced by scripts/bench.sh: how one run is measured, as functions of
# bench.sh's helpers and state (record, mem, $CONC, $SECS, $cpu_pids, ...):
# the load generators (wrk, idempotency-grpc-bench load) around a warm-up, a
# measurement and a one-connection run, the CPU time of each process, Envoy's
# counters before and after, and a scenario's line of the raw results.
filter_stats() { # -> "name value" lines of the filter's counters (of the Envoy $filter_envoy, none before it starts)
    local at=${admin[${filter_envoy:-with}]:-}
    [[ -n $at ]] || return 0
    curl -fsS "http://127.0.0.1:$at/stats?filter=idemgate" 2>/dev/null |
        sed -n 's/^\(.*idemgate[^:]*\): \([0-9]*\)$/\1 \2/p' || true
}
to_json() { # "name value" lines -> {"name": value, ...}
    awk 'BEGIN {printf "{"} {printf "%s\"%s\":%s", (NR > 1 ? "," : ""), $1, $2} END {printf "}"}'
}
stats_json() { # -> {"name": value, ...}
    filter_stats | to_json
}
# Around each measured run: the counters of the callout cluster $stat_cluster
# (requests and connections Envoy made to it) and of the filter's requests,
# from the Envoy whose admin port is $stat_admin ({} when unset).
measured_stats() {
    if [[ -z ${stat_admin:-} ]]; then
        echo "{}"
        return
    fi
    {
        curl -fsS -G "http://127.0.0.1:$stat_admin/stats" \
            --data-urlencode "filter=^(cluster\.$stat_cluster\.upstream_(rq|cx)_total|wasmcustom\.idemgate\.requests_total\..*)\$" \
            2>/dev/null || true
    } | sed -n 's/^\([^:]*\): \([0-9]*\)$/\1 \2/p' | to_json
}

# One line from measured_stats' before/after: the callout cluster's requests and
# connections per covered request.
CALLOUTS_SUMMARY='
import json, sys
m = json.load(sys.stdin)
d = {k: v - m.get("before", {}).get(k, 0) for k, v in m.get("after", {}).items()}
rq = sum(v for k, v in d.items() if k.endswith("upstream_rq_total"))
cx = sum(v for k, v in d.items() if k.endswith("upstream_cx_total"))
covered = sum(v for k, v in d.items() if ".idemgate.requests_total." in k)
per = f" ({rq / covered:.3f} and {cx / covered:.4f} per covered request; {covered} covered)" if covered else ""
print(f"callouts: {rq} requests, {cx} connections{per}")'

TICK=$(getconf CLK_TCK)
cpu_ms() { # pid, or pg:postmaster-pid -> user+system CPU time so far, ms
    if [[ $1 == pg:* ]]; then
        # The whole PostgreSQL server: the postmaster with the children it has
        # reaped (fields 16-17), and the live ones (backends, walwriter, ...).
        local pm=${1#pg:}
        awk -v t="$TICK" '{s += $14 + $15} FILENAME ~ "/" pm "/" {s += $16 + $17} END {printf "%d\n", s * 1000 / t}' \
            pm="$pm" "/proc/$pm/stat" $(pgrep -P "$pm" | sed 's|.*|/proc/&/stat|') 2>/dev/null || echo 0
        return
    fi
    awk -v t="$TICK" '{printf "%d\n", ($14 + $15) * 1000 / t}' "/proc/$1/stat" 2>/dev/null || echo 0
}
cpu_json() { # "before" and "after" arrays of cpu_ms over $cpu_pids -> {"name": ms, ...}
    local p i=0 cpu=
    for p in $cpu_pids; do
        cpu+="${cpu:+,}\"${p%%=*}\":$((after[i] - before[i]))"
        i=$((i + 1))
    done
    echo "{$cpu}"
}
# wrk: warm-up (unmeasured), the measurement at $CONC connections, then
# $LAT_SECS at one connection (latency without queueing). Prints four JSON
# lines: the measurement, the CPU time each process in $cpu_pids (name=pid)
# spent during it, the one-connection run, and Envoy's counters just before
# and after the measurement (measured_stats).
load() { # url mode prefix [pool]
    if [[ ${LOADER:-wrk} == grpc ]]; then
        load_grpc "$@"
        return
    fi
    local before=() after=() p s0 s1
    ${PIN_PROXY:+taskset -c "$PIN_PROXY"} wrk -t"$THREADS" -c"$CONC" -d"${WARMUP}s" -s bench/lua/post.lua "$1" \
        -- "$2" "$3-warm" "${4:-1000}" >/dev/null
    s0=$(measured_stats)
    for p in $cpu_pids; do before+=("$(cpu_ms "${p#*=}")"); done
    ${PIN_PROXY:+taskset -c "$PIN_PROXY"} wrk -t"$THREADS" -c"$CONC" -d"${SECS}s" -s bench/lua/post.lua "$1" \
        -- "$2" "$3" "${4:-1000}" | tail -1
    for p in $cpu_pids; do after+=("$(cpu_ms "${p#*=}")"); done
    s1=$(measured_stats)
    cpu_json
    # New keys get a prefix of their own; retries keep the completed keys'.
    local one=$3-one
    [[ $2 != pool && $2 != spool ]] || one=$3
    mech_snapshot before
    ${PIN_PROXY:+taskset -c "$PIN_PROXY"} wrk -t1 -c1 -d"${LAT_SECS}s" -s bench/lua/post.lua "$1" \
        -- "$2" "$one" "${4:-1000}" | tail -1
    mech_snapshot after
    echo "{\"before\":$s0,\"after\":$s1}"
}
# The same four lines for gRPC unary calls, from idempotency-grpc-bench load:
# $CONC calls in flight over $GRPC_CONNS HTTP/2 connections, then one call at
# a time on one connection. Modes: unique (a new key per call), replay (keys
# PREFIX-<n mod POOL>, completed before; a call is good only if replayed).
load_grpc() { # url mode prefix [pool]
    local before=() after=() p s0 s1 hostport=${1#http://} keys=(--mode unique)
    local target=${hostport%%/*} path=/${hostport#*/}
    # Each run opens its own connections, as wrk does (the warm-up's are closed first).
    [[ $2 == replay ]] && keys=(--mode pool --pool "${4:-1000}" --expect-replayed)
    "$GRPC_BIN" load --target "$target" --path "$path" "${keys[@]}" --prefix "$3$([[ $2 == replay ]] || echo -warm)" \
        --connections "$GRPC_CONNS" --streams "$CONC" --warmup 0 --seconds "$WARMUP" >/dev/null
    s0=$(measured_stats)
    for p in $cpu_pids; do before+=("$(cpu_ms "${p#*=}")"); done
    "$GRPC_BIN" load --target "$target" --path "$path" "${keys[@]}" --prefix "$3" \
        --connections "$GRPC_CONNS" --streams "$CONC" --warmup 0 --seconds "$SECS" | tail -1
    for p in $cpu_pids; do after+=("$(cpu_ms "${p#*=}")"); done
    s1=$(measured_stats)
    cpu_json
    "$GRPC_BIN" load --target "$target" --path "$path" "${keys[@]}" --prefix "$3$([[ $2 == replay ]] || echo -one)" \
        --connections 1 --streams 1 --warmup 0 --seconds "$LAT_SECS" | tail -1
    echo "{\"before\":$s0,\"after\":$s1}"
}
scenario() { # name envoy(with|without|grpc-with|grpc-without|callout-N|store-callout-N) path mode prefix [pool]  (memory and filter counters)
    local name=$1 envoy=$2 before after result one cpu measured url="http://127.0.0.1:${port[$2]}$3"
    say "$name: $url ($4 keys, ${SECS}s at $CONC connections, ${LAT_SECS}s at 1)"
    before=$(stats_json)
    cpu_pids="envoy=${pid_of[$envoy]} upstream=$up_pid"
    stat_admin= stat_cluster= mech_admin=
    case $envoy in
    with | with-unix | pin-with | grpc-with)
        [[ -n ${store_pid:-} ]] && cpu_pids+=" store=$store_pid$store_db_cpu"
        stat_admin=${admin[$envoy]} stat_cluster=idempotency_store
        [[ -z ${store_pid:-} || $envoy == grpc-with ]] || mech_admin=$stat_admin
        ;;
    callout-*)
        cpu_pids+=" sink=$sink_pid"
        stat_admin=${admin[$envoy]} stat_cluster=callout_sink
        ;;
    store-callout-*) # the sink's cluster points at the store
        cpu_pids+=" store=$store_pid"
        stat_admin=${admin[$envoy]} stat_cluster=callout_sink
        ;;
    esac
    { read -r result; read -r cpu; read -r one; read -r measured; } < <(load "$url" "$4" "$5" "${6:-}")
    after=$(stats_json)
    echo "$result"
    echo "$one"
    echo "CPU ms: $cpu"
    [[ -z $stat_admin ]] || echo "$measured" | python3 -c "$CALLOUTS_SUMMARY" || true
    read -r e_rss e_hwm < <(mem "${pid_of[$envoy]}")
    read -r s_rss s_hwm < <(mem "${store_pid:-0}")
    record "{\"scenario\":\"$name\",\"wrk\":$result,\"wrk1\":$one,\"cpu_ms\":$cpu,\"envoy_rss_kb\":$e_rss,\"envoy_hwm_kb\":$e_hwm,\"store_rss_kb\":$s_rss,\"store_hwm_kb\":$s_hwm,\"stats_before\":$before,\"stats_after\":$after,\"measured\":$measured}"
}
