"""The latency floor's targets, for bench/report.py: the floor's terms
(TERMS: the disk's sync F, a process crossing X, the baseline B, a filter
that does nothing W, a callout C and one to the store C_s, a new key's two
calls K, the store alone's claim S and its CPU S_cpu, a call that decides
nothing N, the durable peers P and P_pg), each measured in the run, and the
targets table whose goals are formulas over them."""
import re

from floor_runs import _f, call_floors


def store_alone(text):
    """The store-alone claims' p50 (ms) and context switches per claim, from
    idempotency-store-bench's printout."""
    out = {}
    if text:
        m = re.search(r"claim/s\s+p50\s+([\d.]+) ms", text)
        if m:
            out["p50_ms"] = float(m.group(1))
        m = re.search(r"context switches per claim[^:]*:\s*([\d.]+)", text)
        if m:
            out["ctxt_per_claim"] = float(m.group(1))
        m = re.search(r"CPU per claim[^:]*:\s*([\d.]+) µs", text)
        if m:
            out["cpu_us"] = float(m.group(1))
    return out


def _row(summary, name):
    return next((r for r in summary["rows"] if r["scenario"] == name), None)


# The floor's terms: what the parts under a new key cost, each measured in
# the same run. Latencies are p50s at one connection, in ms; N and S_cpu are
# CPU per call, in µs.
TERMS = (
    ("F", "the disk's durable commit: `fdatasync` after a 4 KiB overwrite in place (`bench/fsync.py`)"),
    ("X", "one loopback round trip between two processes, one byte each way (`idempotency-pingpong`)"),
    ("B", "the baseline: a request through Envoy without the filter to the upstream (1)"),
    ("W", "a proxy-wasm filter that does nothing (1c, no callout, less B)"),
    ("C", "one callout to a trivial Node server (1c: 2 callouts less none, halved)"),
    ("C_s", "one callout to the store's own HTTP stack, `GET /healthz`, which decides nothing "
            "(the same with the store in the sink's place)"),
    ("K", "a new key's two calls where idemgate makes them, bodies held and sent, nothing else (1c-k less none)"),
    ("S", "a new-key claim in the store alone, straight on its SQLite backend (`idempotency-store-bench`)"),
    ("P", "the durable in-app peer's added p50: express-idempotency on Redis with `appendfsync always` (6d, less 6a)"),
    ("P_pg", "the in-app peer on PostgreSQL's added p50 (6p, less 6a)"),
    ("N", "store CPU of a call that reaches no decision, at the fixed rate (µs)"),
    ("S_cpu", "store CPU of a claim's database work, the store alone (µs; claims only, no HTTP)"),
)
MICROSECONDS = ("N", "S_cpu")


def terms(summary):
    """{name: value or None}: the terms of TERMS measured in this run."""
    fs = summary.get("fsync") or {}
    floor = (fs.get("floors") or {}).get("fdatasync overwrite") or ({"p50_us": fs["p50_us"]} if "p50_us" in fs else None)
    alone = store_alone(summary.get("store_claims"))
    callout = summary.get("callout") or {}
    ref, c0 = _row(summary, "reference"), next((r for r in callout.get("rows", []) if r["scenario"] == "callout-0"), None)
    pp = summary.get("pingpong") or {}

    def one_added(name):
        r = _row(summary, name)
        return r.get("one_added_p50_ms") if r else None
    return {
        "F": floor["p50_us"] / 1000 if floor else None,
        "X": pp["p50_us"] / 1000 if pp.get("p50_us") is not None else None,
        "B": ref.get("one_p50_ms") if ref else None,
        "W": c0["one_p50_ms"] - ref["one_p50_ms"] if c0 and ref and c0.get("one_p50_ms") is not None
        and ref.get("one_p50_ms") is not None else None,
        "C": callout.get("one_ms_per_callout"),
        "C_s": callout.get("one_ms_per_store_callout"),
        "K": callout.get("one_ms_new_key_calls"),
        "S": alone.get("p50_ms"),
        "P": one_added("peer-durable"),
        "P_pg": one_added("pgpeer"),
        "N": call_floors(summary.get("fixed_rate") or {})["store_call_us"],
        "S_cpu": alone.get("cpu_us"),
    }


