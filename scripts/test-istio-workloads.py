#!/usr/bin/env python3
"""Unit tests of scripts/istio-workloads.py and of the EnvoyFilters under
examples/istio/ that depend on it (run by scripts/validate-manifests.sh).

    python3 scripts/test-istio-workloads.py [-v]
    python3 scripts/test-istio-workloads.py --render OUT
        write the workloads' Component rendered by `kubectl kustomize` over one
        Deployment per workload of the policies file (what validate-manifests.sh
        validates)

The tests that render with kubectl, or validate with kubernetes-validate,
are skipped when the tool is missing (scripts/setup.sh installs both).
"""
import copy
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
spec = importlib.util.spec_from_file_location("istio_workloads", os.path.join(HERE, "istio-workloads.py"))
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)

POLICIES = os.path.join(ROOT, "examples/istio/workloads/policies.yaml")
WORKLOADS = os.path.join(ROOT, "examples/istio/workloads")
GENERATED = os.path.join(WORKLOADS, "envoyfilters.yaml")
OVERLAY = os.path.join(ROOT, "examples/kubernetes/overlays/example")
fleet = gen.fleet
drift = gen.istio_drift


def admitted(regex, version):
    # Istio matches proxyVersion with Go's regexp MatchString: unanchored.
    return re.search(regex, version) is not None


def envoy_filters():
    for rel in ("examples/istio", "examples/istio/workloads"):
        for name in sorted(os.listdir(os.path.join(ROOT, rel))):
            if name.endswith(".yaml"):
                with open(os.path.join(ROOT, rel, name)) as f:
                    for doc in yaml.safe_load_all(f):
                        if doc and doc.get("kind") == "EnvoyFilter":
                            yield f"{rel}/{name}", doc


class ProxyVersion(unittest.TestCase):
    def test_admits_exactly_the_istio_minors_of_the_tested_envoys(self):
        regex = gen.proxy_version_regex()
        for minor in range(0, 60):
            istio = f"1.{minor}"
            tested = gen.ISTIO_ENVOY.get(istio) in gen.TESTED_ENVOY
            for patch in ("0", "1", "12"):
                for suffix in ("", "-distroless"):
                    version = f"{istio}.{patch}{suffix}"
                    self.assertEqual(admitted(regex, version), tested, f"{regex} on {version}")

    def test_rejects_lookalikes_of_a_tested_minor(self):
        regex = gen.proxy_version_regex()
        for minor in gen.tested_istio_minors():
            n = minor.split(".")[1]
            for version in (f"1.{n}", f"1.{n}0.1", f"1.{n[:-1]}.{n[-1]}", f"11.{n}.0",
                            f"2.{n}.0", f"x1.{n}.0", f"1.{n}-dev", f"1{n}.0"):
                self.assertFalse(admitted(regex, version), f"{regex} admits {version}")

    def test_several_tested_envoys_give_one_alternative_each(self):
        regex = gen.proxy_version_regex(("1.36", "1.40"))
        self.assertEqual(regex, r"^1\.(28|32)\.[0-9]+")
        self.assertTrue(admitted(regex, "1.28.3") and admitted(regex, "1.32.0"))
        self.assertFalse(admitted(regex, "1.29.0") or admitted(regex, "1.31.9"))
        with self.assertRaises(ValueError):
            gen.proxy_version_regex(("1.99",))

    def test_the_tested_envoy_is_the_one_make_test_installs(self):
        with open(os.path.join(ROOT, "scripts/setup.sh")) as f:
            version = re.search(r"^ENVOY_VERSION=(\d+\.\d+)\.\d+", f.read(), re.M).group(1)
        self.assertIn(version, gen.TESTED_ENVOY,
                      "scripts/setup.sh installs another Envoy than TESTED_ENVOY names: update "
                      "TESTED_ENVOY (and ISTIO_ENVOY) in scripts/istio-workloads.py")

    def test_the_tested_envoys_are_the_ones_make_compat_installs_and_runs(self):
        with open(os.path.join(ROOT, "scripts/setup.sh")) as f:
            setup = f.read()
        installed = {re.search(rf"^{name}=(\d+\.\d+)\.\d+", setup, re.M).group(1)
                     for name in ("ENVOY_VERSION", "ENVOY_OLDEST_VERSION")}
        compat = re.search(r"^ENVOY_COMPAT_VERSIONS=\(([^)]*)\)", setup, re.M).group(1).split()
        installed |= {v.rsplit(".", 1)[0] for v in compat}
        with open(os.path.join(ROOT, "scripts/compat.sh")) as f:
            run = set(re.search(r"^MINORS=\(([^)]*)\)", f.read(), re.M).group(1).split())
        self.assertEqual(set(gen.TESTED_ENVOY), installed,
                         "TESTED_ENVOY in scripts/istio-workloads.py and the Envoys scripts/setup.sh "
                         "installs (ENVOY_VERSION, ENVOY_OLDEST_VERSION, ENVOY_COMPAT_VERSIONS) differ")
        self.assertEqual(set(gen.TESTED_ENVOY), run,
                         "TESTED_ENVOY in scripts/istio-workloads.py and the minors scripts/compat.sh "
                         "runs (MINORS) differ")

    def test_every_envoyfilter_of_the_filter_uses_the_computed_regex(self):
        regex, seen = gen.proxy_version_regex(), 0
        for file, doc in envoy_filters():
            text = yaml.safe_dump(doc)
            runs_filter = gen.WASM in text or "idemgate.strip-identity-headers" in text
            for patch in doc["spec"]["configPatches"]:
                version = (patch.get("match", {}).get("proxy") or {}).get("proxyVersion")
                if runs_filter or version is not None:
                    seen += 1
                    self.assertEqual(version, regex, f"{file} {doc['metadata']['name']}")
        self.assertGreaterEqual(seen, 12)


