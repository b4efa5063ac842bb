#!/usr/bin/env python3
"""One snapshot of what a new key costs inside the store and on Envoy's side
of the store call, printed as one JSON object; scripts/bench.sh takes one
before and one after a run at one connection, bench/report.py reads their
differences.

    bench/mechanism.py STORE_PID STORE_URL ENVOY_ADMIN_PORT [UNIX_SOCKET]

- "ctxt": context switches of every thread of the store process so far
  (voluntary and not, /proc/PID/task/*/status);
- "metrics": the store's idemgate_store_* series from its /metrics (the claim
  timer, the writer's stage timers, commits, durable commits, checkpoints),
  over the Unix socket when one is given;
- "rq_time": Envoy's histogram of the store cluster's upstream_rq_time, its
  detailed buckets since Envoy started ([lower bound ms, width ms, count]);
- "callout_us": the filter's own histogram of its store callouts
  (idemgate.store_call_time), the same way, in microseconds: Envoy's
  upstream_rq_time counts whole milliseconds.
  The bench's Envoys flush their stats only when the admin asks
  (stats_flush_on_admin), and a flush merges the workers' histograms after
  the answer: the first request merges, the second reads.
"""
import glob
import http.client
import json
import socket
import sys
import time
import urllib.parse
import urllib.request

RQ_TIME = "cluster.idempotency_store.upstream_rq_time"
CALLOUT_US = "wasmcustom.idemgate.store_call_time"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def context_switches(pid):
    total = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(status) as f:
                total += sum(int(line.split()[-1]) for line in f if "ctxt_switches:" in line)
        except OSError:
            pass  # a thread that ended meanwhile
    return total


def store_metrics(url, unix):
    if unix:
        conn = UnixConnection(unix)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    else:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("idemgate_store_"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def detailed(admin, name):
    """Envoy's histogram `name`, its detailed buckets: [lower bound, width, count]."""
    query = urllib.parse.urlencode({"filter": f"^{name.replace('.', '[.]')}$", "format": "json",
                                    "histogram_buckets": "detailed"})
    url = f"http://127.0.0.1:{admin}/stats?{query}"
    urllib.request.urlopen(url, timeout=10).read()
    time.sleep(0.3)
    with urllib.request.urlopen(url, timeout=10) as r:
        stats = json.load(r).get("stats", [])
    for s in stats:
        for d in (s.get("histograms") or {}).get("details", []):
            if d.get("name") == name:
                return [[b["lower_bound"], b["width"], b["count"]] for b in d.get("totals", [])]
    return []


def main():
    pid, url, admin = sys.argv[1:4]
    unix = sys.argv[4] if len(sys.argv) > 4 else None
    print(json.dumps({"ctxt": context_switches(pid), "metrics": store_metrics(url, unix),
                      "rq_time": detailed(admin, RQ_TIME), "callout_us": detailed(admin, CALLOUT_US),
                      "at": time.time()}))


if __name__ == "__main__":
    main()
