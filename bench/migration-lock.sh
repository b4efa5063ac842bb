#!/usr/bin/env bash
# How long PostgreSQL migration 0004 (records keyed by their scope digest)
# locks the records table: a throwaway cluster at schema version 3 is filled
# with N records (default 10^6, each with a 256-byte stored response), then
# migration 0004 runs as `idempotency-store migrate` runs it (one
# transaction). Meanwhile a claim-like INSERT, started 0.5 s in, measures how
# long a claim waits for the lock. Then migration 0005 (a new column with a
# CHECK, which PostgreSQL verifies with a scan) is timed on the same rows.
# Prints one JSON line.
#
#   bench/migration-lock.sh [N]
#
# Not part of `make test`: filling 10^6 rows and rewriting them takes about a
# minute. CHANGELOG.md quotes its figures.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000000}
MIG=crates/store/src/postgres/migrations
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
[[ -x $PG_BIN/initdb ]] || { echo "migration-lock: no PostgreSQL server binaries (set PG_BIN)" >&2; exit 1; }
W=$(mktemp -d)
as_pg=()
if [[ $(id -u) == 0 ]]; then chown postgres "$W"; as_pg=(runuser -u postgres --); fi
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cleanup() { "${as_pg[@]}" "$PG_BIN/pg_ctl" -D "$W/data" -m immediate -w stop >/dev/null 2>&1 || true; rm -rf "$W"; }
trap cleanup EXIT
"${as_pg[@]}" "$PG_BIN/initdb" -D "$W/data" -A trust -U idem >/dev/null
"${as_pg[@]}" "$PG_BIN/pg_ctl" -D "$W/data" -l "$W/log" -w \
    -o "-p $PORT -k $W -c listen_addresses=127.0.0.1" start >/dev/null
psql() { "$PG_BIN/psql" -h 127.0.0.1 -p "$PORT" -U idem -d postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

# Schema version 3, as a store of that release left it.
{
    echo "BEGIN;"
    echo "CREATE TABLE idempotency_schema_migrations (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL);"
    cat "$MIG/0001_records.sql" "$MIG/0002_generations.sql" "$MIG/0003_event_reasons.sql"
    echo "INSERT INTO idempotency_schema_migrations VALUES (1, 0), (2, 0), (3, 0);"
    echo "COMMIT;"
} | psql -f - >/dev/null

fill_started=$(date +%s.%N)
psql -c "INSERT INTO idempotency_records (scope_version, tenant, principal, route, namespace, idem_key, state,
    fingerprint, fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers, response_body,
    body_stored, created_at, completed_at, expires_at, generation)
  SELECT 'v1', 'tenant-' || (i % 100), 'principal-' || (i % 1000), 'payments.create', 'u', md5(i::text) || '-key',
    'completed', md5((i * 7)::text) || md5((i * 11)::text), i, 1800000000000, 86400000, false, 201,
    '[[\"content-type\",\"application/json\"]]', convert_to(repeat(md5(i::text), 8), 'UTF8'), true,
    1800000000000, 1800000000001, 1800086400000, i
  FROM generate_series(1, $N) AS i" >/dev/null
psql -c "INSERT INTO idempotency_abandoned SELECT 'v1', 'tenant-0', 'principal-0', 'payments.create', 'u',
    md5(i::text) || '-key', 'attempt-' || i, 1800000000000 FROM generate_series(1, $N / 1000) AS i" >/dev/null
psql -c "VACUUM ANALYZE" >/dev/null
psql -c "CHECKPOINT" >/dev/null
fill_s=$(echo "$(date +%s.%N) - $fill_started" | bc)
size_before=$(psql -c "SELECT pg_total_relation_size('idempotency_records')")

# Migration 0004 as the store applies it: one transaction.
{
    echo "BEGIN;"
    echo "SELECT pg_advisory_xact_lock(7201865443);"
    cat "$MIG/0004_scope_digest.sql"
    echo "INSERT INTO idempotency_schema_migrations VALUES (4, 0);"
    echo "COMMIT;"
} >"$W/0004.sql"
started=$(date +%s.%N)
psql -f "$W/0004.sql" >/dev/null &
migration=$!
sleep 0.5
probe_started=$(date +%s.%N)
# A new key's claim: an insert into the records table.
psql -c "INSERT INTO idempotency_records (scope_version, tenant, principal, route, namespace, idem_key, state, fence,
    lease_until, ttl_ms, release_on_unknown, created_at)
  VALUES ('v1', 'tenant-probe', 'p', 'payments.create', 'u', 'probe', 'in_progress', 1, 0, 1000, false, 0)
  ON CONFLICT DO NOTHING" >/dev/null 2>&1 || true
probe_s=$(echo "$(date +%s.%N) - $probe_started" | bc)
wait "$migration"
migration_s=$(echo "$(date +%s.%N) - $started" | bc)
size_after=$(psql -c "SELECT pg_total_relation_size('idempotency_records')")
psql -c "VACUUM ANALYZE idempotency_records" >/dev/null
started=$(date +%s.%N)
{
    echo "BEGIN;"
    cat "$MIG/0005_response_keys.sql"
    echo "INSERT INTO idempotency_schema_migrations VALUES (5, 0);"
    echo "COMMIT;"
} | psql -f - >/dev/null
m5_s=$(echo "$(date +%s.%N) - $started" | bc)
version=$("$PG_BIN/postgres" --version | awk '{print $3}')
printf '{"records":%d,"fill_seconds":%.1f,"migration_0004_seconds":%.2f,"claim_blocked_seconds":%.2f,"records_bytes_before":%d,"records_bytes_after":%d,"migration_0005_seconds":%.2f,"postgres":"%s","cores":%d,"loadavg":"%s"}\n' \
    "$N" "$fill_s" "$migration_s" "$probe_s" "$size_before" "$size_after" "$m5_s" "$version" "$(nproc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
