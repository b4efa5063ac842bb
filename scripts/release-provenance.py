#!/usr/bin/env python3
"""Writes the release's provenance: an in-toto Statement v1 whose predicate is
SLSA Provenance v1, naming every artefact (by sha256) and every image (by
manifest digest), the commit they were built from, and the toolchain.

    scripts/release-provenance.py --annotations JSON --started TIME \
        [--file NAME=PATH]... [--image NAME=DIGEST-FILE]... OUT

It is written by the build itself on the machine that ran `make release`
(SLSA Build L1: it says what was built from what, not that a hardened builder
did it); release.sh signs it with minisign alongside the artefacts.
"""

import argparse
import hashlib
import json
import pathlib
import socket
import subprocess
import sys
from datetime import datetime, timezone

ROOT = pathlib.Path(__file__).resolve().parent.parent


def out(*cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--annotations", required=True)
    ap.add_argument("--started", required=True)
    ap.add_argument("--store-profile", required=True, help="release or debug: which build the store is")
    ap.add_argument("--file", action="append", default=[])
    ap.add_argument("--image", action="append", default=[])
    ap.add_argument("out")
    a = ap.parse_args()
    ann = json.loads(a.annotations)
    revision = ann["org.opencontainers.image.revision"]
    source = ann["org.opencontainers.image.source"]

    subjects = []
    for spec in a.file:
        name, path = spec.split("=", 1)
        subjects.append({"name": name, "digest": {"sha256": sha256(path)}})
    for spec in a.image:
        name, path = spec.split("=", 1)
        digest = pathlib.Path(path).read_text().strip()
        if not digest.startswith("sha256:") or len(digest) != 71:
            sys.exit(f"release-provenance: {path} holds {digest!r}, not a manifest digest")
        subjects.append({"name": name, "digest": {"sha256": digest.removeprefix("sha256:")},
                         "annotations": {"mediaType": "application/vnd.oci.image.manifest.v1+json"}})

    # Uncommitted changes mean the artefacts are not exactly the commit's.
    dirty = out("git", "status", "--porcelain", "--untracked-files=no") != ""
    statement = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": subjects,
        "predicateType": "https://slsa.dev/provenance/v1",
        "predicate": {
            "buildDefinition": {
                "buildType": "urn:idemgate:make-release:v1",
                "externalParameters": {
                    "source": {"uri": source, "digest": {"gitCommit": revision}},
                    "version": ann["org.opencontainers.image.version"],
                    "command": "make release (scripts/release.sh)",
                },
                "internalParameters": {
                    "storeProfile": a.store_profile,
                    "moduleProfile": "wasm",
                    "worktreeHadUncommittedChanges": dirty,
                },
                "resolvedDependencies": [
                    {"uri": f"{source}@{revision}", "digest": {"gitCommit": revision}},
                    {"name": "Cargo.lock", "digest": {"sha256": sha256(ROOT / "Cargo.lock")}},
                    {"name": "rustc", "annotations": {"version": out("rustc", "-V")}},
                    {"name": "cargo", "annotations": {"version": out("cargo", "-V")}},
                ],
            },
            "runDetails": {
                "builder": {"id": f"urn:idemgate:local-builder:{socket.gethostname()}"},
                "metadata": {
                    "startedOn": a.started,
                    "finishedOn": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                },
            },
        },
    }
    pathlib.Path(a.out).write_text(json.dumps(statement, indent=2) + "\n")


if __name__ == "__main__":
    main()
