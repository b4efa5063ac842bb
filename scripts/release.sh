#!/usr/bin/env bash
# Collects the release artefacts in target/release-artefacts/ (`make release`
# builds the module and the store first):
#   idemgate.wasm, idemgate.wasm.sha256   the filter module and its checksum
#   oci-compat/, oci-wasm/, oci-*.digest  the module as OCI image layouts (scripts/oci.sh)
#   idempotency-store                     the store, release build
#   LICENSE, CHANGELOG.md
# and pins the Istio examples (examples/istio/*.yaml) to the compat image's
# manifest digest, so the manifests name exactly the image built here.
#
# `make test` runs it as a check: RELEASE_OUT a scratch directory,
# RELEASE_STORE the debug store, RELEASE_PIN=no (the examples stay as they
# are); the artefacts are then checked against each other.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${RELEASE_OUT:-target/release-artefacts}
store=${RELEASE_STORE:-target/release/idempotency-store}
mkdir -p "$out"
cp target/idemgate.wasm "$out/idemgate.wasm"
(cd "$out" && sha256sum idemgate.wasm >idemgate.wasm.sha256)
scripts/oci.sh "$out/idemgate.wasm" "$out" >/dev/null
install -m 0755 "$store" "$out/idempotency-store"
cp LICENSE CHANGELOG.md "$out/"

if [[ ${RELEASE_PIN:-yes} == no ]]; then
    (cd "$out" && sha256sum --check --quiet idemgate.wasm.sha256)
    for variant in compat wasm; do
        digest=$(cat "$out/oci-$variant.digest")
        [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "release: oci-$variant.digest is $digest" >&2; exit 1; }
        blob=$out/oci-$variant/blobs/sha256/${digest#sha256:}
        [[ $(sha256sum "$blob" | cut -d' ' -f1) == "${digest#sha256:}" ]] ||
            { echo "release: the oci-$variant manifest does not have its digest" >&2; exit 1; }
    done
    "$out/idempotency-store" --help >/dev/null
    echo "release artefacts check out in $out: $(cd "$out" && ls -1 | tr '\n' ' ')"
    exit 0
fi

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
