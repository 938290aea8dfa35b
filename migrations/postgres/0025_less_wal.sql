-- Less WAL per answered message (issue 35 part 2; docs/benchmarks.md has the figures by
-- relation, from scripts/wal-by-relation.sh). Nothing here changes what is counted or kept.

-- 1. The rollups are kept per statement, not per row. A batch that finishes 30 tasks of one
-- agent and platform adds 30 to one cell in one upsert instead of 30 upserts of it (each a
-- row lock and a new row version in the WAL), and so do the answers it inserts and marks
-- delivered. The row triggers of 0022/0023 are replaced by statement triggers that read the
-- statement's transition tables; they count exactly what the row triggers counted (the
-- rollups test compares every cell with a recount). A statement trigger cannot name columns
-- or a WHEN condition, so it runs for every statement on the table and finds the rows that
-- matter itself.
DROP TRIGGER task_rollup_update ON agent_task;
DROP TRIGGER task_rollup_insert ON agent_task;
DROP TRIGGER task_rollup_delete ON agent_task;
DROP TRIGGER answer_rollup_insert ON outbound_reply;
DROP TRIGGER answer_rollup_update ON outbound_reply;
DROP TRIGGER answer_rollup_delete ON outbound_reply;
DROP TRIGGER reply_rollup_insert ON outbound_reply;
DROP TRIGGER reply_rollup_update ON outbound_reply;
DROP TRIGGER reply_rollup_delete ON outbound_reply;
DROP FUNCTION task_rollup_count();
DROP FUNCTION answer_rollup_move();
DROP FUNCTION reply_rollup_count();
DROP FUNCTION task_rollup_add(agent_task, BIGINT);
DROP FUNCTION task_rollup_answer(agent_task, TEXT, BIGINT, BIGINT);

-- Adds `signs[i]` times the finished task `tasks[i]`, its answer in `states[i]` (sent at
-- `sent_ats[i]`), to task_rollup and, when delivered, with its latency to latency_rollup:
-- one upsert per cell for all the rows.
CREATE FUNCTION answer_rollup_rows(tasks agent_task[], states TEXT[], sent_ats BIGINT[],
    signs BIGINT[]) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    WITH a AS (
        SELECT x.*, v.state, v.sent_at, v.sign FROM unnest(tasks) WITH ORDINALITY AS x
        JOIN unnest(states, sent_ats, signs) WITH ORDINALITY AS v(state, sent_at, sign, n)
            ON v.n = x.ordinality
    ), cells AS (
        INSERT INTO task_rollup
        SELECT created_at / 3600000, agent_id, agent_version_id, channel, status,
            COALESCE(failure_type, ''), state, pg_backend_pid(), SUM(sign),
            SUM(sign * GREATEST(claim_count - 1, 0))
        FROM a GROUP BY 1, 2, 3, 4, 5, 6, 7
        ON CONFLICT (hour, agent_id, agent_version_id, channel, status, failure_type, delivery, slot)
        DO UPDATE SET tasks = task_rollup.tasks + excluded.tasks,
            takeovers = task_rollup.takeovers + excluded.takeovers
        RETURNING 1
    )
    INSERT INTO latency_rollup
    SELECT a.created_at / 3600000, a.agent_id, a.channel, COALESCE(a.failure_type, ''),
        latency_le(a.sent_at - m.received_at), pg_backend_pid(), SUM(a.sign)
    FROM a JOIN im_message m ON m.id = a.message_id
    WHERE a.state = 'DELIVERED' GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (hour, agent_id, channel, failure_type, le, slot)
    DO UPDATE SET answers = latency_rollup.answers + excluded.answers;
END $$;

