#!/usr/bin/env python3
"""The filter module fetched over HTTP by Envoy itself, pinned by sha256, as
examples/istio/envoyfilter-http-module.yaml delivers it.

    python3 scripts/test-remote-module.py ENVOY WASM

A local HTTP server stands for the in-cluster Service idemgate-modules: it
serves WASM under the manifest's path, and nothing else. Each case starts a
real Envoy whose inbound HTTP filter chain holds the manifest's
EXTENSION_CONFIG value as written (`remote` code: its `uri`, `cluster`,
`timeout`, `retry_policy`), the cluster it names pointing at that server, and
a route that answers 200 to whatever passes the filter:

  - the right sha256 (WASM's): Envoy fetches the module, the filter logs
    `configured: 3 policies`, reports idemgate_build_info and one
    idemgate_policy_info per policy in /stats/prometheus, and a POST to
    /v1/payments without an Idempotency-Key gets its `400 key-missing`;
  - a wrong sha256 (the server's module is not the pinned one): Envoy
    fetches it 1 + `retry_policy.num_retries` times, refuses each, gives up
    (`Plugin configured to fail closed failed to load`) and counts
    envoy_wasm_remote_load_fetch_failures; the module never runs; Envoy still
    starts its listener, and the filter, failing closed, answers 503 to every
    request on that chain, covered by a policy or not: none reaches the route;
  - the server down: the same.

The emulation: no istiod, no istio-agent. In an Istio sidecar istio-agent
downloads the module and checks its sha256 instead of Envoy (and on failure
replaces the filter with a deny-all one); this runs the fetch an Envoy does
when nothing fetches for it, and the payload Istio would hand over.
"""
import copy
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml

import loopback

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
MANIFEST = os.path.join(ROOT, "examples/istio/envoyfilter-http-module.yaml")
ENV = {"IDEMGATE_STORE_TOKEN": "remote-module-test-token"}


def extension_config():
    """The EXTENSION_CONFIG value of the manifest's EnvoyFilter."""
    with open(MANIFEST) as f:
        doc = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "EnvoyFilter")
    return copy.deepcopy(next(p for p in doc["spec"]["configPatches"]
                              if p["applyTo"] == "EXTENSION_CONFIG")["patch"]["value"])


class ModuleServer(http.server.ThreadingHTTPServer):
    def __init__(self, path, body):
        super().__init__(("127.0.0.1", 0), ModuleHandler)
        self.path, self.body, self.requests = path, body, []


class ModuleHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.requests.append((self.headers.get("host"), self.path))
        if self.path != self.server.path:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "application/wasm")
        self.send_header("content-length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, *args):
        pass


def bootstrap(admin_port, listen, wasm_filter, cluster, module_port):
    upstream = {"direct_response": {"status": 200, "body": {"inline_string": "upstream"}}}
    return {
        "admin": loopback.admin(admin_port),
        "static_resources": {
            "listeners": [loopback.inbound_listener(listen, [wasm_filter], upstream)],
            # The sidecar's outbound cluster for the modules Service, here the local server.
            "clusters": [loopback.static_cluster(cluster, module_port)],
        },
    }


def get(url, timeout=2):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, socket.timeout):
        return None, ""


