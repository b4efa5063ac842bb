#!/usr/bin/env bash
# The OCI layouts of scripts/oci.sh and scripts/oci-store.sh survive a real
# registry, signed: starts Debian's docker-registry (the CNCF distribution
# registry) on a loopback port with a throwaway storage directory, makes a
# throwaway GPG key in a temporary GNUPGHOME, pushes both module variants and
# the store image with `skopeo copy --sign-by` (the signatures go to a
# lookaside directory, as registries.d configures), pulls them back under a
# policy.json that accepts from this registry only images signed by that key,
# and checks that
#   - the registry serves the manifest digest oci.sh computed,
#   - the module inside the pulled image (compat: plugin.wasm in the tar.gz
#     layer; wasm: the application/vnd.module.wasm.content.layer.v1+wasm blob)
#     has the sha256 of the built module; the pulled store image holds the
#     store binary, runs as 10001 and keeps its OCI annotations,
#   - the policy refuses an unsigned image, an image signed by another key,
#     the store image once one byte of its layer blob is altered in the
#     registry's storage (the layer no longer has the digest the signed
#     manifest names), and the compat image once its manifest blob there is
#     replaced by another manifest (signatures belong to a manifest digest:
#     the replacement has none),
#   - the examples pin the compat digest consistently (URL and sha256 agree).
#
#   scripts/oci-roundtrip.sh [MODULE [STORE]]
#       (defaults target/idemgate.wasm, target/debug/idempotency-store)
set -euo pipefail
cd "$(dirname "$0")/.."

module=${1:-target/idemgate.wasm}
store=${2:-target/debug/idempotency-store}
registry_bin=${DOCKER_REGISTRY_BIN:-/usr/bin/docker-registry}
for tool in "$registry_bin" skopeo gpg gpgconf umoci jq curl python3; do
    command -v "$tool" >/dev/null || { echo "oci-roundtrip: needs $tool (scripts/setup.sh)" >&2; exit 1; }
done
start=$(date +%s)
work=$(mktemp -d)
registry_pid=
cleanup() {
    # The script's own status, not the stopped registry's (143).
    local status=$?
    if [[ -n $registry_pid ]]; then
        kill "$registry_pid" 2>/dev/null || true
        wait "$registry_pid" 2>/dev/null || true
    fi
    # The gpg-agent gpg started for the throwaway GNUPGHOME.
    if [[ -d $work/gnupg ]]; then
        GNUPGHOME=$work/gnupg gpgconf --kill gpg-agent 2>/dev/null || true
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT
fail() { echo "oci-roundtrip: FAIL: $*" >&2; exit 1; }

want=$(sha256sum "$module" | cut -d' ' -f1)
# One commit for all three images, though HEAD may move meanwhile.
IDEMGATE_OCI_ANNOTATIONS=$(scripts/oci-annotations.sh)
export IDEMGATE_OCI_ANNOTATIONS
scripts/oci.sh "$module" "$work/out" test >/dev/null
scripts/oci-store.sh "$store" "$work/out" test >/dev/null

# A throwaway signing key, only ever in this run's GNUPGHOME.
export GNUPGHOME=$work/gnupg
mkdir -m 0700 "$GNUPGHOME"
gpg --batch --quiet --pinentry-mode loopback --passphrase '' \
    --quick-generate-key 'idemgate release check <release-check@invalid>' ed25519 sign 1d 2>/dev/null
fpr=$(gpg --batch --with-colons --list-secret-keys 2>/dev/null | awk -F: '$1 == "fpr" {print $10; exit}')
[[ $fpr =~ ^[0-9A-F]{40}$ ]] || fail "no throwaway GPG key"
gpg --batch --export "$fpr" >"$work/signer.gpg"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/registry.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog: {disabled: true}
storage:
  filesystem: {rootdirectory: $work/storage}
http:
  addr: 127.0.0.1:$port
EOF
"$registry_bin" serve "$work/registry.yml" >"$work/registry.log" 2>&1 &
registry_pid=$!
for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$port/v2/" >/dev/null 2>&1 && break
    kill -0 "$registry_pid" 2>/dev/null || { cat "$work/registry.log" >&2; fail "docker-registry exited"; }
    sleep 0.1
done
curl -fsS "http://127.0.0.1:$port/v2/" >/dev/null || fail "docker-registry did not answer on 127.0.0.1:$port"

# Signatures live beside the registry (a lookaside store), as for any registry
# without a signature API. The policy accepts from this registry only what the
# throwaway key signed, rejects every other registry, and reads local layouts
# as they are.
registry=127.0.0.1:$port
mkdir -p "$work/registries.d"
cat >"$work/registries.d/default.yaml" <<EOF
docker:
  $registry:
    sigstore: file://$work/sigstore
    sigstore-staging: file://$work/sigstore
EOF
jq -n --arg reg "$registry" --arg key "$work/signer.gpg" \
    '{default: [{type: "reject"}],
      transports: {
        docker: {($reg): [{type: "signedBy", keyType: "GPGKeys", keyPath: $key}]},
        oci: {"": [{type: "insecureAcceptAnything"}]}}}' >"$work/policy.json"
