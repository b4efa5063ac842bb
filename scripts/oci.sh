#!/usr/bin/env bash
# Writes the filter module as OCI image layouts (https://github.com/opencontainers/image-spec,
# image-layout.md) in both forms Istio's Wasm puller (istio-agent, for
# WasmPlugin `url` and EnvoyFilter `remote.http_uri.uri`) reads, without Docker:
#
#   scripts/oci.sh [MODULE [OUTDIR [TAG]]]
#       (defaults: target/idemgate.wasm, target/release-artefacts, the workspace version)
#
#   OUTDIR/oci-compat/  the "compat" variant: one layer
#                       application/vnd.oci.image.layer.v1.tar+gzip holding
#                       plugin.wasm, manifest annotation module.wasm.image/variant=compat.
#                       Any registry stores it; this is the one the examples pin.
#   OUTDIR/oci-wasm/    the "oci" (Wasm artifact) variant: config and a runtime-config
#                       layer application/vnd.module.wasm.config.v1+json, and the
#                       module itself as application/vnd.module.wasm.content.layer.v1+wasm.
#                       (Istio's puller requires exactly these two layers for this
#                       variant; a registry must accept custom media types.)
#
# Each layout has one manifest, tagged TAG in its index.json, so
# `skopeo copy oci:OUTDIR/oci-compat:TAG docker://REGISTRY/REPO:TAG` pushes it.
# Both manifests carry the release's OCI annotations (source, revision, version,
# licenses, created: scripts/oci-annotations.sh). The files are byte-for-byte
# reproducible (fixed tar metadata, gzip without name or time, `created` is the
# commit's time), so the manifest digest depends on the module and the commit only.
# It prints "<variant> sha256:<manifest digest>" for each, and writes them to
# OUTDIR/oci-<variant>.digest. For an oci:// URL, istio-agent checks the
# data source's `sha256` (WasmPlugin `sha256`) against this manifest digest.
set -euo pipefail
cd "$(dirname "$0")/.."

module=${1:-target/idemgate.wasm}
out=${2:-target/release-artefacts}
tag=${3:-$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)}
[[ -f $module ]] || { echo "oci.sh: no module at $module (make wasm)" >&2; exit 1; }
command -v jq >/dev/null || { echo "oci.sh: needs jq" >&2; exit 1; }
annotations=$(scripts/oci-annotations.sh)

module_sha=$(sha256sum "$module" | cut -d' ' -f1)
module_size=$(stat -c %s "$module")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# put LAYOUT FILE: stores FILE as a blob of LAYOUT; prints its digest (hex).
put() {
    local d
    d=$(sha256sum "$2" | cut -d' ' -f1)
    cp "$2" "$1/blobs/sha256/$d"
    echo "$d"
}
# descriptor MEDIATYPE HEX FILE [TITLE]
descriptor() {
    jq -cn --arg m "$1" --arg d "sha256:$2" --argjson s "$(stat -c %s "$3")" --arg t "${4:-}" \
        '{mediaType: $m, digest: $d, size: $s}
         + (if $t == "" then {} else {annotations: {"org.opencontainers.image.title": $t}} end)'
}
# finish LAYOUT VARIANT MANIFEST_FILE: writes oci-layout, index.json, the digest file.
finish() {
    local layout=$1 variant=$2 m
    m=$(put "$layout" "$3")
    printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
    jq -cn --arg d "sha256:$m" --argjson s "$(stat -c %s "$3")" --arg tag "$tag" \
        '{schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
          manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json",
                       digest: $d, size: $s,
                       annotations: {"org.opencontainers.image.ref.name": $tag}}]}' \
        >"$layout/index.json"
    echo "sha256:$m" >"$out/oci-$variant.digest"
    echo "$variant sha256:$m"
}

mkdir -p "$out"
for variant in compat wasm; do
    rm -rf "${out:?}/oci-$variant"
    mkdir -p "$out/oci-$variant/blobs/sha256"
done

# compat: plugin.wasm in a reproducible tar.gz.
mkdir "$work/root"
cp "$module" "$work/root/plugin.wasm"
chmod 0644 "$work/root/plugin.wasm"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=ustar \
    -C "$work/root" -cf "$work/layer.tar" plugin.wasm
gzip -n -9 -c "$work/layer.tar" >"$work/layer.tar.gz"
layout=$out/oci-compat
layer=$(put "$layout" "$work/layer.tar.gz")
diff_id=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
jq -cn --arg diff "sha256:$diff_id" \
    '{architecture: "wasm", os: "wasip1", config: {},
      rootfs: {type: "layers", diff_ids: [$diff]}}' >"$work/compat-config.json"
config=$(put "$layout" "$work/compat-config.json")
jq -cn --argjson annotations "$annotations" \
    --argjson config "$(descriptor application/vnd.oci.image.config.v1+json "$config" "$work/compat-config.json")" \
    --argjson layer "$(descriptor application/vnd.oci.image.layer.v1.tar+gzip "$layer" "$work/layer.tar.gz")" \
    '{schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
      config: $config, layers: [$layer],
      annotations: ({"module.wasm.image/variant": "compat"} + $annotations)}' >"$work/compat-manifest.json"
finish "$layout" compat "$work/compat-manifest.json"

# oci (Wasm artifact): runtime config + the raw module.
layout=$out/oci-wasm
jq -cn '{type: "envoy_proxy", abiVersions: ["proxy_abi_version_0_2_1"],
         config: {rootIds: ["idemgate"]}}' >"$work/runtime-config.json"
config=$(put "$layout" "$work/runtime-config.json")
layer=$(put "$layout" "$module")
jq -cn --argjson annotations "$annotations" \
    --argjson config "$(descriptor application/vnd.module.wasm.config.v1+json "$config" "$work/runtime-config.json")" \
    --argjson rc "$(descriptor application/vnd.module.wasm.config.v1+json "$config" "$work/runtime-config.json" runtime-config.json)" \
    --argjson layer "$(descriptor application/vnd.module.wasm.content.layer.v1+wasm "$layer" "$module" plugin.wasm)" \
    '{schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
      config: $config, layers: [$rc, $layer], annotations: $annotations}' >"$work/wasm-manifest.json"
finish "$layout" wasm "$work/wasm-manifest.json"

echo "module sha256:$module_sha ($module_size bytes)"