def post(port, path):
    """(status, content type, body) of a POST without an Idempotency-Key, or
    (None, error, "") when nothing accepts the connection."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b'{"amount": 1}', method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("content-type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type"), e.read().decode()
    except (urllib.error.URLError, ConnectionError, socket.timeout) as e:
        return None, str(getattr(e, "reason", e)), ""


class Envoy:
    """One Envoy on a bootstrap, its log in a file."""

    def __init__(self, envoy, tmp, name, config):
        self.admin = config["admin"]["address"]["socket_address"]["port_value"]
        self.path = os.path.join(tmp, f"{name}.json")
        with open(self.path, "w") as f:
            json.dump(config, f)
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([envoy, "-c", self.path, "--base-id", str(loopback.free_port()),
                                      "--log-level", "info"], stdout=self.log, stderr=self.log,
                                     env=dict(os.environ, **ENV))

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_log(self, needle, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            if needle in self.text():
                return True
            if self.proc.poll() is not None:
                return needle in self.text()
            time.sleep(0.1)
        return False

    def stats(self):
        return get(f"http://127.0.0.1:{self.admin}/stats/prometheus")[1]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main(envoy, wasm):
    with open(wasm, "rb") as f:
        module = f.read()
    sha = hashlib.sha256(module).hexdigest()
    value = extension_config()
    remote = value["typed_config"]["config"]["vm_config"]["code"]["remote"]
    uri = urllib.parse.urlsplit(remote["http_uri"]["uri"])
    cluster = remote["http_uri"]["cluster"]
    retries = remote.get("retry_policy", {}).get("num_retries", 1)
    problems, lines = [], []

    def check(ok, what):
        (lines if ok else problems).append(what)

    server = ModuleServer(uri.path, module)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    down_port = loopback.free_port()  # nothing listens there
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        def start(name, pinned, port):
            v = copy.deepcopy(value)
            v["typed_config"]["config"]["vm_config"]["code"]["remote"]["sha256"] = pinned
            listen = loopback.free_port()
            return Envoy(envoy, tmp, name, bootstrap(loopback.free_port(), listen, v, cluster, port)), listen

        # Both failing cases run while the good one does: three Envoys at once.
        good, good_port = start("right-sha256", sha, server.server_port)
        wrong_sha = hashlib.sha256(module + b"\0").hexdigest()
        wrong, wrong_port = start("wrong-sha256", wrong_sha, server.server_port)
        down, down_port_listen = start("server-down", sha, down_port)
        envoys = [good, wrong, down]
        try:
            # 1. The right sha256.
            loaded = good.wait_log("configured: 3 policies", 20)
            check(loaded, "right sha256: the filter logs `configured: 3 policies`")
            fetched = [r for r in server.requests if r[1] == uri.path]
            check(any(h == uri.netloc for h, _ in fetched),
                  f"right sha256: Envoy fetched {uri.path} with Host {uri.netloc} through cluster {cluster}")
            stats = good.stats()
            enforced = sorted(l.split("_mode_enforce_policy_", 1)[1].split("{")[0] for l in stats.splitlines()
                              if l.startswith("idemgate_policy_info_mode_enforce_") and l.endswith(" 1"))
            check(any(l.startswith("idemgate_build_info_") and l.endswith(" 1") for l in stats.splitlines())
                  and enforced == ["orders_create", "payments_create", "refunds_create"]
                  and "envoy_wasm_remote_load_fetch_successes{} 1" in stats,
                  f"right sha256: /stats/prometheus: idemgate_build_info 1, idemgate_policy_info 1 (enforce) "
                  f"for {enforced}, envoy_wasm_remote_load_fetch_successes 1")
            status, ctype, body = post(good_port, "/v1/payments")
            problem = {}
            try:
                problem = json.loads(body)
            except json.JSONDecodeError:
                pass
            check(status == 400 and ctype == "application/problem+json"
                  and problem.get("type", "").endswith("/key-missing"),
                  f"right sha256: POST /v1/payments without a key -> {status} {ctype} "
                  f"{problem.get('type', body[:80])}")
            status, _, body = post(good_port, "/v1/other")
            check(status == 200 and body == "upstream", f"right sha256: POST /v1/other (no policy) -> {status} "
                                                        f"from the route")

            # 2. and 3. The failing fetches: wait until Envoy has given up
            # (1 + retry_policy.num_retries attempts), then every request.
            for name, e, port in (("wrong sha256", wrong, wrong_port), ("server down", down, down_port_listen)):
                gave_up = e.wait_log("Plugin configured to fail closed failed to load", 25 - (time.time() - started))
                log = e.text()
                check(gave_up and "Retry limit exceeded for fetching data from remote data source" in log,
                      f"{name}: Envoy gives up after the retries (`Retry limit exceeded`, `Plugin configured "
                      f"to fail closed failed to load`)")
                stats = e.stats()
                check("configured: " not in log and "idemgate_build_info" not in stats
                      and "envoy_wasm_remote_load_fetch_failures{} 1" in stats,
                      f"{name}: the module never ran (no `configured:` log, no idemgate_build_info), "
                      f"envoy_wasm_remote_load_fetch_failures 1")
                for path in ("/v1/payments", "/v1/other"):
                    status, _, body = post(port, path)
                    check(status == 503 and body != "upstream",
                          f"{name}: POST {path} -> {status} from Envoy, the route never reached (fail closed)")
            fetches = sum(1 for r in server.requests if r[1] == uri.path)
            check(fetches == 1 + (1 + retries),
                  f"the server saw {fetches} fetches: 1 (right sha256) + {1 + retries} (wrong sha256: "
                  f"1 + retry_policy.num_retries {retries})")
        finally:
            for e in envoys:
                e.stop()
            server.shutdown()
            server.server_close()
            if problems:
                for e, name in ((good, "right-sha256"), (wrong, "wrong-sha256"), (down, "server-down")):
                    print(f"--- {name} Envoy log (end):\n{e.text()[-2500:]}", file=sys.stderr)
    for line in lines:
        print(f"test-remote-module: ok {line}")
    for p in problems:
        print(f"test-remote-module: FAIL {p}", file=sys.stderr)
    print(f"test-remote-module: {len(lines)} checks passed, {len(problems)} failed "
          f"in {time.time() - started:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
