#!/usr/bin/env python3
"""Every Envoy payload in the Istio examples, validated by a real Envoy.

    scripts/validate-istio-payloads.py ENVOY

For examples/istio/envoyfilter.yaml, its alternative
examples/istio/envoyfilter-http-module.yaml and the generated
examples/istio/workloads/envoyfilters.yaml, each HTTP_FILTER patch value and
each EXTENSION_CONFIG value goes, as written, into the HTTP filter chain of a
bootstrap (the EXTENSION_CONFIG one in place of its config_discovery reference,
which is what ECDS hands the sidecar). For wasmplugin.yaml, the Wasm filter
Istio generates from it (its name, root_id, pluginConfig as a StringValue, the
remote data source with cluster "_" and the sha256, the VM's environment) is
built the way Istio builds it. For stats.yaml, each BOOTSTRAP patch is merged
into a bootstrap that runs the filter; each HTTP_ROUTE patch (grpc-replay.yaml)
goes first into the virtual host of one. `envoy --mode validate` must accept
each bootstrap.

Before that, what `istioctl analyze` would warn about or Envoy cannot know:
  - an EnvoyFilter with a relative patch (INSERT_BEFORE/AFTER, MERGE, REPLACE,
    REMOVE) and no `priority` (IST0151; IST0155 with a proxyVersion match);
  - two ECDS (EXTENSION_CONFIG) names alike in different objects, or one
    equal to a WasmPlugin's `<namespace>.<name>`: they overwrite each other in
    the proxy (one object written in two files, as envoyfilter.yaml and its
    alternatives are, is one object in the cluster);
  - an alternative to envoyfilter.yaml (envoyfilter-http-module.yaml) that
    differs from it in anything but the module's source (`vm_config.code`).
"""
import json
import os
import subprocess
import sys
import tempfile

import yaml

import loopback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WASM = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


def bootstrap(filters):
    return {
        "static_resources": {
            "listeners": [loopback.inbound_listener(15006, filters, {"route": {"cluster": "app"}})],
            "clusters": [loopback.static_cluster("app", 8080)],
        }
    }


ENVOY_FILTER_FILES = ("envoyfilter.yaml", "envoyfilter-http-module.yaml", "workloads/envoyfilters.yaml")
# Alternatives to envoyfilter.yaml: the same EnvoyFilter object but for the
# module's source (`vm_config.code`), so applying one replaces the other.
ALTERNATIVES = ("envoyfilter-http-module.yaml",)


def docs(name):
    with open(os.path.join(ROOT, "examples/istio", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def all_docs():
    """(file, document) for every YAML file directly in examples/istio and in workloads/."""
    out = []
    base = os.path.join(ROOT, "examples/istio")
    for sub in ("", "workloads"):
        for name in sorted(os.listdir(os.path.join(base, sub))):
            if name.endswith((".yaml", ".yml")):
                rel = os.path.join(sub, name) if sub else name
                out.extend((rel, d) for d in docs(rel))
    return out


def relative(patch):
    """Whether a patch is placed relative to what other EnvoyFilters did (istioctl's rule)."""
    op, to = patch.get("patch", {}).get("operation"), patch.get("applyTo")
    if op in ("INSERT_BEFORE", "INSERT_AFTER", "MERGE"):
        return True
    if op == "REPLACE":
        return to in ("HTTP_FILTER", "NETWORK_FILTER")
    if op == "REMOVE":
        return to not in ("ROUTE_CONFIGURATION", "HTTP_ROUTE")
    return False


def analyze():
    """Problems istioctl analyze or the proxy would meet; [] when none."""
    problems, ecds = [], {}
    for file, doc in all_docs():
        meta = doc.get("metadata", {})
        what = f"{file} {doc.get('kind')}/{meta.get('namespace')}/{meta.get('name')}"
        identity = (doc.get("kind"), meta.get("namespace"), meta.get("name"))
        if doc.get("kind") == "WasmPlugin":
            ecds.setdefault(f"{meta.get('namespace')}.{meta.get('name')}", []).append((identity, what))
        if doc.get("kind") != "EnvoyFilter":
            continue
        spec = doc.get("spec", {})
        for i, patch in enumerate(spec.get("configPatches", [])):
            if relative(patch) and not spec.get("priority"):
                versioned = "proxyVersion" in (patch.get("match", {}).get("proxy") or {})
                problems.append(f"{what}: patch {i} ({patch['patch']['operation']} {patch['applyTo']}) "
                                f"is relative and the EnvoyFilter has no priority "
                                f"(istioctl analyze {'IST0155' if versioned else 'IST0151'})")
            if patch.get("applyTo") == "EXTENSION_CONFIG":
                ecds.setdefault(patch["patch"]["value"]["name"], []).append((identity, what))
    for name, where in sorted(ecds.items()):
        if len({identity for identity, _ in where}) > 1:
            problems.append(f"ECDS name {name} is used by {len(where)} objects: "
                            f"{'; '.join(what for _, what in where)}")
    problems += alternatives()
    return problems


def without_code(doc):
    """An EnvoyFilter with its Wasm module's source cut out."""
    doc = json.loads(json.dumps(doc))
    for patch in doc["spec"]["configPatches"]:
        if patch["applyTo"] == "EXTENSION_CONFIG":
            patch["patch"]["value"]["typed_config"]["config"]["vm_config"].pop("code")
    return doc


def alternatives():
    """Each alternative to envoyfilter.yaml is its EnvoyFilter but for `vm_config.code`."""
    problems = []
    base = [d for d in docs("envoyfilter.yaml") if d.get("kind") == "EnvoyFilter"]
    for file in ALTERNATIVES:
        filters = [d for d in docs(file) if d.get("kind") == "EnvoyFilter"]
        if len(filters) != 1 or len(base) != 1:
            problems.append(f"{file}: expected one EnvoyFilter there and in envoyfilter.yaml")
        elif without_code(filters[0]) != without_code(base[0]):
            problems.append(f"{file}: its EnvoyFilter differs from envoyfilter.yaml's in more than "
                            f"vm_config.code: keep the two alike")
    return problems


def payloads():
    out = []
    for file, doc in ((f, d) for f in ENVOY_FILTER_FILES for d in docs(f)):
        if doc.get("kind") != "EnvoyFilter":
            continue
        ecds = {}
        for patch in doc["spec"]["configPatches"]:
            value = patch["patch"]["value"]
            if patch["applyTo"] == "EXTENSION_CONFIG":
                ecds[value["name"]] = value
        for patch in doc["spec"]["configPatches"]:
            value = patch["patch"]["value"]
            if patch["applyTo"] == "HTTP_FILTER":
                if "config_discovery" in value:
                    value = ecds.pop(value["name"])  # what ECDS delivers under that name
                out.append((f"{file} {doc['metadata']['name']}: {value['name']}", value))
        for name, value in ecds.items():
            out.append((f"{file} {name} (not inserted by any patch)", value))
    for doc in docs("wasmplugin.yaml"):
        if doc.get("kind") != "WasmPlugin":
            continue
        spec, meta = doc["spec"], doc["metadata"]
        code = {"remote": {
            "http_uri": {"uri": spec["url"], "timeout": "30s", "cluster": "_"},
            "sha256": spec["sha256"]}}
        out.append((f"wasmplugin.yaml {meta['namespace']}.{meta['name']}", {
            "name": f"{meta['namespace']}.{meta['name']}",
            "typed_config": {"@type": WASM, "config": {
                "name": f"{meta['namespace']}.{meta['name']}",
                "root_id": spec.get("pluginName", ""),
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                  "value": json.dumps(spec.get("pluginConfig", {}))},
                "fail_open": False,
                "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": code,
                              **vm_environment(spec.get("vmConfig", {}))},
            }}}))
    return out


