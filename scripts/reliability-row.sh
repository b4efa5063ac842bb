#!/usr/bin/env bash
# Writes one row of the results table in docs/reliability.md (or FILE): the row
# whose first cell is RUN is replaced, or appended if there is none. Called by
# scripts/fuzz.sh and by the chaos, soak and security tests when
# IDEMGATE_REPORT names the file; nobody types these rows by hand.
#
#   scripts/reliability-row.sh FILE RUN LOAD FAULTS HOSTILE FUZZ_EXECS VIOLATIONS
set -euo pipefail
(($# == 7)) || { echo "usage: $0 FILE RUN LOAD FAULTS HOSTILE FUZZ_EXECS VIOLATIONS" >&2; exit 2; }
file=$1
shift
row="| $1 | $2 | $3 | $4 | $5 | $6 | $(date -u +%Y-%m-%d) |"
exec 9>"$file.lock"
flock 9
tmp=$(mktemp "$file.XXXXXX")
awk -v run="$1" -v row="$row" '
    BEGIN { done = 0; inside = 0 }
    /<!-- results:begin -->/ { inside = 1 }
    inside && /<!-- results:end -->/ { if (!done) print row; done = 1; inside = 0 }
    inside && index($0, "| " run " |") == 1 { if (!done) print row; done = 1; next }
    { print }
' "$file" >"$tmp"
mv "$tmp" "$file"
rm -f "$file.lock"
