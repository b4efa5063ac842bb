#!/usr/bin/env bash
# Pushes the filter module, as the OCI image `make release` writes
# (target/release-artefacts/oci-compat, scripts/oci.sh), to a registry with
# skopeo, and prints the reference to use, pinned by digest.
#
#   examples/oci/package.sh registry.example.com/idemgate/filter:0.1.0 [compat|wasm]
#
# compat (default): one tar+gzip layer holding plugin.wasm; any registry takes it.
# wasm: the Wasm artifact variant (application/vnd.module.wasm.content.layer.v1+wasm),
#       for registries that accept custom media types.
# Registry credentials: `skopeo login REGISTRY` first. The digest does not depend on
# the registry, so it is the one examples/istio/*.yaml pin after `make release`.
set -euo pipefail
cd "$(dirname "$0")/../.."

image=${1:?usage: examples/oci/package.sh REGISTRY/REPOSITORY:TAG [compat|wasm]}
variant=${2:-compat}
out=target/release-artefacts
command -v skopeo >/dev/null || { echo "package.sh: needs skopeo (scripts/setup.sh installs it)" >&2; exit 1; }
[[ -d $out/oci-$variant ]] || make release
tag=$(jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]' "$out/oci-$variant/index.json")
skopeo copy "oci:$out/oci-$variant:$tag" "docker://$image"
digest=$(cat "$out/oci-$variant.digest")
echo "module sha256 (of the .wasm itself): $(cut -d' ' -f1 "$out/idemgate.wasm.sha256")"
echo "use: oci://${image%:*}@$digest   (sha256: ${digest#sha256:})"
