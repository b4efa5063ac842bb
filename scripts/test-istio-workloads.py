#!/usr/bin/env python3
"""Unit tests of scripts/istio-workloads.py and of the EnvoyFilters under
examples/istio/ that depend on it (run by scripts/validate-manifests.sh).

    python3 scripts/test-istio-workloads.py [-v]
"""
import importlib.util
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


if __name__ == "__main__":
    unittest.main()