skopeo_opts=(--policy "$work/policy.json" --registries.d "$work/registries.d")
# push LAYOUT REPO:TAG [skopeo copy options]: signed unless told otherwise.
push() {
    local layout=$1 ref=$2
    shift 2
    skopeo "${skopeo_opts[@]}" copy -q --dest-tls-verify=false "$@" "oci:$layout:test" "docker://$registry/$ref"
}
# pull REPO@DIGEST DEST: under the policy. The policy judges the source's
# signatures; a layout cannot keep them, hence --remove-signatures.
pull() {
    skopeo "${skopeo_opts[@]}" copy -q --src-tls-verify=false --remove-signatures \
        "docker://$registry/$1" "oci:$2:pulled"
}
# blob DIGEST: the file in the registry's storage that holds it.
blob() { echo "$work/storage/docker/registry/v2/blobs/sha256/${1:7:2}/${1#sha256:}/data"; }

for variant in compat wasm; do
    digest=$(cat "$work/out/oci-$variant.digest")
    push "$work/out/oci-$variant" "idemgate/filter:$variant" --sign-by "$fpr"
    # The registry serves the very manifest the layout holds.
    served=$(curl -fsS -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://$registry/v2/idemgate/filter/manifests/$variant" | sha256sum | cut -d' ' -f1)
    [[ sha256:$served == "$digest" ]] || fail "$variant: registry serves sha256:$served, layout has $digest"
    # Pull it back, by digest, as Istio would, and only if the key signed it.
    pull "idemgate/filter@$digest" "$work/pulled-$variant" ||
        fail "$variant: the signed image was refused under the policy"
    manifest=$(jq -r '.manifests[0].digest' "$work/pulled-$variant/index.json")
    [[ $manifest == "$digest" ]] || fail "$variant: pulled manifest $manifest, pushed $digest"
    blobs=$work/pulled-$variant/blobs/sha256
    m=$(cat "$blobs/${manifest#sha256:}")
    case $variant in
    compat)
        [[ $(jq -r '.layers | length' <<<"$m") == 1 ]] || fail "compat: not a single layer"
        [[ $(jq -r '.annotations["module.wasm.image/variant"]' <<<"$m") == compat ]] ||
            fail "compat: annotation module.wasm.image/variant missing"
        layer=$(jq -r '.layers[0] | select(.mediaType == "application/vnd.oci.image.layer.v1.tar+gzip") | .digest' <<<"$m")
        [[ -n $layer ]] || fail "compat: layer media type"
        mkdir "$work/x"
        tar -xzf "$blobs/${layer#sha256:}" -C "$work/x"
        got=$(sha256sum "$work/x/plugin.wasm" | cut -d' ' -f1)
        ;;
    wasm)
        layer=$(jq -r '.layers[] | select(.mediaType == "application/vnd.module.wasm.content.layer.v1+wasm") | .digest' <<<"$m")
        [[ -n $layer ]] || fail "wasm: no application/vnd.module.wasm.content.layer.v1+wasm layer"
        got=$(sha256sum "$blobs/${layer#sha256:}" | cut -d' ' -f1)
        ;;
    esac
    [[ $got == "$want" ]] || fail "$variant: pulled module sha256:$got, built sha256:$want"
    revision=$(jq -r '.annotations["org.opencontainers.image.revision"]' <<<"$m")
    git cat-file -e "$revision^{commit}" 2>/dev/null ||
        fail "$variant: the pulled manifest's revision annotation ($revision) is no commit here"
    echo "oci-roundtrip: $variant $digest signed, pushed, pulled under the policy, module sha256:$got"
