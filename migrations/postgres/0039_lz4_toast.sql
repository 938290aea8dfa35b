-- Issue 35: long texts are compressed with LZ4, not PostgreSQL's default pglz. A chat whose
-- answers are long carries them in every later prompt, and each model call journals its
-- whole request (`agent_step.input`), the answer goes to the step's output (or `step_blob`),
-- the task's result and the reply: every value over ~2 KB is compressed as it is written,
-- inside the worker's write transactions. An `end-to-end` run of 1,000 messages round 64
-- conversations with 10,000-character answers spent 15–17 ms of PostgreSQL CPU per message
-- with pglz, 8–9 ms with LZ4 (docs/benchmarks.md). Values already stored stay as they are
-- (PostgreSQL reads both); only the columns are changed, no table is rewritten.
--
-- LZ4 is there when the server was built with it (PostgreSQL 14 and later from Debian, the
-- PGDG packages and the common managed services are); a server without it keeps pglz and
-- says so in a NOTICE. Every text and JSON column of every table (a value under ~2 KB is
-- never compressed, so short ones are unaffected); a later migration's new long columns
-- name their compression themselves.
DO $$
DECLARE
    col RECORD;
BEGIN
    BEGIN
        PERFORM set_config('default_toast_compression', 'lz4', true);
    EXCEPTION WHEN OTHERS THEN
        RAISE NOTICE 'this server has no LZ4 compression: long texts stay compressed with pglz';
        RETURN;
    END;
    FOR col IN
        SELECT c.table_name, c.column_name FROM information_schema.columns c
        JOIN information_schema.tables t
            ON t.table_schema = c.table_schema AND t.table_name = c.table_name
        WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE'
          AND c.data_type IN ('text', 'json', 'jsonb') AND c.table_name NOT LIKE '\_sqlx%'
        ORDER BY 1, 2
    LOOP
        EXECUTE format('ALTER TABLE %I ALTER COLUMN %I SET COMPRESSION lz4',
            col.table_name, col.column_name);
    END LOOP;
END $$;
