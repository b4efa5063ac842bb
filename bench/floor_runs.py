"""The one-connection mechanism runs and the fixed-rate runs: read from the raw lines, and their report sections."""
import re

CLAIM = "idemgate_store_claim_duration_seconds"
STAGES = ("queued", "transaction", "commit")
DURABLE = "idemgate_store_write_durable_commits_total"
COMMITS = "idemgate_store_write_commits_total"
CHECKPOINTS = "idemgate_store_wal_checkpoints_total"
# Scenario, label, for the mechanism table (those that ran are printed).
MECHANISM_ROWS = (("sqlite", "3 SQLite"), ("sqlite-background", "3c SQLite, settle: background"),
                  ("sqlite-unix", "3u SQLite, Unix socket"), ("sqlite-detached", "3a SQLite, detached"),
                  ("sqlite-normal", "3b SQLite, synchronous=normal"), ("replay", "5 replay"),
                  ("postgres", "4 PostgreSQL"), ("postgres-background", "4b PostgreSQL, settle: background"),
                  ("postgres-commit-delay", "4cd PostgreSQL, commit_delay=100"))


def _base(name):
    return name.partition("#")[0]


def _delta(before, after):
    return {k: v - (before or {}).get(k, 0) for k, v in (after or {}).items()}


def mechanism(extra):
    """Per scenario, the one-connection runs' snapshots summed over its rounds:
    {"ctxt": n, "seconds": s, "metrics": {series: delta}, "rq_time": {(lower, width): count},
    "callout_us": {(lower, width): count}}."""
    out = {}
    for m in extra.get("mechanism", []):
        b, a = m.get("before"), m.get("after")
        if not b or not a:
            continue
        s = out.setdefault(_base(m["scenario"]), {"ctxt": 0, "seconds": 0.0, "metrics": {}, "rq_time": {},
                                                  "callout_us": {}})
        s["ctxt"] += a["ctxt"] - b["ctxt"]
        s["seconds"] += a.get("at", 0) - b.get("at", 0)
        for k, v in _delta(b["metrics"], a["metrics"]).items():
            s["metrics"][k] = s["metrics"].get(k, 0) + v
        for hist in ("rq_time", "callout_us"):
            before = {(lo, w): n for lo, w, n in b.get(hist, [])}
            for lo, w, n in a.get(hist, []):
                s[hist][(lo, w)] = s[hist].get((lo, w), 0) + n - before.get((lo, w), 0)
    return {name: _mechanism_row(s) for name, s in out.items()}


def _p50(buckets):
    """The lower bound of the bucket that holds the median of detailed
    buckets {(lower, width): count}, and their count; (None, 0) if empty."""
    total = sum(buckets.values())
    seen = 0
    for (lo, _), n in sorted(buckets.items()):
        seen += n
        if seen >= total / 2 and total > 0:
            return lo, total
    return None, 0


def _histogram(metrics, base):
    """A Prometheus histogram's deltas: count, mean (ms) and the p50's bucket
    (lower and upper bound, ms), or {} when it saw nothing."""
    count = metrics.get(base + "_count", 0)
    if count <= 0:
        return {}
    buckets = sorted((float(re.search(r'le="([^"]+)"', k).group(1)), v) for k, v in metrics.items()
                     if k.startswith(base + "_bucket{") and 'le="' in k)
    lower = 0.0
    p50 = None
    for le, cumulative in buckets:
        if cumulative >= count / 2:
            p50 = (lower * 1000, le * 1000)
            break
        lower = le
    return {"count": count, "mean_ms": metrics.get(base + "_sum", 0) / count * 1000, "p50_bucket_ms": p50}


