#!/usr/bin/env python3
"""Pre-fills a store's database for the scale scenario of `make bench`, straight
into the tables (not through HTTP), after `idempotency-store migrate` created
them: N records as the store writes them for the bench's requests (completed,
with the bench's fingerprint, stored status, headers and body), each with its
`claimed` and `completed` events.

    bench/fill.py sqlite FILE N
    bench/fill.py postgres PSQL_CONNINFO N      (psql must be on PATH)
    bench/fill.py arm sqlite|postgres FILE|CONNINFO SECONDS

Prints one JSON line: {"records", "due_archive", "due_purge", "seconds", ...}.

Keys are UUID-shaped and spread evenly over the key space (the first 8 hex
digits are i * 2^32 / N), so the bench's random keys (bench/lua/post.lua, mode
`random`) land all over the primary key's B-tree, as clients' UUIDs do; they
are still generated in key order, so the load appends.

A day's worth of expiries for the sweeper, at the defaults (records live 1 day,
archived metadata is kept 30 days): in a store in its steady state of N records,
about N/31 expire and N/31 pass the audit retention each day. So every 31st
record expired a day ago and waits to be archived (`due_archive`), and every
31st is archived metadata past the retention, waiting to be purged with its
events (`due_purge`); the rest expire 4 to 24 hours from now. Until `arm`, the
times the sweeper looks at (`expires_at` of the first kind, `archived_at` of the
second and its events' `at`) are parked in 2100, so nothing is due: the
scenario runs new keys and replays with the sweeper off, then `arm` makes that
work due SECONDS from now, once the store with its sweeper is up and the load
is running, so all of it is done under load.

Secondary indexes are dropped before the load and built again after it (from
their own definitions), the way bulk loads are done; SQLite loads without a
journal, PostgreSQL with COPY, then VACUUM ANALYZE as autovacuum would.
"""
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time

DAY = 86_400_000
PARKED = 4_102_444_800_000  # 2100-01-01: not due before `arm`
TTL = DAY
RETENTION = 30 * DAY
FINGERPRINT = "58e4b21791cd5e778298ea3781819d359f7aa50730bf24d48a0300e6c34d681f"
ATTEMPT = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e"
HEADERS = '[["x-payment-id","pay_1_%d"],["content-type","application/json; charset=utf-8"]]'
BODY = '{"id":"pay_1_%d","amount":1000,"currency":"EUR","status":"succeeded"}'
RECORD_COLUMNS = (
    "scope_digest, scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint, fence, lease_until, "
    "ttl_ms, release_on_unknown, response_status, response_headers, response_body, body_stored, created_at, "
    "completed_at, expires_at, archived_at, replay_count, generation, attempt"
)
# An event row names its generation; the record holds its scope, attempt and
# fingerprint.
EVENT_COLUMNS = "generation, at, transition, fence, status, actor, detail, duration_ms"
# Each record's events, derived from the record by the database (so they carry
# exactly its columns): (transition, actor, at, status, which records).
EVENTS = (
    ("claimed", "filter", "created_at", "NULL", "TRUE"),
    ("completed", "filter", "completed_at", "response_status", "TRUE"),
    ("archived", "sweeper", "archived_at", "response_status", "archived_at IS NOT NULL"),
)


def records(n, now):
    """(kind, values) of record i, in key order; kind: live, archive, purge."""
    step = (1 << 32) // n if n else 0
    for i in range(n):
        frac = i / n
        kind = ("archive", "purge")[i % 31] if i % 31 < 2 else "live"
        if kind == "live":
            created = now - 20 * 3_600_000 + int(frac * 20 * 3_600_000) - 60_000
        elif kind == "archive":
            created = now - 2 * DAY + int(frac * DAY) - 60_000
        else:
            created = now - RETENTION - 2 * DAY + int(frac * DAY)
        completed = created + 15
        expires = PARKED if kind == "archive" else completed + TTL
        archived = PARKED if kind == "purge" else None
        scope = ("v1", "bench", "bench", "bench.create", "u", "%08x-0000-4000-8000-%012x" % (i * step, i))
        yield kind, (
            scope_digest(scope), *scope,
            "completed", FINGERPRINT, i + 1, completed, TTL, False, 201, HEADERS % i,
            None if kind == "purge" else BODY % i, True, created, completed, expires, archived, 0, i + 1,
            "%s-%x" % (ATTEMPT, i + 1),
        )


