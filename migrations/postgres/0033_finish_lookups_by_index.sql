-- Issue 35 part 2: what a finishing batch looks up, it finds through an index, whatever the
-- statistics say (`auto_explain` of an `end-to-end` run found each of these answered by a
-- sequential scan of the whole table, hashed, once per finishing batch).

-- 1. The placeholders a finish turns into answers (`replace_placeholders`). A live
-- placeholder is rare and short-lived (it becomes its answer at the finish), so this index
-- is small; no update on the answer path changes `placeholder` but that replacement, which
-- is not HOT anyway.
CREATE INDEX outbound_reply_placeholder ON outbound_reply (task_id, idempotency_key)
WHERE placeholder = 1;

-- 2. The finishing statement's rollup trigger looks each finished task's answer and llm
-- steps up by the task, one task at a time, through their indexes.
--
-- As joins, PostgreSQL planned both lookups by the table's statistics; while those still
-- said the table was small (any table that grew since autovacuum last looked), it hashed a
-- sequential scan of every reply and every step so far, once per finishing batch
-- (`auto_explain` of an `end-to-end` run). As `LATERAL` subqueries that `OFFSET 0` keeps from
-- being flattened into joins, each runs per task through `outbound_reply_task_key` and
-- `agent_step_task_id_step_no_key`. What is counted is unchanged.
CREATE OR REPLACE FUNCTION task_rollup_rows(tasks agent_task[], signs BIGINT[]) RETURNS void
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