class Generator(unittest.TestCase):
    def test_regenerating_gives_the_same_bytes(self):
        with open(GENERATED) as f:
            self.assertEqual(gen.generate(POLICIES), f.read(),
                             "run scripts/istio-workloads.py examples/istio/workloads/policies.yaml "
                             "-o examples/istio/workloads")
        for rel, text in gen.outputs(POLICIES).items():
            with open(os.path.join(WORKLOADS, rel)) as f:
                self.assertEqual(text, f.read(), f"{rel}: run scripts/istio-workloads.py "
                                 "examples/istio/workloads/policies.yaml -o examples/istio/workloads")

    def test_help_prints_the_usage(self):
        r = subprocess.run([sys.executable, os.path.join(HERE, "istio-workloads.py"), "--help"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--check DIR", r.stdout)
        self.assertIn("--pod-settings", r.stdout)

    def test_one_envoyfilter_per_workload_with_its_own_ecds_name(self):
        with open(POLICIES) as f:
            workloads = yaml.safe_load(f)["spec"]["workloads"]
        docs = list(yaml.safe_load_all(gen.generate(POLICIES)))
        self.assertEqual(len(docs), len(workloads))
        names = set()
        for doc in docs:
            self.assertTrue(doc["spec"]["priority"] > 0)
            ecds = {p["patch"]["value"]["name"] for p in doc["spec"]["configPatches"]
                    if p["patch"]["value"].get("config_discovery") or p["applyTo"] == "EXTENSION_CONFIG"}
            self.assertEqual(len(ecds), 1, ecds)
            names |= ecds
            config = doc["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]
            self.assertEqual(config["vm_config"]["environment_variables"]["host_env_keys"],
                             ["IDEMGATE_STORE_TOKEN"])
            self.assertNotIn('"token"', config["configuration"]["value"])
        self.assertEqual(len(names), len(docs))

    def check(self, spec):
        return gen.check_input({"spec": spec})

    def base(self):
        return {"store": {"cluster": "outbound|8787||store.idemgate.svc.cluster.local", "token_env": "T"},
                "workloads": [{"name": "a", "namespace": "n", "selector": {"app": "a"},
                               "policies": [{"name": "p"}]}]}

    def test_refuses_an_inline_token(self):
        spec = self.base()
        spec["store"]["token"] = "secret"
        with self.assertRaises(SystemExit):
            self.check(spec)

    def test_refuses_two_filters_in_one_sidecar(self):
        spec = self.base()
        spec["workloads"].append({"name": "b", "namespace": "n", "selector": {"app": "a", "tier": "x"},
                                  "policies": [{"name": "p"}]})
        with self.assertRaises(SystemExit):
            self.check(spec)
        spec["workloads"][1]["namespace"] = "other"
        self.check(spec)

    def test_refuses_a_workload_named_twice(self):
        spec = self.base()
        spec["workloads"].append(dict(spec["workloads"][0], selector={"app": "b"}))
        with self.assertRaises(SystemExit):
            self.check(spec)


class SidecarSettings(unittest.TestCase):
    STORE = {"cluster": "c", "timeout_ms": 1000, "token_env": "T"}

    def settings(self, *policies, store=None):
        return gen.sidecar_settings(store or self.STORE, list(policies))

    def test_the_drain_covers_the_largest_detached_timeout_the_store_and_a_margin(self):
        s = self.settings({"name": "a", "forwarding": {"mode": "detached", "timeout_ms": 12000}},
                          {"name": "b", "forwarding": {"mode": "detached", "timeout_ms": 3000}},
                          {"name": "c"})
        # 12000 + 1000 + (1000 + 1000): the value tests/tests/drain.rs runs.
        self.assertEqual(s["terminationDrainDuration"], "15s")
        self.assertEqual(s["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"], "false")
        self.assertEqual(s["terminationGracePeriodSeconds"], 30)
        self.assertIn("a:", s["why"])

    def test_the_default_detached_timeout_is_the_filters(self):
        # 30000 by default (a 60 s lease); with a 20 s lease, half of it: 10000.
        self.assertEqual(self.settings({"forwarding": {"mode": "detached"}})["terminationDrainDuration"], "33s")
        self.assertEqual(self.settings({"lease_seconds": 20, "forwarding": {"mode": "detached"}})
                         ["terminationDrainDuration"], "13s")
        store = dict(self.STORE, timeout_ms=2500)
        s = self.settings({"forwarding": {"mode": "detached"}}, store=store)
        self.assertEqual(s["terminationDrainDuration"], "36s")  # 30000 + 2500 + (2500 + 1000)
        self.assertEqual(s["terminationGracePeriodSeconds"], 41)

    def test_without_detached_policies_istios_default_drain_stays(self):
        s = self.settings({"name": "p"}, {"forwarding": {"mode": "streaming"}})
        self.assertEqual((s["terminationDrainDuration"], s["terminationGracePeriodSeconds"]), ("5s", 30))

    def test_rounds_up_to_whole_seconds(self):
        s = self.settings({"forwarding": {"mode": "detached", "timeout_ms": 1}})
        self.assertEqual(s["terminationDrainDuration"], "5s")  # 3001 ms, below Istio's 5 s
        s = self.settings({"forwarding": {"mode": "detached", "timeout_ms": 4001}})
        self.assertEqual(s["terminationDrainDuration"], "8s")  # 7001 ms

    def test_pod_settings_print_the_annotation_and_grace_period(self):
        docs = list(yaml.safe_load_all(gen.pod_settings(POLICIES)))
        by_name = {d["workload"]: d for d in docs}
        payments = by_name["shop/payments"]["template"]
        config = yaml.safe_load(payments["metadata"]["annotations"]["proxy.istio.io/config"])
        self.assertEqual(config, {"terminationDrainDuration": "33s",
                                  "proxyMetadata": {"EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "false"}})
        self.assertEqual(payments["spec"]["terminationGracePeriodSeconds"], 38)
        ledger = by_name["finance/ledger"]["template"]
        self.assertIn("terminationDrainDuration: 23s", ledger["metadata"]["annotations"]["proxy.istio.io/config"])

    def test_the_payments_pod_carries_what_its_policies_derive(self):
        """examples/kubernetes/payments.yaml against the payments policies of
        examples/istio/envoyfilter.yaml (the delivery it is applied with)."""
        with open(os.path.join(ROOT, "examples/istio/envoyfilter.yaml")) as f:
            for doc in yaml.safe_load_all(f):
                if doc and doc.get("kind") == "EnvoyFilter":
                    for patch in doc["spec"]["configPatches"]:
                        if patch["applyTo"] == "EXTENSION_CONFIG":
                            config = patch["patch"]["value"]["typed_config"]["config"]
                            plugin = json.loads(config["configuration"]["value"])
        want = gen.sidecar_settings(plugin["store"], plugin["policies"])
        with open(os.path.join(ROOT, "examples/kubernetes/payments.yaml")) as f:
            deployment = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "Deployment")
        template = deployment["spec"]["template"]
        proxy_config = yaml.safe_load(template["metadata"]["annotations"]["proxy.istio.io/config"])
        self.assertEqual(proxy_config["terminationDrainDuration"], want["terminationDrainDuration"])
        self.assertEqual(proxy_config["proxyMetadata"]["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"],
                         want["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"])
        self.assertEqual(template["spec"]["terminationGracePeriodSeconds"],
                         want["terminationGracePeriodSeconds"])
        # The same workload in workloads/policies.yaml derives the same.
        with open(POLICIES) as f:
            spec = yaml.safe_load(f)["spec"]
        payments = next(w for w in spec["workloads"] if w["name"] == "payments")
        self.assertEqual(gen.sidecar_settings(spec["store"], payments["policies"])["terminationDrainDuration"],
                         want["terminationDrainDuration"])

    def test_the_generated_header_lists_each_workloads_settings(self):
        text = gen.generate(POLICIES)
        self.assertIn("shop/payments: terminationDrainDuration 33s, EXIT_ON_ZERO_ACTIVE_CONNECTIONS false, "
                      "terminationGracePeriodSeconds 38", text)
        self.assertIn("finance/ledger: terminationDrainDuration 23s", text)


def spec_of(path=POLICIES):
    with open(path) as f:
        return gen.check_input(yaml.safe_load(f))


def deployments(spec):
    """One plain Deployment per workload, as a team's own overlay holds them."""
    out = []
    for w in spec["workloads"]:
        out.append({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": fleet.deployment_name(w), "namespace": w["namespace"],
                         "labels": dict(w["selector"])},
            "spec": {
                "selector": {"matchLabels": dict(w["selector"])},
                "template": {
                    "metadata": {"labels": dict(w["selector"])},
                    "spec": {"containers": [{
                        "name": "app",
                        "image": "registry.example.com/app@sha256:" + "0" * 64,
                        "ports": [{"containerPort": w.get("grpc_port", 8080)}],
                    }]},
                },
            },
        })
    return out


def kustomize(directory):
    return subprocess.run(["kubectl", "kustomize", directory], check=True, capture_output=True,
                          text=True).stdout


def render_fleet(component=WORKLOADS, spec=None):
    """The workloads' Component over their Deployments, as `kubectl kustomize` renders it."""
    spec = spec or spec_of()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "deployments.yaml"), "w") as f:
            yaml.safe_dump_all(deployments(spec), f, sort_keys=False)
        with open(os.path.join(tmp, "kustomization.yaml"), "w") as f:
            yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                            "resources": ["deployments.yaml"],
                            "components": [os.path.relpath(component, tmp)]}, f)
        return kustomize(tmp)


