-- pgbus schema, version 16: the size limit skips the text measure where it cannot matter.
--
-- Migration 14 measures every payload and headers as the JSON text a consumer receives
-- (`octet_length(payload::text)`), which serializes each document once more at insert:
-- about a tenth of a single-event publish (BENCHMARKS.md, "Hardening against a hostile
-- neighbour"). The text form can only be far larger than the stored form in two ways: a
-- compressed datum (copied as it is from another table) and numbers, whose text can be
-- some 8,200 times their stored bytes (1e131071 takes about 16 bytes in a jsonb array
-- and prints as 131,072 digits; no other element grows more than 6 times, a control
-- character's `\u0001`). So a pair of uncompressed documents of at most 512 stored bytes
-- prints as at most about 512 / 16 * 147,456 bytes (4.7 MB, below the 16 MiB limit),
-- and the constraint accepts it without serializing it; everything else is measured as
-- before. Whether a datum is compressed is `pg_column_compression`, new in PostgreSQL 14:
-- on 13 the constraint stays as migration 14 left it.
DO $$
BEGIN
    IF pg_catalog.current_setting('server_version_num')::pg_catalog.int4 OPERATOR(pg_catalog.>=) 140000 THEN
        EXECUTE $sql$
            ALTER TABLE pgbus.events
                DROP CONSTRAINT events_size_limit,
                ADD CONSTRAINT events_size_limit CHECK (
                    (pg_catalog.pg_column_compression(payload) IS NULL
                     AND pg_catalog.pg_column_compression(headers) IS NULL
                     AND pg_catalog.pg_column_size(payload)
                         OPERATOR(pg_catalog.+) pg_catalog.pg_column_size(headers)
                         OPERATOR(pg_catalog.<=) 512)
                    OR pg_catalog.octet_length(CAST(payload AS pg_catalog.text))
                       OPERATOR(pg_catalog.+) pg_catalog.octet_length(CAST(headers AS pg_catalog.text))
                       OPERATOR(pg_catalog.<=) 16777216) NOT VALID
        $sql$;
    END IF;
END
$$;
