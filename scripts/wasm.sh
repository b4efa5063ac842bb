#!/usr/bin/env bash
# Builds the filter for wasm32-wasip1 (release), copies it to target/idemgate.wasm
# and prints that path.  `scripts/wasm.sh clippy` lints the filter (with its
# test-only code), the worker and the core for wasm32-wasip1 instead.  `scripts/wasm.sh callout` builds the callout
# microbenchmark's filter (bench/callout, for `make bench`) the same way, in its
# own target dir, to target/callout.wasm.  `scripts/wasm.sh faulty` builds the
# filter with its `fault-injection` feature (a request can kill the VM; for the
# lifecycle tests only) to target/idemgate-faulty.wasm.  `scripts/wasm.sh source DIR OUT`
# builds the filter of another source tree (an earlier release) to OUT, in
# this tree's target dir (see below).
#
# With rustup's wasm32-wasip1 target installed this is a plain cargo build.
# Without it, Debian's rustc-web builds std for wasm from rust-web-src
# (-Zbuild-std, which is why RUSTC_BOOTSTRAP is set; the code itself uses no
# unstable features). That build keeps its own target dir so the two compilers
# never share artifacts.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=wasm32-wasip1
OUT=target/idemgate.wasm

if rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
    cargo=cargo
    build_std=()
    target_dir=target
else
    # RUSTC: otherwise /usr/bin/cargo finds rustup's rustc proxy first on PATH.
    # PATH: so `cargo clippy` runs Debian's cargo-clippy, not rustup's.
    export PATH=/usr/bin:$PATH RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1
    export CARGO_TARGET_WASM32_WASIP1_LINKER=wasm-ld
    export RUSTFLAGS="-C link-self-contained=no -L /usr/lib/wasm32-wasi"
    cargo=/usr/bin/cargo
    build_std=(-Zbuild-std=std,panic_abort)
    target_dir=target/wasm-debian
fi

case ${1:-build} in
build)
    "$cargo" build "${build_std[@]}" --profile wasm --target "$TARGET" \
        -p idemgate-filter --target-dir "$target_dir"
    cp "$target_dir/$TARGET/wasm/idemgate_filter.wasm" "$OUT"
    echo "$OUT"
    ;;
faulty)
    "$cargo" build "${build_std[@]}" --profile wasm --target "$TARGET" \
        -p idemgate-filter --features fault-injection --target-dir "$target_dir"
    cp "$target_dir/$TARGET/wasm/idemgate_filter.wasm" target/idemgate-faulty.wasm
    echo target/idemgate-faulty.wasm
    ;;
callout)
    "$cargo" build "${build_std[@]}" --profile wasm --target "$TARGET" \
        -p idemgate-bench-callout --target-dir "$target_dir/bench-callout"
    cp "$target_dir/bench-callout/$TARGET/wasm/idemgate_bench_callout.wasm" target/callout.wasm
    echo target/callout.wasm
    ;;
source)
    src=${2:?usage: scripts/wasm.sh source DIR OUT} out=${3:?usage: scripts/wasm.sh source DIR OUT}
    # Into this tree's target dir, so that std (built from source here) and
    # the dependencies are compiled once. Cargo's hash of a path package
    # leaves its path out: the other tree's own packages (same names, same
    # version) would take this tree's file names and leave them looking
    # fresh. Per-package rustflags give each of those packages a hash of its
    # own; the one unhashed file both trees write, the linked module, is
    # removed after the copy, so this tree's next build links its own again.
    export RUSTC_BOOTSTRAP=1
    flags='["-Cmetadata=idemgate-other-tree"]'
    per_package=()
    for manifest in $(find "$src" -name Cargo.toml -not -path '*/target/*'); do
        name=$(sed -n 's/^name *= *"\(.*\)"$/\1/p' "$manifest" | head -1)
        [[ -z $name ]] || per_package+=(--config "profile.wasm.package.$name.rustflags=$flags")
    done
    "$cargo" build "${build_std[@]}" -Zprofile-rustflags "${per_package[@]}" --profile wasm \
        --target "$TARGET" -p idemgate-filter --manifest-path "$src/Cargo.toml" --target-dir "$PWD/$target_dir"
    linked=$target_dir/$TARGET/wasm
    cp "$linked/idemgate_filter.wasm" "$out"
    rm -f "$linked/idemgate_filter.wasm" "$linked/deps/idemgate_filter.wasm"
    echo "$out"
    ;;
clippy)
    "$cargo" clippy "${build_std[@]}" --target "$TARGET" \
        -p idemgate-filter -p idemgate-worker -p idemgate-core --features idemgate-filter/fault-injection \
        --target-dir "$target_dir" -- -D warnings
    ;;
*)
    echo "usage: scripts/wasm.sh [build|callout|faulty|clippy|source DIR OUT]" >&2
    exit 2
    ;;
esac
