#!/usr/bin/env python3
"""The Prometheus Operator's PodMonitor of examples/kubernetes/components/monitoring,
run by a real Prometheus against a stand-in for a sidecar's :15020.

    python3 scripts/test-monitoring-operator.py

There is no Kubernetes API server or Prometheus Operator here: the scrape
job is what the Operator generates from the PodMonitor for what matters
here (its metricRelabelings, camelCase turned back into Prometheus' own
fields, and the job label `<namespace>/<name>`), and the target is a local
HTTP server answering what istio-agent's merged endpoint answers (Envoy's
stats in their flat Istio form, istio-agent's own, the application's).
Prometheus (the one scripts/setup.sh installs) scrapes it with the rules of
examples/monitoring/alerts.yaml loaded; then:

  - only idemgate's and the Wasm series are stored (the keep), the filter's
    counters with their outcome and policy labels rebuilt;
  - IdemgateModuleFetchFailed fires on istio-agent's failed fetch, and
    IdemgateTargetDown watches the PodMonitor's job (a target that stops
    answering reads up == 0 under that job);
  - every expression of the dashboard parses.
"""
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
MONITORING = os.path.join(ROOT, "examples/kubernetes/components/monitoring/monitoring.yaml")
FIELDS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
          "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}

EXPOSITION = """\
# TYPE idemgate_requests_total_outcome_owned_policy_payments_create counter
idemgate_requests_total_outcome_owned_policy_payments_create 3
# TYPE idemgate_policy_info_mode_enforce_policy_payments_create gauge
idemgate_policy_info_mode_enforce_policy_payments_create 1
# TYPE envoy_wasm_envoy_wasm_runtime_v8_created counter
envoy_wasm_envoy_wasm_runtime_v8_created 2
# TYPE envoy_cluster_upstream_rq_total counter
envoy_cluster_upstream_rq_total{cluster_name="outbound|8080||payments"} 100
# TYPE istio_requests_total counter
istio_requests_total{response_code="200"} 100
# TYPE istio_agent_wasm_remote_fetch_count counter
istio_agent_wasm_remote_fetch_count{result="download_failure"} FAILURES
istio_agent_wasm_remote_fetch_count{result="success"} 1
# TYPE istio_agent_go_goroutines gauge
istio_agent_go_goroutines 42
# TYPE payments_http_requests_total counter
payments_http_requests_total 7
"""


class Sidecar(http.server.BaseHTTPRequestHandler):
    failures = 0
    up = True

    def do_GET(self):
        if not Sidecar.up:
            self.send_response(503)
            self.end_headers()
            return
        body = EXPOSITION.replace("FAILURES", str(Sidecar.failures)).encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def pod_monitor():
    docs = [d for d in yaml.safe_load_all(open(MONITORING)) if d]
    return next(d for d in docs if d["kind"] == "PodMonitor")


def wait(what, predicate, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def dashboard_expressions():
    with open(os.path.join(ROOT, "examples/monitoring/dashboard.json")) as f:
        dashboard = json.load(f)
    out = []

    def walk(v):
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "expr" and isinstance(x, str):
                    out.append(x)
                else:
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(dashboard["panels"])
    return [e.replace("$__rate_interval", "1m").replace("$policy", ".*") for e in out]


def main():
    prometheus = shutil.which("prometheus")
    if not prometheus:
        print("test-monitoring-operator: SKIP, no prometheus (scripts/setup.sh installs it)")
        return 0
    monitor = pod_monitor()
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    job = f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    relabel = [{FIELDS[k]: v for k, v in r.items()} for r in endpoint["metricRelabelings"]]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sidecar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = loopback.free_port()
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.join(ROOT, "examples/monitoring/alerts.yaml")],
            "scrape_configs": [{
                "job_name": job,
                "metrics_path": endpoint["path"],
                "static_configs": [{"targets": [f"127.0.0.1:{server.server_port}"],
                                    "labels": {"namespace": "shop", "pod": "payments-a"}}],
                "metric_relabel_configs": relabel,
            }],
        }
        path = os.path.join(tmp, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        proc = subprocess.Popen([prometheus, f"--config.file={path}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            time.sleep(0.5)
            if proc.poll() is not None:
                raise SystemExit(f"test-monitoring-operator: prometheus did not start: {proc.stderr.read().decode()}")
            wait("the first scrape", lambda: (loopback.prometheus_api(port, "query", query="up").get("data") or {}).get("result"))
            names = wait("the series", lambda: [n for n in (loopback.prometheus_api(port, "label/__name__/values").get("data") or [])
                                                 if not n.startswith(("up", "scrape_"))])
            expected = {"idemgate_requests_total", "idemgate_policy_info", "envoy_wasm_envoy_wasm_runtime_v8_created",
                        "istio_agent_wasm_remote_fetch_count"}
            if set(names) != expected:
                problems.append(f"stored series {sorted(names)}, expected only {sorted(expected)}")
            owned = loopback.prometheus_api(port, "query", query='idemgate_requests_total{outcome="owned",policy="payments.create"}')
            if not owned["data"]["result"] or owned["data"]["result"][0]["metric"].get("job") != job:
                problems.append(f"the filter's counter was not rebuilt with its labels under job {job}: {owned}")
            # istio-agent's fetch fails: the alert fires for that pod.
            Sidecar.failures = 1

            def fetch_alert():
                alerts = loopback.prometheus_api(port, "alerts")["data"]["alerts"]
                return [a for a in alerts if a["labels"]["alertname"] == "IdemgateModuleFetchFailed"
                        and a["state"] == "firing"]
            fired = wait("IdemgateModuleFetchFailed", fetch_alert)
            if fired[0]["labels"].get("pod") != "payments-a":
                problems.append(f"IdemgateModuleFetchFailed without the pod: {fired}")
            # The sidecar stops answering: up == 0 under the PodMonitor's
            # job, which IdemgateTargetDown's expression selects.
            Sidecar.up = False
            rule = next(r for g in yaml.safe_load(open(os.path.join(ROOT, "examples/monitoring/alerts.yaml")))["groups"]
                        for r in g["rules"] if r.get("alert") == "IdemgateTargetDown")
            down = wait("IdemgateTargetDown's expression", lambda: loopback.prometheus_api(port, "query", query=rule["expr"])["data"]["result"])
            if down[0]["metric"].get("job") != job:
                problems.append(f"IdemgateTargetDown's expression does not return the PodMonitor's job: {down}")
            for expr in dashboard_expressions():
                answer = loopback.prometheus_api(port, "query", query=expr)
                if answer.get("status") != "success":
                    problems.append(f"dashboard expression does not run: {expr}: {answer.get('error')}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            server.shutdown()
            server.server_close()
    for p in problems:
        print(f"test-monitoring-operator: FAIL {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"test-monitoring-operator: the PodMonitor's job {job} keeps {len(expected)} series names of 8, "
          "IdemgateModuleFetchFailed fires on istio-agent's failed fetch, IdemgateTargetDown watches the job, "
          f"{len(dashboard_expressions())} dashboard expressions run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
