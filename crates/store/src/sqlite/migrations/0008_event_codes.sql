-- An event's transition is kept as a small integer code, and so is an
-- actor the store writes itself (filter, sweeper, operator); an operator's
-- name stays text (the store's `sqlite::stored` says which). About 14 bytes
-- an event. The table is rebuilt: its columns' TEXT affinity would turn a
-- code back into text. `actor` has none (BLOB), so a name stays text and a
-- code an integer. idemgate_stored_transition() and idemgate_stored_actor()
-- are registered by the store.
CREATE TABLE idempotency_events_0008 (
    id INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    at INTEGER NOT NULL,
    transition INTEGER NOT NULL,
    fence INTEGER NOT NULL,
    status INTEGER,
    actor BLOB NOT NULL,
    detail TEXT,
    duration_ms INTEGER NOT NULL,
    reason TEXT CHECK (reason IS NULL OR length(CAST(reason AS BLOB)) <= 4096)
);
INSERT INTO idempotency_events_0008 (id, generation, at, transition, fence, status, actor, detail, duration_ms, reason)
SELECT id, generation, at, idemgate_stored_transition(transition), fence, status, idemgate_stored_actor(actor),
    detail, duration_ms, reason
FROM idempotency_events ORDER BY id;
DROP TABLE idempotency_events;
ALTER TABLE idempotency_events_0008 RENAME TO idempotency_events;
CREATE INDEX idempotency_events_at ON idempotency_events (at);
CREATE INDEX idempotency_events_generation ON idempotency_events (generation);
