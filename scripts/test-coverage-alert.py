#!/usr/bin/env python3
"""The generated coverage alert fires on a real Envoy that runs without the
filter, and not on one that runs it.

    python3 scripts/test-coverage-alert.py ENVOY WASM

Two Envoys stand for two pods of the workload shop/payments of
examples/istio/workloads/policies.yaml: payments-a runs the filter as the
generated EnvoyFilter configures it (its Wasm configuration, the module read
from WASM instead of the registry, no stats_tags: Istio's flat stat names),
payments-b runs none, as a sidecar of an Istio minor the EnvoyFilter's
proxyVersion does not admit would. A stand-in for kube-state-metrics reports
both pods Running with the workload's labels. A real Prometheus scrapes the
Envoys' /stats/prometheus with the PodMonitor's metricRelabelings under its
job, and loads the generated coverage.rules.yaml with each `for:` cut to 0s
(the only change, so the test takes seconds); then:

  - IdemgateWorkloadPodsUnprotected fires for payments-b, not payments-a;
  - IdemgatePolicyNotReported does not fire for the policies payments-a
    reports, and does for a workload no Envoy here runs (shop/orders).

The emulation: no Kubernetes, no istiod, no istio-agent; the pods are two
processes with pod labels given by the scrape configuration.
"""
import copy
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import yaml

import loopback

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
WORKLOADS = os.path.join(ROOT, "examples/istio/workloads")
MONITORING = os.path.join(ROOT, "examples/kubernetes/components/monitoring/monitoring.yaml")
FIELDS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
          "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}
KSM = """\
# TYPE kube_pod_labels gauge
kube_pod_labels{namespace="shop",pod="payments-a",label_app="payments"} 1
kube_pod_labels{namespace="shop",pod="payments-b",label_app="payments"} 1
# TYPE kube_pod_status_phase gauge
kube_pod_status_phase{namespace="shop",pod="payments-a",phase="Running"} 1
kube_pod_status_phase{namespace="shop",pod="payments-b",phase="Running"} 1
"""


class KubeStateMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(KSM.encode())

    def log_message(self, *args):
        pass


def wasm_filter(wasm):
    """The Wasm filter the generated EnvoyFilter of shop/payments delivers
    over ECDS, its module read from a file."""
    with open(os.path.join(WORKLOADS, "envoyfilters.yaml")) as f:
        doc = next(d for d in yaml.safe_load_all(f) if d and d["metadata"]["name"] == "idemgate-payments")
    value = copy.deepcopy(next(p for p in doc["spec"]["configPatches"]
                               if p["applyTo"] == "EXTENSION_CONFIG")["patch"]["value"])
    value["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": wasm}}
    return value


def bootstrap(admin_port, listen, filters):
    return {
        "admin": loopback.admin(admin_port),
        "static_resources": {"listeners": [
            loopback.inbound_listener(listen, filters, {"direct_response": {"status": 200}})]},
    }


def firing(port, name):
    alerts = (loopback.prometheus_api(port, "alerts").get("data") or {}).get("alerts", [])
    return [a["labels"] for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def main(envoy, wasm):
    prometheus = shutil.which("prometheus")
    if not prometheus:
        sys.exit("test-coverage-alert: no prometheus (scripts/setup.sh installs it)")
    monitor = next(d for d in yaml.safe_load_all(open(MONITORING)) if d and d["kind"] == "PodMonitor")
    job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    relabel = [{FIELDS[k]: v for k, v in r.items()}
               for r in monitor["spec"]["podMetricsEndpoints"][0]["metricRelabelings"]]
    ksm = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KubeStateMetrics)
    threading.Thread(target=ksm.serve_forever, daemon=True).start()
    procs, problems = [], []
    with tempfile.TemporaryDirectory() as tmp:
        admins = {}
        for pod, filters in (("payments-a", [wasm_filter(os.path.abspath(wasm))]), ("payments-b", [])):
            admins[pod] = loopback.free_port()
            path = os.path.join(tmp, f"{pod}.json")
            with open(path, "w") as f:
                json.dump(bootstrap(admins[pod], loopback.free_port(), filters), f)
            log = open(os.path.join(tmp, f"{pod}.log"), "w")
            env = dict(os.environ, IDEMGATE_STORE_TOKEN="coverage-test-token")
            procs.append(subprocess.Popen([envoy, "-c", path, "--base-id", str(loopback.free_port()),
                                           "--log-level", "warn"], stdout=log, stderr=log, env=env))
        with open(os.path.join(WORKLOADS, "coverage.rules.yaml")) as f:
            rules = yaml.safe_load(f)
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule["for"] = "0s"
        rules_path = os.path.join(tmp, "coverage.rules.yaml")
        with open(rules_path, "w") as f:
            yaml.safe_dump(rules, f)
        port = loopback.free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules_path],
            "scrape_configs": [
                {"job_name": job, "metrics_path": "/stats/prometheus",
                 "static_configs": [{"targets": [f"127.0.0.1:{admins[pod]}"],
                                     "labels": {"namespace": "shop", "pod": pod}} for pod in admins],
                 "metric_relabel_configs": relabel},
                {"job_name": "kube-state-metrics", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{ksm.server_port}"]}]},
            ],
        }
        config_path = os.path.join(tmp, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        procs.append(subprocess.Popen([prometheus, f"--config.file={config_path}",
                                       f"--storage.tsdb.path={tmp}/data", f"--web.listen-address=127.0.0.1:{port}",
                                       "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            deadline = time.time() + 60
            pods = []
            while time.time() < deadline:
                pods = sorted(a["pod"] for a in firing(port, "IdemgateWorkloadPodsUnprotected"))
                reported = (loopback.prometheus_api(port, "query", query='idemgate_policy_info{pod="payments-a"} == 1').get("data")
                            or {}).get("result", [])
                if pods and len(reported) == 2:
                    time.sleep(3)  # a few more evaluations: payments-a must stay out
                    pods = sorted(a["pod"] for a in firing(port, "IdemgateWorkloadPodsUnprotected"))
                    break
                time.sleep(0.5)
            if pods != ["payments-b"]:
                for pod in admins:
                    with open(os.path.join(tmp, f"{pod}.log")) as f:
                        print(f"--- {pod}'s Envoy log:\n{f.read()[-3000:]}", file=sys.stderr)
                problems.append(f"IdemgateWorkloadPodsUnprotected fires for {pods}, expected payments-b only "
                                f"(payments-a reports {len(reported)} policies loaded, expected 2)")
            missing = {(a.get("workload"), a.get("policy")) for a in firing(port, "IdemgatePolicyNotReported")}
            for policy in ("payments.create", "refunds.create"):
                if ("shop/payments", policy) in missing:
                    problems.append(f"IdemgatePolicyNotReported fires for {policy}, which payments-a reports")
            if ("shop/orders", "orders.create") not in missing:
                problems.append(f"IdemgatePolicyNotReported does not fire for shop/orders, which no Envoy runs: {missing}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            ksm.shutdown()
            ksm.server_close()
    for p in problems:
        print(f"test-coverage-alert: FAIL {p}", file=sys.stderr)
    if problems:
        return 1
    print("test-coverage-alert: IdemgateWorkloadPodsUnprotected fires for the Envoy without the filter "
          "(payments-b) and not for the one that runs it (payments-a); IdemgatePolicyNotReported fires for "
          "a workload no Envoy runs and not for the policies payments-a reports")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
