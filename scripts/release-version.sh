#!/usr/bin/env bash
# The release's version agrees everywhere it is written:
#   - the workspace version ([workspace.package] in Cargo.toml) is the top
#     released heading of CHANGELOG.md ("## [X.Y.Z] - DATE", below
#     "## [Unreleased]"), so a version bump and its changelog entry go together;
#   - if the tag vX.Y.Z exists, the commit it names has that workspace version
#     and that top released heading too: a tag never names a commit of another
#     version.
# Prints the version.
#
#   scripts/release-version.sh [-C REPO]      check REPO (default: this repository's
#                                             worktree and tags)
#   scripts/release-version.sh --self-test    the check refuses what it must: a
#                                             scratch repository with a changelog
#                                             that lags the version, then a tag on
#                                             a commit of another version
set -euo pipefail
cd "$(dirname "$0")/.."
self=$PWD/scripts/release-version.sh

# cargo_version FILE-CONTENTS: the [workspace.package] version.
cargo_version() { sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"/\1/p'; }
# changelog_version: the first "## [X.Y.Z]" heading that is not [Unreleased].
changelog_version() { sed -n -E 's/^## \[([0-9]+\.[0-9]+\.[0-9]+[^]]*)\].*/\1/p' | head -1; }

if [[ ${1:-} == --self-test ]]; then
    t=$(mktemp -d)
    trap 'rm -rf "$t"' EXIT
    g() { git -C "$t" -c user.name=check -c user.email=check@invalid -c commit.gpgsign=false "$@"; }
    git init -q "$t"
    write() {
        printf '[workspace]\n\n[workspace.package]\nversion = "%s"\n' "$1" >"$t/Cargo.toml"
        printf '# Changelog\n\n## [Unreleased]\n\n## [%s] - 2026-01-01\n' "$2" >"$t/CHANGELOG.md"
        g add Cargo.toml CHANGELOG.md && g commit -q -m "$1/$2"
    }
    expect() { # expect ok|fail WHAT
        if "$self" -C "$t" >"$t.log" 2>&1; then got=ok; else got=fail; fi
        [[ $got == "$1" ]] || { cat "$t.log" >&2; echo "release-version: self-test: $2: $got, want $1" >&2; exit 1; }
    }
    write 1.0.0 1.0.0
    expect ok "matching version and changelog, no tag"
    g tag v1.0.0
    expect ok "tag on its own version"
    write 1.1.0 1.0.0
    expect fail "version 1.1.0 with the changelog still at 1.0.0"
    write 1.1.0 1.1.0
    g tag v1.1.0 HEAD~1
    expect fail "tag v1.1.0 on a commit of 1.1.0 whose changelog says 1.0.0"
    g tag -d v1.1.0 >/dev/null
    g tag v1.1.0 HEAD~2
    expect fail "tag v1.1.0 on a commit of version 1.0.0"
    g tag -f v1.1.0 HEAD >/dev/null
    expect ok "tag v1.1.0 moved onto its commit"
    echo "release-version: self-test ok"
    exit 0
fi

repo=.
[[ ${1:-} == -C ]] && repo=${2:?-C REPO}
fail() { echo "release-version: FAIL: $*" >&2; exit 1; }

version=$(cargo_version <"$repo/Cargo.toml")
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || fail "no [workspace.package] version in $repo/Cargo.toml"
heading=$(changelog_version <"$repo/CHANGELOG.md")
[[ $heading == "$version" ]] ||
    fail "Cargo.toml says $version, the top release in CHANGELOG.md is [${heading:-none}]:" \
        "move [Unreleased]'s entries under ## [$version] - DATE when bumping the version"

tag=v$version
if commit=$(git -C "$repo" rev-parse -q --verify "refs/tags/$tag^{commit}"); then
    at=$(git -C "$repo" show "$commit:Cargo.toml" | cargo_version)
    [[ $at == "$version" ]] || fail "tag $tag names $commit, whose Cargo.toml says ${at:-no version}"
    at=$(git -C "$repo" show "$commit:CHANGELOG.md" | changelog_version)
    [[ $at == "$version" ]] || fail "tag $tag names $commit, whose CHANGELOG.md's top release is [${at:-none}]"
fi
echo "$version"
