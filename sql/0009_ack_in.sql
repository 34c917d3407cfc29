-- pgbus schema, version 9: completing a delivery inside the application's transaction.
--
-- pgbus.ack_in completes one delivery exactly as the acker's SETTLE statement does: it
-- calls pgbus.settle with one completion, so the lease fence (the same locked_by and
-- attempt), the deletion and, for an ordered subscription, the promotion of the key's
-- next delivery are the same code. It runs in the caller's transaction, so the caller's
-- writes and the completion commit together or not at all.
--
-- A stale lease (the delivery was reaped, or claimed again by another worker) raises
-- SQLSTATE PGB01: the caller's transaction is aborted, and its writes cannot commit
-- without the completion.
--
-- A promotion becomes visible when the caller commits, which no bus sees happen, so a
-- completion that promoted a key's next delivery always notifies the buses (pg_notify
-- is delivered at commit, and not at all on rollback).
CREATE FUNCTION pgbus.ack_in(
    p_subscription text, p_event_seq bigint, p_attempt integer, p_worker text)
RETURNS void
LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    v_kind text;
    v_promoted boolean := false;
BEGIN
    FOR v_kind IN
        SELECT s.kind FROM pgbus.settle(
            ARRAY[p_subscription], ARRAY[p_event_seq], ARRAY[p_attempt],
            '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', p_worker) AS s
    LOOP
        IF v_kind = 'ack' THEN
            RAISE EXCEPTION 'pgbus: the lease on delivery % of subscription % (attempt %) was lost',
                p_event_seq, p_subscription, p_attempt
                USING ERRCODE = 'PGB01',
                      HINT = 'The delivery was reaped or claimed again; it will be delivered again. Roll back.';
        ELSIF v_kind = 'promoted' THEN
            v_promoted := true;
        END IF;
    END LOOP;
    IF v_promoted THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
    END IF;
END
$$;