done

# The store image, signed, pushed and pulled back the same way.
digest=$(cat "$work/out/oci-store.digest")
push "$work/out/oci-store" idemgate/store:test --sign-by "$fpr"
pull "idemgate/store@$digest" "$work/pulled-store" || fail "store: the signed image was refused under the policy"
umoci unpack --image "$work/pulled-store:pulled" "$work/store-bundle" >/dev/null
cmp -s "$work/store-bundle/rootfs/usr/local/bin/idempotency-store" "$store" ||
    fail "store: the pulled image does not hold $store"
[[ $(jq -r '"\(.process.user.uid):\(.process.user.gid)"' "$work/store-bundle/config.json") == 10001:10001 ]] ||
    fail "store: the pulled image does not run as 10001:10001"
m=$(cat "$work/pulled-store/blobs/sha256/${digest#sha256:}")
for a in source revision version licenses created; do
    [[ -n $(jq -r --arg k "org.opencontainers.image.$a" '.annotations[$k] // empty' <<<"$m") ]] ||
        fail "store: the pulled manifest has no org.opencontainers.image.$a"
done
echo "oci-roundtrip: store $digest signed, pushed, pulled under the policy, binary as built"

# examples/oci/pin-images.sh pins a FROM and an image: to the digest the
# registry serves for their tag, and leaves stages alone.
ref=$registry/idemgate/filter:wasm
printf 'FROM %s AS base\nFROM base AS other\nFROM scratch\n' "$ref" >"$work/Dockerfile"
printf 'services:\n  one:\n    image: %s\n' "$ref" >"$work/compose.yaml"
PIN_TLS_VERIFY=false examples/oci/pin-images.sh "$work/Dockerfile" "$work/compose.yaml" >/dev/null
pinned=$ref@$(cat "$work/out/oci-wasm.digest")
[[ $(cat "$work/Dockerfile") == "$(printf 'FROM %s AS base\nFROM base AS other\nFROM scratch' "$pinned")" ]] ||
    fail "pin-images.sh wrote a Dockerfile of: $(cat "$work/Dockerfile")"
grep -qxF "    image: $pinned" "$work/compose.yaml" || fail "pin-images.sh wrote a compose file of: $(cat "$work/compose.yaml")"
echo "oci-roundtrip: pin-images.sh pins FROM and image: to $pinned"

# Refusals. refused WHAT REPO@DIGEST: the pull must fail; prints skopeo's reason.
refused() {
    if pull "$2" "$work/refused" 2>"$work/refused.err"; then
        fail "$1: pulled under the policy"
    fi
    echo "oci-roundtrip: refused as it must be, $1: $(tr '\n' ' ' <"$work/refused.err" | cut -c1-200)"
    rm -rf "$work/refused"
}
# An image nobody signed: the policy, not the registry, says no.
push "$work/out/oci-wasm" idemgate/unsigned:test
refused "an unsigned image" "idemgate/unsigned@$(cat "$work/out/oci-wasm.digest")"
grep -qi signature "$work/refused.err" || fail "the unsigned image was refused, but not for its signature"
# An image signed, but by another key than the policy names.
gpg --batch --quiet --pinentry-mode loopback --passphrase '' \
    --quick-generate-key 'someone else <someone-else@invalid>' ed25519 sign 1d 2>/dev/null
