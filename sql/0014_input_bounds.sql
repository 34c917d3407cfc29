-- pgbus schema, version 14: what goes into the log is bounded by what readers receive.
--
-- 1. The size limit measures the JSON text consumers receive. `events_size_limit`
--    measured pg_column_size, the stored size of the jsonb: for a value copied from a
--    table (INSERT ... SELECT, or COPY of a compressible document) that is its compressed
--    size, so a 64 MiB payload passed as a few hundred kilobytes; and a number such as
--    1e131071 is stored in a few bytes but sent as 131,072 digits. Now payload and
--    headers together are at most 16 MiB of jsonb's text form (`payload::text`), which is
--    what a consumer reads in either wire format. A CHECK holds for every writer: INSERT
--    in any form, COPY, MERGE, the publish functions. It costs one serialization of the
--    document per row written.
-- 2. Keys are bounded. Ordered subscriptions put an event's key in btree indexes (about
--    2.7 kB per entry at most): one over-long key made `subscriptions set --ordered` fail,
--    and once a subscription was ordered, the publish of such an event failed in the
--    fan-out, with every other subscription's delivery of it. aggregate_type and source
--    are at most 255 bytes, aggregate_id, ordering_key, correlation_id and causation_id
--    at most 512 bytes (the event id stays at 255): a key, explicit or "type:id", is then
--    at most 768 bytes. Rows written before this version are not rechecked; a key of
--    theirs longer than 768 bytes is ordered under its SHA-256 digest from now on
--    (pgbus.event_key), so it can be indexed.
-- 3. Invisible characters. Ids, keys, sources and names refuse Unicode's
--    Default_Ignorable_Code_Point set (soft hyphen, variation selectors, Hangul fillers,
--    tags, ...) and the line and paragraph separators, with the control characters; names
--    refuse every White_Space code point too (U+00A0 and the other spaces). The ranges
--    are the library's (`pgbus::is_invisible`), generated from the Unicode data, and a
--    test compares both with that data for every code point. In a database whose encoding
--    is not UTF8 only the ASCII control characters are refused, as before.
--
-- Every constraint is added NOT VALID: rows already in the log are not scanned, and are
-- delivered as they were.

SET LOCAL search_path = pg_catalog, pg_temp;

-- 1. The size limit, in bytes of JSON text.
ALTER TABLE pgbus.events
    DROP CONSTRAINT events_size_limit,
    ADD CONSTRAINT events_size_limit
        CHECK (pg_catalog.octet_length(CAST(payload AS pg_catalog.text))
               OPERATOR(pg_catalog.+) pg_catalog.octet_length(CAST(headers AS pg_catalog.text))
               OPERATOR(pg_catalog.<=) 16777216) NOT VALID;

-- 2. The bounds of keys and the other identifiers, one constraint per column so that the
-- error names it.
ALTER TABLE pgbus.events
    ADD CONSTRAINT events_aggregate_type_length
        CHECK (pg_catalog.octet_length(aggregate_type) OPERATOR(pg_catalog.<=) 255) NOT VALID,
    ADD CONSTRAINT events_aggregate_id_length
        CHECK (pg_catalog.octet_length(aggregate_id) OPERATOR(pg_catalog.<=) 512) NOT VALID,
    ADD CONSTRAINT events_ordering_key_length
        CHECK (pg_catalog.octet_length(ordering_key) OPERATOR(pg_catalog.<=) 512) NOT VALID,
    ADD CONSTRAINT events_source_length
        CHECK (pg_catalog.octet_length(source) OPERATOR(pg_catalog.<=) 255) NOT VALID,
    ADD CONSTRAINT events_correlation_id_length
        CHECK (pg_catalog.octet_length(correlation_id) OPERATOR(pg_catalog.<=) 512) NOT VALID,
    ADD CONSTRAINT events_causation_id_length
        CHECK (pg_catalog.octet_length(causation_id) OPERATOR(pg_catalog.<=) 512) NOT VALID;

