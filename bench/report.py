#!/usr/bin/env python3
"""Turns the raw lines of one `make bench` run into bench/results/latest.json,
latest.md, latest.svg and latest-scale.svg, and rewrites the README's
"## Performance" section (and nothing else in the README) to match.

    bench/report.py RAW.jsonl OUT_DIR README.md
"""
import json
import sys
from pathlib import Path

import floor_targets

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
    "grpc-reference": "8 gRPC baseline",
    "grpc-new": "8a gRPC new keys",
    "grpc-replay": "8b gRPC replay",
}
ORDER = ["reference", "uncovered", "sqlite", "sqlite-detached", "sqlite-normal", "sqlite-background", "sqlite-unix",
         "pinned", "postgres", "postgres-background", "postgres-commit-delay", "replay", "peer-base", "peer", "peer-durable",
         "grpc-reference", "grpc-new", "grpc-replay"]
PEERS = ("peer", "peer-base", "peer-durable")
# The gRPC scenarios (8): their own Envoys, upstream and load generator, so
# their own baseline ("grpc-base@<name>" rounds, pooled as "grpc-reference").
GRPC = ("grpc-reference", "grpc-new", "grpc-replay")
WITH_STORE = ("sqlite", "sqlite-detached", "sqlite-normal", "sqlite-background", "sqlite-unix", "replay", "postgres",
              "postgres-background", "postgres-commit-delay")
WRK_FIELDS = ["rps", "p50_us", "p99_us", "p999_us"]
# Raw lines that come once per scale point, kept as lists.
LISTED = ("scale_fill", "sweep", "scale_skip", "mechanism", "syncs", "pg_wal", "fixed_rate")
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
    callout = [build_row(f"callout-{n}", f"{n} callout{'s' if n != 1 else ''} per request", scen, refs)
               for n in range(3) if f"callout-{n}" in scen]
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
            "store_claims": extra.get("store_claims"), "mechanism": floor_targets.mechanism(extra),
            "syncs": floor_targets.syncs(extra), "pg_wal": floor_targets.pg_wal(extra),
            "fixed_rate": floor_targets.fixed_rate(extra), "pinned_skip": extra.get("pinned_skip")}


def per_callout(rows):
    """Envoy's CPU per callout: the difference between 1 or 2 callouts per
    request and none, per callout."""
    envoy = {int(r["scenario"].split("-")[1]): r.get("cpu_us_per_request", {}).get("envoy") for r in rows}
    out = {}
    if envoy.get(0) is not None:
        for n in (1, 2):
            if envoy.get(n) is not None:
                out[f"envoy_us_per_callout_{n}"] = (envoy[n] - envoy[0]) / n
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