def _mechanism_row(s):
    m = s["metrics"]
    claim = _histogram(m, CLAIM)
    claims = claim.get("count", 0)
    row = {"claims": claims, "claim": claim, "seconds": s["seconds"],
           "stages": {st: _histogram(m, f"idemgate_store_write_{st}_seconds") for st in STAGES},
           "durable_commits": m.get(DURABLE), "commits": m.get(COMMITS), "checkpoints": m.get(CHECKPOINTS)}
    if claims:
        row["ctxt_per_claim"] = s["ctxt"] / claims
        if m.get(DURABLE) is not None:
            row["durable_per_claim"] = m[DURABLE] / claims
    callout_p50, timed = _p50(s["callout_us"])
    if timed:
        row["callout_p50_us"] = callout_p50
    rq_p50, calls = _p50(s["rq_time"])
    if calls > 0:
        row["rq_p50_ms"] = rq_p50
        row["rq_calls"] = calls
        row["ctxt_per_callout"] = s["ctxt"] / calls
        row["rq_under_1ms"] = sum(n for (lo, _), n in s["rq_time"].items() if lo < 1) / calls
    return row


def syncs(extra):
    """Per scenario: sync calls under strace over the durable commits meanwhile."""
    out = {}
    for s in extra.get("syncs", []):
        if "error" in s:
            out[s["scenario"]] = {"error": s["error"]}
            continue
        d = _delta(s["before"], s["after"])
        calls = s.get("calls", {})
        checkpointer = sum(n for k, n in calls.items() if k.startswith("checkpointer_"))
        batches = sum(calls.values()) - checkpointer
        out[s["scenario"]] = {"calls": calls, "sync_calls": batches, "checkpointer_calls": checkpointer,
                              "durable": d.get("durable", 0), "commits": d.get("commits", 0),
                              "checkpoints": d.get("checkpoints", 0),
                              "per_durable": batches / d["durable"] if d.get("durable") else None}
    return out


def pg_wal(extra):
    return {w["scenario"]: {**w, "per_key": w["wal_sync"] / w["owned"] if w["owned"] else None}
            for w in extra.get("pg_wal", [])}


