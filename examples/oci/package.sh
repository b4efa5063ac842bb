#!/usr/bin/env bash
# Pushes an image `make release` writes (target/release-artefacts/oci-*:
# scripts/oci.sh, scripts/oci-store.sh) to a registry with skopeo, signed when
# SIGN_BY names a GPG key, and prints the reference to use, pinned by digest.
#
#   [SIGN_BY=FINGERPRINT] examples/oci/package.sh REGISTRY/REPOSITORY:TAG [compat|wasm|store]
#
# compat (default): the filter, one tar+gzip layer holding plugin.wasm; any registry takes it.
# wasm: the filter as the Wasm artifact variant (application/vnd.module.wasm.content.layer.v1+wasm),
#       for registries that accept custom media types.
# store: idempotency-store (no shell, user 10001).
# Registry credentials: `skopeo login REGISTRY` first. Signatures go where
# registries.d says for that registry (docs/operations.md, "Verifying a
# release"). The digest does not depend on the registry, so for compat it is
# the one examples/istio/*.yaml pin after `make release`.
set -euo pipefail
cd "$(dirname "$0")/../.."

image=${1:?usage: examples/oci/package.sh REGISTRY/REPOSITORY:TAG [compat|wasm|store]}
variant=${2:-compat}
out=target/release-artefacts
command -v skopeo >/dev/null || { echo "package.sh: needs skopeo (scripts/setup.sh installs it)" >&2; exit 1; }
case $variant in compat | wasm | store) ;; *) echo "package.sh: no variant $variant" >&2; exit 1 ;; esac
[[ -d $out/oci-$variant ]] || make release
tag=$(jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]' "$out/oci-$variant/index.json")
sign=()
[[ -n ${SIGN_BY:-} ]] && sign=(--sign-by "$SIGN_BY")
skopeo copy "${sign[@]}" "oci:$out/oci-$variant:$tag" "docker://$image"
digest=$(cat "$out/oci-$variant.digest")
if [[ $variant == store ]]; then
    echo "use: ${image%:*}@$digest"
else
    echo "module sha256 (of the .wasm itself): $(cut -d' ' -f1 "$out/idemgate.wasm.sha256")"
    echo "use: oci://${image%:*}@$digest   (sha256: ${digest#sha256:})"
fi
[[ -n ${SIGN_BY:-} ]] || echo "not signed: set SIGN_BY to the release's GPG key to sign"
