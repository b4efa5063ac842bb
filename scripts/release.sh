#!/usr/bin/env bash
# Collects the release artefacts in target/release-artefacts/ (`make release`
# builds the module and the store first):
#   idemgate.wasm, idemgate.wasm.sha256   the filter module and its checksum
#   oci-compat/, oci-wasm/, oci-*.digest  the module as OCI image layouts (scripts/oci.sh)
#   idempotency-store                     the store, release build
#   oci-store/, oci-store.digest          the store as an OCI image layout: no base,
#                                         no shell, runs as 10001 (scripts/oci-store.sh)
#   idemgate.wasm.cdx.json,               CycloneDX SBOMs of the module and of the
#   idempotency-store.cdx.json            store (its image's Debian files included)
#                                         (scripts/release-sbom.py)
#   provenance.intoto.json                in-toto/SLSA provenance: every file and
#                                         image above by digest, the commit, the
#                                         toolchain (scripts/release-provenance.py)
#   *.minisig, minisign.pub               minisign signatures of the module, the store,
#                                         the SBOMs and the provenance, when
#                                         RELEASE_MINISIGN_KEY names a secret key
#   LICENSE, CHANGELOG.md
# Every image carries the OCI annotations source, revision, version, licenses
# and created (scripts/oci-annotations.sh). The version must agree with
# CHANGELOG.md and with the tag vX.Y.Z if there is one (scripts/release-version.sh),
# and the images of examples/Dockerfile and examples/docker-compose.yaml are
# pinned by digest or listed in README.md as not (examples/oci/pin-images.sh --check).
# It then pins the Istio examples (examples/istio/*.yaml) to the compat image's
# manifest digest, so the manifests name exactly the image built here.
#
#   RELEASE_MINISIGN_KEY  minisign secret key that signs the artefacts
#   RELEASE_MINISIGN_PUB  its public key (default: recreated from the secret key)
#   IDEMGATE_SOURCE_URL   the org.opencontainers.image.source of the images
#
# `make test` runs it as a check: RELEASE_OUT a scratch directory,
# RELEASE_STORE the debug store, RELEASE_PIN=no (the examples stay as they
# are). The artefacts are then checked against each other, the store image is
# unpacked (umoci) and its store run from it as its own user, and, without a
# RELEASE_MINISIGN_KEY, a throwaway key signs them so that the signatures are
# checked too (and an altered copy of the module must fail them).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${RELEASE_OUT:-target/release-artefacts}
store=${RELEASE_STORE:-target/release/idempotency-store}
check=no
[[ ${RELEASE_PIN:-yes} == no ]] && check=yes
for tool in jq umoci minisign python3 curl; do
    command -v "$tool" >/dev/null || { echo "release: needs $tool (scripts/setup.sh)" >&2; exit 1; }
