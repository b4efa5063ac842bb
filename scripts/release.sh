#!/usr/bin/env bash
# Collects the release artefacts in target/release-artefacts/ (`make release`
# builds the module and the store first):
#   idemgate.wasm, idemgate.wasm.sha256   the filter module and its checksum
#   oci-compat/, oci-wasm/, oci-*.digest  the module as OCI image layouts (scripts/oci.sh)
#   idempotency-store                     the store, release build
#   LICENSE, CHANGELOG.md
# and pins the Istio examples (examples/istio/*.yaml) to the compat image's
# manifest digest, so the manifests name exactly the image built here.
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/release-artefacts
mkdir -p "$out"
cp target/idemgate.wasm "$out/idemgate.wasm"
(cd "$out" && sha256sum idemgate.wasm >idemgate.wasm.sha256)
scripts/oci.sh "$out/idemgate.wasm" "$out" >/dev/null
install -m 0755 target/release/idempotency-store "$out/idempotency-store"
cp LICENSE CHANGELOG.md "$out/"

digest=$(cat "$out/oci-compat.digest")
hex=${digest#sha256:}
for f in examples/istio/envoyfilter.yaml examples/istio/wasmplugin.yaml; do
    sed -i -E \
        -e "s#(oci://[^@\" ]+)@sha256:[0-9a-f]{64}#\1@sha256:$hex#" \
        -e "s#^( *sha256: *)[0-9a-f]{64}#\1$hex#" "$f"
done

echo "release artefacts in $out:"
(cd "$out" && ls -1)
echo "module  $(cut -d' ' -f1 "$out/idemgate.wasm.sha256")"
echo "image   oci://REGISTRY/idemgate/filter@$digest (compat; examples/istio pinned to it)"
echo "        oci-wasm: $(cat "$out/oci-wasm.digest")"
echo "push:   skopeo copy oci:$out/oci-compat:$(jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]' "$out/oci-compat/index.json") docker://REGISTRY/idemgate/filter:TAG"
