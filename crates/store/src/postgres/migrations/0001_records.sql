CREATE SEQUENCE IF NOT EXISTS idempotency_fence_seq;
CREATE TABLE IF NOT EXISTS idempotency_records (
    scope_version TEXT COLLATE "C" NOT NULL CHECK (octet_length(scope_version) BETWEEN 1 AND 16),
    tenant TEXT COLLATE "C" NOT NULL CHECK (octet_length(tenant) BETWEEN 1 AND 255),
    principal TEXT COLLATE "C" NOT NULL CHECK (octet_length(principal) BETWEEN 1 AND 255),
    route TEXT COLLATE "C" NOT NULL CHECK (octet_length(route) BETWEEN 1 AND 255),
    namespace TEXT COLLATE "C" NOT NULL CHECK (namespace IN ('u', 's')),
    idem_key TEXT COLLATE "C" NOT NULL CHECK (octet_length(idem_key) BETWEEN 1 AND 255),
    state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
    fingerprint TEXT CHECK (fingerprint IS NULL OR octet_length(fingerprint) = 64),
    fence BIGINT NOT NULL CHECK (fence > 0),
    lease_until BIGINT NOT NULL,
    ttl_ms BIGINT NOT NULL CHECK (ttl_ms >= 0),
    release_on_unknown BOOLEAN NOT NULL,
    response_status INTEGER CHECK (response_status IS NULL OR response_status BETWEEN 100 AND 999),
    response_headers TEXT CHECK (response_headers IS NULL OR octet_length(response_headers) <= 1048576),
    response_body BYTEA CHECK (response_body IS NULL OR octet_length(response_body) <= 67108864),
    body_stored BOOLEAN NOT NULL DEFAULT false,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at BIGINT,
    archived_at BIGINT,
    replay_count BIGINT NOT NULL DEFAULT 0 CHECK (replay_count >= 0),
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_records_lease ON idempotency_records (state, lease_until);
CREATE INDEX IF NOT EXISTS idempotency_records_created ON idempotency_records (state, created_at);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at) WHERE archived_at IS NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_archived ON idempotency_records (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_tenant_key ON idempotency_records (tenant, idem_key);
