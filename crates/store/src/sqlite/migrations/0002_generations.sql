ALTER TABLE idempotency_records ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN attempt TEXT CHECK (attempt IS NULL OR length(attempt) BETWEEN 1 AND 64);
UPDATE idempotency_records SET generation = fence;
CREATE TABLE IF NOT EXISTS idempotency_history (
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    state TEXT NOT NULL,
    fingerprint TEXT,
    fence INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    ttl_ms INTEGER NOT NULL,
    release_on_unknown INTEGER NOT NULL,
    response_status INTEGER,
    response_headers TEXT,
    response_body BLOB,
    body_stored INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    archived_at INTEGER,
    replay_count INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    attempt TEXT,
    ended_at INTEGER NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, generation)
);
CREATE INDEX IF NOT EXISTS idempotency_history_ended ON idempotency_history (ended_at);
CREATE INDEX IF NOT EXISTS idempotency_history_tenant_key ON idempotency_history (tenant, idem_key);
CREATE TABLE IF NOT EXISTS idempotency_events (
    id INTEGER PRIMARY KEY,
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    generation INTEGER NOT NULL,
    at INTEGER NOT NULL,
    transition TEXT NOT NULL,
    attempt TEXT,
    fence INTEGER NOT NULL,
    fingerprint TEXT,
    status INTEGER,
    actor TEXT NOT NULL,
    detail TEXT,
    duration_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_events_tenant_key ON idempotency_events (tenant, idem_key);
CREATE INDEX IF NOT EXISTS idempotency_events_at ON idempotency_events (at);
CREATE TABLE IF NOT EXISTS idempotency_abandoned (
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    attempt TEXT NOT NULL,
    at INTEGER NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, attempt)
);
