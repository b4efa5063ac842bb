#!/usr/bin/env bash
# Writes one row of the results table in docs/reliability.md (or FILE), after
# the run's own assertions: the row whose first cell is RUN is replaced, or
# appended if there is none. Every row names the commit it ran on ("+changes"
# when the tree had uncommitted changes) and whether the run passed. Rows of
# other commits move to the "Earlier runs" table, so the results table only
# ever shows evidence for one commit. Called by scripts/fuzz.sh and by the
# chaos, soak and security tests when IDEMGATE_REPORT names the file; nobody
# types these rows by hand. TABLE `oracles` holds the runs built to break a
# promise, whose pass is the audit reporting it; they replace their own row.
#
#   scripts/reliability-row.sh FILE RUN LOAD FAULTS HOSTILE FUZZ_EXECS VIOLATIONS VERDICT [TABLE]
set -euo pipefail
(($# == 8 || $# == 9)) || { echo "usage: $0 FILE RUN LOAD FAULTS HOSTILE FUZZ_EXECS VIOLATIONS VERDICT [TABLE]" >&2; exit 2; }
table=${9:-results}
set -- "${@:1:8}"
repo=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$repo" rev-parse --short=10 HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$repo" status --porcelain -- . ':!docs/reliability.md' 2>/dev/null) ]]; then
    commit="$commit+changes"
fi
# The table file itself is the lock: a lock file beside it would show as an
# uncommitted change to a concurrent writer's check above.
exec 9<"$1"
flock 9
python3 - "$commit" "$(date -u +%Y-%m-%d)" "$table" "$@" <<'PY'
import sys
commit, date, table, path, run, *cells = sys.argv[1:]
row = "| " + " | ".join([run, *cells, f"`{commit}`", date]) + " |"
lines = open(path).read().split("\n")

def block(name):
    begin = lines.index(f"<!-- {name}:begin -->")
    end = lines.index(f"<!-- {name}:end -->")
    # Header and separator lines stay; the rest are rows.
    return begin, end

def run_of(line):
    return line.split(" | ")[0][2:]

def commit_of(line):
    parts = [p.strip() for p in line.strip().strip("|").split("|")]
    return parts[-2] if len(parts) >= 2 else ""

if table != "results":
    b, e = block(table)
    rows = [r for r in lines[b + 3 : e] if r.startswith("| ") and run_of(r) != run]
    out = lines[: b + 3] + rows + [row] + lines[e:]
    open(path, "w").write("\n".join(out))
    sys.exit(0)
rb, re_ = block("results")
head, rows = lines[rb + 1 : rb + 3], lines[rb + 3 : re_]
current = [r for r in rows if r.startswith("| ") and commit_of(r) == f"`{commit}`" and run_of(r) != run]
stale = [r for r in rows if r.startswith("| ") and commit_of(r) != f"`{commit}`" and run_of(r) != run]
eb, ee = block("earlier")
eh, erows = lines[eb + 1 : eb + 3], lines[eb + 3 : ee]
moved = {run_of(r) for r in stale}
erows = stale + [r for r in erows if r.startswith("| ") and run_of(r) not in moved]
out = lines[: rb + 1] + head + current + [row] + lines[re_:eb + 1] + eh + erows + lines[ee:]
open(path, "w").write("\n".join(out))
PY