-- The key an event is ordered by: the explicit key, else "aggregate_type:aggregate_id";
-- a key longer than 768 bytes (only a row written before version 14 can have one) as
-- 'sha256:' and the hex digest of its text. Inlined into the fan-out, replay and
-- configure_subscription, so no SET clause: every name is qualified instead.
CREATE OR REPLACE FUNCTION pgbus.event_key(ordering_key text, aggregate_type text, aggregate_id text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
             WHEN pg_catalog.octet_length(coalesce(ordering_key, aggregate_type
                                                   OPERATOR(pg_catalog.||) ':'
                                                   OPERATOR(pg_catalog.||) aggregate_id))
                  OPERATOR(pg_catalog.>) 768
             THEN 'sha256:' OPERATOR(pg_catalog.||)
                  pg_catalog.encode(pg_catalog.sha256(CAST(coalesce(ordering_key, aggregate_type
                                                   OPERATOR(pg_catalog.||) ':'
                                                   OPERATOR(pg_catalog.||) aggregate_id)
                                                 AS pg_catalog.bytea)), 'hex')
             ELSE coalesce(ordering_key, aggregate_type OPERATOR(pg_catalog.||) ':'
                                         OPERATOR(pg_catalog.||) aggregate_id)
           END
$$;

-- 3. The characters refused, as regular-expression brackets. `v_ids`: control
-- characters (C0 but NUL, DEL, C1), Default_Ignorable_Code_Point (DerivedCoreProperties.txt),
-- U+2028 and U+2029. `v_names` adds White_Space (PropList) and '*'.
-- Written with the regular expressions' \u and \U escapes (code points, in a UTF8
-- database), so that the constraints print readably.
DO $$
DECLARE
    v_ids text;
    v_names text;
BEGIN
    IF pg_catalog.current_setting('server_encoding') OPERATOR(pg_catalog.=) 'UTF8' THEN
        v_ids := E'\\u0001-\\u001f\\u007f-\\u009f'
              || E'\\u00ad\\u034f\\u061c\\u115f-\\u1160\\u17b4-\\u17b5\\u180b-\\u180f'
              || E'\\u200b-\\u200f\\u202a-\\u202e\\u2060-\\u206f\\u3164\\ufe00-\\ufe0f'
              || E'\\ufeff\\uffa0\\ufff0-\\ufff8\\U0001bca0-\\U0001bca3'
              || E'\\U0001d173-\\U0001d17a\\U000e0000-\\U000e0fff'
              || E'\\u2028-\\u2029';
        v_names := v_ids
              || E'\\u0009-\\u000d\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a'
              || E'\\u202f\\u205f\\u3000*';
    ELSE
        v_ids := E'\\u0001-\\u001f\\u007f';
        v_names := v_ids || '[:space:][:cntrl:]*';
    END IF;
    v_ids := '[' OPERATOR(pg_catalog.||) v_ids OPERATOR(pg_catalog.||) ']';
    v_names := '[' OPERATOR(pg_catalog.||) v_names OPERATOR(pg_catalog.||) ']';

    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION pgbus.visible_text(t text) RETURNS boolean
         LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pgbus, pg_temp
         AS %L', pg_catalog.format('SELECT t !~ %L', v_ids));
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION pgbus.valid_name(name text) RETURNS boolean
         LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pgbus, pg_temp
         AS %L',
        pg_catalog.format('SELECT octet_length(name) BETWEEN 1 AND 255 AND name !~ %L', v_names));

    -- The events' constraints spell the test out (migration 11: no function to inline
    -- for every INSERT statement).
    ALTER TABLE pgbus.events
        DROP CONSTRAINT events_event_name_check,
        DROP CONSTRAINT events_ids_visible;
    EXECUTE pg_catalog.format(
        'ALTER TABLE pgbus.events
           ADD CONSTRAINT events_event_name_check
             CHECK (pg_catalog.octet_length(event_name) BETWEEN 1 AND 255
                    AND event_name OPERATOR(pg_catalog.!~) %L) NOT VALID,
           ADD CONSTRAINT events_ids_visible
             CHECK ((id OPERATOR(pg_catalog.||) coalesce(correlation_id, %L)
                     OPERATOR(pg_catalog.||) coalesce(causation_id, %L)
                     OPERATOR(pg_catalog.||) coalesce(aggregate_type, %L)
                     OPERATOR(pg_catalog.||) coalesce(aggregate_id, %L)
                     OPERATOR(pg_catalog.||) coalesce(ordering_key, %L)
                     OPERATOR(pg_catalog.||) coalesce(source, %L))
                    OPERATOR(pg_catalog.!~) %L) NOT VALID',
        v_names, '', '', '', '', '', '', v_ids);
END
$$;