other=$(gpg --batch --with-colons --list-secret-keys 2>/dev/null | awk -F: -v fpr="$fpr" '$1 == "fpr" && $10 != fpr {print $10; exit}')
[[ $other =~ ^[0-9A-F]{40}$ ]] || fail "no second throwaway GPG key"
push "$work/out/oci-wasm" idemgate/otherkey:test --sign-by "$other"
refused "an image signed by another key" "idemgate/otherkey@$(cat "$work/out/oci-wasm.digest")"
grep -qi signature "$work/refused.err" || fail "the image signed by another key was refused, but not for its signature"

# One byte of the store's layer, altered where the registry keeps it.
layer=$(jq -r '.layers[0].digest' <<<"$m")
data=$(blob "$layer")
[[ -f $data ]] || fail "no blob $layer in the registry's storage ($data)"
byte=$(od -An -tu1 -j 1000 -N1 "$data" | tr -d ' ')
printf "\\$(printf %03o $(((byte + 1) % 256)))" | dd of="$data" bs=1 seek=1000 conv=notrunc status=none
cmp -s "$data" "$work/out/oci-store/blobs/sha256/${layer#sha256:}" && fail "the store's layer blob is not altered"
refused "the store image with an altered layer blob" "idemgate/store@$digest"

# The compat image's manifest blob replaced by another valid manifest (one more
# annotation): whoever can write the storage cannot sign the replacement.
compat=$(cat "$work/out/oci-compat.digest")
data=$(blob "$compat")
[[ -f $data ]] || fail "no blob $compat in the registry's storage ($data)"
jq -c '.annotations["org.opencontainers.image.title"] = "replaced"' "$work/out/oci-compat/blobs/sha256/${compat#sha256:}" >"$work/replaced.json"
cp "$work/replaced.json" "$data"
refused "the compat image with its manifest replaced (by tag)" "idemgate/filter:compat"
refused "the compat image with its manifest replaced (by digest)" "idemgate/filter@$compat"

# The examples pin an oci:// URL by digest and the same digest as sha256.
python3 - <<'EOF'
import re, sys, pathlib
bad = []
for f in ["examples/istio/envoyfilter.yaml", "examples/istio/wasmplugin.yaml"]:
    text = pathlib.Path(f).read_text()
    urls = re.findall(r"oci://[^\s\"]+", text)
    shas = re.findall(r"^\s*sha256:\s*\"?([0-9a-f]+)\"?\s*$", text, re.M)
    if not urls or not shas:
        bad.append(f"{f}: no oci:// URL with a sha256")
        continue
    for u in urls:
        m = re.search(r"@sha256:([0-9a-f]{64})$", u)
        if not m:
            bad.append(f"{f}: {u} is not pinned by digest")
        elif any(s != m.group(1) for s in shas):
            bad.append(f"{f}: sha256 {shas} differs from the URL's digest {m.group(1)}")
if bad:
    print("\n".join("oci-roundtrip: FAIL: " + b for b in bad), file=sys.stderr)
    sys.exit(1)
EOF
# Whether they pin this very build is for `make release` to settle: any change
# to the filter or any commit changes the digest, so this only says so.
built=$(cat "$work/out/oci-compat.digest")
if ! grep -q "${built#sha256:}" examples/istio/envoyfilter.yaml; then
    echo "oci-roundtrip: note: examples/istio pin another module than this build ($built); \`make release\` re-pins them"
fi
echo "oci-roundtrip: ok in $(($(date +%s) - start)) s"
