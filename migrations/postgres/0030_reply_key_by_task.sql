-- Issue 35 part 2: a reply's key is unique within its task, in one index.
--
-- Replies were indexed by key (unique) and by task (`outbound_reply_task`), two entries at
-- the insert and two more at the non-HOT update that marks the reply sent. Every reply key
-- names its task (`agent-task-<id>`, `…-r<n>`, `…-part-<k>`, `…-reclaimed-v<n>`, an
-- approval's `…-confirm-…`), so (task_id, idempotency_key) is as unique as the key alone, and
-- one unique index on it serves both the lookups by task and the lookups by key, which all
-- name the task. The upserts' conflict target is that pair. SQLite gets the same unique
-- index in place of its task index (its column constraint stays: dropping it rebuilds the
-- table).
ALTER TABLE outbound_reply DROP CONSTRAINT outbound_reply_idempotency_key_key;
DROP INDEX outbound_reply_task;
CREATE UNIQUE INDEX outbound_reply_task_key ON outbound_reply (task_id, idempotency_key);

-- The finishing statement's rollup trigger finds each task's answer by task and key.
CREATE OR REPLACE FUNCTION task_rollup_rows(tasks agent_task[], signs BIGINT[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    states TEXT[];
    sent_ats BIGINT[];
BEGIN
    SELECT array_agg(COALESCE(answer_state(r.status, r.placeholder), '') ORDER BY x.ordinality),
        array_agg(r.sent_at ORDER BY x.ordinality) INTO states, sent_ats
    FROM unnest(tasks) WITH ORDINALITY AS x
    LEFT JOIN outbound_reply r ON r.task_id = x.id
        AND r.idempotency_key = answer_key(x.id, x.resume_count);
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
