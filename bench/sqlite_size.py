#!/usr/bin/env python3
"""Prints {"records": N, "bytes": B} for a store's SQLite file: B is the pages
in use (page_count - freelist_count) times the page size, i.e. the table and its
indexes, whether the pages are still in the WAL or already in the main file."""
import json
import sqlite3
import sys

db = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, timeout=10)
records = db.execute("SELECT count(*) FROM idempotency_records").fetchone()[0]
page_size = db.execute("PRAGMA page_size").fetchone()[0]
pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
print(json.dumps({"records": records, "bytes": pages * page_size}))
