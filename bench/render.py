"""The report's text, for bench/report.py: bench/results/latest.md and the
README's "## Performance" section, from bench/summary.py's numbers."""
import sys
from pathlib import Path

import floor_runs
import floor_targets
from summary import GRPC, PEERS, fmt_per, probe_rounds, records_label, row_of
from targets import FORWARDING_MODES, GRPC_SETUP, forwarding_modes, grpc_summary, targets

def fmt_counters(c):
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "–"


def per_round(probe, unit=""):
    """A duplicate-execution probe's executions, each round's."""
    return ", ".join(f"{e}{unit}" for e in probe_rounds(probe))


def conditions(meta):
    runs = []
    if meta.get("baseline_runs_rps"):
        runs.append(f"The baseline's own runs in this run ranged {min(meta['baseline_runs_rps'])}–"
                    f"{max(meta['baseline_runs_rps'])} req/s")
    if meta.get("grpc_baseline_runs_rps"):
        runs.append(f"{'the' if runs else 'The'} gRPC baseline's {min(meta['grpc_baseline_runs_rps'])}–"
                    f"{max(meta['grpc_baseline_runs_rps'])} calls/s")
    noise = (" and ".join(runs) + ": on a shared 2-core machine throughput ratios carry that much noise, and CPU "
             "time per request is the steadier measure.") if runs else ""
    only = (f" Only the {meta['only']} scenarios ran (`BENCH_ONLY={meta['only']}`)." if meta.get("only") else "")
    if meta.get("only") == "grpc":
        tool = (f"`idempotency-grpc-bench load`, {meta.get('concurrency')} calls in flight over "
                f"{meta.get('grpc_connections')} HTTP/2 connections")
        paired = "8a and 8b"
    elif meta.get("only") in ("floor", "scale", "bodies"):
        tool = f"`wrk -t{meta.get('threads')} -c{meta.get('concurrency')}`"
        paired = {"floor": "3–5", "scale": "7", "bodies": "each body size"}[meta["only"]]
    else:
        tool = f"`wrk -t{meta.get('threads')} -c{meta.get('concurrency')}`"
        paired = "1c–5, 7 and 8" if "grpc_connections" in meta else "1c–5 and 7"
    return (
        f"{meta.get('date', '?')}, {meta.get('cores', '?')} cores shared by everything (load generator, Envoy with "
        f"`--concurrency 2`, upstream, store, databases); load average {meta.get('loadavg', '?')} at the start. "
        f"{tool}, {meta.get('seconds')} s measured per scenario "
        f"(for {paired} in {meta.get('rounds', 1)} alternating rounds, each after a {meta.get('warmup')} s warm-up), "
        f"then {meta.get('latency_seconds')} s at one connection (`-c1`: latency without queueing), on loopback. Envoy {meta.get('envoy')}, Node "
        f"{meta.get('node')}, Redis {meta.get('redis')}, PostgreSQL {meta.get('postgres')} (defaults: fsync on), "
        f"store on SQLite with its default `synchronous=full` (group commit); Redis as started by default "
        f"(no fsync per write; 6d: `appendonly yes`, `appendfsync always`). " + noise + only
    )

