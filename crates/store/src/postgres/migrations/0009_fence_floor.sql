-- Fences never go back. A database restored from a backup, or a standby
-- promoted before it had every commit, holds the fence sequence as it was
-- then, behind fences the lost commits had handed out; drawn again, such a
-- fence would let a late completion of a lost generation land on a new one.
-- The store calls this on every new connection (and PgBouncer's
-- connect_query may, for the server connections it makes): the sequence
-- moves up to this server's clock in microseconds when it is behind it.
-- Every fence drawn before a loss is below the clock of that moment (the
-- sequence moves one a claim, the clock a million a second), so none is
-- drawn again once a connection to the restored or promoted database has
-- called this. The advisory lock keeps two calls from setting the sequence
-- back below what the other handed out; SECURITY DEFINER lets the store's
-- role, which may only draw from the sequence, move it. A procedure: a
-- CALL is not planned, so never compiled by JIT.
CREATE PROCEDURE idempotency_fence_floor()
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off AS $$
DECLARE
    clock bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(7201865444);
    clock := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    IF nextval('idempotency_fence_seq') < clock THEN
        PERFORM setval('idempotency_fence_seq', clock);
    END IF;
END
$$;
CALL idempotency_fence_floor();
