-- Stored responses may be sealed at rest (AES-256-GCM): the id of the key
-- that sealed a record's headers and body, NULL when they are plaintext.
-- Keys rotate without rewriting rows: each row names its own key.
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS response_key TEXT
    CHECK (response_key IS NULL OR octet_length(response_key) BETWEEN 1 AND 32);
ALTER TABLE idempotency_history ADD COLUMN IF NOT EXISTS response_key TEXT;