-- Adds `signs[i]` times the finished task `tasks[i]` (the row as counted: +1 its new
-- version, -1 its old one) to the three task rollups: its cell with its answer's state, its
-- latency when delivered, its llm steps' tokens per model.
CREATE FUNCTION task_rollup_rows(tasks agent_task[], signs BIGINT[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    states TEXT[];
    sent_ats BIGINT[];
BEGIN
    SELECT array_agg(COALESCE(answer_state(r.status, r.placeholder), '') ORDER BY x.ordinality),
        array_agg(r.sent_at ORDER BY x.ordinality) INTO states, sent_ats
    FROM unnest(tasks) WITH ORDINALITY AS x
    LEFT JOIN outbound_reply r ON r.idempotency_key = answer_key(x.id, x.resume_count);
    PERFORM answer_rollup_rows(tasks, states, sent_ats, signs);
    INSERT INTO token_rollup
    SELECT t.created_at / 3600000, t.agent_id, t.channel, COALESCE(t.failure_type, ''),
        COALESCE(step_model(s.input), ''), pg_backend_pid(), SUM(t.sign),
        SUM(t.sign * s.tokens_in), SUM(t.sign * COALESCE(s.tokens_out, 0))
    FROM (SELECT x.*, v.sign FROM unnest(tasks) WITH ORDINALITY AS x
          JOIN unnest(signs) WITH ORDINALITY AS v(sign, n) ON v.n = x.ordinality) t
    JOIN agent_step s ON s.task_id = t.id
    WHERE s.step_type = 'llm' AND s.tokens_in IS NOT NULL GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (hour, agent_id, channel, failure_type, model, slot)
    DO UPDATE SET calls = token_rollup.calls + excluded.calls,
        prompt_tokens = token_rollup.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = token_rollup.completion_tokens + excluded.completion_tokens;
END $$;

-- Tasks entering or leaving the finished states, or changing what their cell counts while
-- finished (failure type, claims, resumes), as the row trigger's WHEN chose them.
CREATE FUNCTION task_rollup_statement() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    tasks agent_task[];
    signs BIGINT[];
BEGIN
    IF TG_OP = 'UPDATE' THEN
        WITH changed AS (
            SELECT o, n FROM old_rows o JOIN new_rows n ON n.id = o.id
            WHERE o.status IS DISTINCT FROM n.status OR o.failure_type IS DISTINCT FROM n.failure_type
               OR o.claim_count IS DISTINCT FROM n.claim_count
               OR o.resume_count IS DISTINCT FROM n.resume_count
        )
        SELECT array_agg(c.task), array_agg(c.sign) INTO tasks, signs FROM (
            SELECT o AS task, -1::BIGINT AS sign FROM changed
            WHERE (o).status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
            UNION ALL
            SELECT n, 1 FROM changed WHERE (n).status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')) c;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT array_agg(n), array_agg(1::BIGINT) INTO tasks, signs FROM new_rows n
        WHERE n.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED');
    ELSE
        SELECT array_agg(o), array_agg(-1::BIGINT) INTO tasks, signs FROM old_rows o
        WHERE o.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED');
    END IF;
    IF tasks IS NOT NULL THEN
        PERFORM task_rollup_rows(tasks, signs);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER task_rollup_update AFTER UPDATE ON agent_task
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION task_rollup_statement();
CREATE TRIGGER task_rollup_insert AFTER INSERT ON agent_task
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION task_rollup_statement();
CREATE TRIGGER task_rollup_delete AFTER DELETE ON agent_task
REFERENCING OLD TABLE AS old_rows
FOR EACH STATEMENT EXECUTE FUNCTION task_rollup_statement();

-- Replies settling (reply_rollup: every reply not PENDING), and a finished task's answer
-- moving between delivery states (task_rollup and latency_rollup), per statement.
-- `moved` holds each changed reply's old and new version (either NULL for an insert or a
-- delete).
CREATE FUNCTION reply_rollup_rows(moved JSONB) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    tasks agent_task[];
    states TEXT[];
    sent_ats BIGINT[];
    signs BIGINT[];
BEGIN
    -- reply_rollup: -1 for the old version if it was settled, +1 for the new one.
    WITH m AS (
        SELECT * FROM jsonb_to_recordset(moved) AS x(old_status TEXT, new_status TEXT,
            old_placeholder BIGINT, new_placeholder BIGINT, created_at BIGINT, channel TEXT)
    )
    INSERT INTO reply_rollup
    SELECT created_at / 3600000, channel, status, placeholder, pg_backend_pid(), SUM(sign)
    FROM (SELECT created_at, channel, old_status AS status, old_placeholder AS placeholder,
              -1 AS sign FROM m WHERE old_status IS NOT NULL AND old_status <> 'PENDING'
          UNION ALL
          SELECT created_at, channel, new_status, new_placeholder, 1 FROM m
          WHERE new_status IS NOT NULL AND new_status <> 'PENDING') s
    GROUP BY 1, 2, 3, 4
    ON CONFLICT (hour, channel, status, placeholder, slot)
    DO UPDATE SET replies = reply_rollup.replies + excluded.replies;
    -- A finished task's answer in its old state (-1) and its new one (+1).
    SELECT array_agg(t), array_agg(s.state), array_agg(s.sent_at), array_agg(s.sign)
    INTO tasks, states, sent_ats, signs
    FROM jsonb_to_recordset(moved) AS m(old_status TEXT, new_status TEXT,
        old_placeholder BIGINT, new_placeholder BIGINT, old_sent_at BIGINT, new_sent_at BIGINT,
        task_id BIGINT, idempotency_key TEXT)
    JOIN agent_task t ON t.id = m.task_id
    CROSS JOIN LATERAL (
        SELECT COALESCE(answer_state(m.old_status, m.old_placeholder), ''), m.old_sent_at, -1::BIGINT
        UNION ALL
        SELECT COALESCE(answer_state(m.new_status, m.new_placeholder), ''), m.new_sent_at, 1::BIGINT
    ) AS s(state, sent_at, sign)
    WHERE m.idempotency_key LIKE 'agent-task-%'
      AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
      AND m.idempotency_key = answer_key(t.id, t.resume_count)
      AND COALESCE(answer_state(m.old_status, m.old_placeholder), '')
          <> COALESCE(answer_state(m.new_status, m.new_placeholder), '');
    IF tasks IS NOT NULL THEN
        PERFORM answer_rollup_rows(tasks, states, sent_ats, signs);
    END IF;
END $$;

CREATE FUNCTION reply_rollup_statement() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moved JSONB;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        SELECT jsonb_agg(jsonb_build_object('old_status', o.status, 'new_status', n.status,
            'old_placeholder', o.placeholder, 'new_placeholder', n.placeholder,
            'old_sent_at', o.sent_at, 'new_sent_at', n.sent_at, 'task_id', n.task_id,
            'idempotency_key', n.idempotency_key, 'created_at', n.created_at, 'channel', n.channel))
        INTO moved
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE o.status IS DISTINCT FROM n.status OR o.placeholder IS DISTINCT FROM n.placeholder;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT jsonb_agg(jsonb_build_object('new_status', n.status,
            'new_placeholder', n.placeholder, 'new_sent_at', n.sent_at, 'task_id', n.task_id,
            'idempotency_key', n.idempotency_key, 'created_at', n.created_at, 'channel', n.channel))
        INTO moved
        FROM new_rows n WHERE n.status <> 'PENDING' OR n.idempotency_key LIKE 'agent-task-%';
    ELSE
        SELECT jsonb_agg(jsonb_build_object('old_status', o.status,
            'old_placeholder', o.placeholder, 'old_sent_at', o.sent_at, 'task_id', o.task_id,
            'idempotency_key', o.idempotency_key, 'created_at', o.created_at, 'channel', o.channel))
        INTO moved
        FROM old_rows o WHERE o.status <> 'PENDING' OR o.idempotency_key LIKE 'agent-task-%';
    END IF;
    IF moved IS NOT NULL THEN
        PERFORM reply_rollup_rows(moved);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER reply_rollup_update AFTER UPDATE ON outbound_reply
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION reply_rollup_statement();
CREATE TRIGGER reply_rollup_insert AFTER INSERT ON outbound_reply
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION reply_rollup_statement();
CREATE TRIGGER reply_rollup_delete AFTER DELETE ON outbound_reply
REFERENCING OLD TABLE AS old_rows
FOR EACH STATEMENT EXECUTE FUNCTION reply_rollup_statement();

-- 2. The task list's window and retention read tasks by creation time in ranges: a BRIN
-- index answers those (tasks are created in time order) and, unlike the B-tree it
-- replaces, writes nothing for the new row versions a claim and a finish make.
DROP INDEX agent_task_created;
CREATE INDEX agent_task_created ON agent_task USING brin (created_at);

-- 3. No query reads an audit row by its id alone (a task's rows go through audit_log_task,
-- others' through audit_log_target, both ordered by id); ids stay unique by their sequence.
-- The primary key's index was a fourth of the audit rows' WAL.
ALTER TABLE audit_log DROP CONSTRAINT audit_log_pkey;

-- 4. Room on each page for a row's next version, so updates that change no indexed column
-- stay on the page and write no index entry (HOT): a step's completion, a reply's delivery
-- lease. Applies to pages written from now on. A step's completed version (with its output)
-- is about as large as the begun one: half of each page is left for them.
ALTER TABLE agent_step SET (fillfactor = 50);
ALTER TABLE outbound_reply SET (fillfactor = 70);
-- A task's claim and finish change indexed columns (its status is in the partial indexes'
-- predicates), so they are never HOT; but a new version that fits on its page is logged as
-- the bytes that changed, and one that moves to another page costs a whole copy and an
-- extra row-lock record (PostgreSQL locks the old version while it finds the new page).
-- Room for both of a task's new versions on the page it was inserted in.
ALTER TABLE agent_task SET (fillfactor = 40);

-- 5. An audit row names its task without a foreign key. Tasks are never deleted, and every
-- audit row of a task is written in a transaction that holds or has just written the task
-- row; the key's check locked that row again (a row-lock record in the WAL per audit row
-- written next to a new or updated task row: at intake, claim and delivery).
ALTER TABLE audit_log DROP CONSTRAINT audit_log_task_id_fkey;
-- Likewise a reply names its task, and a task its message: neither is ever deleted, and each
-- is written in the transaction that writes (or has just written) the row it names.
ALTER TABLE outbound_reply DROP CONSTRAINT outbound_reply_task_id_fkey;
ALTER TABLE agent_task DROP CONSTRAINT agent_task_message_id_fkey;

-- 6. The claim's "oldest active task of its conversation" reads pending tasks through an
-- index of pending tasks only and running ones through the unique running index; the index
-- over both states it replaces got a new entry at every claim.
CREATE INDEX agent_task_pending_conversation ON agent_task (channel, conversation_id, id)
    WHERE status = 'PENDING';
DROP INDEX agent_task_active_conversation;