def targets(summary):
    """(target, measured, met) for each target; None where not measured."""
    out = []
    conc = summary["meta"].get("concurrency")
    r2, r3, r5 = row_of(summary, "uncovered"), row_of(summary, "sqlite"), row_of(summary, "replay")
    r4, r3c = row_of(summary, "postgres"), row_of(summary, "sqlite-background")
    peer = row_of(summary, "peer")
    if r2:
        out.append(("uncovered route ≥ 95% of baseline req/s", f"{r2['rps_x']:.0%}", r2["rps_x"] >= 0.95))
    if r3:
        out.append((f"new keys, SQLite, {conc} connections, req/s ≥ 0.60× baseline", f"{r3['rps_x']:.2f}×",
                    r3["rps_x"] >= 0.60))
    if r4:
        out.append((f"new keys, PostgreSQL, {conc} connections, req/s ≥ 0.50× baseline", f"{r4['rps_x']:.2f}×",
                    r4["rps_x"] >= 0.50))
    if r3 and r3.get("cpu_x"):
        out.append(("CPU per new key (all processes, SQLite) ≤ 2.0× baseline", f"{r3['cpu_x']:.2f}×",
                    r3["cpu_x"] <= 2.0))
    if r3 and "one_added_p50_ms" in r3:
        out.append(("added p50 at 1 connection, `settle: before_response` (SQLite) ≤ +0.9 ms",
                    f"{r3['one_added_p50_ms']:+.2f} ms", r3["one_added_p50_ms"] <= 0.9))
    if r3c and "one_added_p50_ms" in r3c:
        out.append(("added p50 at 1 connection, `settle: background` (SQLite) ≤ +0.5 ms",
                    f"{r3c['one_added_p50_ms']:+.2f} ms", r3c["one_added_p50_ms"] <= 0.5))
    if r5:
        out.append(("replay req/s ≥ 0.95× baseline", f"{r5['rps_x']:.2f}×", r5["rps_x"] >= 0.95))
    if r3:
        out.append((f"SQLite, new keys: added p50 ≤ 1 ms, at {conc} connections",
                    f"{r3['added_p50_ms']:+.2f} ms", r3["added_p50_ms"] <= 1.0))
    if r3 and peer:
        out.append((
            f"added p50 below the peer's (each vs its own baseline), at {conc} connections",
            f"{r3['added_p50_ms']:+.2f} ms vs {peer['added_p50_ms']:+.2f} ms",
            r3["added_p50_ms"] < peer["added_p50_ms"],
        ))
        if "one_added_p50_ms" in r3 and "one_added_p50_ms" in peer:
            out.append((
                "added p50 below the peer's, at 1 connection",
                f"{r3['one_added_p50_ms']:+.2f} ms vs {peer['one_added_p50_ms']:+.2f} ms",
                r3["one_added_p50_ms"] < peer["one_added_p50_ms"],
            ))
    if r3 and "calls_per_request" in r3:
        out.append((f"store callouts per new key ≤ 0.5 at {conc} connections (SQLite, 3)",
                    f"{r3['calls_per_request']:.2f}", r3["calls_per_request"] <= 0.5))
    for db in ("sqlite", "postgres"):
        points = [p for p in summary["scale"]["points"] if p["db"] == db and p["records"]]
        if not points:
            continue
        top = points[-1]
        at = records_label(top["records"])
        for kind, what in (("new", "new-key"), ("replay", "replay")):
            r = top.get(kind) or {}
            if "rps_vs_empty" in r:
                out.append((f"{db}: {what} claim throughput ≥ 0.8× the empty store's at 10^7 (largest measured: {at})",
                            f"{r['rps_vs_empty']:.2f}× (p99 {fmt_per(r.get('p99_vs_empty'))}×)",
                            r["rps_vs_empty"] >= 0.8))
        if db == "sqlite" and top.get("bytes_per_record"):
            out.append((f"SQLite: ≤ 400 bytes per record (file after a checkpoint / records, at {at})",
                        f"{top['bytes_per_record']:.0f}", top["bytes_per_record"] <= 400))
        w = top.get("sweep")
        if w and "p999_ms" in w:
            out.append((f"{db}: p99.9 while the sweeper archives and purges a day's worth of expiries ≤ the store "
                        f"timeout ({w.get('timeout_ms')} ms), at {at}",
                        f"{w['p999_ms']:.1f} ms{'' if w.get('done') else ' (sweep not done)'}",
                        w["p999_ms"] <= w.get("timeout_ms", 0) and bool(w.get("done"))))
    probes = summary["probes"]
    if "idemgate" in probes:
        e = probes["idemgate"]["executions"]
        out.append(("0 duplicate executions (50 at once, one key)", f"{e - 1 if e else 0} duplicates", e <= 1))
    wasm = summary["meta"].get("wasm_bytes")
    if wasm:
        out.append(("wasm module ≤ 1 MB", f"{wasm / 1e6:.2f} MB ({wasm} bytes)", wasm <= 1_000_000))
    m = summary["memory"]
    if m.get("envoy_without_filter_rss_kb") and m.get("envoy_with_filter_rss_kb"):
        x = m["envoy_with_filter_rss_kb"] / m["envoy_without_filter_rss_kb"]
        out.append(("Envoy RSS with the filter ≤ 1.5× without", f"{x:.2f}×", x <= 1.5))
    return out


