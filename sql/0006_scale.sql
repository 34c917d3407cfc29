-- pgbus schema, version 6: costs that follow the work, not the number of subscriptions.
--
-- Fan-out costs O(matching subscriptions), not O(subscriptions).
-- Until now every new event was tested against every pattern of every subscription:
-- with 10,000 subscriptions, publishing 100,000 events ran for minutes. The patterns are
-- now indexed: an exact name by equality, `prefix.*` by its prefix ('order.'), '*' as
-- the empty prefix. An event name probes the index once for itself and once for each
-- of its prefixes ('order.line.added': '', 'order.', 'order.line.'), so the cost follows
-- the name's depth and the subscriptions that match, whatever the number that do not.

CREATE TABLE pgbus.subscription_patterns (
    prefix       text    NOT NULL,  -- the exact name, or what a prefix pattern's names start with
    exact        boolean NOT NULL,
    subscription text    NOT NULL,
    PRIMARY KEY (prefix, exact, subscription)
);
CREATE INDEX subscription_patterns_subscription_idx
    ON pgbus.subscription_patterns (subscription);

-- A pattern as (prefix, exact): 'order.placed' -> ('order.placed', true); 'order.*' ->
-- ('order.', false); '*' -> ('', false).
CREATE FUNCTION pgbus.pattern_key(pattern text, OUT prefix text, OUT exact boolean)
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN pattern = '*' THEN ''
                WHEN right(pattern, 2) = '.*' THEN left(pattern, -1)
                ELSE pattern END,
           NOT (pattern = '*' OR right(pattern, 2) = '.*')
$$;

-- Keeps the index in step with pgbus.subscriptions, with the owner's rights (consumers
-- create and reconfigure subscriptions but cannot write the index directly).
CREATE FUNCTION pgbus.index_patterns() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM pgbus.subscription_patterns AS p WHERE p.subscription = OLD.name;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO pgbus.subscription_patterns (prefix, exact, subscription)
        SELECT DISTINCT k.prefix, k.exact, NEW.name
        FROM unnest(NEW.patterns) AS p(pattern), pgbus.pattern_key(p.pattern) AS k;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER subscriptions_index_patterns
    AFTER INSERT OR DELETE OR UPDATE OF name, patterns ON pgbus.subscriptions
    FOR EACH ROW EXECUTE FUNCTION pgbus.index_patterns();

INSERT INTO pgbus.subscription_patterns (prefix, exact, subscription)
SELECT DISTINCT k.prefix, k.exact, s.name
FROM pgbus.subscriptions AS s, unnest(s.patterns) AS p(pattern), pgbus.pattern_key(p.pattern) AS k;

-- What an event name probes: itself (exact), the empty prefix ('*'), and every prefix
-- that ends at a dot. A plain SQL function, inlined where it is called.
CREATE FUNCTION pgbus.name_keys(name text, OUT prefix text, OUT exact boolean)
RETURNS SETOF record
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT name, true
    UNION ALL
    SELECT '', false
    UNION ALL
    SELECT array_to_string(parts[1:i], '.') || '.', false
    FROM (SELECT string_to_array(name, '.') AS parts) AS s,
         generate_series(1, cardinality(parts) - 1) AS i
$$;

-- The indexed match: same contract as before, inlined into the fan-out's statements.
CREATE OR REPLACE FUNCTION pgbus.subscriptions_matching(event_name text)
RETURNS TABLE (subscription text, ordered boolean)
LANGUAGE sql STABLE AS $$
    SELECT s.name, s.ordered
    FROM pgbus.subscriptions AS s
    WHERE s.name IN (SELECT p.subscription
                     FROM pgbus.name_keys(subscriptions_matching.event_name) AS k
                     JOIN pgbus.subscription_patterns AS p
                       ON p.prefix = k.prefix AND p.exact = k.exact)
$$;

-- Operators read the index too (status); consumers need nothing new: the trigger writes it.

-- Dead letters of every subscription, oldest event first, a page at a time
-- (`pgbus dead list` without --subscription; with one, deliveries_dead_idx serves).
CREATE INDEX deliveries_dead_seq_idx ON pgbus.deliveries (event_seq, subscription)
    WHERE status = 'dead';
