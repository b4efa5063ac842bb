#!/usr/bin/env python3
"""Unit tests of scripts/istio-workloads.py and of the EnvoyFilters under
examples/istio/ that depend on it (run by scripts/validate-manifests.sh).

    python3 scripts/test-istio-workloads.py [-v]
"""
import importlib.util
import json
import os
import re
import unittest

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
spec = importlib.util.spec_from_file_location("istio_workloads", os.path.join(HERE, "istio-workloads.py"))
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)

POLICIES = os.path.join(ROOT, "examples/istio/workloads/policies.yaml")
GENERATED = os.path.join(ROOT, "examples/istio/workloads/envoyfilters.yaml")


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
                             "-o examples/istio/workloads/envoyfilters.yaml")

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
        return {"store": {"cluster": "c", "token_env": "T"},
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


if __name__ == "__main__":
    unittest.main()
