"""The targets table, and the sentences on the forwarding modes (3a vs 3) and the gRPC rows (8a, 8b)."""
from summary import fmt_per, probe_rounds, records_label, row_of


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
        rounds = probe_rounds(probes["idemgate"])
        duplicates = sum(max(e - 1, 0) for e in rounds)
        out.append((f"0 duplicate executions (50 at once, one key; {len(rounds)} "
                    f"round{'s' if len(rounds) != 1 else ''})", f"{duplicates} duplicates",
                    duplicates == 0 and all(e >= 1 for e in rounds)))
    wasm = summary["meta"].get("wasm_bytes")
    if wasm:
        out.append(("wasm module ≤ 1 MB", f"{wasm / 1e6:.2f} MB ({wasm} bytes)", wasm <= 1_000_000))
    m = summary["memory"]
    if m.get("envoy_without_filter_rss_kb") and m.get("envoy_with_filter_rss_kb"):
        x = m["envoy_with_filter_rss_kb"] / m["envoy_without_filter_rss_kb"]
        value = f"{x:.2f}×"
        idle_without = m.get("envoy_idle_without_rss_kb")
        if idle_without and m.get("envoy_idle_with_rss_kb") and m.get("envoy_idle_callout_rss_kb"):
            # The floor under the goal: Envoy with a module that does nothing.
            value += (f" (idle: {m['envoy_idle_with_rss_kb'] / idle_without:.2f}×, and with 1c's filter, "
                      f"which does nothing, {m['envoy_idle_callout_rss_kb'] / idle_without:.2f}×)")
        out.append(("Envoy RSS with the filter ≤ 1.5× without", value, x <= 1.5))
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
