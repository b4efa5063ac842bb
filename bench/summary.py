"""The numbers of one `make bench` run, for bench/report.py: the raw lines
merged per scenario and round, each scenario's row against its baseline,
and the scale, sweep and callout summaries."""
import json
from pathlib import Path

import floor_runs

NAMES = {
    "reference": "1. Envoy passthrough (baseline; mean of its runs)",
    "uncovered": "2. Envoy + filter, uncovered route",
    "sqlite": "3. + store on SQLite, new keys, streaming forwarding",
    "sqlite-detached": "3a. the same, detached forwarding",
    "sqlite-normal": "3b. the same, SQLite synchronous=normal",
    "sqlite-background": "3c. the same, settle: background",
    "sqlite-unix": "3u. 3 with the store on a Unix socket (Envoy `pipe` address)",
    "postgres": "4. + store on PostgreSQL, new keys",
    "postgres-background": "4b. the same, settle: background",
    "postgres-commit-delay": "4cd. 4 with PostgreSQL commit_delay=100",
    "pinned": "3p. 3 pinned: the store on core 0; wrk, upstream, Envoy (1 worker) on core 1",
    "replay": "5. replay of completed keys (SQLite)",
    "peer-base": "6a. Express handler alone (peer baseline)",
    "peer": "6. express-idempotency + Redis, new keys",
    "peer-durable": "6d. the same on a durable Redis (appendfsync always)",
    "pgpeer": "6p. the handler behind an in-app middleware on PostgreSQL (claim committed before it, response saved after)",
    "grpc-reference": "8. gRPC passthrough (gRPC baseline; mean of its runs)",
    "grpc-new": "8a. gRPC unary calls + store on SQLite, new keys",
    "grpc-replay": "8b. gRPC unary calls, replay of completed keys (SQLite)",
}

SHORT = {
    "reference": "1 baseline",
    "uncovered": "2 uncovered",
    "sqlite": "3 SQLite",
    "sqlite-detached": "3a SQLite detached",
    "sqlite-normal": "3b SQLite normal",
    "sqlite-background": "3c SQLite background",
    "sqlite-unix": "3u SQLite Unix socket",
    "postgres": "4 PostgreSQL",
    "postgres-background": "4b PostgreSQL background",
    "postgres-commit-delay": "4cd PG commit_delay",
    "pinned": "3p SQLite pinned",
    "replay": "5 replay",
    "peer-base": "6a peer base",
    "peer": "6 peer",
    "peer-durable": "6d peer, durable Redis",
    "pgpeer": "6p peer on PostgreSQL",
    "grpc-reference": "8 gRPC baseline",
    "grpc-new": "8a gRPC new keys",
    "grpc-replay": "8b gRPC replay",
}

ORDER = ["reference", "uncovered", "sqlite", "sqlite-detached", "sqlite-normal", "sqlite-background", "sqlite-unix",
         "pinned", "postgres", "postgres-background", "postgres-commit-delay", "replay", "peer-base", "peer", "peer-durable",
         "pgpeer", "grpc-reference", "grpc-new", "grpc-replay"]

PEERS = ("peer", "peer-base", "peer-durable", "pgpeer")

# The gRPC scenarios (8): their own Envoys, upstream and load generator, so
# their own baseline ("grpc-base@<name>" rounds, pooled as "grpc-reference").
GRPC = ("grpc-reference", "grpc-new", "grpc-replay")

WITH_STORE = ("sqlite", "sqlite-detached", "sqlite-normal", "sqlite-background", "sqlite-unix", "replay", "postgres",
              "postgres-background", "postgres-commit-delay")

WRK_FIELDS = ["rps", "p50_us", "p99_us", "p999_us"]

# Raw lines that come once per scale point, kept as lists.
LISTED = ("scale_fill", "sweep", "scale_skip", "mechanism", "syncs", "pg_wal", "fixed_rate", "bodies")

STORE_RQ = "cluster.idempotency_store.upstream_rq_total"

STORE_CX = "cluster.idempotency_store.upstream_cx_total"

SINK_RQ = "cluster.callout_sink.upstream_rq_total"

SINK_CX = "cluster.callout_sink.upstream_cx_total"