def scope_digest(parts):
    """The record's key, as the store computes it (Scope::digest): SHA-256 of
    each part's length (4 bytes, big-endian) and bytes."""
    encoded = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return hashlib.sha256(encoded).digest()


def sqlite_attempt(attempt):
    """A filter's attempt id (32 hex digits, `-`, a hex counter) as SQLite
    stores it: its 16 bytes, then the counter's big-endian bytes."""
    prefix, counter = attempt.split("-")
    n = int(counter, 16)
    return bytes.fromhex(prefix) + n.to_bytes(max(1, (n.bit_length() + 7) // 8), "big")


# SQLite keeps an event's transition, and the store's own actors, as codes
# (the store's `sqlite::stored`).
SQLITE_CODES = {"claimed": 0, "completed": 1, "archived": 8, "filter": 0, "sweeper": 1}


def events_sql(coded=False):
    out = []
    for transition, actor, at, status, which in EVENTS:
        if coded:
            transition, actor = SQLITE_CODES[transition], SQLITE_CODES[actor]
        else:
            transition, actor = f"'{transition}'", f"'{actor}'"
        out.append(
            f"INSERT INTO idempotency_events ({EVENT_COLUMNS}) SELECT "
            f"generation, CASE WHEN archived_at IS NULL THEN {at} ELSE {PARKED} END, "
            f"{transition}, fence, {status}, {actor}, NULL, "
            f"CASE WHEN archived_at IS NULL THEN {at} - created_at ELSE {DAY} END FROM idempotency_records WHERE {which}"
        )
    return out


def fill_sqlite(path, n, now):
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-262144;")
    indexes = db.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
        "AND tbl_name IN ('idempotency_records', 'idempotency_events')").fetchall()
    for name, _ in indexes:
        db.execute(f'DROP INDEX "{name}"')
    counts = {"live": 0, "archive": 0, "purge": 0}

    def rows():
        for kind, v in records(n, now):
            counts[kind] += 1
            v = list(v)
            v[15] = v[15].encode() if v[15] is not None else None  # the store writes bodies as BLOBs
            # and, on SQLite, fingerprints and the filter's attempt ids as bytes (its `sqlite::stored`)
            v[8] = bytes.fromhex(v[8])
            v[23] = sqlite_attempt(v[23])
            yield v

    db.execute("BEGIN")
    db.executemany(f"INSERT INTO idempotency_records ({RECORD_COLUMNS}) VALUES ({', '.join('?' * 24)})", rows())
    for sql in events_sql(coded=True):
        db.execute(sql)
    db.execute("UPDATE idempotency_fence SET value = ?1 WHERE id = 1", (n,))
    db.execute("COMMIT")
    for _, sql in indexes:
        db.execute(sql)
    db.executescript("PRAGMA journal_mode=WAL;")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    # Where the bytes go: every table and index, pages and all (summed here:
    # dbstat's own aggregate wraps at 4 GiB per object).
    objects = dict(db.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall())
    db.close()
    return counts, {"bytes": os.path.getsize(path), "objects": objects}


def psql(conninfo, sql, stdin=None):
    out = subprocess.run(["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", conninfo, "-c", sql],
                         input=stdin, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"fill: psql failed: {out.stderr.strip()}\n  {sql[:200]}")
    return out.stdout


def fill_postgres(conninfo, n, now):
    indexes = [line.split("|", 1) for line in psql(conninfo, (
        "SELECT i.relname, pg_get_indexdef(i.oid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "JOIN pg_class t ON t.oid = x.indrelid WHERE t.relname IN ('idempotency_records', 'idempotency_events') "
        "AND NOT x.indisprimary AND NOT x.indisunique")).splitlines() if line]
    psql(conninfo, "; ".join(f'DROP INDEX "{name}"' for name, _ in indexes) or "SELECT 1")
    counts = {"live": 0, "archive": 0, "purge": 0}
    proc = subprocess.Popen(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", conninfo, "-c",
                             f"COPY idempotency_records ({RECORD_COLUMNS}) FROM STDIN"],
                            stdin=subprocess.PIPE, text=True)
    text = lambda v: ("\\N" if v is None else "t" if v is True else "f" if v is False  # noqa: E731
                      else "\\\\x" + v.hex() if isinstance(v, bytes) else str(v))
    chunk = []
    for kind, v in records(n, now):
        counts[kind] += 1
        # COPY's text format; none of the values holds a tab, newline or backslash,
        # and bytea takes the body's printable ASCII as it is.
        chunk.append("\t".join(map(text, v)))
        if len(chunk) == 10_000:
            proc.stdin.write("\n".join(chunk) + "\n")
            chunk = []
    if chunk:
        proc.stdin.write("\n".join(chunk) + "\n")
    proc.stdin.close()
    if proc.wait():
        sys.exit("fill: COPY into idempotency_records failed")
    psql(conninfo, "BEGIN; " + "; ".join(events_sql()) + f"; SELECT setval('idempotency_fence_seq', {max(n, 1)}); COMMIT")
    for _, sql in indexes:
        psql(conninfo, "SET maintenance_work_mem = '256MB'; " + sql)
    psql(conninfo, "VACUUM ANALYZE idempotency_records")
    psql(conninfo, "VACUUM ANALYZE idempotency_events")
    size = psql(conninfo, "SELECT pg_total_relation_size('idempotency_records'), "
                          "pg_total_relation_size('idempotency_events')").strip().split("|")
    # Where the bytes go: each table (with its TOAST) and each index.
    objects = dict(
        (name, int(b)) for name, b in (line.split("|") for line in psql(conninfo, (
            "SELECT c.relname, CASE c.relkind WHEN 'i' THEN pg_relation_size(c.oid) "
            "ELSE pg_total_relation_size(c.oid) - pg_indexes_size(c.oid) END FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' "
            "AND c.relkind IN ('r', 'i') AND c.relname LIKE 'idempotency%'")).splitlines() if line))
    return counts, {"bytes": int(size[0]), "events_bytes": int(size[1]), "objects": objects}


