-- Current records are keyed by their scope's digest (SHA-256 of the scope's
-- encoding, 32 bytes): a smaller primary key index than the six text
-- columns, whose first five are the same for every key of a tenant's route.
-- The scope columns stay, for operators. The digest of existing rows is
-- computed here exactly as the store computes it (Scope::digest): each
-- component's length as a big-endian 32-bit integer, then its UTF-8 bytes.
CREATE FUNCTION pg_temp.idemgate_part(part text) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT
    AS $$ SELECT int4send(octet_length(convert_to(part, 'UTF8'))) || convert_to(part, 'UTF8') $$;
CREATE FUNCTION pg_temp.idemgate_scope_digest(v text, t text, p text, r text, n text, k text) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT
    AS $$ SELECT sha256(pg_temp.idemgate_part(v) || pg_temp.idemgate_part(t) || pg_temp.idemgate_part(p)
                        || pg_temp.idemgate_part(r) || pg_temp.idemgate_part(n) || pg_temp.idemgate_part(k)) $$;

ALTER TABLE idempotency_records ADD COLUMN scope_digest BYTEA;
UPDATE idempotency_records
    SET scope_digest = pg_temp.idemgate_scope_digest(scope_version, tenant, principal, route, namespace, idem_key);
ALTER TABLE idempotency_records ALTER COLUMN scope_digest SET NOT NULL;
ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_scope_digest_length
    CHECK (octet_length(scope_digest) = 32);
ALTER TABLE idempotency_records DROP CONSTRAINT idempotency_records_pkey;
ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_pkey PRIMARY KEY (scope_digest);

-- Fewer secondary indexes on the write path: a claim maintains the key, the
-- in-progress index and (tenant, key); a completion the in-progress index
-- (the record leaves it) and the expiry index. Each index covers only the
-- rows its sweeper phase or listing reads: in-progress records by lease,
-- unknown ones by age, completed or unknown ones by expiry, archived ones by
-- archiving time.
DROP INDEX IF EXISTS idempotency_records_lease;
DROP INDEX IF EXISTS idempotency_records_created;
DROP INDEX IF EXISTS idempotency_records_expires;
CREATE INDEX idempotency_records_in_progress ON idempotency_records (lease_until) WHERE state = 'in_progress';
CREATE INDEX idempotency_records_unknown ON idempotency_records (created_at) WHERE state = 'unknown';
CREATE INDEX idempotency_records_expires ON idempotency_records (expires_at)
    WHERE archived_at IS NULL AND expires_at IS NOT NULL;

-- Abandoned attempts are found by the record's key too.
ALTER TABLE idempotency_abandoned ADD COLUMN scope_digest BYTEA;
UPDATE idempotency_abandoned
    SET scope_digest = pg_temp.idemgate_scope_digest(scope_version, tenant, principal, route, namespace, idem_key);
ALTER TABLE idempotency_abandoned ALTER COLUMN scope_digest SET NOT NULL;
ALTER TABLE idempotency_abandoned DROP CONSTRAINT idempotency_abandoned_pkey;
ALTER TABLE idempotency_abandoned ADD CONSTRAINT idempotency_abandoned_pkey PRIMARY KEY (scope_digest, attempt);

DROP FUNCTION pg_temp.idemgate_scope_digest(text, text, text, text, text, text);
DROP FUNCTION pg_temp.idemgate_part(text);
