#!/usr/bin/env python3
"""Writes a CycloneDX 1.5 SBOM (JSON) of one shipped artefact, from Cargo's own
resolution: the crates `cargo build -p PACKAGE --target TARGET` compiles in,
with their licences, versions and Cargo.lock checksums, and the dependency graph.

    scripts/release-sbom.py --package idemgate-filter --target wasm32-wasip1 \
        --artefact out/idemgate.wasm --annotations JSON [--debian-packages FILE] OUT

The crate set comes from `cargo tree -e normal` for that package and target
(features resolved as that build resolves them, not unified over the workspace).
Proc-macros and what only they pull in run in the compiler, not in the
artefact: they are listed with scope "excluded". Build scripts and their
dependencies are not listed. --debian-packages (oci-store.sh's list) adds the
Debian packages whose files the store image carries. The document is a pure
function of its inputs: its serial number derives from the artefact's sha256,
its timestamp is the commit's (the annotations' "created").
"""

import argparse
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tomllib
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(\d+)(\S+) v(\S+)((?: \([^)]*\))*)\|(.*?)\|(.*?)( \(\*\))?$")
# The Debian packages oci-store.sh carries, by their copyright files.
DEBIAN_LICENSES = {
    "libc6": "LGPL-2.1-or-later",
    "libgcc-s1": "GPL-3.0-or-later WITH GCC-exception-3.1",
    "ca-certificates": "MPL-2.0",
}


def fail(msg):
    print(f"release-sbom: {msg}", file=sys.stderr)
    sys.exit(1)


def spdx(expr):
    # Old crates write "MIT/Apache-2.0"; SPDX says OR.
    return re.sub(r"\s*/\s*", " OR ", expr.strip())


