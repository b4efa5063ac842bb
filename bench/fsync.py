#!/usr/bin/env python3
"""Prints what one durable write costs on the disk under DIR: a 4 KiB write
followed by fdatasync (the top level: "p50_us", "p99_us", "n", the floor the
targets use), and each of fdatasync and fsync after an overwrite in place
and after an append ("floors": {"fdatasync overwrite": {...}, ...})."""
import json
import os
import statistics
import sys
import time

N = 300


def probe(path, sync, append):
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = os.urandom(4096)
        for i in range(N):
            t0 = time.perf_counter_ns()
            os.pwrite(fd, block, (i if append else i % 64) * 4096)
            sync(fd)
            times.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    q = statistics.quantiles(times, n=100)
    return {"p50_us": round(statistics.median(times)), "p99_us": round(q[98]), "n": N}


path = os.path.join(sys.argv[1], "fsync.probe")
floors = {
    f"{name} {how}": probe(path, sync, how == "append")
    for name, sync in (("fdatasync", os.fdatasync), ("fsync", os.fsync))
    for how in ("overwrite", "append")
}
print(json.dumps({**floors["fdatasync overwrite"], "floors": floors}))