def needs(tool):
    return unittest.skipUnless(shutil.which(tool), f"{tool} is not installed (scripts/setup.sh)")


def path_matches(pattern, path):
    """Istio's AuthorizationPolicy path match: exact, `prefix*`, `*suffix` or `*`."""
    if pattern == "*":
        return True
    if pattern.endswith("*"):
        return path.startswith(pattern[:-1])
    if pattern.startswith("*"):
        return path.endswith(pattern[1:])
    return path == pattern


def allowed(policy, namespace, method, path, principal=None):
    """Istio's ALLOW semantics, for the fields the generated policy uses: a
    request passes when one rule's every `from` and `to` matches."""
    for rule in policy["spec"]["rules"]:
        sources = [f["source"] for f in rule.get("from", [])]
        operations = [t["operation"] for t in rule.get("to", [])]
        source_ok = not sources or any(
            (not s.get("namespaces") or namespace in s["namespaces"]) and
            (not s.get("principals") or principal in s["principals"]) for s in sources)
        op_ok = not operations or any(
            (not o.get("methods") or method in o["methods"]) and
            (not o.get("paths") or any(path_matches(p, path) for p in o["paths"])) for o in operations)
        if source_ok and op_ok:
            return True
    return False


class Fleet(unittest.TestCase):
    """What the generator writes besides the EnvoyFilters."""

    def setUp(self):
        self.spec = spec_of()
        self.o = gen.objects(self.spec)

    def test_grpc_workloads_get_the_replay_route_and_the_store_http2(self):
        grpc = [w for w in self.spec["workloads"] if fleet.grpc_policies(w)]
        self.assertEqual([(w["namespace"], w["name"]) for w in grpc], [("ledger", "ledger")])
        self.assertEqual(len(self.o["replay"]), 1)
        replay = self.o["replay"][0]
        self.assertEqual(replay["metadata"]["namespace"], "ledger")
        self.assertEqual(replay["spec"]["workloadSelector"]["labels"], {"app": "ledger"})
        patch = replay["spec"]["configPatches"][0]
        self.assertEqual(patch["match"]["proxy"]["proxyVersion"], gen.proxy_version_regex())
        self.assertEqual(patch["match"]["routeConfiguration"]["portNumber"], 50051)
        route = patch["patch"]["value"]
        self.assertEqual(route["match"]["path"], "/idemgate.v1.Store/Replay")
        self.assertEqual(route["match"]["headers"], [{"name": "x-idemgate-replay", "present_match": True}])
        self.assertEqual(route["route"]["cluster"], self.spec["store"]["cluster"])
        # The same route as the hand-written examples/istio/grpc-replay.yaml.
        with open(os.path.join(ROOT, "examples/istio/grpc-replay.yaml")) as f:
            hand = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "EnvoyFilter")
        self.assertEqual(hand["spec"]["configPatches"][0]["patch"], patch["patch"])
        self.assertEqual(hand["spec"]["configPatches"][0]["match"], patch["match"])
        rule = next(d for d in self.o["store"] if d["kind"] == "DestinationRule")
        self.assertEqual(rule["spec"]["host"], "idempotency-store.idemgate.svc.cluster.local")
        self.assertEqual(rule["spec"]["trafficPolicy"]["connectionPool"]["http"]["h2UpgradePolicy"], "UPGRADE")
        self.assertEqual(rule["spec"]["trafficPolicy"]["tls"], {"mode": "ISTIO_MUTUAL"})

    def test_without_grpc_policies_neither_route_nor_http2(self):
        spec = copy.deepcopy(self.spec)
        spec["workloads"] = [w for w in spec["workloads"] if not fleet.grpc_policies(w)]
        o = gen.objects(spec)
        self.assertEqual(o["replay"], [])
        rule = next(d for d in o["store"] if d["kind"] == "DestinationRule")
        self.assertNotIn("connectionPool", rule["spec"]["trafficPolicy"])

    def test_a_grpc_policy_needs_its_port(self):
        spec = copy.deepcopy(self.spec)
        del next(w for w in spec["workloads"] if fleet.grpc_policies(w))["grpc_port"]
        with self.assertRaises(SystemExit):
            gen.check_input({"spec": spec})

    def test_each_namespace_may_call_exactly_the_paths_it_needs(self):
        policy = next(d for d in self.o["store"] if d["kind"] == "AuthorizationPolicy")
        self.assertEqual((policy["metadata"]["namespace"], policy["metadata"]["name"]),
                         ("idemgate", "idempotency-store"))
        grpc = {w["namespace"] for w in self.spec["workloads"] if fleet.grpc_policies(w)}
        for ns in {w["namespace"] for w in self.spec["workloads"]}:
            for path in fleet.STORE_API_PATHS:
                self.assertTrue(allowed(policy, ns, "POST", path), f"{ns} POST {path}")
                self.assertFalse(allowed(policy, ns, "GET", path), f"{ns} GET {path}")
            self.assertEqual(allowed(policy, ns, "POST", fleet.REPLAY_PATH), ns in grpc, f"{ns} replay")
            for path in ("/admin/v1/unknown", "/admin/console", "/v1/anything", "/openapi.json"):
                self.assertFalse(allowed(policy, ns, "POST", path), f"{ns} {path}")
        # The gRPC replay from the ledger's namespace: denied by the shipped
        # single-workload policy (shop only), admitted by the generated one.
        self.assertTrue(allowed(policy, "ledger", "POST", "/idemgate.v1.Store/Replay"))
        self.assertFalse(allowed(policy, "shop", "POST", "/idemgate.v1.Store/Replay"))
        self.assertFalse(allowed(policy, "elsewhere", "POST", "/v1/claim"))
        operator = "cluster.local/ns/ops/sa/idempotency-operator"
        self.assertTrue(allowed(policy, "ops", "GET", "/admin/console", operator))
        self.assertFalse(allowed(policy, "ops", "POST", "/v1/claim", operator))
        self.assertTrue(allowed(policy, "monitoring", "GET", "/readyz"))

    def test_the_network_policy_and_pod_monitor_list_the_workloads_namespaces(self):
        namespaces = sorted({w["namespace"] for w in self.spec["workloads"]})
        (_, np_ops, _), (_, pm_ops, _) = self.o["json_patches"]
        self.assertEqual(np_ops[1]["value"][0]["namespaceSelector"]["matchExpressions"][0]["values"], namespaces)
        self.assertEqual(pm_ops[0]["value"], namespaces)

    def test_every_namespace_gets_the_token(self):
        secrets = [d for d in self.o["store"] if d["kind"] == "ExternalSecret"]
        self.assertEqual(sorted(d["metadata"]["namespace"] for d in secrets),
                         sorted({w["namespace"] for w in self.spec["workloads"]}))
        for d in secrets:
            self.assertEqual(d["spec"]["data"][0]["remoteRef"], {"key": "idemgate/store", "property": "api-token"})

    def test_the_rollout_check_runs_the_script_and_fails_its_job(self):
        with open(os.path.join(ROOT, "scripts/rollout-check.py")) as f:
            script = f.read()
        configmaps = [d for d in self.o["rollout"] if d["kind"] == "ConfigMap"]
        self.assertEqual([d["data"]["rollout-check.py"] for d in configmaps], [script])
        job = next(d for d in self.o["rollout"] if d["kind"] == "CronJob")
        self.assertEqual(job["metadata"]["namespace"], "shop")
        spec = job["spec"]["jobTemplate"]["spec"]
        self.assertEqual(spec["backoffLimit"], 0)
        pod = spec["template"]
        self.assertEqual(pod["metadata"]["annotations"]["sidecar.istio.io/nativeSidecar"], "true")
        self.assertEqual(pod["spec"]["restartPolicy"], "Never")
        args = pod["spec"]["containers"][0]["args"]
        self.assertEqual(args[:2], ["/opt/rollout-check/rollout-check.py",
                                    "http://payments.shop.svc.cluster.local:8080/v1/payments"])
        self.assertIn("authorization: Bearer $(ROLLOUT_CHECK_TOKEN)", args)

    def test_a_failing_route_makes_the_check_exit_non_zero(self):
        """The CronJob's verdict is the script's exit code: against a route
        without the filter (a plain server), it exits 1."""
        import http.server
        import threading

        class Plain(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(201)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Plain)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/rollout-check.py"),
                                f"http://127.0.0.1:{server.server_port}/v1/payments", "--timeout", "5"],
                               capture_output=True, text=True, timeout=60)
        finally:
            server.shutdown()
            server.server_close()
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("NOT enforced", r.stdout)

    def test_the_coverage_alerts_name_every_policy_as_the_sidecar_labels_it(self):
        self.assertEqual(fleet.relabeled_policy("payments.create"), "payments.create")
        self.assertEqual(fleet.relabeled_policy("fail-open"), "fail.open")
        self.assertEqual(fleet.relabeled_policy("payment_intents.create"), "payment.intents.create")
        rules = fleet.coverage_rules(self.spec)[0]["rules"]
        pods = [r for r in rules if r["alert"] == "IdemgateWorkloadPodsUnprotected"]
        absent = [r for r in rules if r["alert"] == "IdemgatePolicyNotReported"]
        self.assertEqual(len(pods), len(self.spec["workloads"]))
        self.assertEqual(len(absent), sum(len(w["policies"]) for w in self.spec["workloads"]))
        ledger = next(r for r in pods if r["labels"]["workload"] == "finance/ledger")
        self.assertIn('label_app="ledger", label_tier="api"', ledger["expr"])
        self.assertIn('policy=~"ledger\\\\.transfers\\\\.create"', ledger["expr"])


