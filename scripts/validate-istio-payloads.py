#!/usr/bin/env python3
"""Every Envoy payload in the Istio examples, validated by a real Envoy.

    scripts/validate-istio-payloads.py ENVOY

For examples/istio/envoyfilter.yaml, each HTTP_FILTER patch value and each
EXTENSION_CONFIG value goes, as written, into the HTTP filter chain of a
bootstrap (the EXTENSION_CONFIG one in place of its config_discovery reference,
which is what ECDS hands the sidecar). For wasmplugin.yaml, the Wasm filter
Istio generates from it (its name, root_id, pluginConfig as a StringValue, the
remote data source with cluster "_" and the sha256) is built the way Istio
builds it. For stats.yaml, each BOOTSTRAP patch is merged into a bootstrap
that runs the filter. `envoy --mode validate` must accept each bootstrap.
"""
import json
import os
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
WASM = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


def bootstrap(filters):
    return {
        "static_resources": {
            "listeners": [{
                "name": "inbound",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 15006}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "inbound",
                        "route_config": {"virtual_hosts": [{
                            "name": "app", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "app"}}]}]},
                        "http_filters": filters + [ROUTER],
                    }}]}],
            }],
            "clusters": [{
                "name": "app", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "app", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8080}}}}]}]},
            }],
        }
    }


def docs(name):
    with open(os.path.join(ROOT, "examples/istio", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def payloads():
    out = []
    for doc in docs("envoyfilter.yaml"):
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
                out.append((f"envoyfilter.yaml {value['name']}", value))
        for name, value in ecds.items():
            out.append((f"envoyfilter.yaml {name} (not inserted by any patch)", value))
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
                "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": code},
            }}}))
    return out


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


def main():
    envoy = sys.argv[1]
    found = payloads()
    if len(found) < 3:
        sys.exit(f"validate-istio-payloads: expected at least 3 payloads, found {len(found)}")
    boots = [(what, bootstrap([value])) for what, value in found]
    boots += bootstrap_patches([found[0][1]])
    failed = 0
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
