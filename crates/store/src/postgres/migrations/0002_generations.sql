ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS generation BIGINT NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS attempt TEXT COLLATE "C" CHECK (attempt IS NULL OR octet_length(attempt) BETWEEN 1 AND 64);
UPDATE idempotency_records SET generation = fence;
CREATE TABLE IF NOT EXISTS idempotency_history (
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    state TEXT NOT NULL,
    fingerprint TEXT,
    fence BIGINT NOT NULL,
    lease_until BIGINT NOT NULL,
    ttl_ms BIGINT NOT NULL,
    release_on_unknown BOOLEAN NOT NULL,
    response_status INTEGER,
    response_headers TEXT,
    response_body BYTEA,
    body_stored BOOLEAN NOT NULL,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at BIGINT,
    archived_at BIGINT,
    replay_count BIGINT NOT NULL,
    generation BIGINT NOT NULL,
    attempt TEXT COLLATE "C",
    ended_at BIGINT NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, generation)
);
CREATE INDEX IF NOT EXISTS idempotency_history_ended ON idempotency_history (ended_at);
CREATE INDEX IF NOT EXISTS idempotency_history_tenant_key ON idempotency_history (tenant, idem_key);
CREATE TABLE IF NOT EXISTS idempotency_events (
    id BIGSERIAL PRIMARY KEY,
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    generation BIGINT NOT NULL,
    at BIGINT NOT NULL,
    transition TEXT NOT NULL,
    attempt TEXT,
    fence BIGINT NOT NULL,
    fingerprint TEXT,
    status INTEGER,
    actor TEXT NOT NULL,
    detail TEXT,
    duration_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_events_tenant_key ON idempotency_events (tenant, idem_key);
CREATE INDEX IF NOT EXISTS idempotency_events_at ON idempotency_events (at);
CREATE TABLE IF NOT EXISTS idempotency_abandoned (
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    attempt TEXT COLLATE "C" NOT NULL,
    at BIGINT NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, attempt)
);