FORWARDING_MODES = (
    "3 and 3a are the two forwarding modes side by side: the same new-key requests, each on a fresh "
    "SQLite store and alternating with its own baseline runs. 3 forwards by streaming (the default: "
    "through Envoy's router); 3a's policy sets `\"forwarding\": {\"mode\": \"detached\"}` (on "
    "`/pay-detached`): the filter sends the upstream request itself as an HTTP call to the route's "
    "cluster, takes in the whole response, completes the record, then relays it."
)


def forwarding_modes(summary):
    """One sentence comparing 3a (detached) with 3 (streaming); None without both."""
    s, d = row_of(summary, "sqlite"), row_of(summary, "sqlite-detached")
    if not s or not d:
        return None
    parts = [f"req/s {d.get('rps_x', 0):.2f}× baseline vs {s.get('rps_x', 0):.2f}×",
             f"added p50 {d.get('added_p50_ms', 0):+.2f} ms vs {s.get('added_p50_ms', 0):+.2f} ms"]
    if "one_added_p50_ms" in d and "one_added_p50_ms" in s:
        parts.append(f"at 1 connection {d['one_added_p50_ms']:+.2f} ms vs {s['one_added_p50_ms']:+.2f} ms")
    if d.get("cpu_us_total") and s.get("cpu_us_total"):
        parts.append(f"CPU per request {d['cpu_us_total']:.0f} µs vs {s['cpu_us_total']:.0f} µs")
    return "Detached vs streaming (3a vs 3): " + "; ".join(parts) + "."


GRPC_SETUP = (
    "Rows 8–8b are gRPC unary calls (`bench/grpc.yaml`): a `POST` of one length-prefixed message frame "
    "(`content-type: application/grpc`, `te: trailers`) with `x-tenant-id`/`x-user-id` and an "
    "`idempotency-key` metadata entry, to `/bench.v1.Ledger/Transfer`, which a policy with `\"grpc\": {{}}` "
    "covers. They run through a pair of Envoys of their own (the same bootstrap with and without the "
    "filter; with it, the replay route to the store's `/idemgate.v1.Store/Replay` over HTTP/2) in front "
    "of a trivial Rust gRPC server (`idempotency-grpc-bench upstream`: the message echoed, then the "
    "trailers `grpc-status: 0`), store on a fresh SQLite file. The load generator is "
    "`idempotency-grpc-bench load` (hyper's HTTP/2 client; wrk cannot speak HTTP/2): {conc} calls in "
    "flight over {conns} HTTP/2 connections (Envoy's listener balances them exactly over its two "
    "workers), then one call at a time on one connection (\"@1\"). A call counts as good when its "
    "`grpc-status` is 0 and, in 8b, when it carries `idempotent-replayed: true`; the others are in "
    "\"non-2xx\". 8a and 8b alternate with their own baseline, the same calls with new keys through the "
    "Envoy without the filter (row 8 pools those runs): their ratios and added latencies are to it, not "
    "to 1. That upstream answers in microseconds where the HTTP rows' Express handler takes a few "
    "hundred, so the gRPC ratios show more of the filter's cost, not a slower filter."
)


def grpc_summary(summary):
    """One sentence on the gRPC rows (8a, 8b) against their own baseline; None without them."""
    parts = []
    for name, what in (("grpc-new", "new keys"), ("grpc-replay", "replays")):
        r = row_of(summary, name)
        if not r:
            continue
        bit = (f"{what} {r.get('rps_x', 0):.2f}× the baseline's calls/s, added p50 {r.get('added_p50_ms', 0):+.2f} ms "
               f"and p99 {r.get('added_p99_ms', 0):+.2f} ms at {summary['meta'].get('concurrency')} calls in flight")
        if "one_added_p50_ms" in r:
            bit += (f", {r['one_added_p50_ms']:+.2f} ms and {r.get('one_added_p99_ms', 0):+.2f} ms at one "
                    f"connection")
        parts.append(bit)
    if not parts:
        return None
    return "gRPC unary calls (8a, 8b), each against its own gRPC baseline: " + "; ".join(parts) + "."


