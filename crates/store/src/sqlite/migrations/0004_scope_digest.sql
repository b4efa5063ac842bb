-- Current records are keyed by their scope's digest (SHA-256 of the scope's
-- encoding, 32 bytes) in a WITHOUT ROWID table: a lookup descends one B-tree
-- and compares 32 bytes, instead of descending the six-column text key's
-- index and then the table. The scope columns stay, for operators.
--
-- Fewer secondary indexes on the write path: a claim maintains the key, the
-- in-progress index and (tenant, key); a completion the key, the in-progress
-- index (the record leaves it) and the expiry index. Each index covers only
-- the rows its sweeper phase or listing reads: in-progress records by lease,
-- unknown ones by age, completed or unknown ones by expiry, archived ones by
-- archiving time.
--
-- idemgate_scope_digest() is registered by the store on its connections; it
-- computes what the store binds for every current record (Scope::digest).
CREATE TABLE idempotency_records_0004 (
    scope_digest BLOB NOT NULL PRIMARY KEY CHECK (length(scope_digest) = 32),
    scope_version TEXT NOT NULL CHECK (length(CAST(scope_version AS BLOB)) BETWEEN 1 AND 16),
    tenant TEXT NOT NULL CHECK (length(CAST(tenant AS BLOB)) BETWEEN 1 AND 255),
    principal TEXT NOT NULL CHECK (length(CAST(principal AS BLOB)) BETWEEN 1 AND 255),
    route TEXT NOT NULL CHECK (length(CAST(route AS BLOB)) BETWEEN 1 AND 255),
    namespace TEXT NOT NULL CHECK (namespace IN ('u', 's')),
    idem_key TEXT NOT NULL CHECK (length(CAST(idem_key AS BLOB)) BETWEEN 1 AND 255),
    state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
    fingerprint TEXT CHECK (fingerprint IS NULL OR length(fingerprint) = 64),
    fence INTEGER NOT NULL CHECK (fence > 0),
    lease_until INTEGER NOT NULL,
    ttl_ms INTEGER NOT NULL CHECK (ttl_ms >= 0),
    release_on_unknown INTEGER NOT NULL CHECK (release_on_unknown IN (0, 1)),
    response_status INTEGER CHECK (response_status IS NULL OR response_status BETWEEN 100 AND 999),
    response_headers TEXT CHECK (response_headers IS NULL OR length(CAST(response_headers AS BLOB)) <= 1048576),
    response_body BLOB CHECK (response_body IS NULL OR length(response_body) <= 67108864),
    body_stored INTEGER NOT NULL DEFAULT 0 CHECK (body_stored IN (0, 1)),
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    archived_at INTEGER,
    replay_count INTEGER NOT NULL DEFAULT 0 CHECK (replay_count >= 0),
    generation INTEGER NOT NULL DEFAULT 0,
    attempt TEXT CHECK (attempt IS NULL OR length(attempt) BETWEEN 1 AND 64)
) WITHOUT ROWID;
INSERT INTO idempotency_records_0004 (scope_digest, scope_version, tenant, principal, route, namespace, idem_key,
    state, fingerprint, fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers,
    response_body, body_stored, created_at, completed_at, expires_at, archived_at, replay_count, generation, attempt)
SELECT idemgate_scope_digest(scope_version, tenant, principal, route, namespace, idem_key), scope_version, tenant,
    principal, route, namespace, idem_key, state, fingerprint, fence, lease_until, ttl_ms, release_on_unknown,
    response_status, response_headers, response_body, body_stored, created_at, completed_at, expires_at, archived_at,
    replay_count, generation, attempt
FROM idempotency_records;
DROP TABLE idempotency_records;
ALTER TABLE idempotency_records_0004 RENAME TO idempotency_records;
CREATE INDEX idempotency_records_in_progress ON idempotency_records (lease_until) WHERE state = 'in_progress';
CREATE INDEX idempotency_records_unknown ON idempotency_records (created_at) WHERE state = 'unknown';
CREATE INDEX idempotency_records_expires ON idempotency_records (expires_at)
    WHERE archived_at IS NULL AND expires_at IS NOT NULL;
CREATE INDEX idempotency_records_archived ON idempotency_records (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX idempotency_records_tenant_key ON idempotency_records (tenant, idem_key);

-- Abandoned attempts are found by the record's key too.
CREATE TABLE idempotency_abandoned_0004 (
    scope_digest BLOB NOT NULL CHECK (length(scope_digest) = 32),
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    attempt TEXT NOT NULL,
    at INTEGER NOT NULL,
    PRIMARY KEY (scope_digest, attempt)
);
INSERT OR IGNORE INTO idempotency_abandoned_0004 (scope_digest, scope_version, tenant, principal, route, namespace,
    idem_key, attempt, at)
SELECT idemgate_scope_digest(scope_version, tenant, principal, route, namespace, idem_key), scope_version, tenant,
    principal, route, namespace, idem_key, attempt, at
FROM idempotency_abandoned;
DROP TABLE idempotency_abandoned;
ALTER TABLE idempotency_abandoned_0004 RENAME TO idempotency_abandoned;
