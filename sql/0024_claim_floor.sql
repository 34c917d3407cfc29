-- pgbus schema, version 24: a claim that starts where work can be, so that a transaction
-- held open elsewhere costs it little.
--
-- A claim scanned its subscription's due deliveries from the oldest. Every delivery
-- claimed since the oldest open transaction began left an index entry there that points
-- at a row version no longer pending but not yet removable (the xmin horizon holds it), and
-- the scan visited each of them, every claim: behind a session idle in transaction for ten
-- minutes at 200 events a second, 120,000 of them (docs/ARCHITECTURE.md, "A claim behind
-- a long transaction").
--
-- 1. Each delivery records when it became claimable (`ready_at`): the later of its due
--    time and the clock when it was written pending at the head of its key. A trigger
--    sets it on every write that makes a delivery claimable (an insert, a promotion, a
--    retry, a reap, an operator's retry, a row written by SQL), so no writer can leave it
--    behind; an insert with the column's default (the clock) needs no trigger call.
-- 2. The claim index orders by it (`deliveries_ready_idx`), and the claim takes a lower
--    bound per subscription (a floor): every claimable delivery has `ready_at` at or above
--    it. The claim returns the next floors: five seconds before its own start when it took
--    everything it saw, or the oldest it took when it was full. A writer's delivery is
--    at least as late as the clock when it was written, which is at most five seconds
--    before its commit for any of pgbus's own writes; the bus claims without a floor every
--    thirty seconds and at start, which finds whatever a slower writer left below one.
-- 3. The old index stays: the next due time, the backlog gauges and `status` read
--    deliveries by due time.
--
-- Every statement can run again.

ALTER TABLE pgbus.deliveries ADD COLUMN IF NOT EXISTS ready_at timestamptz;
-- For new rows only (no rewrite of the table).
ALTER TABLE pgbus.deliveries ALTER COLUMN ready_at SET DEFAULT pg_catalog.clock_timestamp();

-- Deliveries pending before this migration keep their order: claimable since they were due.
UPDATE pgbus.deliveries SET ready_at = available_at
WHERE status = 'pending' AND ready_at IS NULL;

CREATE OR REPLACE FUNCTION pgbus.ready_at() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    NEW.ready_at := greatest(NEW.available_at, clock_timestamp());
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.ready_at() FROM PUBLIC;

-- Inserted at the head with a due time after the default's clock (a scheduled event), or
-- with no time at all; updated into the claimable state, or claimable with a new due time.
DROP TRIGGER IF EXISTS deliveries_ready_insert ON pgbus.deliveries;
CREATE TRIGGER deliveries_ready_insert BEFORE INSERT ON pgbus.deliveries
    FOR EACH ROW
    WHEN (NEW.status = 'pending' AND NEW.is_head
          AND (NEW.ready_at IS NULL OR NEW.ready_at < NEW.available_at))
    EXECUTE FUNCTION pgbus.ready_at();
DROP TRIGGER IF EXISTS deliveries_ready_update ON pgbus.deliveries;
CREATE TRIGGER deliveries_ready_update BEFORE UPDATE ON pgbus.deliveries
    FOR EACH ROW
    WHEN (NEW.status = 'pending' AND NEW.is_head
          AND (OLD.status <> 'pending' OR NOT OLD.is_head
               OR NEW.available_at IS DISTINCT FROM OLD.available_at
               OR NEW.ready_at IS NULL OR NEW.ready_at < NEW.available_at))
    EXECUTE FUNCTION pgbus.ready_at();

-- A pending delivery always has one (the trigger and the default give it): a write that
-- went around both (triggers disabled) is refused, not left where no claim looks.
ALTER TABLE pgbus.deliveries DROP CONSTRAINT IF EXISTS deliveries_ready_check;
ALTER TABLE pgbus.deliveries ADD CONSTRAINT deliveries_ready_check
    CHECK (status <> 'pending' OR ready_at IS NOT NULL);

CREATE INDEX IF NOT EXISTS deliveries_ready_idx
    ON pgbus.deliveries (subscription, ready_at, event_seq)
    WHERE status = 'pending' AND is_head;

-- The claim with floors ($8, one per subscription of $1, NULL for none): the library's
-- CLAIM statement (a test compares them), with a plan built once per session.
CREATE OR REPLACE FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer,
                                           bigint, timestamptz[])
RETURNS TABLE (secs float8, subscription text, attempts integer, seq bigint, id text,
               event_name text, event_version integer, source text, aggregate_type text,
               aggregate_id text, correlation_id text, causation_id text,
               occurred_at timestamptz, payload jsonb, headers jsonb, created_at timestamptz,
               ordering_key text, waited float8, cut boolean, floors timestamptz[])
LANGUAGE plpgsql SECURITY DEFINER SET plan_cache_mode = force_generic_plan SET jit = off
SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
#variable_conflict use_column
BEGIN
RETURN QUERY
WITH subs AS (
  SELECT * FROM unnest($1::text[], $2::int4[], $8::timestamptz[]) WITH ORDINALITY
    AS s(name, quota, floor, ord)
),
candidates AS (
  SELECT p.row_id, p.subscription, p.event_seq, p.ready_at
  FROM subs CROSS JOIN LATERAL (
    SELECT d.ctid AS row_id, d.subscription, d.event_seq, d.ready_at
    FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
      AND d.ready_at >= coalesce(subs.floor, '-infinity')
      AND d.ready_at <= now() + interval '1 second'
      AND d.available_at <= now()
    ORDER BY d.ready_at, d.event_seq
    LIMIT subs.quota
    FOR UPDATE SKIP LOCKED
  ) AS p
),
picked AS (
  SELECT c.row_id, c.subscription, c.event_seq, c.ready_at FROM candidates AS c
  ORDER BY c.ready_at, c.event_seq
  LIMIT $3
),
sized AS (
  SELECT p.row_id, p.subscription, p.event_seq,
         row_number() OVER w AS n,
         sum(coalesce((SELECT pg_column_size(e.payload)::int8 + pg_column_size(e.headers)
                       FROM pgbus.events AS e WHERE e.seq = p.event_seq), 0)) OVER w AS bytes
  FROM picked AS p
  WINDOW w AS (ORDER BY p.ready_at, p.event_seq, p.subscription
               ROWS UNBOUNDED PRECEDING)
),
kept AS (
  SELECT row_id FROM sized WHERE n = 1 OR bytes <= $7::int8
),
claimed AS (
  UPDATE pgbus.deliveries AS d
  SET status = 'processing',
      attempts = d.attempts + 1,
      locked_until = now() + $4 * interval '1 millisecond',
      locked_by = $5
  WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM kept))
  RETURNING d.subscription, d.event_seq, d.attempts, d.available_at, d.ready_at
),
awake AS (
  UPDATE pgbus.consumers SET awake = true
  WHERE id = $5 AND NOT awake AND (SELECT count(*) FROM claimed) >= $6
  RETURNING 1
),
whole AS (
  SELECT (SELECT count(*) FROM candidates) = (SELECT count(*) FROM kept) AS took_all
),
floors AS (
  SELECT array_agg(
           CASE WHEN whole.took_all
                     AND (SELECT count(*) FROM candidates AS c
                          WHERE c.subscription = subs.name) < subs.quota
                  THEN now() - interval '5 seconds'
                WHEN EXISTS (SELECT 1 FROM claimed AS c WHERE c.subscription = subs.name)
                  THEN least((SELECT min(c.ready_at) FROM claimed AS c
                              WHERE c.subscription = subs.name),
                             now() - interval '5 seconds')
                ELSE subs.floor
           END ORDER BY subs.ord) AS floors
  FROM subs CROSS JOIN whole
),
next_due AS (
  SELECT extract(epoch FROM min(n.available_at) - now())::float8 AS secs
  FROM subs CROSS JOIN LATERAL (
    SELECT d.available_at FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
      AND d.available_at > now() AND d.available_at < 'infinity'
    ORDER BY d.available_at, d.event_seq
    LIMIT 1
  ) AS n
)
SELECT next_due.secs, c.subscription, c.attempts,
       e.seq, e.id, e.event_name, e.event_version, e.source, e.aggregate_type,
       e.aggregate_id, e.correlation_id, e.causation_id, e.occurred_at, e.payload,
       e.headers, e.created_at, e.ordering_key,
       (extract(epoch FROM now()) - extract(epoch FROM c.available_at))::float8 AS waited,
       (SELECT count(*) FROM sized) > (SELECT count(*) FROM kept) AS cut,
       floors.floors
