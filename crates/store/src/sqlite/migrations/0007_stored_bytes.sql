-- Fingerprints and the filter's attempt ids are kept as bytes, not as the
-- text the API speaks: a fingerprint's 32 bytes instead of 64 hex digits,
-- and an attempt id of the filter's shape (32 hex digits, `-`, a hex
-- counter) as its 16 bytes and the counter's; any other attempt id stays
-- text (the store's `sqlite::stored` says which). The other tables' columns
-- take the new values in place. idemgate_stored_attempt() is registered by
-- the store.
--
-- The records' table is rebuilt, for its fingerprint CHECK and as a rowid
-- table in the order records were created (0004 made it WITHOUT ROWID): a
-- WITHOUT ROWID table's indexes each carry its 32-byte key, and its rows lie
-- in the key's random order, so the rows that a batch of completions or a
-- sweep writes each sit on a page of their own. Now rows lie in time order
-- and the indexes carry the rowid; the key is the primary key's own index.
CREATE TABLE idempotency_records_0007 (
    scope_digest BLOB NOT NULL PRIMARY KEY CHECK (length(scope_digest) = 32),
    scope_version TEXT NOT NULL CHECK (length(CAST(scope_version AS BLOB)) BETWEEN 1 AND 16),
    tenant TEXT NOT NULL CHECK (length(CAST(tenant AS BLOB)) BETWEEN 1 AND 255),
    principal TEXT NOT NULL CHECK (length(CAST(principal AS BLOB)) BETWEEN 1 AND 255),
    route TEXT NOT NULL CHECK (length(CAST(route AS BLOB)) BETWEEN 1 AND 255),
    namespace TEXT NOT NULL CHECK (namespace IN ('u', 's')),
    idem_key TEXT NOT NULL CHECK (length(CAST(idem_key AS BLOB)) BETWEEN 1 AND 255),
    state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
    fingerprint BLOB CHECK (fingerprint IS NULL OR length(fingerprint) = 32),
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
    -- Bytes or text; its length in bytes either way.
    attempt BLOB CHECK (attempt IS NULL OR length(CAST(attempt AS BLOB)) BETWEEN 1 AND 64),
    response_key TEXT CHECK (response_key IS NULL OR length(CAST(response_key AS BLOB)) BETWEEN 1 AND 32)
);
INSERT INTO idempotency_records_0007 (scope_digest, scope_version, tenant, principal, route, namespace, idem_key,
    state, fingerprint, fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers,
    response_body, body_stored, created_at, completed_at, expires_at, archived_at, replay_count, generation, attempt,
    response_key)
SELECT scope_digest, scope_version, tenant, principal, route, namespace, idem_key, state, unhex(fingerprint), fence,
    lease_until, ttl_ms, release_on_unknown, response_status, response_headers, response_body, body_stored,
    created_at, completed_at, expires_at, archived_at, replay_count, generation, idemgate_stored_attempt(attempt),
    response_key
FROM idempotency_records ORDER BY created_at;
DROP TABLE idempotency_records;
ALTER TABLE idempotency_records_0007 RENAME TO idempotency_records;
CREATE INDEX idempotency_records_in_progress ON idempotency_records (lease_until) WHERE state = 'in_progress';
CREATE INDEX idempotency_records_unknown ON idempotency_records (created_at) WHERE state = 'unknown';
CREATE INDEX idempotency_records_expires ON idempotency_records (expires_at)
    WHERE archived_at IS NULL AND expires_at IS NOT NULL;
CREATE INDEX idempotency_records_archived ON idempotency_records (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX idempotency_records_tenant_key ON idempotency_records (tenant, idem_key);

UPDATE idempotency_history SET fingerprint = unhex(fingerprint), attempt = idemgate_stored_attempt(attempt);
UPDATE idempotency_purged_generations
    SET fingerprint = unhex(fingerprint), attempt = idemgate_stored_attempt(attempt);
UPDATE idempotency_abandoned SET attempt = idemgate_stored_attempt(attempt);