@needs("kubectl")
class Rendered(unittest.TestCase):
    """The Components as `kubectl kustomize` renders them."""

    @classmethod
    def setUpClass(cls):
        cls.spec = spec_of()
        cls.fleet = [d for d in yaml.safe_load_all(render_fleet()) if d]
        cls.store = [d for d in yaml.safe_load_all(kustomize(OVERLAY)) if d]

    def test_every_deployment_carries_its_drain_grace_and_token(self):
        by_name = {(d["metadata"]["namespace"], d["metadata"]["name"]): d
                   for d in self.fleet if d["kind"] == "Deployment"}
        for w in self.spec["workloads"]:
            want = gen.sidecar_settings(self.spec["store"], w["policies"])
            pod = by_name[(w["namespace"], fleet.deployment_name(w))]["spec"]["template"]
            config = yaml.safe_load(pod["metadata"]["annotations"]["proxy.istio.io/config"])
            self.assertEqual(config["terminationDrainDuration"], want["terminationDrainDuration"])
            self.assertEqual(config["proxyMetadata"]["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"], "false")
            self.assertEqual(pod["spec"]["terminationGracePeriodSeconds"], want["terminationGracePeriodSeconds"])
            containers = {c["name"]: c for c in pod["spec"]["containers"]}
            self.assertEqual(set(containers), {"app", "istio-proxy"})
            self.assertEqual(containers["istio-proxy"]["env"], [{
                "name": "IDEMGATE_STORE_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "idemgate-store-token", "key": "api-token"}}}])

    def test_the_store_overlay_admits_exactly_the_workloads_namespaces(self):
        namespaces = sorted({w["namespace"] for w in self.spec["workloads"]})
        policy = next(d for d in self.store if d["kind"] == "NetworkPolicy")
        api = policy["spec"]["ingress"][0]
        self.assertEqual(api["ports"], [{"protocol": "TCP", "port": 8787}])
        self.assertEqual(api["from"], [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}]}}])
        monitor = next(d for d in self.store if d["kind"] == "PodMonitor")
        self.assertEqual(monitor["spec"]["namespaceSelector"]["matchNames"], namespaces)

    @unittest.skipUnless(os.path.exists(os.path.join(ROOT, ".tools/venv/bin/kubernetes-validate")),
                         "kubernetes-validate is not installed (scripts/setup.sh)")
    def test_the_rendered_fleet_is_valid_kubernetes(self):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_dump_all(self.fleet, f)
            f.flush()
            r = subprocess.run([os.path.join(ROOT, ".tools/venv/bin/kubernetes-validate"), "--strict",
                                "--quiet", "--no-warn", "-k", "1.33.0", f.name], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def applied(self, tmp, fleet_docs=None, store_docs=None):
        with open(os.path.join(tmp, "fleet.yaml"), "w") as f:
            yaml.safe_dump_all(self.fleet if fleet_docs is None else fleet_docs, f)
        # As `kubectl get -o yaml` exports the store's side: a List, with
        # fields the API server adds.
        items = copy.deepcopy(self.store if store_docs is None else store_docs)
        for d in items:
            d["metadata"].update({"uid": "x", "resourceVersion": "1", "generation": 1})
            d["status"] = {}
        with open(os.path.join(tmp, "store.yaml"), "w") as f:
            yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}, f)
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = gen.main([POLICIES, "--check", tmp])
        return code, err.getvalue()

    def test_check_finds_no_drift_in_what_was_applied(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, err = self.applied(tmp)
        self.assertEqual(code, 0, err)

    def test_check_prints_each_drift_in_what_was_applied(self):
        fleet_docs = copy.deepcopy(self.fleet)
        payments = next(d for d in fleet_docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "payments")
        payments["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"] = \
            "terminationDrainDuration: 5s\n"
        fleet_docs = [d for d in fleet_docs if not (d["kind"] == "EnvoyFilter" and
                                                    d["metadata"]["name"] == "idemgate-orders")]
        stale = copy.deepcopy(next(d for d in fleet_docs if d["kind"] == "EnvoyFilter"))
        stale["metadata"]["name"] = "idemgate-retired"
        fleet_docs.append(stale)
        store_docs = copy.deepcopy(self.store)
        monitor = next(d for d in store_docs if d["kind"] == "PodMonitor")
        monitor["spec"]["namespaceSelector"]["matchNames"] = ["shop"]
        with tempfile.TemporaryDirectory() as tmp:
            code, err = self.applied(tmp, fleet_docs, store_docs)
        self.assertEqual(code, 1)
        self.assertIn("Deployment.apps shop/payments differs", err)
        self.assertIn("-          terminationDrainDuration: 5s\n+          terminationDrainDuration: 33s", err)
        self.assertIn("missing EnvoyFilter.networking.istio.io shop/idemgate-orders", err)
        self.assertIn("idemgate-retired is labelled as generated but no longer generated", err)
        self.assertIn("PodMonitor.monitoring.coreos.com idemgate/idemgate-sidecars /spec/namespaceSelector/matchNames", err)
        self.assertIn("+- ledger", err)


class OutputDirectory(unittest.TestCase):
    def test_check_on_the_output_directory_prints_a_changed_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            copy_dir = os.path.join(tmp, "workloads")
            shutil.copytree(WORKLOADS, copy_dir)
            path = os.path.join(copy_dir, "store/podmonitor-patch.yaml")
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace("  - ledger\n", ""))
            with open(os.path.join(copy_dir, "patches/shop.retired.yaml"), "w") as f:
                f.write(drift.MARK + " from x: do not edit.\n")
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                code = gen.main([POLICIES, "--check", copy_dir])
            self.assertEqual(code, 1)
            self.assertIn("store/podmonitor-patch.yaml differs", err.getvalue())
            self.assertIn("+  - ledger", err.getvalue())
            self.assertIn("patches/shop.retired.yaml: generated once, no longer written", err.getvalue())
            with redirect_stdout(out):
                self.assertEqual(gen.main([POLICIES, "-o", copy_dir]), 0)
                self.assertEqual(gen.main([POLICIES, "--check", copy_dir]), 0)
            self.assertFalse(os.path.exists(os.path.join(copy_dir, "patches/shop.retired.yaml")))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:
        with open(sys.argv[2], "w") as out:
            out.write(render_fleet())
        sys.exit(0)
    unittest.main()
