#!/usr/bin/env bash
# The stages of `make check`, `make lint` and `make test`, each timed. The
# table of stage times is printed at the end, whether the run passed or not,
# and kept in target/stage-times.txt.
#
#   scripts/test.sh check     the inner loop: formatting, clippy (host and
#                             wasm), the core's tests with the map, the
#                             simulation's fixed set, the store's unit
#                             tests, its layers, its SQLite and in-memory
#                             stories; no Envoy, no PostgreSQL
#   scripts/test.sh lint      formatting, clippy (host and wasm), rustdoc
#   scripts/test.sh test      everything CI runs (`make test`); what it
#                             installs, it installs while the builds run
#
# The end-to-end suites run one at a time (their timing-sensitive tests, a
# store restarted or slower than the filter, never share the two cores with
# another suite's) and each is a stage of its own; a failed suite does not
# stop the others. Rows of docs/reliability.md are written only when
# IDEMGATE_REPORT names the file (`make report`).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=$(realpath -m "${IDEMGATE_VENV:-.tools/venv}")
ENVOY=${ENVOY_BIN:-$VENV/bin/envoy}
OLDEST_ENVOY=$PWD/.tools/envoy-1.36/bin/envoy
TIMES=target/stage-times.txt

names=() seconds=() verdicts=() failed=()
started=$SECONDS

