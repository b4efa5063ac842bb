#!/usr/bin/env bash
# Writes the store as an OCI image layout, without Docker (umoci):
#
#   scripts/oci-store.sh [STORE [OUTDIR [TAG]]]
#       (defaults: target/release/idempotency-store, target/release-artefacts,
#        the workspace version)
#
#   OUTDIR/oci-store/        the layout: one image tagged TAG, one layer
#   OUTDIR/oci-store.digest  its manifest digest
#   OUTDIR/oci-store.packages the Debian packages whose files it carries
#
# The image has no base and no shell, no package manager, no coreutils: its one
# layer holds
#   /usr/local/bin/idempotency-store   the binary, as given
#   the shared libraries it links (ldd: glibc's libc, libm, libgcc_s) and the
#   dynamic loader, at the paths the binary asks for; a static binary needs none
#   /etc/passwd, /etc/group            user and group idemgate, 10001, so the
#                                      image runs as non-root by default
#   /etc/nsswitch.conf                 hosts from /etc/hosts, then DNS
#   /etc/ssl/certs/ca-certificates.crt the host's CA roots, for PostgreSQL with
#                                      sslmode=verify-full (rustls-native-certs)
#   /usr/share/doc/<package>/copyright for every Debian package a file came from
#                                      (glibc is LGPL: its terms travel with it)
#   /data (10001, 0700), /tmp (1777)   the SQLite database and SQLite's temp files
# and runs `idempotency-store serve` as 10001:10001 in /data, listening on
# 0.0.0.0:8787 with SQLite in /data unless IDEMGATE_* say otherwise.
# Its manifest and config carry the release's OCI annotations
# (scripts/oci-annotations.sh); every file's time is the commit's, so one
# binary built at one commit gives one digest.
set -euo pipefail
cd "$(dirname "$0")/.."

store=${1:-target/release/idempotency-store}
out=${2:-target/release-artefacts}
tag=${3:-$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)}
for tool in umoci jq ldd dpkg-query; do
    command -v "$tool" >/dev/null || { echo "oci-store: needs $tool (scripts/setup.sh installs umoci)" >&2; exit 1; }
done
[[ -x $store ]] || { echo "oci-store: no store binary at $store (cargo build --release -p idemgate-store)" >&2; exit 1; }
case $(uname -m) in
x86_64) arch=amd64 ;;
aarch64) arch=arm64 ;;
*) echo "oci-store: no OCI architecture name for $(uname -m)" >&2; exit 1 ;;
esac
# The libraries carried are this machine's (a Debian system): their licences.
licenses="Apache-2.0 AND LGPL-2.1-or-later AND GPL-3.0-or-later WITH GCC-exception-3.1 AND MPL-2.0"
annotations=$(scripts/oci-annotations.sh "$licenses")
created=$(jq -r '."org.opencontainers.image.created"' <<<"$annotations")

mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/data" "$root/tmp"
install -m 0755 "$store" "$root/usr/local/bin/idempotency-store"

# The loader and libraries, each at the path the binary names (ldd prints
# "name => /path (addr)" or "/path (addr)"); "not found" is a broken binary.
if ldd "$store" 2>&1 | grep -q 'not found'; then
    ldd "$store" >&2
    echo "oci-store: $store needs a library this machine lacks" >&2
    exit 1
fi
packages=()
while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
    chmod 0755 "$root$lib"
    # /lib is /usr/lib on a merged-/usr system: dpkg knows one of the two names.
    pkg=$(dpkg-query -S "$lib" 2>/dev/null || dpkg-query -S "$(readlink -f "$lib")" 2>/dev/null || true)
    [[ -n $pkg ]] || { echo "oci-store: no Debian package owns $lib" >&2; exit 1; }
    packages+=("${pkg%%:*}")
done < <(ldd "$store" 2>/dev/null | grep -o '/[^ ]*' || true)
packages+=(ca-certificates)
cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
for pkg in $(printf '%s\n' "${packages[@]}" | sort -u); do
    mkdir -p "$root/usr/share/doc/$pkg"
    cp -L "/usr/share/doc/$pkg/copyright" "$root/usr/share/doc/$pkg/copyright"
done
# What the image carries from this machine, for the SBOM (scripts/release-sbom.py):
# OUTDIR/oci-store.packages, "package<TAB>version<TAB>architecture" a line.
for pkg in $(printf '%s\n' "${packages[@]}" | sort -u); do
    dpkg-query -W -f='${Package}\t${Version}\t${Architecture}\n' "$pkg"
done >"$out/oci-store.packages"

printf 'root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nidemgate:x:10001:10001:idemgate:/data:/usr/sbin/nologin\n' \
    >"$root/etc/passwd"
printf 'root:x:0:\nidemgate:x:10001:\n' >"$root/etc/group"
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
chmod 0644 "$root/etc/passwd" "$root/etc/group" "$root/etc/nsswitch.conf" "$root/etc/ssl/certs/ca-certificates.crt"
chown 10001:10001 "$root/data"
chmod 0700 "$root/data"
chmod 1777 "$root/tmp"
find "$root" -exec touch -h -d "$created" {} +

layout=$out/oci-store
rm -rf "$layout"
umoci init --layout "$layout"
umoci new --image "$layout:$tag"
umoci insert --image "$layout:$tag" --history.created "$created" \
    --history.created_by "scripts/oci-store.sh" "$root" /
config=(--created "$created" --os linux --architecture "$arch"
    --config.user 10001:10001 --config.workingdir /data
    --config.entrypoint /usr/local/bin/idempotency-store --config.cmd serve
    --config.env IDEMGATE_LISTEN=0.0.0.0:8787
    --config.env IDEMGATE_DATABASE_URL=sqlite:///data/idempotency.db
    --config.exposedports 8787/tcp --config.volume /data --config.stopsignal SIGTERM)
while IFS=$'\t' read -r k v; do
    config+=(--manifest.annotation "$k=$v" --config.label "$k=$v")
done < <(jq -r 'to_entries[] | "\(.key)\t\(.value)"' <<<"$annotations")
umoci config --image "$layout:$tag" --no-history "${config[@]}"
umoci gc --layout "$layout"
chmod -R a+rX "$layout"

digest=$(jq -r --arg tag "$tag" \
    '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $tag) | .digest' "$layout/index.json")
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "oci-store: no manifest tagged $tag in $layout" >&2; exit 1; }
echo "$digest" >"$out/oci-store.digest"
echo "store $digest"