done
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
# Before pinning examples/istio below changes the tree.
dirty=no
git diff --quiet HEAD -- || dirty=yes
work=$(mktemp -d)
store_pid=
cleanup() {
    local status=$?
    if [[ -n $store_pid ]]; then
        kill "$store_pid" 2>/dev/null || true
        wait "$store_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT
fail() { echo "release: FAIL: $*" >&2; exit 1; }

if [[ $check == yes ]]; then
    scripts/release-version.sh --self-test >/dev/null
fi
version=$(scripts/release-version.sh)
# The examples' images: pinned by digest, or README.md says why not.
examples/oci/pin-images.sh --check >/dev/null
annotations=$(scripts/oci-annotations.sh)
export IDEMGATE_OCI_ANNOTATIONS=$annotations

mkdir -p "$out"
cp target/idemgate.wasm "$out/idemgate.wasm"
(cd "$out" && sha256sum idemgate.wasm >idemgate.wasm.sha256)
scripts/oci.sh "$out/idemgate.wasm" "$out" >/dev/null
install -m 0755 "$store" "$out/idempotency-store"
scripts/oci-store.sh "$out/idempotency-store" "$out" >/dev/null
cp LICENSE CHANGELOG.md "$out/"

scripts/release-sbom.py --package idemgate-filter --target wasm32-wasip1 \
    --artefact "$out/idemgate.wasm" --annotations "$annotations" "$out/idemgate.wasm.cdx.json"
scripts/release-sbom.py --package idemgate-store --target "$(rustc -vV | sed -n 's/^host: //p')" \
    --artefact "$out/idempotency-store" --annotations "$annotations" \
    --debian-packages "$out/oci-store.packages" "$out/idempotency-store.cdx.json"
profile=release
[[ $store == */debug/* ]] && profile=debug
scripts/release-provenance.py --annotations "$annotations" --started "$started" --store-profile "$profile" \
    --file "idemgate.wasm=$out/idemgate.wasm" --file "idempotency-store=$out/idempotency-store" \
    --file "idemgate.wasm.cdx.json=$out/idemgate.wasm.cdx.json" \
    --file "idempotency-store.cdx.json=$out/idempotency-store.cdx.json" \
    --image "oci-compat=$out/oci-compat.digest" --image "oci-wasm=$out/oci-wasm.digest" \
    --image "oci-store=$out/oci-store.digest" "$out/provenance.intoto.json"

signed=(idemgate.wasm idempotency-store idemgate.wasm.cdx.json idempotency-store.cdx.json provenance.intoto.json)
key=${RELEASE_MINISIGN_KEY:-}
pub=${RELEASE_MINISIGN_PUB:-}
if [[ -z $key && $check == yes ]]; then
    # A check signs with a throwaway key, so that signing and verifying are tested.
    key=$work/minisign.key pub=$work/minisign.pub
    minisign -G -W -s "$key" -p "$pub" >/dev/null
fi
rm -f "$out"/*.minisig "$out/minisign.pub"
if [[ -n $key ]]; then
    # Signing runs in $out: the keys by absolute path.
    key=$(realpath "$key")
    [[ -z $pub ]] || pub=$(realpath "$pub")
    if [[ -n $pub ]]; then
        cp "$pub" "$out/minisign.pub"
    else
        minisign -R -s "$key" -p "$out/minisign.pub" >/dev/null
    fi
    (cd "$out" && minisign -S -s "$key" -t "idemgate $version $(jq -r '."org.opencontainers.image.revision"' <<<"$annotations")" \
        -m "${signed[@]}" >/dev/null)
fi

if [[ $check == yes ]]; then
    (cd "$out" && sha256sum --check --quiet idemgate.wasm.sha256)
    # The commit the annotations named when the build began (HEAD may move
    # while it runs): every image and the provenance name that one.
    revision=$(jq -r '."org.opencontainers.image.revision"' <<<"$annotations")
    git cat-file -e "$revision^{commit}" || fail "the revision $revision is no commit of this repository"
    for variant in compat wasm store; do
        digest=$(cat "$out/oci-$variant.digest")
        [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "oci-$variant.digest is $digest"
        blob=$out/oci-$variant/blobs/sha256/${digest#sha256:}
        [[ $(sha256sum "$blob" | cut -d' ' -f1) == "${digest#sha256:}" ]] ||
            fail "the oci-$variant manifest does not have its digest"
        for a in source revision version licenses created; do
            [[ -n $(jq -r --arg k "org.opencontainers.image.$a" '.annotations[$k] // empty' "$blob") ]] ||
                fail "oci-$variant: no annotation org.opencontainers.image.$a"
        done
        [[ $(jq -r '.annotations["org.opencontainers.image.revision"]' "$blob") == "$revision" ]] ||
            fail "oci-$variant: revision annotation is not $revision"
        [[ $(jq -r '.annotations["org.opencontainers.image.version"]' "$blob") == "$version" ]] ||
            fail "oci-$variant: version annotation is not $version"
    done
    "$out/idempotency-store" --help >/dev/null

    # The store image: unpacked as a runtime would, it holds the store and what
    # it links, nothing to run a shell with, and its store serves as its user.
    [[ $(id -u) == 0 ]] || fail "running the store image's rootfs needs root (chroot as the image's user)"
    tag=$(jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]' "$out/oci-store/index.json")
    umoci unpack --image "$out/oci-store:$tag" "$work/bundle" >/dev/null
    rootfs=$work/bundle/rootfs
    user=$(jq -r '"\(.process.user.uid):\(.process.user.gid)"' "$work/bundle/config.json")
    [[ $user == 10001:10001 ]] || fail "oci-store runs as $user, not 10001:10001"
    shells=$(find "$rootfs" \( -name sh -o -name bash -o -name dash -o -name ash -o -name zsh -o -name busybox \) -printf '/%P\n')
    [[ -z $shells ]] || fail "oci-store holds a shell: $shells"
    unexpected=$(find "$rootfs" -type f -printf '/%P\n' | grep -v -E \
        '^/(usr/local/bin/idempotency-store|lib(64)?/.*\.so(\.[0-9]+)*|etc/(passwd|group|nsswitch\.conf|ssl/certs/ca-certificates\.crt)|usr/share/doc/[^/]+/copyright)$' || true)
    [[ -z $unexpected ]] || fail "oci-store holds more than the store and what it needs: $unexpected"
    cmp -s "$rootfs/usr/local/bin/idempotency-store" "$out/idempotency-store" ||
        fail "oci-store's binary is not the released idempotency-store"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    mapfile -t args < <(jq -r '.process.args[]' "$work/bundle/config.json")
    mapfile -t env < <(jq -r '.process.env[]' "$work/bundle/config.json")
    # The image's own command and environment, with a loopback port and tokens.
    env -i "${env[@]}" IDEMGATE_LISTEN="127.0.0.1:$port" IDEMGATE_API_TOKEN=check-api-token \
        IDEMGATE_ADMIN_TOKEN=check-admin-token \
        /usr/sbin/chroot --userspec="$user" "$rootfs" "${args[@]}" >"$work/store.log" 2>&1 &
    store_pid=$!
    for _ in $(seq 100); do
        curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
        kill -0 "$store_pid" 2>/dev/null || { cat "$work/store.log" >&2; fail "the store exited in its image's rootfs"; }
        sleep 0.1
    done
    curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null || { cat "$work/store.log" >&2; fail "the store in its image did not get ready"; }
    [[ $(stat -c %u "$rootfs/data/idempotency.db") == 10001 ]] || fail "the image's store did not write /data/idempotency.db as 10001"
    kill "$store_pid" && wait "$store_pid" 2>/dev/null || true
    store_pid=

    # SBOMs: each names its artefact by sha256 and the crates it is built from.
    for pair in idemgate.wasm:proxy-wasm idempotency-store:rusqlite idempotency-store:libc6; do
        f=${pair%%:*} want=${pair#*:}
        sbom=$out/$f.cdx.json
        [[ $(jq -r '.bomFormat + " " + .specVersion' "$sbom") == "CycloneDX 1.5" ]] || fail "$f.cdx.json is not CycloneDX 1.5"
        [[ $(jq -r '.metadata.component.hashes[0].content' "$sbom") == $(sha256sum "$out/$f" | cut -d' ' -f1) ]] ||
            fail "$f.cdx.json does not name $f's sha256"
        jq -e --arg n "$want" 'any(.components[]; .name == $n and .scope == "required")' "$sbom" >/dev/null ||
            fail "$f.cdx.json does not list $want"
        jq -e 'all(.components[] | select(.purl // "" | startswith("pkg:cargo/")); .hashes[0].content | test("^[0-9a-f]{64}$"))' \
            "$sbom" >/dev/null || fail "$f.cdx.json: a crate without its Cargo.lock checksum"
    done
    # Provenance: every subject is what the release holds, built from that commit.
    prov=$out/provenance.intoto.json
    [[ $(jq -r '.predicate.buildDefinition.externalParameters.source.digest.gitCommit' "$prov") == "$revision" ]] ||
        fail "the provenance does not name $revision"
    while read -r name digest; do
        case $name in
        oci-*) want=$(cut -d: -f2 "$out/$name.digest") ;;
        *) want=$(sha256sum "$out/$name" | cut -d' ' -f1) ;;
        esac
        [[ $digest == "$want" ]] || fail "the provenance's $name is sha256:$digest, the release's sha256:$want"
    done < <(jq -r '.subject[] | "\(.name) \(.digest.sha256)"' "$prov")
    [[ $(jq '.subject | length' "$prov") == 7 ]] || fail "the provenance does not name all 7 artefacts"

    # Signatures: each verifies; an altered copy does not.
    for f in "${signed[@]}"; do
        minisign -V -q -p "$out/minisign.pub" -m "$out/$f" || fail "minisign -V refuses $f"
    done
    cp "$out/idemgate.wasm" "$work/altered.wasm"
    cp "$out/idemgate.wasm.minisig" "$work/altered.wasm.minisig"
    byte=$(od -An -tu1 -j 100 -N1 "$work/altered.wasm" | tr -d ' ')
    printf "\\$(printf %03o $(((byte + 1) % 256)))" | dd of="$work/altered.wasm" bs=1 seek=100 conv=notrunc status=none
    cmp -s "$out/idemgate.wasm" "$work/altered.wasm" && fail "the altered copy of the module is not altered"
    if minisign -V -q -p "$out/minisign.pub" -m "$work/altered.wasm" 2>/dev/null; then
        fail "minisign -V accepts an altered module"
    fi
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
# The module served over HTTP is pinned by the sha256 of the file itself.
module=$(cut -d' ' -f1 "$out/idemgate.wasm.sha256")
sed -i -E \
    -e "s#(sha256: *\")[0-9a-f]{64}\"#\1$module\"#" \
    -e "s#idemgate-[0-9][0-9a-z.+-]*\.wasm#idemgate-$version.wasm#g" examples/istio/envoyfilter-http-module.yaml

ref() { jq -r '.manifests[0].annotations["org.opencontainers.image.ref.name"]' "$out/$1/index.json"; }
echo "release $version artefacts in $out:"
(cd "$out" && ls -1)
echo "module  $(cut -d' ' -f1 "$out/idemgate.wasm.sha256")"
echo "image   oci://REGISTRY/idemgate/filter@$digest (compat; examples/istio pinned to it)"
echo "        oci-wasm: $(cat "$out/oci-wasm.digest")"
echo "store   REGISTRY/idemgate/store@$(cat "$out/oci-store.digest")"
echo "push:   skopeo copy --sign-by KEY oci:$out/oci-compat:$(ref oci-compat) docker://REGISTRY/idemgate/filter:TAG"
echo "        skopeo copy --sign-by KEY oci:$out/oci-store:$(ref oci-store) docker://REGISTRY/idemgate/store:TAG"
if [[ -z $key ]]; then
    echo "not signed: set RELEASE_MINISIGN_KEY to a minisign secret key to sign the artefacts"
fi
if [[ $dirty == yes ]]; then
    echo "note: the worktree had uncommitted changes; the images' revision annotation is HEAD's"
fi
if [[ $(git rev-parse -q --verify "refs/tags/v$version^{commit}" || true) != "$(git rev-parse HEAD)" ]]; then
    echo "note: HEAD is not tagged v$version (README.md, Releases)"
fi
