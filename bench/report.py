#!/usr/bin/env python3
"""Turns the raw lines of one `make bench` run into bench/results/latest.json,
latest.md, latest.svg and latest-scale.svg, and rewrites the README's
"## Performance" section (and nothing else in the README) to match.

    bench/report.py RAW.jsonl OUT_DIR README.md
"""
import json
import sys
from pathlib import Path

from charts import scale_svg, svg
from render import markdown, readme_section, update_readme
from summary import load, summarize

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