def crates(package, target):
    cmd = ["cargo", "tree", "--offline", "--locked", "-p", package, "-e", "normal",
           "--target", target, "--prefix", "depth", "--format", "{p}|{l}|{r}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        fail(f"{' '.join(cmd)} failed:\n{run.stderr}")
    nodes, edges, stack = {}, set(), []
    for line in run.stdout.splitlines():
        m = LINE.match(line)
        if not m:
            fail(f"unexpected cargo tree line: {line!r}")
        depth, name, version, extra, lic, repo, _ = m.groups()
        depth = int(depth)
        ref = f"{name}@{version}"
        notes = re.findall(r"\(([^)]*)\)", extra)
        node = nodes.setdefault(ref, {"name": name, "version": version, "license": lic,
                                      "repository": repo, "path": None, "proc_macro": False})
        for n in notes:
            if n == "proc-macro":
                node["proc_macro"] = True
            elif n.startswith("/"):
                node["path"] = n
        del stack[depth:]
        if stack:
            edges.add((stack[-1], ref))
        stack.append(ref)
    if not nodes:
        fail(f"cargo tree listed nothing for {package} on {target}")
    return nodes, edges


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--artefact", required=True)
    ap.add_argument("--annotations", required=True, help="scripts/oci-annotations.sh's JSON")
    ap.add_argument("--debian-packages")
    ap.add_argument("out")
    a = ap.parse_args()

    ann = json.loads(a.annotations)
    created = ann["org.opencontainers.image.created"]
    revision = ann["org.opencontainers.image.revision"]
    source = ann["org.opencontainers.image.source"]
    artefact = pathlib.Path(a.artefact)
    digest = hashlib.sha256(artefact.read_bytes()).hexdigest()

    lock = tomllib.loads((ROOT / "Cargo.lock").read_text())
    checksums = {(p["name"], p["version"]): p.get("checksum") for p in lock["package"]}

    nodes, edges = crates(a.package, a.target)
    root = next(r for r, n in nodes.items() if n["name"] == a.package)
    # Required: reachable from the root without entering a proc-macro.
    children = {}
    for parent, child in edges:
        children.setdefault(parent, []).append(child)
    required, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in required and not nodes[c]["proc_macro"]:
                required.add(c)
                todo.append(c)

    def bom_ref(ref):
        n = nodes[ref]
        return f"pkg:cargo/{n['name']}@{n['version']}" if n["path"] is None else f"path:{ref}"

    def component(ref):
        n = nodes[ref]
        c = {"type": "library", "bom-ref": bom_ref(ref), "name": n["name"], "version": n["version"],
             "scope": "required" if ref in required else "excluded"}
        if n["license"]:
            c["licenses"] = [{"expression": spdx(n["license"])}]
        if n["path"] is None:
            c["purl"] = c["bom-ref"]
            sha = checksums.get((n["name"], n["version"]))
            if not sha:
                fail(f"{ref}: no checksum in Cargo.lock")
            c["hashes"] = [{"alg": "SHA-256", "content": sha}]
        else:
            rel = pathlib.Path(n["path"]).resolve().relative_to(ROOT)
            c["properties"] = [{"name": "cargo:source", "value": f"path {rel} at {revision}"}]
            if rel.parts[0] == "vendor":
                c["properties"].append({"name": "cargo:patch",
                                        "value": f"[patch.crates-io] replaces crates.io's {n['name']}: see {rel}/PATCH.md"})
        if n["repository"]:
            c["externalReferences"] = [{"type": "vcs", "url": n["repository"]}]
        if n["proc_macro"]:
            c.setdefault("properties", []).append({"name": "cargo:kind", "value": "proc-macro"})
        return c

    n = nodes[root]
    meta_component = {
        "type": "application", "bom-ref": bom_ref(root), "name": artefact.name,
        "version": n["version"], "licenses": [{"expression": spdx(n["license"])}],
        "hashes": [{"alg": "SHA-256", "content": digest}],
        "externalReferences": [{"type": "vcs", "url": source}],
        "properties": [{"name": "cargo:package", "value": a.package},
                       {"name": "cargo:target", "value": a.target},
                       {"name": "git:revision", "value": revision}],
    }
    components = [component(r) for r in sorted(nodes) if r != root]
    deps = {r: sorted(bom_ref(c) for c in children.get(r, [])) for r in nodes}
    dependencies = [{"ref": bom_ref(r), "dependsOn": deps[r]} for r in sorted(nodes)]

    if a.debian_packages:
        debs = []
        for line in pathlib.Path(a.debian_packages).read_text().splitlines():
            name, version, arch = line.split("\t")
            os_release = dict(l.split("=", 1) for l in pathlib.Path("/etc/os-release").read_text().split("\n") if "=" in l)
            distro = f"debian-{os_release.get('VERSION_ID', '').strip(chr(34))}"
            purl = f"pkg:deb/debian/{name}@{version}?arch={arch}&distro={distro}"
            d = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
                 "scope": "required",
                 "properties": [{"name": "idemgate:carried-in", "value": "oci-store image (files of this package)"}]}
            if name in DEBIAN_LICENSES:
                d["licenses"] = [{"expression": DEBIAN_LICENSES[name]}]
            debs.append(d)
            dependencies.append({"ref": purl, "dependsOn": []})
        components += debs
        for d in dependencies:
            if d["ref"] == bom_ref(root):
                d["dependsOn"] = sorted(d["dependsOn"] + [x["bom-ref"] for x in debs])

    bom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": "urn:uuid:" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"idemgate:{a.package}:{digest}:{revision}")),
        "version": 1,
        "metadata": {
            "timestamp": created,
            "tools": {"components": [{"type": "application", "name": "scripts/release-sbom.py",
                                      "description": "cargo tree -e normal and Cargo.lock"}]},
            "component": meta_component,
        },
        "components": components,
        "dependencies": dependencies,
    }
    pathlib.Path(a.out).write_text(json.dumps(bom, indent=2) + "\n")


if __name__ == "__main__":
    main()