report() {
    # Never leave an install half done.
    [[ -z ${setup_pid:-} ]] || wait "$setup_pid" 2>/dev/null || true
    mkdir -p target
    {
        printf '\n%-44s %8s  %s\n' stage seconds verdict
        for i in "${!names[@]}"; do
            printf '%-44s %8s  %s\n' "${names[$i]}" "${seconds[$i]}" "${verdicts[$i]}"
        done
        printf '%-44s %8s\n' total $((SECONDS - started))
    } | tee "$TIMES"
    if ((${#failed[@]})); then
        echo "failed stages: ${failed[*]}" >&2
        exit 1
    fi
}

# stage NAME COMMAND...: runs it, timed; a failure ends the run unless
# KEEP_GOING is set (then the run fails at its end).
stage() {
    local name=$1 t=$SECONDS status=0
    shift
    echo "==> $name"
    "$@" || status=$?
    names+=("$name")
    seconds+=($((SECONDS - t)))
    if ((status == 0)); then
        verdicts+=(ok)
    else
        verdicts+=("FAILED ($status)")
        failed+=("$name")
        [[ -n ${KEEP_GOING:-} ]] || report
    fi
}

e2e() { # ENVOY CARGO_TEST_ARGS...
    local envoy=$1
    shift
    IDEMGATE_WASM=$PWD/target/idemgate.wasm \
        IDEMGATE_STORE_BIN=$PWD/target/debug/idempotency-store \
        ENVOY_BIN=$envoy IDEMGATE_PYTHON=$VENV/bin/python \
        IDEMGATE_PREVIOUS="$PWD/$(scripts/previous-release.sh)" \
        cargo test "$@"
}

validate_bootstraps() {
    local f
    for f in envoy/*.yaml; do
        # Bootstraps named _*.yaml are fragments, not complete configs.
        case $f in envoy/_*) continue ;; esac
        "$ENVOY" --mode validate --log-level warn -c "$f" || return 1
    done
}

release_dry_run() {
    local d status=0
    d=$(mktemp -d)
    RELEASE_OUT=$d RELEASE_STORE=target/debug/idempotency-store RELEASE_PIN=no scripts/release.sh || status=$?
    rm -rf "$d"
    return $status
}

lint() {
    stage fmt cargo fmt --all --check
    stage clippy cargo clippy --workspace --all-targets -- -D warnings
    stage "clippy (wasm)" scripts/wasm.sh clippy
}

check() {
    stage setup scripts/setup.sh check
    lint
    stage "core and worker: unit, map" cargo test -p idemgate-core -p idemgate-worker
    stage "simulation: the fixed set" cargo test -p idemgate-simulation
    stage "store: unit" cargo test -p idemgate-store --lib --bins
    stage "store: layers, query plans, SQLite and memory stories" cargo test -p idemgate-store --test tests -- \
        layers:: query_plans:: stories::sqlite:: stories::sealed_sqlite:: stories::memory::
}

# The installs are network and disk; the builds are CPU. The toolchain comes
# first (the builds need it), then the rest installs while the builds run,
# its output kept until it is waited for.
setup_alongside() {
    setup_log=target/setup.log
    mkdir -p target
    (
        t=$SECONDS
        scripts/setup.sh >"$setup_log" 2>&1
        status=$?
        echo "setup: $((SECONDS - t)) s alongside the builds" >>"$setup_log"
        exit $status
    ) &
    setup_pid=$!
}

setup_waited() {
    local status=0
    wait "$setup_pid" || status=$?
    cat "$setup_log"
    return $status
}

test_all() {
    # Every crate of the tree is built once here (three times over, counting
    # the previous release's, the tests' and the fuzz targets' builds): the
    # incremental caches would only cost time and gigabytes of disk.
    export CARGO_INCREMENTAL=0
    stage "setup: toolchain" scripts/setup.sh check
    setup_alongside
    lint
    stage rustdoc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items --workspace
    stage wasm scripts/wasm.sh
    # The previous release is built before this one's store: both builds put
    # their idempotency-store in target/debug/.
    stage "previous release" scripts/previous-release.sh
    stage "wasm (faulty)" scripts/wasm.sh faulty
    stage "store build" cargo build -p idemgate-store
    stage "setup: the rest (waited for)" setup_waited
    stage "bootstraps" validate_bootstraps
    stage "istio payloads" python3 scripts/validate-istio-payloads.py "$ENVOY"
    # The minors between the oldest and the pinned one: the module loads in
    # each, under every bootstrap and Istio payload (make compat runs all).
    stage "Envoy 1.37-1.39: bootstraps, istio payloads" \
        env COMPAT_SUITES="bootstraps payloads" scripts/compat.sh 1.37 1.38 1.39
    stage "plugin configs" "$VENV/bin/python" scripts/validate-plugin-configs.py
    stage manifests scripts/validate-manifests.sh
    stage "coverage alerts on a real Envoy" python3 scripts/test-coverage-alert.py "$ENVOY" target/idemgate.wasm
    stage "remote module fetch on a real Envoy" python3 scripts/test-remote-module.py "$ENVOY" target/idemgate.wasm
    stage "oci round trip" scripts/oci-roundtrip.sh target/idemgate.wasm
    stage "release dry run" release_dry_run
    stage "simulation: the fixed set" cargo test -p idemgate-simulation
    stage "workspace tests" e2e "$ENVOY" --workspace --exclude e2e --exclude idemgate-simulation
    stage "e2e: harness" cargo test -p e2e --lib
    local suite
    for suite in $(sed -n 's/^mod \([a-z0-9_]*\);.*$/\1/p' tests/tests/main.rs); do
        KEEP_GOING=1 stage "e2e: $suite" e2e "$ENVOY" -p e2e --test main -- "$suite::"
    done
    ((${#failed[@]} == 0)) || report
    # The oldest Envoy the README names (1.36): detached forwarding, lost
    # claims and the demo walkthrough.
    stage "e2e on 1.36: detached, lost_claims" e2e "$OLDEST_ENVOY" -p e2e --test main -- detached:: lost_claims::
    stage "demo on 1.36" env ENVOY_BIN="$OLDEST_ENVOY" scripts/demo-smoke.sh
    stage demo scripts/demo-smoke.sh
    stage fuzz scripts/fuzz.sh 25
}

case ${1:-test} in
check) check ;;
lint)
    lint
    stage rustdoc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items --workspace
    ;;
test) test_all ;;
*)
    echo "usage: $0 [check|lint|test]" >&2
    exit 2
    ;;
esac
report
