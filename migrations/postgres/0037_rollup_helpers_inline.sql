-- Issue 35 part 2: the rollup triggers' helper functions run as part of the queries that
-- call them, and a reply trigger hands its rows on without JSON. What is counted is
-- unchanged (the rollups test compares every cell with a recount).
--
-- `pg_stat_statements` with `track = 'all'` (an `end-to-end` run of 5,000 messages) showed
-- the reply trigger's `reply_rollup_rows` as the costliest statement PostgreSQL ran, nested
-- or not (0.25 ms per answered message, in the replies' insert and the delivery mark), and
-- `answer_key` run 15,000 times as a statement of its own: PostgreSQL inlines an SQL
-- function into its caller only when its body is no more volatile than it is declared, and
-- `text || bigint` is STABLE (it calls the bigint's output function through `anytextcat`),
-- so the IMMUTABLE `answer_key` was called, planned and executed per row instead.
-- `latency_le` (STABLE, two subqueries) is never inlined either: each statement that calls
-- it plans its body again.

-- The same text: `bigint::text` is the IMMUTABLE `int8out`, and `text || text` IMMUTABLE.
CREATE OR REPLACE FUNCTION answer_key(task_id BIGINT, resume_count BIGINT) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT 'agent-task-' || task_id::text
        || CASE WHEN resume_count = 0 THEN '' ELSE '-r' || resume_count::text END
$$;

-- The same bucket (the smallest bound at or above `waited`, else the largest; NULL in the
-- largest), as one CASE written from latency_bound's rows: an expression, inlined into the
-- query that calls it. latency_bound stays the one list of bounds (the recount reads it).
DO $$
BEGIN
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION latency_le(waited BIGINT) RETURNS BIGINT '
        'LANGUAGE sql IMMUTABLE AS $f$ SELECT CASE %s ELSE %s END::BIGINT $f$',
        (SELECT string_agg(format('WHEN waited <= %s THEN %s', le, le), ' ' ORDER BY le)
         FROM latency_bound),
        (SELECT MAX(le) FROM latency_bound));
END $$;

-- A reply's change as the reply trigger hands it on: its old and new version (either NULL
-- for an insert or a delete), the columns the rollups read. An array of these replaces the
-- JSONB array each trigger built and its functions parsed twice.
CREATE TYPE reply_move AS (
    old_status TEXT, new_status TEXT, old_placeholder BIGINT, new_placeholder BIGINT,
    old_sent_at BIGINT, new_sent_at BIGINT, task_id BIGINT, idempotency_key TEXT,
    created_at BIGINT, channel TEXT
);

-- As in 0034: replies settling (reply_rollup), and a finished task's answer moving between
-- delivery states (task_rollup and latency_rollup).
CREATE FUNCTION reply_rollup_moves(moved reply_move[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    tasks rollup_task[];
    states TEXT[];
    sent_ats BIGINT[];
    signs BIGINT[];
BEGIN
    INSERT INTO reply_rollup
    SELECT created_at / 3600000, channel, status, placeholder, pg_backend_pid(), SUM(sign)
    FROM (SELECT m.created_at, m.channel, m.old_status AS status,
              m.old_placeholder AS placeholder, -1 AS sign
          FROM unnest(moved) m WHERE m.old_status IS NOT NULL AND m.old_status <> 'PENDING'
          UNION ALL
          SELECT m.created_at, m.channel, m.new_status, m.new_placeholder, 1
          FROM unnest(moved) m WHERE m.new_status IS NOT NULL AND m.new_status <> 'PENDING') s
    GROUP BY 1, 2, 3, 4
    ON CONFLICT (hour, channel, status, placeholder, slot)
    DO UPDATE SET replies = reply_rollup.replies + excluded.replies;
    SELECT array_agg(ROW(t.id, t.agent_id, t.agent_version_id, t.channel, t.status,
            t.failure_type, t.claim_count, t.resume_count, t.message_id,
            t.created_at)::rollup_task),
        array_agg(s.state), array_agg(s.sent_at), array_agg(s.sign)
    INTO tasks, states, sent_ats, signs
    FROM unnest(moved) m
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

CREATE OR REPLACE FUNCTION reply_rollup_statement() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moved reply_move[];
BEGIN
    IF TG_OP = 'UPDATE' THEN
        SELECT array_agg(ROW(o.status, n.status, o.placeholder, n.placeholder, o.sent_at,
                n.sent_at, n.task_id, n.idempotency_key, n.created_at, n.channel)::reply_move)
        INTO moved
        FROM old_rows o JOIN new_rows n ON n.id = o.id
        WHERE o.status IS DISTINCT FROM n.status OR o.placeholder IS DISTINCT FROM n.placeholder;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT array_agg(ROW(NULL, n.status, NULL, n.placeholder, NULL, n.sent_at, n.task_id,
                n.idempotency_key, n.created_at, n.channel)::reply_move)
        INTO moved
        FROM new_rows n WHERE n.status <> 'PENDING' OR n.idempotency_key LIKE 'agent-task-%';
    ELSE
        SELECT array_agg(ROW(o.status, NULL, o.placeholder, NULL, o.sent_at, NULL, o.task_id,
                o.idempotency_key, o.created_at, o.channel)::reply_move)
        INTO moved
        FROM old_rows o WHERE o.status <> 'PENDING' OR o.idempotency_key LIKE 'agent-task-%';
    END IF;
    IF moved IS NOT NULL THEN
        PERFORM reply_rollup_moves(moved);
    END IF;
    RETURN NULL;
END $$;

DROP FUNCTION reply_rollup_rows(JSONB);
