#!/usr/bin/env bash
# The base images of examples/Dockerfile (FROM) and the images of
# examples/docker-compose.yaml (image:), pinned by digest.
#
#   examples/oci/pin-images.sh [--update] [FILE...]
#       Needs the registries: resolves each image that has no digest yet
#       (every image with --update) with `skopeo inspect --raw` and rewrites it
#       in place as NAME:TAG@sha256:DIGEST, the digest of what the tag names now
#       (for a multi-platform image, its index). Docker and Compose then pull
#       exactly that, and the tag stays to say what it was.
#   examples/oci/pin-images.sh --check [FILE...]
#       Offline (`make test`, through scripts/release.sh): every image is pinned
#       by digest, or is listed in README.md's "Releases" section among the
#       images that are not, and no image listed there is pinned meanwhile.
#
# FILE defaults to both examples. `scratch` and a Dockerfile's own stages are
# not images. PIN_TLS_VERIFY=false lets the resolving talk to a plain-HTTP
# registry (the test's own).
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=pin
case ${1:-} in
--update) mode=update; shift ;;
--check) mode=check; shift ;;
esac
files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=(examples/Dockerfile examples/docker-compose.yaml)

# images FILE: the image references FILE names, one a line.
images() {
    case $1 in
    *Dockerfile*)
        # FROM [--platform=P] IMAGE [AS NAME]; stages named by AS are not images.
        awk 'toupper($1) == "FROM" {
                 i = 2; if ($i ~ /^--platform=/) i++
                 img = $i
                 if (img != "scratch" && !(tolower(img) in stage)) print img
                 if (toupper($(i + 1)) == "AS") stage[tolower($(i + 2))] = 1
             }' "$1"
        ;;
    *) sed -n -E 's/^[[:space:]]*image:[[:space:]]*"?([^"[:space:]]+)"?.*/\1/p' "$1" ;;
    esac
}
pinned() { [[ $1 =~ @sha256:[0-9a-f]{64}$ ]]; }

if [[ $mode == check ]]; then
    # The README's table of unpinned images: rows "| `IMAGE` | why |" in "## Releases".
    listed=$(awk '/^## /{on = ($0 ~ /^## Releases/)} on' README.md | sed -n -E 's/^\| `([^`]+)` \|.*/\1/p')
    bad=()
    for f in "${files[@]}"; do
        while read -r img; do
            if pinned "$img"; then
                if grep -qxF "${img%@*}" <<<"$listed"; then
                    bad+=("$f: $img is pinned, but README.md still lists ${img%@*} as not")
                fi
            elif ! grep -qxF "$img" <<<"$listed"; then
                bad+=("$f: $img is not pinned by digest, and README.md's Releases section does not say why")
            fi
        done < <(images "$f")
    done
    if [[ ${#bad[@]} -gt 0 ]]; then
        printf 'pin-images: FAIL: %s\n' "${bad[@]}" >&2
        exit 1
    fi
    n=$(for f in "${files[@]}"; do images "$f"; done | wc -l)
    [[ $n -gt 0 ]] || { echo "pin-images: FAIL: no images found in ${files[*]}" >&2; exit 1; }
    echo "pin-images: $n images in ${files[*]}: each pinned by digest or listed in README.md"
    exit 0
fi

command -v skopeo >/dev/null || { echo "pin-images: needs skopeo (scripts/setup.sh installs it)" >&2; exit 1; }
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
for f in "${files[@]}"; do
    while read -r img; do
        if pinned "$img"; then
            [[ $mode == update ]] || continue
        fi
        name=${img%@*}
        # The digest of the manifest's exact bytes (a file: $(...) would drop a final newline).
        skopeo inspect --raw --tls-verify="${PIN_TLS_VERIFY:-true}" "docker://$name" >"$raw" ||
            { echo "pin-images: cannot resolve $name" >&2; exit 1; }
        digest=sha256:$(sha256sum "$raw" | cut -d' ' -f1)
        # Only on the lines that name the image, and only the whole reference.
        IMG=$img NEW=$name@$digest perl -i -pe \
            's/(^\s*(?:FROM\s+(?:--platform=\S+\s+)?|image:\s*"?))\Q$ENV{IMG}\E(?=["\s]|$)/$1$ENV{NEW}/i' "$f"
        echo "$f: $name@$digest"
    done < <(images "$f")
done