def goal(T, names, add):
    """A goal as a formula over the terms: "≤ W + C + S + 0.12 ms = 1.23 ms"
    and its limit, or the limit None and the terms this run did not measure.
    A name may carry a factor ("2N"); terms in µs make a goal in µs."""
    total, missing = add, []
    for name in names:
        factor, key = (int(name[0]), name[1:]) if name[0].isdigit() else (1, name)
        if T.get(key) is None:
            missing.append(key)
        else:
            total += factor * T[key]
    us = any(n.lstrip("0123456789") in MICROSECONDS for n in names)
    unit, digits = ("µs", 0) if us else ("ms", 2)
    text = "≤ " + " + ".join(names) + (f" + {add:g} {unit}" if add else "")
    if missing:
        return text, None, missing
    return f"{text} = {total:.{digits}f} {unit}", total, []


def floor_targets(summary):
    """(target, today, goal, measured, met), and the terms: met is None where not measured."""
    T = terms(summary)
    conc = summary["meta"].get("concurrency")
    mech, sy, wal = summary.get("mechanism") or {}, summary.get("syncs") or {}, summary.get("pg_wal") or {}
    alone = store_alone(summary.get("store_claims"))
    out = []

    def not_measured(target, today, goal_text, why):
        out.append((target, today, goal_text, f"not measured: {why}", None))

    def added(target, today, name, names, add, also=""):
        """A scenario's added p50 at one connection against a formula."""
        text, limit, missing = goal(T, names, add)
        r = _row(summary, name)
        if not r or "one_added_p50_ms" not in r:
            not_measured(target, today, text, f"scenario {name} did not run")
        elif limit is None:
            not_measured(target, today, text, f"{', '.join(missing)} not measured in this run "
                                               f"(the scenario: {r['one_added_p50_ms']:+.2f} ms)")
        else:
            v = r["one_added_p50_ms"]
            out.append((target, today, text, f"{v:+.2f} ms{also}", v <= limit))

    added("added p50 at 1 connection, `settle: background`, SQLite (3c)", "+1.58 ms", "sqlite-background",
          ("W", "C", "S"), 0.12)
    added("added p50 at 1 connection, `before_response`, SQLite (3)", "+2.23 ms", "sqlite", ("W", "K", "S"), 0.15)

    target = "store claim p50, the store alone (S)"
    text, limit, missing = goal(T, ("F",), 0.06)
    if T["S"] is None:
        not_measured(target, "—", text, "the store alone did not run")
    elif limit is None:
        not_measured(target, "—", text, "F: the disk's floors did not run")
    else:
        out.append((target, "—", text, f"{T['S']:.2f} ms", T["S"] <= limit))

    target = "store claim p50 under Envoy (store's own timer; 3 at 1 connection)"
    text, limit, missing = goal(T, ("S",), 0.05)
    c = (mech.get("sqlite") or {}).get("claim") or {}
    if not c.get("p50_bucket_ms"):
        not_measured(target, "1.0–2.1 ms", text, "no claim timer read (3's one-connection runs)")
    elif limit is None:
        not_measured(target, "1.0–2.1 ms", text, "S: the store alone did not run")
    else:
        lo, hi = c["p50_bucket_ms"]
        # The histogram tells the p50's bucket only: decided by the bucket
        # when it lies wholly on one side, else by the mean.
        met = False if lo >= limit else (True if hi <= limit else c["mean_ms"] <= limit)
        out.append((target, "1.0–2.1 ms", text, f"in the {lo:g}–{hi:g} ms bucket (mean {c['mean_ms']:.2f} ms)", met))

    target = "context switches per claim in the store, 1 connection"
    m3 = (mech.get("sqlite") or {}).get("ctxt_per_claim")
    if m3 is None and alone.get("ctxt_per_claim") is None:
        not_measured(target, "~6–8", "≤ 2", "neither 3's one-connection runs nor the store alone ran")
    else:
        vals = [v for v in (m3, alone.get("ctxt_per_claim")) if v is not None]
        out.append((target, "~6–8", "≤ 2", f"{_f(m3, 1)} under Envoy (3: a claim and its completion); "
                                             f"{_f(alone.get('ctxt_per_claim'), 1)} store alone (claims only)",
                    all(v <= 2 for v in vals)))

    target = "syncs per durable batch (3, strace)"
    s = sy.get("sqlite")
    if not s or s.get("error") or s.get("per_durable") is None:
        why = (s or {}).get("error") or "3's strace run did not run or saw no durable commit"
        not_measured(target, "?", "exactly 1", why)
    else:
        out.append((target, "?", "exactly 1", f"{s['per_durable']:.3f} ({s['sync_calls']} syncs / {s['durable']} durable "
                                              f"commits; apart: {s['checkpointer_calls']} on the checkpointer's thread "
                                              f"for {s['checkpoints']} checkpoints)", round(s["per_durable"], 2) == 1.0))

    r4 = _row(summary, "postgres")
    fr = summary.get("fixed_rate") or {}
    fb, fs = fr.get("baseline"), fr.get("sqlite")
    rate = f"{fs['rate']:.0f}" if fs else "the fixed"
    target = f"store CPU per new key (SQLite), fixed rate at {rate} req/s"
    text, limit, missing = goal(T, ("2N", "S_cpu"), 40)
    if not fs:
        not_measured(target, "282 µs", text, "the open-loop run at a fixed rate did not run")
    elif limit is None:
        not_measured(target, "282 µs", text, f"{', '.join(missing)} not measured in this run "
                                             f"(the store: {fs['cpu_us'].get('store', 0):.0f} µs)")
    else:
        v = fs["cpu_us"].get("store", 0)
        out.append((target + f" ({fs['achieved_rps']:.0f} answered)", "282 µs", text, f"{v:.0f} µs", v <= limit))
    if fb and fs:
        at = f" at {fs['rate']:.0f} req/s offered ({fs['achieved_rps']:.0f} answered)"
        above = fs["cpu_us"].get("envoy", 0) - fb["cpu_us"].get("envoy", 0)
        shape = call_floors(fr)["envoy_new_key_calls_us"]
        two_callouts = f"; a new key's two calls without the filter's work: {shape:+.0f} µs" if shape is not None else ""
        out.append((f"Envoy CPU per new key above baseline, fixed rate{at}", "+220 µs", "≤ +120 µs",
                    f"{above:+.0f} µs{two_callouts}", above <= 120))
    else:
        not_measured("Envoy CPU per new key above baseline, fixed rate", "+220 µs", "≤ +120 µs",
                     "the open-loop run at a fixed rate did not run")

    target = f"PostgreSQL server CPU per new key / WAL flushes per key (4, {conc} connection{'s' if conc != 1 else ''})"
    w4 = wal.get("postgres")
    pg_cpu = ((r4 or {}).get("cpu_us_per_request") or {}).get("postgres")
    if pg_cpu is None or not w4 or w4.get("per_key") is None:
        not_measured(target, "687 µs / 0.88", "≤ 300 µs / ≤ 0.35", "scenario 4 or its WAL count did not run")
    else:
        others = [(label, (wal.get(name) or {}).get("per_key"))
                  for name, label in (("postgres-commit-delay", "commit_delay=100"),
                                      ("postgres-background", "4b, settle: background"),
                                      ("pgpeer", "6p, the peer on PostgreSQL"))]
        others = [f"{label}: {per:.2f}" for label, per in others if per is not None]
        extra = f" ({'; '.join(others)})" if others else ""
        out.append((target, "687 µs / 0.88", "≤ 300 µs / ≤ 0.35", f"{pg_cpu:.0f} µs / {w4['per_key']:.2f}{extra}",
                    pg_cpu <= 300 and w4["per_key"] <= 0.35))
    target = "all processes, CPU per new key × baseline, fixed rate (load generator included)"
    if fb and fs and fb["cpu_us_total"]:
        x = fs["cpu_us_total"] / fb["cpu_us_total"]
        out.append((target, "2.56×", "≤ 1.7×", f"{x:.2f}× ({fs['cpu_us_total']:.0f} / {fb['cpu_us_total']:.0f} µs)",
                    x <= 1.7))
    else:
        not_measured(target, "2.56×", "≤ 1.7×", "the open-loop run at a fixed rate did not run")
    rp = _row(summary, "pinned")
    t1, t2 = "pinned-core run: proxy core new-key throughput × baseline", "pinned-core run: SQLite store keys/s per core"
    if rp and rp.get("rps_x"):
        out.append((t1 + f" ({rp['rps']:.0f} req/s)", "—", "≥ 0.70×", f"{rp['rps_x']:.2f}×", rp["rps_x"] >= 0.70))
        store_us = (rp.get("cpu_us_per_request") or {}).get("store")
        if store_us:
            per_core = 1e6 / store_us
            out.append((t2, "—", "≥ 8,000", f"{per_core:,.0f} ({store_us:.0f} µs of store CPU per key)",
                        per_core >= 8000))
        else:
            not_measured(t2, "—", "≥ 8,000", "the store's CPU was not read")
    else:
        why = summary.get("pinned_skip") or "the pinned-core run did not run"
        not_measured(t1, "—", "≥ 0.70×", why)
        not_measured(t2, "—", "≥ 8,000", why)

    target = "SQLite bytes per record at 10^6"
    p6 = next((p for p in summary["scale"]["points"] if p["db"] == "sqlite" and p["records"] == 10**6), None)
    if p6 and p6.get("bytes_per_record"):
        out.append((target, "1,250", "≤ 650", f"{p6['bytes_per_record']:.0f}", p6["bytes_per_record"] <= 650))
    else:
        not_measured(target, "1,250", "≤ 650", "needs the scale fill at 10^6 (the full run's scenario 7)")

    # Against the durable in-app peers, each on its own kind of database.
    added("added p50 at 1 connection, `settle: background`, SQLite (3c), against the durable Redis peer (6d)",
          "—", "sqlite-background", ("P", "C"), 0)
    added("added p50 at 1 connection, PostgreSQL, `settle: background` (4b), against the peer on PostgreSQL (6p)",
          "—", "postgres-background", ("P_pg", "C"), 0)
    added("added p50 at 1 connection, PostgreSQL, `before_response` (4), against the peer on PostgreSQL (6p)",
          "+2.58 ms", "postgres", ("P_pg", "C"), 0)
    r5 = _row(summary, "replay")
    if r5 and "one_added_p50_ms" in r5:
        out.append(("added p50 at 1 connection, replay (5)", "+0.21 ms", "≤ 0.15 ms", f"{r5['one_added_p50_ms']:+.2f} ms",
                    r5["one_added_p50_ms"] <= 0.15))
    else:
        not_measured("added p50 at 1 connection, replay (5)", "+0.21 ms", "≤ 0.15 ms", "scenario replay did not run")
    return T, out


