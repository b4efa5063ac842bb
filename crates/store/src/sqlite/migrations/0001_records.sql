CREATE TABLE IF NOT EXISTS idempotency_records (
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
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_records_lease ON idempotency_records (state, lease_until);
CREATE INDEX IF NOT EXISTS idempotency_records_created ON idempotency_records (state, created_at);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at) WHERE archived_at IS NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_archived ON idempotency_records (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_tenant_key ON idempotency_records (tenant, idem_key);
CREATE TABLE IF NOT EXISTS idempotency_fence (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO idempotency_fence (id, value) VALUES (1, 0);
