-- pgbus schema, version 7: names and ids an operator can read as they are.
--
-- Event ids and the other identifiers of an event (correlation and causation ids,
-- aggregate type and id, ordering key, source), event and subscription names refuse
-- control characters (C0, DEL, C1) and the invisible characters that change how text
-- around them reads: bidirectional overrides and isolates, zero-width characters, the
-- byte order mark. An id that moves the cursor or reverses the text around it could make
-- `pgbus dead list` show one event as another. New rows only: rows already stored are
-- not rechecked (the command line escapes what it prints).

-- The characters refused, as a regular-expression bracket; in a database that is not
-- UTF8 only the control characters it can hold.
DO $$
DECLARE
    v_class text;
BEGIN
    IF pg_catalog.current_setting('server_encoding') = 'UTF8' THEN
        v_class := '[' || chr(1) || '-' || chr(31) || chr(127) || '-' || chr(159)
                   || chr(1564) || chr(6158) || chr(8203) || '-' || chr(8207)
                   || chr(8234) || '-' || chr(8238) || chr(8288) || '-' || chr(8297)
                   || chr(65279) || ']';
    ELSE
        v_class := '[' || chr(1) || '-' || chr(31) || chr(127) || ']';
    END IF;
    EXECUTE format(
        'CREATE FUNCTION pgbus.visible_text(t text) RETURNS boolean
         LANGUAGE sql IMMUTABLE PARALLEL SAFE AS %L',
        format('SELECT t !~ %L', v_class));
END
$$;

CREATE OR REPLACE FUNCTION pgbus.valid_name(name text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT octet_length(name) BETWEEN 1 AND 255 AND name !~ '[[:space:][:cntrl:]*]'
       AND pgbus.visible_text(name)
$$;

ALTER TABLE pgbus.events
    ADD CONSTRAINT events_ids_visible
        CHECK (pgbus.visible_text(id || coalesce(correlation_id, '') || coalesce(causation_id, '')
                                  || coalesce(aggregate_type, '') || coalesce(aggregate_id, '')
                                  || coalesce(ordering_key, '') || coalesce(source, '')))
        NOT VALID;
