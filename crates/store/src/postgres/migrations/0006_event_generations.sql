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
--
-- The dropped columns take no time to drop: existing rows keep their bytes
-- until the sweeper purges them at the end of the audit retention (or a
-- VACUUM FULL rewrites the table); rows written from now on are small.
CREATE TABLE idempotency_purged_generations (
    generation BIGINT NOT NULL PRIMARY KEY,
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    attempt TEXT COLLATE "C",
    fingerprint TEXT
);
CREATE INDEX idempotency_purged_generations_tenant_key ON idempotency_purged_generations (tenant, idem_key);

-- Events whose generation has neither a record nor a history row any more.
INSERT INTO idempotency_purged_generations (generation, scope_version, tenant, principal, route, namespace,
    idem_key, attempt, fingerprint)
SELECT DISTINCT ON (generation) generation, scope_version, tenant, principal, route, namespace, idem_key, attempt,
    fingerprint
FROM idempotency_events e
WHERE NOT EXISTS (SELECT 1 FROM idempotency_records r WHERE r.generation = e.generation)
  AND NOT EXISTS (SELECT 1 FROM idempotency_history h WHERE h.generation = e.generation)
ORDER BY generation, id;

CREATE INDEX idempotency_events_generation ON idempotency_events (generation);
DROP INDEX IF EXISTS idempotency_events_tenant_key;
ALTER TABLE idempotency_events DROP COLUMN scope_version;
ALTER TABLE idempotency_events DROP COLUMN tenant;
ALTER TABLE idempotency_events DROP COLUMN principal;
ALTER TABLE idempotency_events DROP COLUMN route;
ALTER TABLE idempotency_events DROP COLUMN namespace;
ALTER TABLE idempotency_events DROP COLUMN idem_key;
ALTER TABLE idempotency_events DROP COLUMN attempt;
ALTER TABLE idempotency_events DROP COLUMN fingerprint;