FROM next_due CROSS JOIN floors
LEFT JOIN (claimed AS c JOIN pgbus.events AS e ON e.seq = c.event_seq) ON true
ORDER BY e.seq;
END
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer,
                                           bigint, timestamptz[]) FROM PUBLIC;

-- What consumers call: cut a batch, then claim (migration 18's pgbus.claim, with floors).
CREATE OR REPLACE FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint,
                                       timestamptz[])
RETURNS TABLE (secs float8, subscription text, attempts integer, seq bigint, id text,
               event_name text, event_version integer, source text, aggregate_type text,
               aggregate_id text, correlation_id text, causation_id text,
               occurred_at timestamptz, payload jsonb, headers jsonb, created_at timestamptz,
               ordering_key text, waited float8, cut boolean, floors timestamptz[])
LANGUAGE plpgsql SECURITY DEFINER SET jit = off
SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
BEGIN
    PERFORM pgbus.fan_out_committed();
    RETURN QUERY SELECT * FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7, $8);
END
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint,
                                       timestamptz[]) FROM PUBLIC;

-- Whoever may claim may claim with floors. The claim without them stays (a bus of the
-- previous release keeps running during an upgrade), reading by due time as before.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS role
        FROM pg_catalog.pg_proc AS p,
             pg_catalog.aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)'::regprocedure
          AND a.grantee <> 0 AND a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.claim(text[], integer[], integer, '
                       'bigint, text, integer, bigint, timestamptz[]) TO %s', r.role);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.grant_consumer(consumer regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', consumer);
    EXECUTE format('GRANT SELECT ON pgbus.events, pgbus.settings, pgbus.deliveries, '
                   'pgbus.delivery_failures, pgbus.consumers, pgbus.subscriptions, '
                   'pgbus.leader TO %s',
                   consumer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION '
                   'pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint), '
                   'pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint, '
                   'timestamptz[]), '
                   'pgbus.settle(text[], bigint[], integer[], text[], bigint[], integer[], '
                   'text[], bigint[], boolean[], text[], bigint[], integer[], text), '
                   'pgbus.ack_in(text, bigint, integer, text), '
                   'pgbus.reap(integer), '
                   'pgbus.promote_orphans(integer), '
                   'pgbus.mark_asleep(text), '
                   'pgbus.extend_leases(text[], bigint[], integer[], bigint, text), '
                   'pgbus.heartbeat(text, bigint, text[], text, boolean), '
                   'pgbus.beat(text, bigint, text[], text, boolean, bigint), '
                   'pgbus.leave(text), '
                   'pgbus.resign(text), '
                   'pgbus.join_subscription(text, text[], integer, boolean, text), '
                   'pgbus.sweep(bigint, integer, bigint) TO %s', consumer);
END
$$;
