#!/usr/bin/env bash
# Runs the libFuzzer targets in fuzz/ for a bounded time each. Every seed
# (fuzz/seeds/<target>/) and every input a target ever crashed on
# (fuzz/regressions/<target>/) is run first, as part of the target's corpus;
# fuzz/tests/regressions.rs replays the same inputs on stable Rust without
# libFuzzer (`cargo test --manifest-path fuzz/Cargo.toml`).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 25 s, all)
#
# `make test` runs 25 s per target, `make fuzz` 300 s. A crash is copied to
# fuzz/regressions/<target>/ (so it becomes a regression test) and fails the
# run. The targets are built by cargo with cargo-fuzz's instrumentation
# flags (below; installing cargo-fuzz from source would cost a fresh clone's
# `make test` minutes for a wrapper around them), as a debug build in a
# target dir of their own (target/fuzz-build: the workspace's artefacts are
# never touched by a build with other flags and other features). Only the
# crates under test (the core, the store and the targets) are instrumented,
# through per-package profile flags, so the dependencies compile as plain
# debug code, a few times faster than a release build of the whole tree
# with instrumentation. Coverage
# is fed back from the project's own code, which is what the targets are
# about; debug assertions (overflow checks) are on. The flags need nightly;
# RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them. The code under
# test has no `unsafe` (the workspace denies it), so the targets run without
# AddressSanitizer.
# With IDEMGATE_REPORT=FILE each target's executions go into its results table.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-25}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(key jcs config store_request)

# cargo-fuzz's instrumentation (its `Project::cargo`): libFuzzer's coverage
# counters, comparison tracing and stack depth, `cfg(fuzzing)`.
flags='["-Cpasses=sancov-module", "-Cllvm-args=-sanitizer-coverage-level=4",
  "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters", "-Cllvm-args=-sanitizer-coverage-pc-table",
  "-Cllvm-args=-sanitizer-coverage-trace-compares", "-Cllvm-args=-simplifycfg-branch-fold-threshold=0",
  "-Cllvm-args=-sanitizer-coverage-stack-depth", "--cfg", "fuzzing", "-Clink-dead-code"]'
build=(cargo build --quiet --manifest-path fuzz/Cargo.toml -Zprofile-rustflags)
for crate in idemgate-core idemgate-store idemgate-fuzz; do
    build+=(--config "profile.dev.package.$crate.rustflags=$flags")
done
for t in "${targets[@]}"; do build+=(--bin "$t"); done
export RUSTC_BOOTSTRAP=1
echo "fuzz: building ${targets[*]}"
CARGO_TARGET_DIR=$PWD/target/fuzz-build "${build[@]}"

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
# Each target runs on one core; as many at once as there are cores, each
# still for its full time.
run() { # TARGET
    local t=$1 status=0
    "target/fuzz-build/debug/$t" "$out/corpus/$t" "fuzz/seeds/$t" "fuzz/regressions/$t" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$out/artifacts/$t/" -print_final_stats=1 >"$out/$t.log" 2>&1 || status=$?
    echo "$status" >"$out/$t.status"
}
cores=$(nproc)
for t in "${targets[@]}"; do
    # Old artifacts were saved to fuzz/regressions/ already.
    rm -rf "$out/artifacts/$t/" "$out/$t.status"
    mkdir -p "$out/corpus/$t" "$out/artifacts/$t/" "fuzz/regressions/$t"
    while (($(jobs -rp | wc -l) >= cores)); do wait -n || true; done
    echo "fuzz: $t for ${secs}s"
    run "$t" &
done
wait
for t in "${targets[@]}"; do
    artifacts=$out/artifacts/$t/
    log=$out/$t.log
    status=$(cat "$out/$t.status" 2>/dev/null || echo 1)
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
echo "fuzz: $total executions in total"
if ((${#failed[@]})); then
    echo "fuzz: FAILED: ${failed[*]}" >&2
    exit 1
fi
