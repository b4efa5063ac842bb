#!/usr/bin/env python3
"""Prints {"p50_us": .., "p99_us": .., "n": ..} for a 4 KiB write followed by
fdatasync in a file under DIR: what one durable commit costs on this disk."""
import json
import os
import statistics
import sys
import time

path = os.path.join(sys.argv[1], "fsync.probe")
n = 300
times = []
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
try:
    block = os.urandom(4096)
    for i in range(n):
        t0 = time.perf_counter_ns()
        os.pwrite(fd, block, (i % 64) * 4096)
        os.fdatasync(fd)
        times.append((time.perf_counter_ns() - t0) / 1000)
finally:
    os.close(fd)
    os.unlink(path)
q = statistics.quantiles(times, n=100)
print(json.dumps({"p50_us": round(statistics.median(times)), "p99_us": round(q[98]), "n": n}))
