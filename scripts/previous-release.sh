#!/usr/bin/env bash
# Builds the previous release from this repository's history for the
# mixed-version tests (tests/tests/mixed_versions.rs): its filter module and
# its store binary, in target/previous/<version>/, and prints that directory.
# Built once; later runs find them there.
#
# Both share the current build's target dirs (the dependencies, and std for
# wasm, are compiled once; only the release's own crates are built apart:
# scripts/wasm.sh source says how). Run it
# before building the current store: cargo puts the last built
# `idempotency-store` in target/debug/.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.1.0
COMMIT=be525d9c8c06cb082688a4f78457195b7c0699ea

out=target/previous/$VERSION
if [[ -f $out/idemgate.wasm && -x $out/idempotency-store ]]; then
    echo "$out"
    exit 0
fi

if ! git cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    # A shallow clone: deepen it from where it came from.
    git fetch --quiet --unshallow 2>/dev/null || git fetch --quiet origin "$COMMIT" 2>/dev/null || true
fi
if ! git cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    echo "previous-release: release $VERSION ($COMMIT) is not in this clone's history;" \
        "the mixed-version tests need it: clone without --depth" >&2
    exit 1
fi

src=$out/src
rm -rf "$src"
mkdir -p "$src"
git archive "$COMMIT" | tar -x -C "$src"

scripts/wasm.sh source "$src" "$out/idemgate.wasm" >/dev/null
cargo build --quiet --manifest-path "$src/Cargo.toml" -p idemgate-store --target-dir "$PWD/target"
cp target/debug/idempotency-store "$out/idempotency-store"
rm -rf "$src"
echo "$out"
