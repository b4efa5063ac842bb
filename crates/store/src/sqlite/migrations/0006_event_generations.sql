-- An event names its generation instead of copying the generation's scope,
-- attempt and fingerprint: a generation is the fence its claim drew, and
-- fences are drawn once, so the number alone names one generation of one
-- key. Its record (while current) or its history row (once ended) holds
-- the rest; the audit finds a key's generations through their (tenant, key)
-- indexes and the events through the events' generation index, which grows
-- at its end as fences do. The events' own (tenant, key) index goes.
--
-- A generation purged while some of its events remain (the sweeper takes
-- records, history and events past the retention in separate batches) keeps
-- its scope, attempt and fingerprint in idempotency_purged_generations, for
-- those events, until they are purged too.
CREATE TABLE idempotency_purged_generations (
    generation INTEGER NOT NULL PRIMARY KEY,
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    attempt TEXT,
    fingerprint TEXT
);
CREATE INDEX idempotency_purged_generations_tenant_key ON idempotency_purged_generations (tenant, idem_key);

-- Events whose generation has neither a record nor a history row any more.
INSERT OR IGNORE INTO idempotency_purged_generations (generation, scope_version, tenant, principal, route,
    namespace, idem_key, attempt, fingerprint)
SELECT generation, scope_version, tenant, principal, route, namespace, idem_key, attempt, fingerprint
FROM idempotency_events
WHERE generation NOT IN (SELECT generation FROM idempotency_records UNION ALL SELECT generation FROM idempotency_history)
ORDER BY id;

CREATE TABLE idempotency_events_0006 (
    id INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    at INTEGER NOT NULL,
    transition TEXT NOT NULL,
    fence INTEGER NOT NULL,
    status INTEGER,
    actor TEXT NOT NULL,
    detail TEXT,
    duration_ms INTEGER NOT NULL,
    reason TEXT CHECK (reason IS NULL OR length(CAST(reason AS BLOB)) <= 4096)
);
INSERT INTO idempotency_events_0006 (id, generation, at, transition, fence, status, actor, detail, duration_ms, reason)
SELECT id, generation, at, transition, fence, status, actor, detail, duration_ms, reason FROM idempotency_events;
DROP TABLE idempotency_events;
ALTER TABLE idempotency_events_0006 RENAME TO idempotency_events;
CREATE INDEX idempotency_events_at ON idempotency_events (at);
CREATE INDEX idempotency_events_generation ON idempotency_events (generation);
