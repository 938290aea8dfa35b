-- Issue 35 part 2: the rollup triggers pass tasks between their functions as the few columns
-- a rollup cell reads, not as whole `agent_task` rows.
--
-- A whole-row value (`o`, `t`, `array_agg(t)`) carries every column, and PostgreSQL
-- decompresses and copies each TOASTed one into it: the task's answer (`result`, ten
-- thousand characters for a long answer) and its `trace`, at the finish (old and new row)
-- and again at the answer's insert and at its delivery. Measured apart: an array of 2,000
-- rows with a ~10 KB answer took 33–40 ms to build as whole rows, 1 ms as these columns.
-- What is counted is unchanged (the rollups test compares every cell with a recount).
CREATE TYPE rollup_task AS (
    id BIGINT, agent_id BIGINT, agent_version_id BIGINT, channel TEXT, status TEXT,
    failure_type TEXT, claim_count BIGINT, resume_count BIGINT, message_id BIGINT,
    created_at BIGINT
);

DROP FUNCTION task_rollup_rows(agent_task[], BIGINT[]);
DROP FUNCTION answer_rollup_rows(agent_task[], TEXT[], BIGINT[], BIGINT[]);

-- As in 0025: `signs[i]` times the finished task `tasks[i]`, its answer in `states[i]` (sent
-- at `sent_ats[i]`), to task_rollup and, when delivered, with its latency to latency_rollup.
CREATE FUNCTION answer_rollup_rows(tasks rollup_task[], states TEXT[], sent_ats BIGINT[],
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

-- As in 0030: the three task rollups. Each task's answer and llm steps are looked up per
-- task (issue 35 part 2, with migration 0033): as joins, PostgreSQL planned both lookups by
-- the table's statistics, and while those still said the table was small (any table that
-- grew since autovacuum last looked) it hashed a sequential scan of every reply and every
-- step so far, once per finishing batch (`auto_explain` of an `end-to-end` run). As
-- `LATERAL` subqueries that `OFFSET 0` keeps from being flattened into joins, each runs per
-- task through `outbound_reply_task_key` and `agent_step_task_id_step_no_key`.
CREATE FUNCTION task_rollup_rows(tasks rollup_task[], signs BIGINT[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    states TEXT[];
    sent_ats BIGINT[];
BEGIN
    SELECT array_agg(COALESCE(answer_state(r.status, r.placeholder), '') ORDER BY x.ordinality),
        array_agg(r.sent_at ORDER BY x.ordinality) INTO states, sent_ats
    FROM unnest(tasks) WITH ORDINALITY AS x
    LEFT JOIN LATERAL (
        SELECT o.status, o.placeholder, o.sent_at FROM outbound_reply o
        WHERE o.task_id = x.id AND o.idempotency_key = answer_key(x.id, x.resume_count)
        OFFSET 0
    ) r ON true;
    PERFORM answer_rollup_rows(tasks, states, sent_ats, signs);
    INSERT INTO token_rollup
    SELECT t.created_at / 3600000, t.agent_id, t.channel, COALESCE(t.failure_type, ''),
        COALESCE(step_model(s.input), ''), pg_backend_pid(), SUM(t.sign),
        SUM(t.sign * s.tokens_in), SUM(t.sign * COALESCE(s.tokens_out, 0))
    FROM (SELECT x.*, v.sign FROM unnest(tasks) WITH ORDINALITY AS x
          JOIN unnest(signs) WITH ORDINALITY AS v(sign, n) ON v.n = x.ordinality) t
    CROSS JOIN LATERAL (
        SELECT st.input, st.tokens_in, st.tokens_out FROM agent_step st
        WHERE st.task_id = t.id AND st.step_type = 'llm' AND st.tokens_in IS NOT NULL
        OFFSET 0
    ) s
    GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (hour, agent_id, channel, failure_type, model, slot)
    DO UPDATE SET calls = token_rollup.calls + excluded.calls,
        prompt_tokens = token_rollup.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = token_rollup.completion_tokens + excluded.completion_tokens;
END $$;

-- As in 0025: tasks entering or leaving the finished states, or changing what their cell
-- counts while finished (failure type, claims, resumes).
CREATE OR REPLACE FUNCTION task_rollup_statement() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    tasks rollup_task[];
    signs BIGINT[];
BEGIN
    IF TG_OP = 'UPDATE' THEN
        WITH changed AS (
            SELECT ROW(o.id, o.agent_id, o.agent_version_id, o.channel, o.status,
                    o.failure_type, o.claim_count, o.resume_count, o.message_id,
                    o.created_at)::rollup_task AS o,
                ROW(n.id, n.agent_id, n.agent_version_id, n.channel, n.status,
                    n.failure_type, n.claim_count, n.resume_count, n.message_id,
                    n.created_at)::rollup_task AS n
            FROM old_rows o JOIN new_rows n ON n.id = o.id
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
        SELECT array_agg(ROW(n.id, n.agent_id, n.agent_version_id, n.channel, n.status,
                n.failure_type, n.claim_count, n.resume_count, n.message_id,
                n.created_at)::rollup_task), array_agg(1::BIGINT)
        INTO tasks, signs FROM new_rows n
        WHERE n.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED');
    ELSE
        SELECT array_agg(ROW(o.id, o.agent_id, o.agent_version_id, o.channel, o.status,
                o.failure_type, o.claim_count, o.resume_count, o.message_id,
                o.created_at)::rollup_task), array_agg(-1::BIGINT)
        INTO tasks, signs FROM old_rows o
        WHERE o.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED');
    END IF;
    IF tasks IS NOT NULL THEN
        PERFORM task_rollup_rows(tasks, signs);
    END IF;
    RETURN NULL;
END $$;

-- As in 0025: replies settling, and a finished task's answer moving between delivery states.
CREATE OR REPLACE FUNCTION reply_rollup_rows(moved JSONB) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    tasks rollup_task[];
    states TEXT[];
    sent_ats BIGINT[];
    signs BIGINT[];
BEGIN
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
    SELECT array_agg(ROW(t.id, t.agent_id, t.agent_version_id, t.channel, t.status,
            t.failure_type, t.claim_count, t.resume_count, t.message_id,
            t.created_at)::rollup_task),
        array_agg(s.state), array_agg(s.sent_at), array_agg(s.sign)
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
