#!/usr/bin/env bash
# Prints, as one JSON object, the OCI annotations (image-spec annotations.md)
# every image of a release carries, so a pulled image says what it was built
# from:
#   org.opencontainers.image.source     where the source lives: IDEMGATE_SOURCE_URL,
#                                       else the git remote "origin", else this
#                                       checkout (git+file://), which names no
#                                       public place: set one of the first two
#                                       for a published release
#   org.opencontainers.image.revision   the commit (git rev-parse HEAD)
#   org.opencontainers.image.version    the workspace version (Cargo.toml)
#   org.opencontainers.image.licenses   LICENSES (an SPDX expression), default the workspace's
#   org.opencontainers.image.created    the commit's time, not the build's, so a
#                                       rebuild of one commit gives the same digest
#
#   scripts/oci-annotations.sh [LICENSES]
#   IDEMGATE_OCI_ANNOTATIONS=JSON scripts/oci-annotations.sh [LICENSES]   (prints JSON)
set -euo pipefail
cd "$(dirname "$0")/.."

command -v jq >/dev/null || { echo "oci-annotations: needs jq" >&2; exit 1; }
# A release computes them once and hands them to each image through
# IDEMGATE_OCI_ANNOTATIONS: others may commit while it builds, and every image
# must name the same commit.
if [[ -n ${IDEMGATE_OCI_ANNOTATIONS:-} ]]; then
    jq -ce --arg l "${1:-}" 'if $l == "" then . else .["org.opencontainers.image.licenses"] = $l end' \
        <<<"$IDEMGATE_OCI_ANNOTATIONS"
    exit
fi
revision=$(git rev-parse --verify HEAD 2>/dev/null) ||
    { echo "oci-annotations: not a git checkout: the images must name their commit" >&2; exit 1; }
created=$(TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ "$revision")
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
license=$(sed -n '/^\[workspace.package\]/,/^\[/s/^license = "\(.*\)"/\1/p' Cargo.toml)
[[ -n $version && -n $license ]] || { echo "oci-annotations: no version or license in Cargo.toml" >&2; exit 1; }
source=${IDEMGATE_SOURCE_URL:-$(git remote get-url origin 2>/dev/null || echo "git+file://$PWD")}
jq -cn --arg source "$source" --arg revision "$revision" --arg version "$version" \
    --arg licenses "${1:-$license}" --arg created "$created" \
    '{"org.opencontainers.image.source": $source,
      "org.opencontainers.image.revision": $revision,
      "org.opencontainers.image.version": $version,
      "org.opencontainers.image.licenses": $licenses,
      "org.opencontainers.image.created": $created}'