def markdown(summary):
    meta, rows = summary["meta"], summary["rows"]
    out = ["# `make bench`: latest run", "", conditions(summary["meta"]), ""]
    if meta.get("only") == "scale":
        return "\n".join(out + scale_section(summary))
    if meta.get("only") == "bodies":
        return "\n".join(out + bodies_section(summary))
    out += [
        "Every request is a `POST` of a small JSON body with `x-tenant-id`/`x-user-id` and an",
        "`Idempotency-Key`. The upstream of every Envoy scenario is the same Express handler",
        "(`bench/peer/app.js`, `BENCH_MODE=plain`); the peer (6) is that handler behind",
        "`express-idempotency` with `express-idempotency-redis-adapter`, called directly, and its",
        "own baseline (6a) is the same handler without the middleware; 6p is that handler behind the",
        "in-app idempotency a PostgreSQL shop writes (`BENCH_MODE=pgpeer`: a row per key claimed by",
        "`INSERT … ON CONFLICT DO NOTHING` and committed durably before the handler, the response saved",
        "by `UPDATE` before it is sent) on 4's PostgreSQL server. Ratios are to scenario 1;",
        "*added* latency is to each stack's own baseline (1 for idemgate, 6a for the peers).",
        f"Both Envoys run side by side, and each of 2–5 alternates with its own baseline runs in "
        f"{meta.get('rounds', 1)} rounds",
        "(baseline, scenario, baseline, scenario, …): its ratios and added latencies are the median of",
        "the per-round ratios and differences; its req/s is pooled over the rounds and its percentiles",
        "are the rounds' medians (its baseline's pooled req/s is in the last column). Row 1 pools all",
        "baseline runs. Latencies in ms; \"@1\" is the one-connection run after each measurement.",
        "",
    ]
    if any(r["scenario"] in GRPC for r in rows):
        out += [GRPC_SETUP.format(conns=meta.get("grpc_connections", "?"), conc=meta.get("concurrency")), ""]
    if row_of(summary, "sqlite-detached"):
        out += [FORWARDING_MODES, ""]
    out += [
        f"| scenario | req/s | × base | p50 | × base | p99 | × base | p99.9 | × base "
        f"| added p50 | added p99 | non-2xx | p50 @1 | added p50 @1 | added p99 @1 | filter counters | its baseline req/s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for r in rows:
        out.append(
            f"| {r['label']} | {r['rps']:.0f} | {r.get('rps_x', 0):.2f} | {r['p50_ms']:.2f} | {r.get('p50_x', 0):.2f} "
            f"| {r['p99_ms']:.2f} | {r.get('p99_x', 0):.2f} | {r['p999_ms']:.2f} | {r.get('p999_x', 0):.2f} "
            f"| {r.get('added_p50_ms', 0):+.2f} | {r.get('added_p99_ms', 0):+.2f} | {r['non_2xx']} "
            f"| {r.get('one_p50_ms', 0):.2f} | {r.get('one_added_p50_ms', 0):+.2f} | {r.get('one_added_p99_ms', 0):+.2f} "
            f"| {fmt_counters(r['counters'])} | {r['paired_baseline_rps'] or 0:.0f} |"
        )
    modes = forwarding_modes(summary)
    if modes:
        out += ["", modes]
    grpc = grpc_summary(summary)
    if grpc:
        out += ["", grpc]
    out += store_calls_section(summary)
    out += callout_section(summary)
    out += floor_targets.targets_section(summary)
    if meta.get("only") != "floor":  # its rows are about throughput at many connections
        out += ["", "## Other targets (ratios from this run; never asserted in tests)", "",
                "| target | measured | met |", "|---|---|---|"]
        for t, v, ok in targets(summary):
            out.append(f"| {t} | {v} | {'yes' if ok else '**no**'} |")
    f = summary.get("fsync")
    if f:
        out += ["", f"One durable commit on this machine's disk (a 4 KiB write and `fdatasync`, {f['n']} times, "
                    f"`bench/fsync.py`): p50 {f['p50_us']} µs, p99 {f['p99_us']} µs. Where the missed targets' "
                    "time goes, and what would remove it: [profile.md](profile.md)."]
        floors = f.get("floors")
        if floors:
            out += ["", "| a 4 KiB write, then | p50 µs | p99 µs |", "|---|--:|--:|"]
            out += [f"| {name} | {v['p50_us']} | {v['p99_us']} |" for name, v in floors.items()]
    claims = summary.get("store_claims")
    if claims:
        out += ["", "The store alone, new-key claims on its SQLite backend at one connection "
                    "(`idempotency-store-bench --claims-only`): the stage means come from the store's "
                    "`idemgate_store_write_*_seconds` histograms, the context switches from every thread "
                    "of the process.", "", "```", claims.strip(), "```"]
    out += floor_runs.mechanism_section(summary)
    out += floor_runs.fixed_rate_section(summary)
    out += floor_runs.serial_section(summary)
    if summary["probes"]:
        out += ["", "## Duplicate executions: 50 identical requests at once, one key, a 200 ms handler", "",
                "Each round a key of its own, one round after the other: how often a race lets duplicates "
                "through varies from one try to the next.", "",
                "| stack | answers, every round | executions, each round |", "|---|---|--:|"]
    for name, label in (("idemgate", "idemgate (Envoy + filter + store on SQLite)"),
                        ("peer", "express-idempotency + Redis"),
                        ("pgpeer", "in-app middleware on PostgreSQL (6p)")):
        p = summary["probes"].get(name)
        if p:
            answers = ", ".join(f"{n}× {code}" for code, n in sorted(p["statuses"].items()))
            out.append(f"| {label} | {answers} | {per_round(p)} |")
    out += ["", "## CPU time per request (µs, user + system, during the measured run)", "",
            "Where a 2-core machine's time goes: at saturation, throughput ratios follow these sums. In 4 and 6p",
            "the PostgreSQL server's processes (backends, WAL writer, checkpointer, autovacuum) are counted",
            "too: on a machine of its own in production, it shares the two cores here.", ""]
    if any(r["scenario"] in GRPC for r in summary["rows"]):
        out += ["The gRPC rows (8) have an upstream of their own (the Rust gRPC server of `idempotency-grpc-bench`),",
                "in the \"upstream\" column, and their \"× baseline\" is to the gRPC baseline (8).", ""]
    out += ["| scenario | Envoy | store | PostgreSQL server | upstream (Node; 8: Rust) | peer Node | Redis | total "
            "| × baseline |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in summary["rows"]:
        c = r.get("cpu_us_per_request")
        if not c:
            continue
        total = sum(c.values())
        cell = lambda k: f"{c[k]:.0f}" if k in c else "–"  # noqa: E731
        node_up = cell("upstream") if "upstream" in c else (cell("node") if r["scenario"] == "peer-base" else "–")
        node_peer = cell("node") if r["scenario"] in ("peer", "peer-durable", "pgpeer") else "–"
        x = r.get("cpu_x", 1.0 if r["scenario"] in ("reference", "grpc-reference") else 0)
        out.append(f"| {r['label']} | {cell('envoy')} | {cell('store')} | {cell('postgres')} | {node_up} | {node_peer} "
                   f"| {cell('redis')} "
                   f"| {total:.0f} | {x:.2f} |")
    if meta.get("only"):
        return "\n".join(out + ["", "![chart](latest.svg)", ""])
    m = summary["memory"]
    kb = lambda k: f"{m[k] / 1024:.1f} MiB" if m.get(k) else "–"  # noqa: E731
    out += ["", "## Memory (VmRSS after the scenario; VmHWM = peak)", "", "| process | RSS | peak |", "|---|--:|--:|",
            f"| Envoy without the filter, idle | {kb('envoy_idle_without_rss_kb')} | – |",
            f"| Envoy with the filter loaded, idle | {kb('envoy_idle_with_rss_kb')} | – |",
            f"| Envoy with 1c's filter (a module that does nothing), idle | {kb('envoy_idle_callout_rss_kb')} | – |",
            f"| Envoy without the filter (largest after a baseline run) | {kb('envoy_without_filter_rss_kb')} | {kb('envoy_without_filter_hwm_kb')} |",
            f"| Envoy with the filter (largest after 2–5) | {kb('envoy_with_filter_rss_kb')} | {kb('envoy_with_filter_hwm_kb')} |",
            f"| store on SQLite (after 3) | {kb('store_sqlite_rss_kb')} | {kb('store_sqlite_hwm_kb')} |",
            f"| store on SQLite, detached forwarding (after 3a) | {kb('store_sqlite-detached_rss_kb')} | {kb('store_sqlite-detached_hwm_kb')} |",
            f"| store on SQLite (after 5) | {kb('store_replay_rss_kb')} | {kb('store_replay_hwm_kb')} |",
            f"| store on SQLite, synchronous=normal (after 3b) | {kb('store_sqlite-normal_rss_kb')} | {kb('store_sqlite-normal_hwm_kb')} |",
            f"| store on SQLite, settle: background (after 3c) | {kb('store_sqlite-background_rss_kb')} | {kb('store_sqlite-background_hwm_kb')} |",
            f"| store on PostgreSQL (after 4; the server's own memory not counted) | {kb('store_postgres_rss_kb')} | {kb('store_postgres_hwm_kb')} |",
            f"| Node, handler alone (after 6a) | {kb('upstream_node_rss_kb')} | – |",
            f"| Node with express-idempotency (after 6) | {kb('peer_node_rss_kb')} | – |",
            f"| redis-server (after 6) | {kb('peer_redis_rss_kb')} | – |"]
    out += ["", "## Bytes per record", "", "| where | records | bytes | bytes/record |", "|---|--:|--:|--:|"]
    for name, label in (("sqlite", "SQLite file, pages in use (after 3)"),
                        ("postgres", "PostgreSQL `pg_total_relation_size` (after 4)"),
                        ("redis", "Redis `used_memory` growth (peer, after 6)")):
        p = summary["per_record"].get(name)
        if p:
            out.append(f"| {label} | {p['records']} | {p['bytes']} | {p['bytes_per_record']:.0f} |")
    out += ["", "Records hold the scope, fingerprint, lease, fence, timestamps and the stored response",
            "(status, replayed headers, body); the peer stores the request (with all its headers) and the",
            "response as one JSON string.", "",
            "![chart](latest.svg)", ""]
    out += scale_section(summary)
    return "\n".join(out)

def bodies_section(summary):
    rows = summary.get("bodies") or []
    out = ["## Bodies: new keys with request and response bodies of each size", "",
           "`BENCH_ONLY=bodies` (`bench/bodies.sh`): new keys on `/pay-bodies` (a policy that holds and stores "
           "bodies up to 2 MiB), the request body and the upstream's response body each of the size shown, at one "
           "connection and at many, the store on PostgreSQL; each alternating with the same requests through the "
           "Envoy without the filter. Envoy's CPU per request (user + system over the measured run) with the filter "
           "and without it; PostgreSQL's WAL bytes per new key (`pg_current_wal_insert_lsn` before and after, over "
           "the new keys the filter owned meanwhile, warm-ups and one-connection runs included).", "",
           "| body (each way) | connections | req/s | × baseline | added p50 ms | Envoy CPU µs/key | baseline's "
           "| Envoy above baseline | store CPU µs/key | PostgreSQL CPU µs/key | WAL bytes per key | WAL ÷ body |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        c, b = r.get("cpu_us_per_request") or {}, r.get("baseline_cpu_us_per_request") or {}
        above = c["envoy"] - b["envoy"] if "envoy" in c and "envoy" in b else None
        per = r.get("wal_bytes_per_key")
        out.append(f"| {r['kib']:g} KiB | {r['connections']} | {r['rps']:.0f} | {fmt_per(r.get('rps_x'))} "
                   f"| {r.get('added_p50_ms', 0):+.2f} | {fmt_per(c.get('envoy'), 0)} | {fmt_per(b.get('envoy'), 0)} "
                   f"| {'–' if above is None else f'{above:+.0f}'} | {fmt_per(c.get('store'), 0)} "
                   f"| {fmt_per(c.get('postgres'), 0)} | {fmt_per(per, 0)} "
                   f"| {fmt_per(per / r['bytes'] if per and r['bytes'] else None)} |")
    return out

def store_calls_section(summary):
    """Envoy's counters of the store's cluster per covered request, every scenario with the filter."""
    rows = [r for r in summary["rows"] if r["scenario"] not in ("reference", "grpc-reference") + PEERS]
    for p in summary["scale"]["points"]:
        rows += [p[k] for k in ("new", "replay") if p.get(k)]
        if p.get("sweep"):
            rows.append({"label": f"{p['db']}, {p['records']:,} records, sweeping", **p["sweep"]})
    if not any("covered" in r for r in rows):
        return []
    out = ["", "## Store callouts per covered request", "",
           "Envoy's counters of the store's cluster (`cluster.idempotency_store.upstream_rq_total` and",
           "`upstream_cx_total`) over each measured run, divided by the requests the filter handled in it",
           "(the sum of its `idemgate.requests_total.*` counters). A new key takes two store calls (claim, then",
           "completion) and a replay one; the filter group-commits them per Envoy worker (one callout in",
           "flight per worker, the calls arriving meanwhile sent together as one `POST /v1/batch`), so",
           "fewer callouts than calls is the batching at work. Connections per request near 0 means the",
           "callouts reuse kept-alive connections.", "",
           "| scenario | covered requests | store callouts | per request | store connections | per request |",
           "|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "covered" in r:
            out.append(f"| {r['label']} | {r['covered']} | {r['calls']} | {r['calls_per_request']:.3f} "
                       f"| {r['connections']} | {r['connections_per_request']:.4f} |")
        else:
            out.append(f"| {r['label']} | 0 | – | – | – | – |")
    return out

def callout_section(summary):
    c = summary.get("callout") or {}
    rows = c.get("rows") or []
    if not rows:
        return []
    out = ["", "## The callout microbenchmark: Envoy's CPU per callout", "",
           "A filter that does nothing but make N sequential `dispatch_http_call`s per request (a `GET` to",
           "a trivial Node server, `bench/callout`) and then lets the request through to the same upstream.",
           "N = 0, 1, 2 run on listeners of one Envoy (`--concurrency 2`), in alternating rounds. The",
           "Envoy CPU of 1 and 2 callouts minus that of none is what a callout costs Envoy, the filter's",
           "own work aside. A fourth listener makes a new key's two calls where idemgate makes them and",
           "nothing else: a `POST` of the whole request body before the request goes on, one of the whole",
           "response body before the response does; its Envoy CPU less none's is what the shape of a new key",
           "costs Envoy, and idemgate's extra over it (3) is the filter's own work. With 3's store up,",
           "the same Envoy again with the store in the sink's place: 0 and 2 callouts a request to the",
           "store's `GET /healthz` (its HTTP stack, no decision, no database), in rounds of their own.", "",
           "| callouts per request | req/s | p50 | p99 | p50 @1 | Envoy CPU µs/request | sink (or store) CPU µs/request "
           "| callouts per request (counted) | connections per request |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        cpu = r.get("cpu_us_per_request", {})
        out.append(f"| {r['label']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                   f"| {fmt_per(r.get('one_p50_ms'))} "
                   f"| {cpu.get('envoy', 0):.0f} | {cpu.get('sink', cpu.get('store', 0)):.0f} "
                   f"| {fmt_per(r.get('calls_per_request'), 3)} | {fmt_per(r.get('connections_per_request'), 4)} |")
    parts = [f"{c[f'envoy_us_per_callout_{n}']:.0f} µs (from {n} callout{'s' if n > 1 else ''})"
             for n in (1, 2) if f"envoy_us_per_callout_{n}" in c]
    if parts:
        out += ["", "Envoy CPU per callout: " + ", ".join(parts) + "."]
    if "one_ms_per_callout" in c:
        out += [f"Latency per callout at one connection (p50, from 2 callouts): "
                f"{c['one_ms_per_callout'] * 1000:.0f} µs."]
    if "one_ms_per_store_callout" in c:
        out += [f"A callout to the store's `/healthz` at one connection (p50, from 2 callouts): "
                f"{c['one_ms_per_store_callout'] * 1000:.0f} µs; Envoy CPU "
                f"{fmt_per(c.get('envoy_us_per_store_callout'), 0)} µs and the store's "
                f"{fmt_per(c.get('store_us_per_store_callout'), 0)} µs per callout."]
    shape = c.get("envoy_us_new_key_calls")
    if shape is not None:
        line = f"A new key's two calls where idemgate makes them, nothing else: {shape:+.0f} µs of Envoy CPU above none"
        envoy = {r["scenario"]: r.get("cpu_us_per_request", {}).get("envoy") for r in summary.get("rows", [])}
        envoy3, envoy1 = envoy.get("sqlite"), envoy.get("reference")
        if envoy3 is not None and envoy1 is not None:
            line += f"; idemgate's new key (3) {envoy3 - envoy1:+.0f} µs above its baseline (1)"
        out += [line + "."]
    return out

def scale_section(summary):
    sc = summary["scale"]
    if not sc["points"] and not sc["skipped"]:
        return []
    meta = summary["meta"]
    out = ["", "## Scale: the store pre-filled", "",
           "For SQLite, then PostgreSQL, the store empty and then pre-filled (`bench/fill.py`, straight into",
           "the tables) with completed records as the store writes them for these requests, each with its",
           "two events; keys are UUID-shaped and spread over the key space, and so are the new keys and",
           "the replayed ones sent here. New keys and replays (of 1000 keys completed just before) run with",
           "the sweeper off, each alternating with its own baseline runs. \"× empty\": for req/s the ratio of",
           "each one's ratio to its baseline to the empty store's (so machine noise cancels); for p99 and CPU",
           "per request (all processes) the plain ratio. Bytes per record: the SQLite file after a checkpoint, or PostgreSQL's",
           "`pg_total_relation_size` of the records and events tables, over the records.", "",
           "| database | records | fill s | bytes/record | new keys req/s | × base | × empty | p99 ms | × empty "
           "| CPU × empty | replays req/s | × base | × empty | p99 ms | × empty | CPU × empty |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]

    def cells(r):
        if not r:
            return "| – | – | – | – | – | – "
        return (f"| {r['rps']:.0f} | {r.get('rps_x', 0):.2f} | {fmt_per(r.get('rps_vs_empty'))} | {r['p99_ms']:.2f} "
                f"| {fmt_per(r.get('p99_vs_empty'))} | {fmt_per(r.get('cpu_vs_empty'))} ")

    for p in sc["points"]:
        f = p.get("fill") or {}
        bpr = f"{p['bytes_per_record']:.0f}" if p.get("bytes_per_record") else "–"
        out.append(f"| {p['db']} | {p['records']:,} | {f.get('seconds', 0):.0f} | {bpr} "
                   + cells(p.get("new")) + cells(p.get("replay")) + "|")
    for k in sc["skipped"]:
        out.append(f"| {k['db']} | {k['records']:,} | skipped: needs about {k['need_bytes'] / 2**30:.0f} GiB of "
                   f"disk, {k['free_bytes'] / 2**30:.0f} GiB free | | | | | | | | | | | | | |")
    out += bytes_section(sc["points"])
    sweeps = [p for p in sc["points"] if p.get("sweep")]
    if sweeps:
        out += ["", "### The sweeper catching up on a day's worth of expiries, under load", "",
                "At the defaults (records live a day, archived metadata is kept 30 days) a store in its steady",
                "state of N records sees about N/31 expire and N/31 pass the audit retention each day: the fill",
                "left every 31st record expired (to archive: body dropped, an `archived` event) and every 31st",
                "archived past the retention (to purge, with its events), parked until the store is up again",
                "with its sweeper (default interval and batch). New keys arrive at "
                f"{meta.get('concurrency')} connections from 1 s before",
                "that work is due until the sweeper has done it; \"seconds\" is from due to done. The bound on",
                f"p99.9: the filter's store timeout ({meta.get('store_timeout_ms')} ms), past which a request fails.", "",
                "| database | records | archived | purged | events purged | seconds | rows/s | req/s | p50 ms | p99 ms "
                "| p99.9 ms | max ms | non-2xx | p99.9 ≤ timeout |",
                "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
        for p in sweeps:
            w = p["sweep"]
            ok = w.get("p999_ms", 1e9) <= w.get("timeout_ms", 0)
            done = "" if w.get("done") else " (not done)"
            out.append(f"| {p['db']} | {p['records']:,} | {w.get('archived', 0)} of {w.get('due_archive', 0)} "
                       f"| {w.get('purged', 0)} of {w.get('due_purge', 0)} | {w.get('events_purged', 0)} "
                       f"| {w['seconds']:.1f}{done} | {w.get('rows_per_second', 0):.0f} | {w.get('rps', 0):.0f} "
                       f"| {w.get('p50_ms', 0):.2f} | {w.get('p99_ms', 0):.2f} | {w.get('p999_ms', 0):.2f} "
                       f"| {w.get('max_ms', 0):.2f} | {w.get('non_2xx', 0)} | {'yes' if ok else '**no**'} |")
        before = [p for p in sweeps if p["sweep"].get("archived_before_load") or p["sweep"].get("purged_before_load")]
        if before:
            out += ["", "Swept before the load began (the sweeper starts with the store): " + "; ".join(
                f"{p['db']} {p['records']:,}: {p['sweep']['archived_before_load']} archived, "
                f"{p['sweep']['purged_before_load']} purged" for p in before) + "."]
    out += ["", "![throughput against record count](latest-scale.svg)", ""]
    return out

def bytes_section(points):
    """Each table and index of the largest fill of each database, in bytes per record."""
    tops = {}
    for p in points:
        f = p.get("fill") or {}
        objects = sum(v for k, v in (f.get("objects") or {}).items() if k.startswith("idempotency"))
        # Only a breakdown that adds up to the database's size (an older fill.py
        # took dbstat's own aggregate, which wraps at 4 GiB per object).
        whole = f.get("bytes", 0) + f.get("events_bytes", 0)
        if objects and abs(objects - whole) <= 0.1 * whole and p["records"] >= tops.get(p["db"], {}).get("records", 0):
            tops[p["db"]] = p
    if not tops:
        return []
    out = ["", "### Where a record's bytes go", "",
           "Each table and index after the fill (SQLite's `dbstat`, pages and all; PostgreSQL's relation sizes,",
           "a table with its TOAST), over the records: a record and its two events, as the store writes them.", "",
           "| database | records | object | bytes/record | share |", "|---|--:|---|--:|--:|"]
    for db, p in tops.items():
        objects = {k: v for k, v in p["fill"]["objects"].items() if k.startswith("idempotency")}
        total = sum(objects.values())
        for name, b in sorted(objects.items(), key=lambda kv: -kv[1]):
            if b / p["records"] >= 1:
                out.append(f"| {db} | {p['records']:,} | `{name}` | {b / p['records']:.0f} | {b / total:.0%} |")
        out.append(f"| {db} | {p['records']:,} | all | {total / p['records']:.0f} | 100% |")
    return out

def readme_section(summary):
    meta = summary["meta"]
    out = [
        "## Performance",
        "",
        "Numbers come from `make bench`: every scenario measured side by side in one run,",
        "on loopback, at one fixed concurrency, and reported as ratios to the same run's",
        "baseline (Envoy without the filter, in front of the same upstream). Latest run:",
        "",
        f"| scenario | req/s × baseline | p50 × | p99 × | p99.9 × | added p50 | added p50, 1 connection "
        f"| CPU per request × baseline |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in summary["rows"]:
        out.append(f"| {r['label']} | {r.get('rps_x', 0):.2f} | {r.get('p50_x', 0):.2f} | {r.get('p99_x', 0):.2f} "
                   f"| {r.get('p999_x', 0):.2f} | {r.get('added_p50_ms', 0):+.2f} ms | {r.get('one_added_p50_ms', 0):+.2f} ms "
                   f"| {r.get('cpu_x', 0):.2f} |")
    if row_of(summary, "sqlite") and row_of(summary, "sqlite-detached"):
        out += ["", FORWARDING_MODES + " " + forwarding_modes(summary)]
    p = summary["probes"]
    if "idemgate" in p and "peer" in p:
        rounds = len(probe_rounds(p["peer"]))
        tries = "" if rounds == 1 else f" (in {rounds} tries, a key each)"
        out += ["", f"Fifty identical requests sent at once with one key to a 200 ms handler{tries} executed it "
                    f"**{per_round(p['idemgate'], '×')}** behind idemgate and **{per_round(p['peer'], '×')}** "
                    f"behind express-idempotency with Redis"
                    + (f", and **{per_round(p['pgpeer'], '×')}** behind the in-app middleware on PostgreSQL"
                       if "pgpeer" in p else "") + "."]
    m, pr = summary["memory"], summary["per_record"]
    facts = []
    if meta.get("wasm_bytes"):
        facts.append(f"wasm module {meta['wasm_bytes'] / 1e6:.2f} MB")
    if m.get("envoy_with_filter_rss_kb") and m.get("envoy_without_filter_rss_kb"):
        facts.append(f"Envoy RSS with the filter {m['envoy_with_filter_rss_kb'] / m['envoy_without_filter_rss_kb']:.2f}× without")
    if m.get("store_sqlite_rss_kb"):
        facts.append(f"store RSS {m['store_sqlite_rss_kb'] / 1024:.0f} MiB")
    for k, label in (("sqlite", "SQLite"), ("postgres", "PostgreSQL"), ("redis", "the peer's Redis")):
        if k in pr:
            facts.append(f"{pr[k]['bytes_per_record']:.0f} bytes per record on {label}")
    if facts:
        out += ["", "; ".join(facts) + "."]
    calls = []
    r3 = row_of(summary, "sqlite")
    if r3 and "calls_per_request" in r3:
        calls.append(f"a new key took {r3['calls_per_request']:.2f} store callouts at {meta.get('concurrency')} "
                     f"connections (two store calls each, group-committed per Envoy worker)")
    c = summary.get("callout") or {}
    if "envoy_us_per_callout_2" in c:
        calls.append(f"one callout costs Envoy about {c['envoy_us_per_callout_2']:.0f} µs of CPU (measured with a "
                     f"filter making 0, 1 and 2 callouts per request)")
    if calls:
        out += ["", "Store callouts: " + "; ".join(calls) + "."]
    scale = []
    for db, label in (("sqlite", "SQLite"), ("postgres", "PostgreSQL")):
        pts = [p for p in summary["scale"]["points"] if p["db"] == db and p["records"] and p.get("new")]
        if pts:
            top = pts[-1]
            bits = [f"new keys {top['new'].get('rps_vs_empty', 0):.2f}×"]
            if top.get("replay"):
                bits.append(f"replays {top['replay'].get('rps_vs_empty', 0):.2f}×")
            if top.get("bytes_per_record"):
                bits.append(f"{top['bytes_per_record']:.0f} bytes per record")
            w = top.get("sweep")
            if w and "p999_ms" in w:
                if w.get("done"):
                    bits.append(f"p99.9 {w['p999_ms']:.0f} ms while the sweeper caught up on a day's expiries")
                else:
                    bits.append(f"p99.9 {w['p999_ms']:.0f} ms while the sweeper worked on a day's expiries, "
                                f"which it had not finished after {w['seconds']:.0f} s")
            scale.append(f"{label} at {records_label(top['records'])} records: " + ", ".join(bits))
    if scale:
        out += ["", "Against the empty store's throughput: " + "; ".join(scale) + " (chart: "
                "[bench/results/latest-scale.svg](bench/results/latest-scale.svg))."]
    out += ["", "Conditions: " + conditions(meta) + " Absolute numbers, CPU per process, memory, targets and",
            "the chart: [bench/results/latest.md](bench/results/latest.md); where the time goes and what to",
            "change: [bench/results/profile.md](bench/results/profile.md).", ""]
    return "\n".join(out)

def update_readme(path, section):
    text = Path(path).read_text()
    start = text.find("\n## Performance\n")
    if start < 0:
        print(f"report: no '## Performance' section in {path}; left as is", file=sys.stderr)
        return
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end
    Path(path).write_text(text[: start + 1] + section + text[end:])
