-- pgbus schema, version 12: no function of pgbus resolves a name through its caller's
-- search_path.
--
-- PostgreSQL resolves an operator or function by looking through the search_path, and
-- an exact match of the argument types in any schema on the path beats a match in
-- pg_catalog that needs an implicit cast. `bigint * interval` (pg_catalog has only
-- `float8 * interval`), `numeric <= bigint`, `numeric * integer` are such: a role that
-- can create objects in a schema on the caller's path (`public` before PostgreSQL 15,
-- or a schema named after the caller, `"$user"`) could plant `*(bigint, interval)` and
-- have it run with the rights of whoever publishes or consumes, a superuser included.
--
-- 1. Every function of pgbus runs with `search_path = pg_catalog, pgbus, pg_temp`
--    (pg_temp last: nobody else's temporary objects are ever found first, and
--    functions and operators are never looked up in pg_temp), except the few below.
-- 2. The exceptions are the functions on the hot path whose cost a SET clause would
--    raise: SQL functions that PostgreSQL inlines into the statement that calls them
--    (a SET clause prevents inlining) and small helpers called once per statement or
--    per row. They are immune instead: every function is called as pg_catalog.f, every
--    operator as OPERATOR(pg_catalog.op), every type and relation is schema-qualified,
--    and no construct that looks an operator up by name (IN, IS DISTINCT FROM, a bare
--    `=`) is used. The list is closed: tests/hostile_neighbour.rs fails on any other
--    function without the pinned path.
--
-- Stored expressions (CHECK constraints, defaults, trigger conditions) were bound to
-- their operators when they were created; migrate runs every migration with the pinned
-- search_path, so they are bound to pg_catalog's.

-- 2. The immune functions, with the same semantics as before.

-- A UUIDv7 (the default of events.id).
CREATE OR REPLACE FUNCTION pgbus.uuid_v7() RETURNS pg_catalog.uuid
LANGUAGE sql PARALLEL SAFE AS $$
    SELECT pg_catalog.encode(
        pg_catalog.set_bit(pg_catalog.set_bit(
            overlay(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                    placing substring(pg_catalog.int8send(pg_catalog.int8(
                        extract(epoch FROM pg_catalog.clock_timestamp())
                        OPERATOR(pg_catalog.*) 1000)) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::pg_catalog.uuid
$$;

-- An event's ordering key (inlined into the fan-out).
CREATE OR REPLACE FUNCTION pgbus.event_key(ordering_key text, aggregate_type text, aggregate_id text)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT COALESCE(ordering_key,
                    aggregate_type OPERATOR(pg_catalog.||) ':' OPERATOR(pg_catalog.||) aggregate_id)
$$;

-- The keys of subscription_patterns an event name matches (inlined into the fan-out).
CREATE OR REPLACE FUNCTION pgbus.name_keys(name text, OUT prefix text, OUT exact boolean)
RETURNS SETOF record LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT name, true
    UNION ALL
    SELECT '', false
    UNION ALL
    SELECT pg_catalog.array_to_string(parts[1:i], '.') OPERATOR(pg_catalog.||) '.', false
    FROM (SELECT pg_catalog.string_to_array(name, '.') AS parts) AS s,
         pg_catalog.generate_series(1, pg_catalog.cardinality(parts) OPERATOR(pg_catalog.-) 1) AS i
$$;

-- The subscriptions whose patterns match an event name (inlined into the fan-out).
-- `= ANY (subquery)` is what `IN (subquery)` stands for, with the operator named.
CREATE OR REPLACE FUNCTION pgbus.subscriptions_matching(event_name text)
RETURNS TABLE (subscription text, ordered boolean) LANGUAGE sql STABLE AS $$
    SELECT s.name, s.ordered
    FROM pgbus.subscriptions AS s
    WHERE s.name OPERATOR(pg_catalog.=) ANY (
        SELECT p.subscription
        FROM pgbus.name_keys(subscriptions_matching.event_name) AS k
        JOIN pgbus.subscription_patterns AS p
          ON p.prefix OPERATOR(pg_catalog.=) k.prefix AND p.exact OPERATOR(pg_catalog.=) k.exact)
$$;

-- Whether a pattern matches an event name (once per event and pattern in a replay).
CREATE OR REPLACE FUNCTION pgbus.pattern_matches(pattern text, event_name text)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pattern OPERATOR(pg_catalog.=) '*'
        OR pattern OPERATOR(pg_catalog.=) event_name
        OR (pg_catalog."right"(pattern, 2) OPERATOR(pg_catalog.=) '.*'
            AND pg_catalog.starts_with(event_name, pg_catalog."left"(pattern, -1)))
$$;

-- The next delivery of a key (called per settled head).
CREATE OR REPLACE FUNCTION pgbus.next_of_key(p_subscription text, p_key text)
RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT n.event_seq FROM pgbus.deliveries AS n
    WHERE n.subscription OPERATOR(pg_catalog.=) p_subscription
      AND n.ordering_key OPERATOR(pg_catalog.=) p_key
      AND NOT n.is_head AND n.status OPERATOR(pg_catalog.=) 'pending'
    ORDER BY n.key_pos, n.event_seq
    LIMIT 1
$$;

-- The key locks of the fan-out and of settlements: the same locks, in the same order.
-- The two-array unnest in FROM stands for ROWS FROM of two one-array unnests.
CREATE OR REPLACE FUNCTION pgbus.lock_keys(subs text[], keys text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(h)
    FROM (SELECT DISTINCT pg_catalog.hashtextextended(
                     s OPERATOR(pg_catalog.||) pg_catalog.chr(31) OPERATOR(pg_catalog.||) k,
                     7305) AS h
          FROM ROWS FROM (pg_catalog.unnest(subs), pg_catalog.unnest(keys)) AS t(s, k)
          WHERE k IS NOT NULL
          ORDER BY 1) AS sorted;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.require_read_committed(what text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation')
       OPERATOR(pg_catalog.<>) 'read committed' THEN
        RAISE EXCEPTION '% must run in a READ COMMITTED transaction (this one is %)',
            what, pg_catalog.current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
END
$$;

-- pgbus.lock_config is immune as migration 5 wrote it: a boolean test and two calls of
-- pg_catalog functions with a bigint constant.

-- 1. Every other function: the pinned search_path, added to its settings (jit = off,
-- plan_cache_mode) without redefining it. A function that already pins one keeps it.
DO $$
DECLARE
    v_fn record;
BEGIN
    FOR v_fn IN
        SELECT p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid) AS args
        FROM pg_catalog.pg_proc AS p
        WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pgbus'::pg_catalog.regnamespace
          AND p.prokind OPERATOR(pg_catalog.=) 'f'
          AND NOT (p.proname OPERATOR(pg_catalog.=) ANY (ARRAY[
                   'uuid_v7', 'event_key', 'name_keys', 'subscriptions_matching',
                   'pattern_matches', 'next_of_key', 'lock_keys', 'require_read_committed',
                   'lock_config']::pg_catalog.name[]))
          AND NOT COALESCE(p.proconfig, '{}') OPERATOR(pg_catalog.@>)
                  ARRAY['search_path=pg_catalog, pgbus, pg_temp']::pg_catalog.text[]
        ORDER BY 1, 2
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION pgbus.%I(%s) SET search_path = pg_catalog, pgbus, pg_temp',
                                  v_fn.proname, v_fn.args);
    END LOOP;
END
$$;
