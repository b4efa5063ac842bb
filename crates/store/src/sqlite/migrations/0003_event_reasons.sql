ALTER TABLE idempotency_events ADD COLUMN reason TEXT CHECK (reason IS NULL OR length(CAST(reason AS BLOB)) <= 4096);
