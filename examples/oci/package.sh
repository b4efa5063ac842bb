#!/usr/bin/env bash
# Packages the filter module as an OCI image that Istio (WasmPlugin `url`, or
# istio-agent for the EnvoyFilter's `remote.http_uri.uri`) can pull, and pushes it.
#
#   examples/oci/package.sh registry.example.com/idemgate/filter:0.1.0
#
# With `oras` on PATH it pushes the OCI artifact layout Istio reads natively
# (config application/vnd.module.wasm.config.v1+json, one layer
# application/vnd.module.wasm.content.layer.v1+wasm) from target/idemgate.wasm,
# which `make wasm` builds. Otherwise, with Docker, it builds the image the
# `wasm` target of examples/Dockerfile describes (FROM scratch, /plugin.wasm:
# the "compat" layout Istio also accepts) and pushes that.
# It prints the reference to use, pinned by digest.
set -euo pipefail
cd "$(dirname "$0")/../.."

image=${1:?usage: examples/oci/package.sh REGISTRY/REPOSITORY:TAG}

if command -v oras >/dev/null; then
    [[ -f target/idemgate.wasm ]] || make wasm
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cp target/idemgate.wasm "$work/plugin.wasm"
    echo '{}' >"$work/config.json"
    (cd "$work" && oras push "$image" \
        --config config.json:application/vnd.module.wasm.config.v1+json \
        plugin.wasm:application/vnd.module.wasm.content.layer.v1+wasm)
    digest=$(oras resolve "$image")
elif command -v docker >/dev/null; then
    docker build -f examples/Dockerfile --target wasm -t "$image" .
    docker push "$image"
    digest=$(docker inspect --format '{{index .RepoDigests 0}}' "$image")
    digest=${digest##*@}
else
    echo "package.sh: needs oras (https://oras.land) or docker" >&2
    exit 1
fi

echo "module sha256 (of the .wasm itself): $(sha256sum target/idemgate.wasm 2>/dev/null | cut -d' ' -f1)"
echo "use: oci://${image%:*}@$digest"