def vm_environment(vm_config):
    """A WasmPlugin's vmConfig.env as Envoy's vm_config.environment_variables."""
    host = [e["name"] for e in vm_config.get("env", []) if e.get("valueFrom") == "HOST"]
    inline = {e["name"]: e.get("value", "") for e in vm_config.get("env", [])
              if e.get("valueFrom", "INLINE") == "INLINE"}
    env = {}
    if host:
        env["host_env_keys"] = host
    if inline:
        env["key_values"] = inline
    return {"environment_variables": env} if env else {}


def bootstrap_patches(filters):
    """(what, bootstrap) for each BOOTSTRAP merge patch, applied to a bootstrap with `filters`."""
    out = []
    for doc in docs("stats.yaml"):
        if doc.get("kind") != "EnvoyFilter":
            continue
        for patch in doc["spec"]["configPatches"]:
            if patch["applyTo"] == "BOOTSTRAP":
                b = bootstrap(filters)
                b.update(patch["patch"]["value"])
                out.append((f"stats.yaml {doc['metadata']['name']} (bootstrap)", b))
    return out


def route_patches(filters):
    """(what, bootstrap) for each HTTP_ROUTE patch, inserted first into the
    virtual host of a bootstrap with `filters`, its cluster defined."""
    out = []
    for file, doc in all_docs():
        if doc.get("kind") != "EnvoyFilter":
            continue
        for patch in doc["spec"]["configPatches"]:
            if patch["applyTo"] != "HTTP_ROUTE":
                continue
            route = patch["patch"]["value"]
            b = bootstrap(filters)
            listener = b["static_resources"]["listeners"][0]
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["route_config"]["virtual_hosts"][0]["routes"].insert(0, route)
            cluster = json.loads(json.dumps(b["static_resources"]["clusters"][0]))
            cluster["name"] = cluster["load_assignment"]["cluster_name"] = route["route"]["cluster"]
            b["static_resources"]["clusters"].append(cluster)
            out.append((f"{file} {doc['metadata']['name']}: route {route.get('name')}", b))
    return out


def main():
    envoy = sys.argv[1]
    problems = analyze()
    for p in problems:
        print(f"validate-istio-payloads: FAIL {p}", file=sys.stderr)
    found = payloads()
    if len(found) < 6:
        sys.exit(f"validate-istio-payloads: expected at least 6 payloads, found {len(found)}")
    boots = [(what, bootstrap([value])) for what, value in found]
    boots += bootstrap_patches([found[0][1]])
    boots += route_patches([found[0][1]])
    failed = len(problems)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (what, config) in enumerate(boots):
            path = os.path.join(tmp, f"{i}.json")
            with open(path, "w") as f:
                json.dump(config, f)
            r = subprocess.run([envoy, "--mode", "validate", "--log-level", "warn", "-c", path],
                               capture_output=True, text=True)
            if r.returncode != 0:
                failed += 1
                print(f"validate-istio-payloads: FAIL {what}:\n{r.stdout}{r.stderr}", file=sys.stderr)
            else:
                print(f"validate-istio-payloads: ok {what}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