def fixed_rate(extra):
    """Per scenario (the names of FIXED_RATE_ROWS), its open-loop rounds pooled: offered and achieved rate,
    p50/p99 of the rounds, answers that were not 2xx, failures to get one,
    and CPU µs per request of each process, the load generator ("loadgen")
    included."""
    out = {}
    for f in extra.get("fixed_rate", []):
        s = out.setdefault(f["scenario"], {"rate": f["rate"], "requests": 0, "seconds": 0.0, "cpu_ms": {},
                                           "p50_us": [], "p99_us": [], "errors": 0, "non_2xx": 0})
        r = f["result"]
        s["requests"] += r["requests"]
        s["seconds"] += r["seconds"]
        s["errors"] += r["err_connect"] + r["err_timeout"]
        s["non_2xx"] += r["err_status"]
        s["p50_us"].append(r["p50_us"])
        s["p99_us"].append(r["p99_us"])
        for k, v in {**f["cpu_ms"], "loadgen": r.get("cpu_ms", 0)}.items():
            s["cpu_ms"][k] = s["cpu_ms"].get(k, 0) + v
    for s in out.values():
        n = s["requests"] or 1
        s["achieved_rps"] = s["requests"] / s["seconds"] if s["seconds"] else 0
        s["cpu_us"] = {k: v * 1000 / n for k, v in s["cpu_ms"].items()}
        s["cpu_us_total"] = sum(s["cpu_us"].values())
        s["p50_us"], s["p99_us"] = sorted(s["p50_us"])[len(s["p50_us"]) // 2], sorted(s["p99_us"])[len(s["p99_us"]) // 2]
    return out


def call_floors(fr):
    """What calls cost at the fixed rate, from the rows beside the
    baseline: the store's CPU for a call that reaches no decision, Envoy's
    for one callout (one callout a request less none) and for a new key's
    two where idemgate makes them (callout-k less none). None where those
    rows did not run."""
    nd, c0 = fr.get("store-no-decision"), fr.get("callout-0")

    def above_none(name):
        s = fr.get(name)
        return s["cpu_us"].get("envoy", 0) - c0["cpu_us"].get("envoy", 0) if c0 and s else None
    return {"store_call_us": nd["cpu_us"].get("store") if nd else None,
            "envoy_callout_us": above_none("callout-1"), "envoy_new_key_calls_us": above_none("callout-k")}


FIXED_RATE_ROWS = (("baseline", "baseline"), ("sqlite", "3. new keys, store on SQLite"),
                   ("store-no-decision", "a store call that reaches no decision (404), straight to the store"),
                   ("callout-0", "1c. no callout a request"), ("callout-1", "1c. one callout a request"),
                   ("callout-k", "1c. a new key's two calls where idemgate makes them, nothing else"))


def fixed_rate_section(summary):
    fr = summary.get("fixed_rate") or {}
    if not fr:
        return []
    out = ["", "## CPU per request at a fixed offered rate (open loop)", "",
           "New keys offered at a fixed rate by `idempotency-paced-load` (one thread; latency counted from each "
           "request's due time, so it includes the generator's own timer lateness: tokio's timers have millisecond "
           "resolution), through the Envoy without the filter (baseline) and the one with it and the "
           "store on SQLite (3), in alternating rounds; CPU time (user + system) of each process during the "
           "measured seconds over the requests answered, the load generator's own included. In the same rounds, "
           "at the same rate: requests straight to the store on a path it does not serve (answered 404 before "
           "any database work: what a call costs the store at this rate, with the idle gap before each), and "
           "the callout microbenchmark's Envoy (1c) with no callout a request to its trivial sink, one, and a new "
           "key's two where idemgate makes them.", "",
           "| scenario | offered req/s | achieved | p50 ms | p99 ms | not 2xx | errors | Envoy | store | upstream "
           "| callout sink | load generator | all | × baseline |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    base = fr.get("baseline", {}).get("cpu_us_total")
    for name, label in FIXED_RATE_ROWS:
        s = fr.get(name)
        if not s:
            continue
        c = s["cpu_us"]
        x = f"{s['cpu_us_total'] / base:.2f}" if base and "envoy" in c else "–"
        # The load generator times 2xx answers only.
        timed = s["non_2xx"] < s["requests"]
        out.append(f"| {label} | {s['rate']:.0f} | {s['achieved_rps']:.0f} "
                   f"| {_f(s['p50_us'] / 1000 if timed else None)} | {_f(s['p99_us'] / 1000 if timed else None)} "
                   f"| {s['non_2xx']} | {s['errors']} | {_f(c.get('envoy'), 0)} "
                   f"| {_f(c.get('store'), 0)} | {_f(c.get('upstream'), 0)} | {_f(c.get('sink'), 0)} "
                   f"| {c.get('loadgen', 0):.0f} | {s['cpu_us_total']:.0f} | {x} |")
    floors = call_floors(fr)
    if any(v is not None for v in floors.values()):
        out += ["", f"At this rate a store call that reaches no decision costs the store "
                    f"{_f(floors['store_call_us'], 0)} µs, and one callout costs Envoy "
                    f"{_f(floors['envoy_callout_us'], 0)} µs (one callout a request less none); a new key makes "
                    f"two of each. A new key's two calls where idemgate makes them, without its work, cost Envoy "
                    f"{_f(floors['envoy_new_key_calls_us'], 0)} µs above none."]
    return out


def _f(v, digits=2, unit=""):
    return "–" if v is None else f"{v:.{digits}f}{unit}"


def mechanism_section(summary):
    mech, sy, wal = summary.get("mechanism") or {}, summary.get("syncs") or {}, summary.get("pg_wal") or {}
    if not mech and not sy and not wal:
        return []
    out = ["", "## A new key inside the store, at one connection", "",
           "Over each scenario's one-connection runs (summed over its rounds; the store driven by Envoy and the "
           "filter): context switches of every thread of the store process (`/proc/<pid>/task/*/status`) per "
           "claim; the store's own timers from its `/metrics` (`idemgate_store_claim_duration_seconds` and the "
           "writer's `idemgate_store_write_{queued,transaction,commit}_seconds`: means exact, p50 only as the "
           "bucket that holds it); the writer's durable commits per claim; Envoy's `upstream_rq_time` of the "
           "store's cluster (a store callout, whole milliseconds as Envoy records them) and the filter's own "
           "timer of the same callouts (`idemgate_store_call_time`, Envoy's detailed buckets: the lower "
           "bound of the p50's). A new key is a claim and "
           "a completion: the context switches and commits of both are in the window, divided by the claims.", "",
           "| scenario | claims | context switches per claim (per store callout) | claim mean ms "
           "| claim p50 bucket ms | queued / transaction / commit mean ms | durable commits per claim "
           "| WAL checkpoints | store callout p50 (Envoy) | callouts under 1 ms | store callout p50 (filter) |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, label in MECHANISM_ROWS:
        r = mech.get(name)
        if not r:
            continue
        c = r["claim"]
        bucket = c.get("p50_bucket_ms")
        stages = " / ".join(_f(r["stages"][s].get("mean_ms"), 3) for s in STAGES)
        span = f"{bucket[0]:g}–{bucket[1]:g}" if bucket else "–"
        rq = "–" if r.get("rq_p50_ms") is None else f"{r['rq_p50_ms']:g} ms"
        under = None if r.get("rq_under_1ms") is None else r["rq_under_1ms"] * 100
        per = f"{_f(r.get('ctxt_per_claim'), 1)} ({_f(r.get('ctxt_per_callout'), 1)})"
        callout = "–" if r.get("callout_p50_us") is None else f"{r['callout_p50_us']:g} µs"
        out.append(f"| {label} | {r['claims']:.0f} | {per} | {_f(c.get('mean_ms'), 3)} | {span} | {stages} "
                   f"| {_f(r.get('durable_per_claim'), 2)} | {_f(r.get('checkpoints'), 0)} | {rq} "
                   f"| {_f(under, 0, '%')} | {callout} |")
    if sy:
        out += ["", "Syncs per durable batch: the store's `fsync`/`fdatasync` calls (`strace -f` attached to the "
                    "store, every thread) while new keys arrive at one connection, over the writer's durable commits "
                    "meanwhile (`idemgate_store_write_durable_commits_total`). A checkpoint's syncs, on the "
                    "checkpointer's thread, are counted apart. Under strace each call is slower: these runs count, "
                    "they time nothing.", "",
                "| scenario | fdatasync | fsync | durable commits | syncs per durable commit "
                "| checkpoints | the checkpointer's syncs |",
                "|---|--:|--:|--:|--:|--:|--:|"]
        for name, s in sy.items():
            if "error" in s:
                out.append(f"| {name} | not measured ({s['error']}) | | | | | |")
                continue
            out.append(f"| {name} | {s['calls'].get('fdatasync', 0)} | {s['calls'].get('fsync', 0)} | {s['durable']} "
                       f"| {_f(s['per_durable'], 3)} | {s['checkpoints']} | {s['checkpointer_calls']} |")
    if wal:
        out += ["", "PostgreSQL's WAL syncs per new key: `pg_stat_wal.wal_sync` before and after the scenario's "
                    "rounds (each read after 11 s idle, once every backend has reported), over the new keys the "
                    "filter owned meanwhile (warm-ups and one-connection runs included).", "",
                "| scenario | WAL syncs | new keys | per new key |", "|---|--:|--:|--:|"]
        for name, w in wal.items():
            out.append(f"| {name} | {w['wal_sync']} | {w['owned']} | {_f(w['per_key'], 3)} |")
    return out


def serial_section(summary):
    """At one connection each request is alone, so its mean time (one over
    the requests a second) can be set beside the CPU every process spent on
    it: where they agree, the request's time is work done one process after
    another, not waiting."""
    if summary["meta"].get("concurrency") != 1:
        return []
    out = ["", "## At one connection, a request's time is its CPU", "",
           "Each scenario's mean time per request at one connection (one over its requests a second, its own "
           "connections: the pinned run's 32 are left out) beside the CPU time (user + system) that every process "
           "of the scenario spent per request in the same runs. Where the two agree, the processes worked on the "
           "request one after another, and the difference is what it waited for without working (a sync): on "
           "this machine the latency at one connection is paid in CPU, and each target of added latency is a "
           "target of CPU per request.", "",
           "| scenario | time per request µs | CPU per request µs (all processes) | CPU ÷ time |",
           "|---|--:|--:|--:|"]
    for r in summary["rows"]:
        if r["scenario"] == "pinned" or not r.get("rps") or not r.get("cpu_us_total"):
            continue
        per = 1e6 / r["rps"]
        out.append(f"| {r['label']} | {per:.0f} | {r['cpu_us_total']:.0f} | {r['cpu_us_total'] / per:.2f} |")
    return out