HANDLED = "wasmcustom.idemgate.requests_total."

COUNTERS = ["owned", "replayed", "conflict", "store_error", "passed", "invalid", "missing"]

def load(path):
    meta, scen, extra, probes = {}, {}, {}, {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "meta" in d:
            meta = d["meta"]
        elif "scenario" in d:
            scen[d["scenario"]] = d
        elif "probe" in d:
            probes[d["probe"]] = d["result"]
        elif "envoy_idle" in d:
            extra.setdefault("envoy_idle", {}).update(d["envoy_idle"])
        elif any(k in d for k in LISTED):
            for k, v in d.items():
                extra.setdefault(k, []).append(v)
        else:
            extra.update(d)
    scen = merge_rounds(scen)
    # The reference rows: the mean of the baseline runs (one before each of
    # 2-5), and of the gRPC baseline runs (one before each of 8a-8b).
    for prefix, name, runs_key in (("baseline", "reference", "baseline_runs_rps"),
                                   ("grpc-base", "grpc-reference", "grpc_baseline_runs_rps")):
        bases = [v for n, v in scen.items() if n.startswith(prefix + "@")]
        if bases:
            scen[name] = pooled(name, bases)
            meta[runs_key] = [round(r["wrk"]["rps"]) for b in bases for r in b.get("rounds", [b])]
    return meta, scen, extra, probes

def pooled(name, bases):
    """A reference row: the mean of its baseline runs."""
    ref = {"scenario": name}
    for w in ("wrk", "wrk1"):
        runs = [b[w] for b in bases if w in b]
        if runs:
            ref[w] = {f: sum(r[f] for r in runs) / len(runs) for f in WRK_FIELDS}
            ref[w].update({f: sum(r[f] for r in runs) for f in runs[0] if f not in WRK_FIELDS})
    cpus = [b["cpu_ms"] for b in bases if "cpu_ms" in b]
    if cpus and len(cpus) == len(bases):
        ref["cpu_ms"] = {k: sum(c.get(k, 0) for c in cpus) for k in cpus[0]}
    return ref

def median(values):
    v = sorted(values)
    n = len(v)
    return (v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2) if n else 0

def merge_wrk(runs):
    """Several wrk runs as one: pooled throughput, median percentiles."""
    out = {f: sum(r[f] for r in runs) for f in runs[0] if f not in WRK_FIELDS}
    out["rps"] = out["requests"] / out["seconds"] if out.get("seconds") else 0
    for f in WRK_FIELDS[1:]:
        out[f] = median([r[f] for r in runs])
    return out

def merge_rounds(scen):
    """`name#1`, `name#2`, ... (alternating rounds) become `name`, keeping the rounds."""
    groups = {}
    for name, v in scen.items():
        base, _, r = name.partition("#")
        if r:
            groups.setdefault(base, []).append((int(r), v))
    for base, runs in groups.items():
        runs = [v for _, v in sorted(runs, key=lambda x: x[0])]
        merged = dict(runs[-1])
        merged["scenario"] = base
        merged["rounds"] = runs
        for w in ("wrk", "wrk1"):
            if all(w in r for r in runs):
                merged[w] = merge_wrk([r[w] for r in runs])
        if all("cpu_ms" in r for r in runs):
            merged["cpu_ms"] = {k: sum(r["cpu_ms"].get(k, 0) for r in runs) for k in runs[0]["cpu_ms"]}
        for k in ("envoy_rss_kb", "envoy_hwm_kb", "store_rss_kb", "store_hwm_kb"):
            if k in merged:
                merged[k] = max(r.get(k, 0) for r in runs)
        if "stats_before" in runs[0]:
            merged["stats_before"] = runs[0]["stats_before"]
        deltas = [measured_delta(r) for r in runs]
        merged["measured_delta"] = {k: sum(d.get(k, 0) for d in deltas) for d in deltas for k in d}
        for name in [n for n in scen if n.partition("#")[0] == base]:
            del scen[name]
        scen[base] = merged
    return scen

def measured_delta(s):
    """Envoy's counters over the measured run: {name: after - before}."""
    if "measured_delta" in s:
        return s["measured_delta"]
    m = s.get("measured") or {}
    before, after = m.get("before") or {}, m.get("after") or {}
    return {k: v - before.get(k, 0) for k, v in after.items()}

def callouts(s):
    """Store (or sink) requests and connections per covered request over the
    measured run; covered = requests the filter handled (its requests.*
    counters), or wrk's requests for the callout microbenchmark."""
    d = measured_delta(s)
    if SINK_RQ in d or SINK_CX in d:
        n = s["wrk"]["requests"]
        rq, cx = d.get(SINK_RQ, 0), d.get(SINK_CX, 0)
    else:
        n = sum(v for k, v in d.items() if k.startswith(HANDLED))
        rq, cx = d.get(STORE_RQ, 0), d.get(STORE_CX, 0)
    if not n:
        return {}
    return {"covered": n, "calls": rq, "connections": cx, "calls_per_request": rq / n,
            "connections_per_request": cx / n}

def paired_ratio(x, b, w, field, diff=False):
    """Median over alternating rounds of x/b (or x-b); None without rounds."""
    xr, br = x.get("rounds"), b.get("rounds") if b else None
    if not xr or not br or len(xr) != len(br) or not all(w in r for r in xr + br):
        return None
    if diff:
        return median([a[w][field] - c[w][field] for a, c in zip(xr, br)])
    return median([a[w][field] / c[w][field] for a, c in zip(xr, br) if c[w][field]])

def counters(s):
    """The filter's request outcomes over the run, summed over its policies
    (`requests.outcome.<outcome>.policy.<policy>`)."""
    before, after = s.get("stats_before") or {}, s.get("stats_after") or {}
    out = {}
    for key, value in after.items():
        rest = key.removeprefix(HANDLED + "outcome.")
        outcome = rest.split(".policy.")[0]
        if rest != key and outcome in COUNTERS:
            out[outcome] = out.get(outcome, 0) + value - before.get(key, 0)
    return {k: v for k, v in out.items() if v}

def build_row(name, label, scen, refs):
    """One scenario's row: its numbers, and its ratios to its own baseline
    (the paired runs when it has them, else `refs`: the pooled baseline and
    the peer's, at 32 connections and at 1)."""
    base, base1, peer_base, peer_base1 = refs
    w = scen[name]["wrk"]
    paired = scen.get(f"baseline@{name}") or scen.get(f"grpc-base@{name}") or scen.get(f"pin-base@{name}")
    if paired:
        base_of = paired["wrk"]
    else:
        base_of = base
    own = peer_base if name in PEERS else base_of
    ref = base_of
    row = {
        "scenario": name,
        "label": label,
        "rps": w["rps"],
        "p50_ms": w["p50_us"] / 1000,
        "p99_ms": w["p99_us"] / 1000,
        "p999_ms": w["p999_us"] / 1000,
        "non_2xx": w["err_status"],
        "socket_errors": w["err_connect"] + w["err_read"] + w["err_write"] + w["err_timeout"],
        "requests": w["requests"],
        "counters": counters(scen[name]),
    }
    cpu = scen[name].get("cpu_ms")
    if cpu and w["requests"]:
        row["cpu_us_per_request"] = {k: v * 1000 / w["requests"] for k, v in cpu.items()}
        row["cpu_us_total"] = sum(row["cpu_us_per_request"].values())
    if ref:
        row["rps_x"] = w["rps"] / ref["rps"]
        row["p50_x"] = w["p50_us"] / ref["p50_us"]
        row["p99_x"] = w["p99_us"] / ref["p99_us"]
        row["p999_x"] = w["p999_us"] / ref["p999_us"]
    if paired:
        for key, field in (("rps_x", "rps"), ("p50_x", "p50_us"), ("p99_x", "p99_us"), ("p999_x", "p999_us")):
            v = paired_ratio(scen[name], paired, "wrk", field)
            if v is not None:
                row[key] = v
    if own:
        row["added_p50_ms"] = (w["p50_us"] - own["p50_us"]) / 1000
        row["added_p99_ms"] = (w["p99_us"] - own["p99_us"]) / 1000
        row["rps_own_x"] = w["rps"] / own["rps"]
    if paired:
        for key, field in (("added_p50_ms", "p50_us"), ("added_p99_ms", "p99_us")):
            v = paired_ratio(scen[name], paired, "wrk", field, diff=True)
            if v is not None:
                row[key] = v / 1000
    row["paired_baseline_rps"] = paired["wrk"]["rps"] if paired else None
    one = scen[name].get("wrk1")
    own1 = peer_base1 if name in PEERS else (paired.get("wrk1") if paired else base1)
    if one:
        row["one_p50_ms"] = one["p50_us"] / 1000
        row["one_p99_ms"] = one["p99_us"] / 1000
        if own1:
            row["one_added_p50_ms"] = (one["p50_us"] - own1["p50_us"]) / 1000
            row["one_added_p99_ms"] = (one["p99_us"] - own1["p99_us"]) / 1000
        if paired:
            for key, field in (("one_added_p50_ms", "p50_us"), ("one_added_p99_ms", "p99_us")):
                v = paired_ratio(scen[name], paired, "wrk1", field, diff=True)
                if v is not None:
                    row[key] = v / 1000
    row.update(callouts(scen[name]))
    return row

def summarize(meta, scen, extra, probes):
    rows = []
    base = scen.get("reference", {}).get("wrk")
    peer_base = scen.get("peer-base", {}).get("wrk")
    base1 = scen.get("reference", {}).get("wrk1")
    peer_base1 = scen.get("peer-base", {}).get("wrk1")
    refs = (base, base1, peer_base, peer_base1)
    grpc_refs = (scen.get("grpc-reference", {}).get("wrk"), scen.get("grpc-reference", {}).get("wrk1"), None, None)
    for name in ORDER:
        if name in scen:
            rows.append(build_row(name, NAMES[name], scen, grpc_refs if name in GRPC else refs))
    callout = [build_row(name, label, scen, refs) for name, label in CALLOUT_ROWS if name in scen]
    scale = scale_rows(scen, extra, refs)

    mem = {}
    without = [v for n, v in scen.items() if n.startswith("baseline")]
    if without:
        mem["envoy_without_filter_rss_kb"] = max(s["envoy_rss_kb"] for s in without)
        mem["envoy_without_filter_hwm_kb"] = max(s["envoy_hwm_kb"] for s in without)
    idle = extra.get("envoy_idle", {})
    if idle:
        mem["envoy_idle_without_rss_kb"] = idle.get("without")
        mem["envoy_idle_with_rss_kb"] = idle.get("with")
        mem["envoy_idle_callout_rss_kb"] = idle.get("callout")
    with_filter = [scen[n] for n in ("uncovered",) + WITH_STORE if n in scen]
    if with_filter:
        mem["envoy_with_filter_rss_kb"] = max(s["envoy_rss_kb"] for s in with_filter)
        mem["envoy_with_filter_hwm_kb"] = max(s["envoy_hwm_kb"] for s in with_filter)
    for n in WITH_STORE:
        if n in scen:
            mem[f"store_{n}_rss_kb"] = scen[n]["store_rss_kb"]
            mem[f"store_{n}_hwm_kb"] = scen[n]["store_hwm_kb"]
    if "peer" in scen:
        mem["peer_node_rss_kb"] = scen["peer"]["node_rss_kb"]
        mem["peer_redis_rss_kb"] = scen["peer"]["redis_rss_kb"]
    if "peer-base" in scen:
        mem["upstream_node_rss_kb"] = scen["peer-base"]["node_rss_kb"]

    per_record = {}
    for key, label in (("sqlite_size", "sqlite"), ("postgres_size", "postgres")):
        if key in extra and extra[key]["records"]:
            per_record[label] = {
                "records": extra[key]["records"],
                "bytes": extra[key]["bytes"],
                "bytes_per_record": extra[key]["bytes"] / extra[key]["records"],
            }
    if "redis_size" in extra and extra["redis_size"]["records"]:
        r = extra["redis_size"]
        per_record["redis"] = {
            "records": r["records"],
            "bytes": r["used_memory_delta"],
            "bytes_per_record": r["used_memory_delta"] / r["records"],
        }
    ref_cpu = next((r.get("cpu_us_total") for r in rows if r["scenario"] == "reference"), None)
    grpc_cpu = next((r.get("cpu_us_total") for r in rows if r["scenario"] == "grpc-reference"), None)
    for r in rows + callout + [p[k] for p in scale["points"] for k in ("new", "replay") if p.get(k)]:
        own_cpu = grpc_cpu if r["scenario"] in GRPC else ref_cpu
        if own_cpu and r.get("cpu_us_total"):
            r["cpu_x"] = r["cpu_us_total"] / own_cpu
    return {"meta": meta, "rows": rows, "memory": mem, "per_record": per_record, "probes": probes,
            "callout": {"rows": callout, **per_callout(callout)}, "scale": scale, "fsync": extra.get("fsync"),
            "store_claims": extra.get("store_claims"), "mechanism": floor_runs.mechanism(extra),
            "syncs": floor_runs.syncs(extra), "pg_wal": floor_runs.pg_wal(extra),
            "fixed_rate": floor_runs.fixed_rate(extra), "pinned_skip": extra.get("pinned_skip"),
            "pingpong": extra.get("pingpong"), "bodies": bodies_rows(scen, extra, refs)}


def bodies_rows(scen, extra, refs):
    """BENCH_ONLY=bodies: per body size and connections, the row of new keys
    with bodies against its paired baseline, Envoy's CPU per request of both
    and PostgreSQL's WAL bytes per new key."""
    out = []
    for b in extra.get("bodies", []):
        name = b["scenario"]
        if name not in scen:
            continue
        row = build_row(name, f"{b['kib']:g} KiB at {b['connections']}", scen, refs)
        base = scen.get(f"baseline@{name}") or {}
        requests = (base.get("wrk") or {}).get("requests")
        if base.get("cpu_ms") and requests:
            row["baseline_cpu_us_per_request"] = {k: v * 1000 / requests for k, v in base["cpu_ms"].items()}
        row.update({"kib": b["kib"], "bytes": b["bytes"], "connections": b["connections"],
                    "wal_bytes": b["wal_bytes"], "owned": b["owned"],
                    "wal_bytes_per_key": b["wal_bytes"] / b["owned"] if b["owned"] else None})
        out.append(row)
    return out

# The callout microbenchmark's listeners: callout-N makes N callouts a
# request to the trivial sink; callout-k a new key's two where idemgate
# makes them; store-callout-N, N callouts to the store's /healthz (the store
# in the sink's place).
CALLOUT_ROWS = (("callout-0", "0 callouts per request"), ("callout-1", "1 callout per request"),
                ("callout-2", "2 callouts per request"),
                ("callout-k", "a new key's 2 calls where idemgate makes them (bodies held and sent), nothing else"),
                ("store-callout-0", "0 callouts per request, the store in the sink's place"),
                ("store-callout-2", "2 callouts per request to the store's `GET /healthz` (decides nothing)"))


def per_callout(rows):
    """Envoy's CPU per callout: the difference between 1 or 2 callouts per
    request and none, per callout; and what a new key's two calls cost it
    where idemgate makes them, above none. The same differences of the p50
    at one connection: the latency a callout adds, and a new key's two; and
    those of a callout to the store's own HTTP stack on a path that decides
    nothing, with the store's CPU per such call."""
    envoy = {r["scenario"]: r.get("cpu_us_per_request", {}).get("envoy") for r in rows}
    store = {r["scenario"]: r.get("cpu_us_per_request", {}).get("store") for r in rows}
    one = {r["scenario"]: r.get("one_p50_ms") for r in rows}
    out = {}

    def diff(values, name, base, per=1):
        if values.get(name) is not None and values.get(base) is not None:
            return (values[name] - values[base]) / per
        return None
    for key, value in (("one_ms_per_callout", diff(one, "callout-2", "callout-0", 2)),
                       ("one_ms_new_key_calls", diff(one, "callout-k", "callout-0")),
                       ("envoy_us_per_callout_1", diff(envoy, "callout-1", "callout-0")),
                       ("envoy_us_per_callout_2", diff(envoy, "callout-2", "callout-0", 2)),
                       ("envoy_us_new_key_calls", diff(envoy, "callout-k", "callout-0")),
                       ("one_ms_per_store_callout", diff(one, "store-callout-2", "store-callout-0", 2)),
                       ("envoy_us_per_store_callout", diff(envoy, "store-callout-2", "store-callout-0", 2)),
                       ("store_us_per_store_callout", diff(store, "store-callout-2", "store-callout-0", 2))):
        if value is not None:
            out[key] = value
    return out

def scale_rows(scen, extra, refs):
    """The scale scenario: per database and record count, the fill, new keys,
    replays and the sweep. Against the same database's empty store: req/s as
    the ratio of each one's ratio to its own paired baseline (machine noise
    cancels), p99 and CPU per request as plain ratios."""
    points = {}
    for f in extra.get("scale_fill", []):
        points[(f["db"], f["fill"]["records"])] = {"db": f["db"], "records": f["fill"]["records"], "fill": f["fill"]}
    for name in scen:
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == "scale":
            _, db, n, kind = parts
            p = points.setdefault((db, int(n)), {"db": db, "records": int(n)})
            p[kind] = build_row(name, f"{db}, {int(n):,} records, {kind}", scen, refs)
    for w in extra.get("sweep", []):
        p = points.setdefault((w["db"], w["records"]), {"db": w["db"], "records": w["records"]})
        p["sweep"] = sweep_summary(w)
    for p in points.values():
        f = p.get("fill") or {}
        if f.get("records"):
            p["bytes_per_record"] = f["bytes"] / f["records"]
            if "events_bytes" in f:
                p["bytes_per_record_records_table"] = f["bytes"] / f["records"]
                p["bytes_per_record"] = (f["bytes"] + f["events_bytes"]) / f["records"]
        empty = points.get((p["db"], 0))
        for kind in ("new", "replay"):
            r, e = p.get(kind), (empty or {}).get(kind)
            if r and e:
                if r.get("rps_x") and e.get("rps_x"):
                    r["rps_vs_empty"] = r["rps_x"] / e["rps_x"]
                if e.get("p99_ms"):  # tails are too noisy to divide by another run's
                    r["p99_vs_empty"] = r["p99_ms"] / e["p99_ms"]
                if r.get("cpu_us_total") and e.get("cpu_us_total"):
                    r["cpu_vs_empty"] = r["cpu_us_total"] / e["cpu_us_total"]
    order = sorted(points.values(), key=lambda p: (p["db"] != "sqlite", p["records"]))
    return {"points": order, "skipped": extra.get("scale_skip", [])}

def sweep_summary(w):
    wrk = w.get("wrk") or {}
    out = {k: w[k] for k in ("due_archive", "due_purge", "archived", "purged", "events_purged", "archived_before_load",
                             "purged_before_load", "done", "timeout_ms") if k in w}
    out["seconds"] = w["ms"] / 1000
    if wrk:
        out.update({"rps": wrk["rps"], "p50_ms": wrk["p50_us"] / 1000, "p99_ms": wrk["p99_us"] / 1000,
                    "p999_ms": wrk["p999_us"] / 1000, "max_ms": wrk["max_us"] / 1000, "non_2xx": wrk["err_status"],
                    "socket_errors": wrk["err_connect"] + wrk["err_read"] + wrk["err_write"] + wrk["err_timeout"],
                    "requests": wrk["requests"]})
        if w["ms"]:
            out["rows_per_second"] = (w.get("archived", 0) + w.get("purged", 0)) / (w["ms"] / 1000)
    if w.get("cpu_ms") and wrk.get("requests"):
        out["cpu_us_per_request"] = {k: v * 1000 / wrk["requests"] for k, v in w["cpu_ms"].items()}
    c = callouts({"measured": w.get("measured"), "wrk": wrk})
    out.update(c)
    return out

def row_of(summary, name):
    return next((r for r in summary["rows"] if r["scenario"] == name), None)

def probe_rounds(probe):
    """A duplicate-execution probe's executions, round by round (a run from
    before rounds were kept has its one)."""
    return probe.get("per_round") or [probe["executions"]]


def fmt_per(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"

def records_label(n):
    """10^k for a power of ten, else n with thousands separators."""
    k = len(str(n)) - 1
    return f"10^{k}" if n == 10**k and k > 1 else f"{n:,}"