def fmt_counters(c):
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "–"


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
    elif meta.get("only") == "floor":
        tool = f"`wrk -t{meta.get('threads')} -c{meta.get('concurrency')}`"
        paired = "3–5"
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
    out += [
        "Every request is a `POST` of a small JSON body with `x-tenant-id`/`x-user-id` and an",
        "`Idempotency-Key`. The upstream of every Envoy scenario is the same Express handler",
        "(`bench/peer/app.js`, `BENCH_MODE=plain`); the peer (6) is that handler behind",
        "`express-idempotency` with `express-idempotency-redis-adapter`, called directly, and its",
        "own baseline (6a) is the same handler without the middleware. Ratios are to scenario 1;",
        "*added* latency is to each stack's own baseline (1 for idemgate, 6a for the peer).",
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
    out += floor_targets.mechanism_section(summary)
    out += floor_targets.fixed_rate_section(summary)
    out += floor_targets.serial_section(summary)
    if summary["probes"]:
        out += ["", "## Duplicate executions: 50 identical requests at once, one key, a 200 ms handler", "",
                "| stack | answers | executions |", "|---|---|--:|"]
    for name, label in (("idemgate", "idemgate (Envoy + filter + store on SQLite)"),
                        ("peer", "express-idempotency + Redis")):
        p = summary["probes"].get(name)
        if p:
            answers = ", ".join(f"{n}× {code}" for code, n in sorted(p["statuses"].items()))
            out.append(f"| {label} | {answers} | {p['executions']} |")
    out += ["", "## CPU time per request (µs, user + system, during the measured run)", "",
            "Where a 2-core machine's time goes: at saturation, throughput ratios follow these sums. In 4",
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
        node_peer = cell("node") if r["scenario"] in ("peer", "peer-durable") else "–"
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


def fmt_per(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"


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
           "N = 0, 1, 2 run on three listeners of one Envoy (`--concurrency 2`), in alternating rounds. The",
           "Envoy CPU of 1 and 2 callouts minus that of none is what a callout costs Envoy, the filter's",
           "own work aside.", "",
           "| callouts per request | req/s | p50 | p99 | p50 @1 | Envoy CPU µs/request | sink CPU µs/request "
           "| callouts per request (counted) | connections per request |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        cpu = r.get("cpu_us_per_request", {})
        out.append(f"| {r['label']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                   f"| {fmt_per(r.get('one_p50_ms'))} "
                   f"| {cpu.get('envoy', 0):.0f} | {cpu.get('sink', 0):.0f} "
                   f"| {fmt_per(r.get('calls_per_request'), 3)} | {fmt_per(r.get('connections_per_request'), 4)} |")
    parts = [f"{c[f'envoy_us_per_callout_{n}']:.0f} µs (from {n} callout{'s' if n > 1 else ''})"
             for n in (1, 2) if f"envoy_us_per_callout_{n}" in c]
    if parts:
        out += ["", "Envoy CPU per callout: " + ", ".join(parts) + "."]
    one = {int(r["scenario"].split("-")[1]): r.get("one_p50_ms") for r in rows}
    if None not in (one.get(0), one.get(2)):
        out += [f"Latency per callout at one connection (p50, from 2 callouts): "
                f"{(one[2] - one[0]) / 2 * 1000:.0f} µs."]
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


def svg(summary):
    rows = summary["rows"]
    W, bar_h, gap, left = 760, 18, 8, 190
    scale_w = W - left - 80
    panels = [
        ("Throughput, req/s as a share of the baseline (2–5: of the run just before each)", [(SHORT[r["scenario"]], r.get("rps_x", 0)) for r in rows],
         lambda v: f"{v:.0%}", 1.0),
        ("CPU time per request, all processes, × the baseline's (steadier than req/s)",
         [(SHORT[r["scenario"]], r.get("cpu_x", 0)) for r in rows], lambda v: f"{v:.2f}×", 1.0),
        ("p50 latency, ms (lighter: p99)", [(SHORT[r["scenario"]], (r["p50_ms"], r["p99_ms"])) for r in rows],
         lambda v: f"{v:.1f}", None),
    ]
    y = 30
    parts = []
    for title, data, fmt, mark in panels:
        parts.append(f'<text x="10" y="{y}" font-size="14" font-weight="bold">{title}</text>')
        y += 14
        vmax = max((max(v) if isinstance(v, tuple) else v) for _, v in data) or 1
        if mark:
            vmax = max(vmax, mark)
        for label, v in data:
            parts.append(f'<text x="{left - 8}" y="{y + 13}" font-size="12" text-anchor="end">{label}</text>')
            if isinstance(v, tuple):
                p50, p99 = v
                parts.append(f'<rect x="{left}" y="{y}" width="{p99 / vmax * scale_w:.1f}" height="{bar_h}" fill="#9ecae1"/>')
                parts.append(f'<rect x="{left}" y="{y + 4}" width="{p50 / vmax * scale_w:.1f}" height="{bar_h - 8}" fill="#3182bd"/>')
                parts.append(f'<text x="{left + p99 / vmax * scale_w + 4:.1f}" y="{y + 13}" font-size="11">'
                             f'{fmt(p50)} / {fmt(p99)}</text>')
            else:
                color = "#d95f0e" if label.startswith("6") else "#31a354"
                parts.append(f'<rect x="{left}" y="{y}" width="{v / vmax * scale_w:.1f}" height="{bar_h}" fill="{color}"/>')
                parts.append(f'<text x="{left + v / vmax * scale_w + 4:.1f}" y="{y + 13}" font-size="11">{fmt(v)}</text>')
            y += bar_h + gap
        if mark:
            x = left + mark / vmax * scale_w
            top = y - len(data) * (bar_h + gap)
            parts.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{y}" stroke="#555" stroke-dasharray="3,3"/>')
        y += 30
    meta = summary["meta"]
    parts.append(f'<text x="10" y="{y - 10}" font-size="10" fill="#555">make bench, {meta.get("date", "")}: '
                 f'{meta.get("cores")} cores, wrk -c{meta.get("concurrency")}, {meta.get("seconds")} s per scenario, loopback</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>' + "".join(parts) + "</svg>\n")


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
        out += ["", f"Fifty identical requests sent at once with one key to a 200 ms handler executed it "
                    f"**{p['idemgate']['executions']}×** behind idemgate and **{p['peer']['executions']}×** "
                    f"behind express-idempotency with Redis."]
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


def records_label(n):
    """10^k for a power of ten, else n with thousands separators."""
    k = len(str(n)) - 1
    return f"10^{k}" if n == 10**k and k > 1 else f"{n:,}"


def scale_svg(summary):
    """Claim throughput against record count: req/s as a share of the empty
    store's (ratios to paired baselines), one line per database and path."""
    points = summary["scale"]["points"]
    counts = sorted({p["records"] for p in points})
    series = []
    for db, dbl, color in (("sqlite", "SQLite", "#31a354"), ("postgres", "PostgreSQL", "#3182bd")):
        for kind, kl, dash in (("new", "new keys", ""), ("replay", "replays", "6,4")):
            pts = [(p["records"], p[kind]) for p in points if p["db"] == db and p.get(kind)]
            if pts:
                series.append((f"{dbl}, {kl}", color, dash,
                               [(n, r.get("rps_vs_empty", 1.0 if n == 0 else None), r["rps"]) for n, r in pts]))
    W, H, left, top, right, bottom = 760, 380, 70, 50, 200, 60
    pw, ph = W - left - right, H - top - bottom
    values = [v for *_, pts in series for _, v, _ in pts if v is not None]
    vmax = max(values + [1.2])
    parts = [f'<text x="10" y="24" font-size="14" font-weight="bold">Claim throughput against records in the '
             f'store, × the empty store\'s (labels: req/s)</text>']
    x = {n: left + (i + 0.5) * pw / max(len(counts), 1) for i, n in enumerate(counts)}
    y = lambda v: top + ph - v / vmax * ph  # noqa: E731
    for t in [0.2 * i for i in range(int(vmax / 0.2) + 1)]:
        parts.append(f'<line x1="{left}" y1="{y(t):.1f}" x2="{left + pw}" y2="{y(t):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" font-size="11" text-anchor="end">{t:.1f}×</text>')
    parts.append(f'<line x1="{left}" y1="{y(0.8):.1f}" x2="{left + pw}" y2="{y(0.8):.1f}" stroke="#d95f0e" '
                 f'stroke-dasharray="3,3"/><text x="{left + pw + 4}" y="{y(0.8) + 4:.1f}" font-size="11" '
                 f'fill="#d95f0e">target 0.8×</text>')
    for n in counts:
        label = records_label(n)
        if n == 0:
            label = "empty"
        elif label.startswith("10^"):
            label = "10" + label[3:].translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
        parts.append(f'<text x="{x[n]:.1f}" y="{top + ph + 18}" font-size="12" text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 40}" font-size="12" text-anchor="middle">'
                 f'records in the store</text>')
    for i, (name, color, dash, pts) in enumerate(series):
        xy = [(x[n], y(v), rps) for n, v, rps in pts if v is not None]
        if len(xy) > 1:
            d = " ".join(f"{a:.1f},{b:.1f}" for a, b, _ in xy)
            parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2" '
                         f'stroke-dasharray="{dash}"/>')
        for j, (a, b, rps) in enumerate(xy):
            parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>')
            if j == 0 and pts[0][0] == 0:  # the empty store: every line starts at 1.0, labels stacked
                parts.append(f'<text x="{a - 8:.1f}" y="{b + (i - 1.5) * 12 + 4:.1f}" font-size="10" '
                             f'text-anchor="end" fill="{color}">{rps:.0f}</text>')
            else:
                parts.append(f'<text x="{a + 5:.1f}" y="{b - 5 + (10 if dash else 0):.1f}" font-size="10" '
                             f'fill="{color}">{rps:.0f}</text>')
        ly = top + 10 + i * 20
        parts.append(f'<line x1="{left + pw + 10}" y1="{ly}" x2="{left + pw + 40}" y2="{ly}" stroke="{color}" '
                     f'stroke-width="2" stroke-dasharray="{dash}"/><text x="{left + pw + 46}" y="{ly + 4}" '
                     f'font-size="11">{name}</text>')
    meta = summary["meta"]
    parts.append(f'<text x="10" y="{H - 8}" font-size="10" fill="#555">make bench, {meta.get("date", "")}: '
                 f'{meta.get("cores")} cores, wrk -c{meta.get("concurrency")}, ratios to paired baselines, loopback</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>' + "".join(parts) + "</svg>\n")


def main():
    raw, out_dir, readme = sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
    summary = summarize(*load(raw))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary)
    (out_dir / "latest.md").write_text(md)
    (out_dir / "latest.svg").write_text(svg(summary))
    if summary["scale"]["points"]:
        (out_dir / "latest-scale.svg").write_text(scale_svg(summary))
    if readme:
        update_readme(readme, readme_section(summary))
    print(md)


if __name__ == "__main__":
    main()
