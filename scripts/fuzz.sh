#!/usr/bin/env bash
# Runs the libFuzzer targets in fuzz/ for a bounded time each, then replays
# every seed and saved crash on stable Rust (fuzz/tests/regressions.rs).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 25 s, all)
#
# `make test` runs 25 s per target, `make fuzz` 300 s. A crash is copied to
# fuzz/regressions/<target>/ (so it becomes a regression test) and fails the
# run. cargo-fuzz is installed from crates.io when missing. It needs nightly
# flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them. The code
# under test has no `unsafe` (the workspace denies it), so the targets run
# without AddressSanitizer but with debug assertions (overflow checks) on.
# With IDEMGATE_REPORT=FILE each target's executions go into its results table.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-25}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(key jcs config store_request)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz from crates.io (cargo install cargo-fuzz --locked)"
    cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
out=target/fuzz
mkdir -p "$out"
total=0
failed=()
declare -A hostile=(
    [key]="arbitrary Idempotency-Key field lines"
    [jcs]="arbitrary JSON bodies"
    [config]="arbitrary plugin configurations"
    [store_request]="arbitrary store requests, 8 endpoints x 4 credentials"
)
for t in "${targets[@]}"; do
    corpus=$out/corpus/$t
    artifacts=$out/artifacts/$t/
    # Old artifacts were saved to fuzz/regressions/ already.
    rm -rf "$artifacts"
    mkdir -p "$corpus" "$artifacts"
    log=$out/$t.log
    echo "fuzz: $t for ${secs}s"
    status=0
    cargo fuzz run --sanitizer none --debug-assertions "$t" "$corpus" "fuzz/seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$artifacts" -print_final_stats=1 >"$log" 2>&1 || status=$?
    runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1 || true)
    runs=${runs:-0}
    total=$((total + runs))
    crashes=0
    for a in "$artifacts"*; do
        [[ -f $a ]] || continue
        crashes=$((crashes + 1))
        cp "$a" "fuzz/regressions/$t/$(basename "$a")"
        echo "fuzz: $t found $(basename "$a"), saved as fuzz/regressions/$t/$(basename "$a")"
    done
    if ((status != 0 || crashes > 0)); then
        failed+=("$t")
        tail -40 "$log"
    fi
    echo "fuzz: $t: $runs executions, $crashes crashes (log: $log)"
    if [[ -n ${IDEMGATE_REPORT:-} ]]; then
        scripts/reliability-row.sh "$IDEMGATE_REPORT" "fuzz: $t ($secs s)" "1 core" "—" \
            "${hostile[$t]}" "$runs" "$crashes crashes" \
            "$( ((status == 0 && crashes == 0)) && echo passed || echo FAILED)"
    fi
done
echo "fuzz: replaying seeds and saved crashes"
cargo test --quiet --release --manifest-path fuzz/Cargo.toml --test regressions
echo "fuzz: $total executions in total"
if ((${#failed[@]})); then
    echo "fuzz: FAILED: ${failed[*]}" >&2
    exit 1
fi