def arm_sql(due):
    """Makes the parked work due at `due` (ms): expiries, and archived records
    (with their events) past the audit retention."""
    return [f"UPDATE idempotency_records SET expires_at = {due} WHERE archived_at IS NULL AND expires_at = {PARKED}",
            f"UPDATE idempotency_records SET archived_at = {due - RETENTION} WHERE archived_at = {PARKED}",
            f"UPDATE idempotency_events SET at = {due - RETENTION} WHERE at = {PARKED}"]


def arm(kind, where, seconds):
    t0 = time.monotonic()
    due = int(time.time() * 1000) + int(seconds * 1000)
    if kind == "sqlite":
        db = sqlite3.connect(where, isolation_level=None, timeout=30)
        db.execute("BEGIN IMMEDIATE")
        for sql in arm_sql(due):
            db.execute(sql)
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
    else:
        # A store in its steady state has statistics that know how much is
        # due; these moved from 2100 at once, so they are analyzed again.
        # (Planned on the fill's, the purge of the day's events took them
        # for 51 rows and hashed all 967,743 of them each batch.)
        psql(where, "BEGIN; " + "; ".join(arm_sql(due)) + "; COMMIT; ANALYZE idempotency_records, idempotency_events")
    print(json.dumps({"due_at_ms": due, "arm_seconds": round(time.monotonic() - t0, 1)}))


def main():
    if sys.argv[1] == "arm":
        arm(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    kind, where, n = sys.argv[1], sys.argv[2], int(float(sys.argv[3]))
    now = int(time.time() * 1000)
    t0 = time.monotonic()
    counts, sizes = (fill_sqlite if kind == "sqlite" else fill_postgres)(where, n, now)
    out = {"records": n, "due_archive": counts["archive"], "due_purge": counts["purge"],
           "seconds": round(time.monotonic() - t0, 1), **sizes}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