def terms_lines(T):
    """The terms as a table (also what a run prints)."""
    out = ["| term | what it is | this run |", "|---|---|--:|"]
    for name, what in TERMS:
        v = T.get(name)
        if v is None:
            cell = "not measured"
        elif name in MICROSECONDS:
            cell = f"{v:.0f} µs"
        else:
            cell = f"{v * 1000:+.0f} µs" if name in ("W", "P", "P_pg") else f"{v * 1000:.0f} µs"
        out.append(f"| {name} | {what} | {cell} |")
    return out


def targets_section(summary):
    T, rows = floor_targets(summary)
    out = ["", "## Targets of the latency floor", "",
           "Each goal is a formula over the floor's terms, each measured in this run: what the parts under a "
           "new key cost on this machine, so a goal moves with the machine and the margin over the terms is "
           "the filter's and the store's own. Latencies are p50s at one connection. \"Added\" latencies are "
           "to each scenario's own baseline at one connection (the median over its rounds); the peers' (6d, "
           "6p) to the handler alone (6a). A row this run did not measure says why.", ""]
    out += terms_lines(T)
    out += ["", "| target | before | goal | measured | met |", "|---|--:|--:|---|---|"]
    for target, today, goal_text, measured, met in rows:
        mark = "–" if met is None else ("yes" if met else "**no**")
        out.append(f"| {target} | {today} | {goal_text} | {measured} | {mark} |")
    return out
