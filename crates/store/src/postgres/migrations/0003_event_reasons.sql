ALTER TABLE idempotency_events ADD COLUMN IF NOT EXISTS reason TEXT CHECK (reason IS NULL OR octet_length(reason) <= 4096);
