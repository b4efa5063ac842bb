"""The report's charts, for bench/report.py: latest.svg (each scenario's
requests a second against its baseline) and latest-scale.svg (new keys and
replays by records in the store)."""
from summary import SHORT, records_label

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
