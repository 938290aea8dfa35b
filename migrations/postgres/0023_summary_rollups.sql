-- The failure summary from rollups (issue 35). A finished task's count now also carries
-- where its answer stands (`delivery`: '' none yet, DELIVERED, PENDING, FAILED, UNKNOWN;
-- the states of reports' DELIVERY_STATE), and beside it are kept, per hour of the task,
-- agent, platform and failure type:
--   token_rollup    its model calls and tokens per model (from the journalled requests),
--   latency_rollup  its answer's webhook-to-delivery time, as a histogram (`le` is the
--                   bucket's upper bound in ms, from latency_bound; longer counts in the last).
-- A task's share of the rollups is a function of the task row, its answer (the reply under
-- its key, `domain::reply_key`), its message's arrival and its llm steps, none of which
-- changes while the task is finished except the answer's state; so it is added when the task
-- finishes, taken out (-1) when it is resumed or removed, and moved between delivery states
-- by a trigger on the answer. Only sums over `slot` mean anything (see 0022).

CREATE TABLE latency_bound (le BIGINT PRIMARY KEY);
INSERT INTO latency_bound VALUES (100), (250), (500), (750), (1000), (1500), (2000), (3000),
    (5000), (7500), (10000), (15000), (20000), (30000), (45000), (60000), (90000), (120000),
    (300000), (600000), (1800000), (3600000), (21600000), (86400000), (604800000);

DROP TABLE task_rollup;
CREATE TABLE task_rollup (
    hour             BIGINT NOT NULL,
    agent_id         BIGINT NOT NULL,
    agent_version_id BIGINT NOT NULL,
    channel          TEXT NOT NULL,
    status           TEXT NOT NULL,
    failure_type     TEXT NOT NULL,
    delivery         TEXT NOT NULL,
    slot             BIGINT NOT NULL,
    tasks            BIGINT NOT NULL,
    takeovers        BIGINT NOT NULL,
    PRIMARY KEY (hour, agent_id, agent_version_id, channel, status, failure_type, delivery, slot)
);

CREATE TABLE token_rollup (
    hour              BIGINT NOT NULL,
    agent_id          BIGINT NOT NULL,
    channel           TEXT NOT NULL,
    failure_type      TEXT NOT NULL,
    model             TEXT NOT NULL,
    slot              BIGINT NOT NULL,
    calls             BIGINT NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    PRIMARY KEY (hour, agent_id, channel, failure_type, model, slot)
);

CREATE TABLE latency_rollup (
    hour         BIGINT NOT NULL,
    agent_id     BIGINT NOT NULL,
    channel      TEXT NOT NULL,
    failure_type TEXT NOT NULL,
    le           BIGINT NOT NULL,
    slot         BIGINT NOT NULL,
    answers      BIGINT NOT NULL,
    PRIMARY KEY (hour, agent_id, channel, failure_type, le, slot)
);

-- Given-up replies, newest first, for the summary's "not getting through" list (the pending
-- ones with an error are found through outbound_reply_due).
CREATE INDEX outbound_reply_given_up ON outbound_reply (id) WHERE status IN ('FAILED', 'UNKNOWN');
-- Failed tasks by age, for the summary's top errors (the newest failures of the window).
CREATE INDEX agent_task_failed ON agent_task (created_at) WHERE failure_type IS NOT NULL;

-- Where an answer row stands for its chat user (reports' DELIVERY_STATE).
CREATE FUNCTION answer_state(status TEXT, placeholder BIGINT) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN status = 'SENT' AND placeholder = 0 THEN 'DELIVERED'
                WHEN status = 'SENT' THEN 'PENDING' ELSE status END
$$;

-- The key of a task's answer (`domain::reply_key`).
CREATE FUNCTION answer_key(task_id BIGINT, resume_count BIGINT) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT 'agent-task-' || task_id
        || CASE WHEN resume_count = 0 THEN '' ELSE '-r' || resume_count END
$$;

-- The latency bucket of `waited` ms.
CREATE FUNCTION latency_le(waited BIGINT) RETURNS BIGINT LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= waited),
                    (SELECT MAX(le) FROM latency_bound))
$$;

-- The model a journalled request asked for (NULL when retention removed it).
CREATE FUNCTION step_model(input TEXT) RETURNS TEXT LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN input LIKE '{%' THEN input::json ->> 'model' END
$$;

-- Adds `sign` times the task's answer in `delivery` (with its latency when delivered) to
-- task_rollup and latency_rollup.
CREATE FUNCTION task_rollup_answer(t agent_task, state TEXT, answered_at BIGINT, sign BIGINT)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO task_rollup VALUES (t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), state, pg_backend_pid(), sign,
        sign * GREATEST(t.claim_count - 1, 0))
    ON CONFLICT (hour, agent_id, agent_version_id, channel, status, failure_type, delivery, slot)
    DO UPDATE SET tasks = task_rollup.tasks + excluded.tasks,
        takeovers = task_rollup.takeovers + excluded.takeovers;
    IF state = 'DELIVERED' THEN
        INSERT INTO latency_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel,
            COALESCE(t.failure_type, ''), latency_le(answered_at - m.received_at),
            pg_backend_pid(), sign
        FROM im_message m WHERE m.id = t.message_id
        ON CONFLICT (hour, agent_id, channel, failure_type, le, slot)
        DO UPDATE SET answers = latency_rollup.answers + excluded.answers;
    END IF;
END $$;

-- Adds `sign` times the finished task `t` to the rollups.
CREATE FUNCTION task_rollup_add(t agent_task, sign BIGINT) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    answer RECORD;
BEGIN
    SELECT answer_state(r.status, r.placeholder) AS state, r.sent_at INTO answer
    FROM outbound_reply r
    WHERE r.idempotency_key = answer_key(t.id, t.resume_count);
    PERFORM task_rollup_answer(t, COALESCE(answer.state, ''), answer.sent_at, sign);
    INSERT INTO token_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel,
        COALESCE(t.failure_type, ''), COALESCE(step_model(s.input), ''), pg_backend_pid(),
        sign * COUNT(*), sign * SUM(s.tokens_in), sign * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = t.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT (hour, agent_id, channel, failure_type, model, slot)
    DO UPDATE SET calls = token_rollup.calls + excluded.calls,
        prompt_tokens = token_rollup.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = token_rollup.completion_tokens + excluded.completion_tokens;
END $$;

CREATE OR REPLACE FUNCTION task_rollup_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN
        PERFORM task_rollup_add(OLD, -1);
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN
        PERFORM task_rollup_add(NEW, 1);
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER task_rollup_update ON agent_task;
CREATE TRIGGER task_rollup_update
AFTER UPDATE OF status, failure_type, claim_count, resume_count ON agent_task
FOR EACH ROW
WHEN ((OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') OR NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
      AND (OLD.status IS DISTINCT FROM NEW.status
           OR OLD.failure_type IS DISTINCT FROM NEW.failure_type
           OR OLD.claim_count IS DISTINCT FROM NEW.claim_count
           OR OLD.resume_count IS DISTINCT FROM NEW.resume_count))
EXECUTE FUNCTION task_rollup_count();

-- An answer changing state moves its finished task between delivery states.
CREATE FUNCTION answer_rollup_move() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    reply outbound_reply;
    t agent_task;
    was TEXT := '';
    now_is TEXT := '';
BEGIN
    IF TG_OP = 'DELETE' THEN reply := OLD; ELSE reply := NEW; END IF;
    SELECT * INTO t FROM agent_task WHERE id = reply.task_id;
    IF NOT FOUND OR t.status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        OR reply.idempotency_key <> answer_key(t.id, t.resume_count) THEN
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN was := answer_state(OLD.status, OLD.placeholder); END IF;
    IF TG_OP <> 'DELETE' THEN now_is := answer_state(NEW.status, NEW.placeholder); END IF;
    IF was <> now_is THEN
        PERFORM task_rollup_answer(t, was, OLD.sent_at, -1);
        PERFORM task_rollup_answer(t, now_is, NEW.sent_at, 1);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER answer_rollup_insert AFTER INSERT ON outbound_reply
FOR EACH ROW WHEN (NEW.idempotency_key LIKE 'agent-task-%')
EXECUTE FUNCTION answer_rollup_move();

CREATE TRIGGER answer_rollup_update AFTER UPDATE OF status, placeholder ON outbound_reply
FOR EACH ROW WHEN (NEW.idempotency_key LIKE 'agent-task-%'
    AND (OLD.status IS DISTINCT FROM NEW.status OR OLD.placeholder IS DISTINCT FROM NEW.placeholder))
EXECUTE FUNCTION answer_rollup_move();

CREATE TRIGGER answer_rollup_delete AFTER DELETE ON outbound_reply
FOR EACH ROW WHEN (OLD.idempotency_key LIKE 'agent-task-%')
EXECUTE FUNCTION answer_rollup_move();

-- What history holds already (Store::rebuild_rollups counts the same way).
INSERT INTO task_rollup
SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id, t.channel, t.status,
    COALESCE(t.failure_type, ''),
    COALESCE(CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED'
                  WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END, ''),
    0, COUNT(*), SUM(CASE WHEN t.claim_count > 1 THEN t.claim_count - 1 ELSE 0 END)
FROM agent_task t LEFT JOIN outbound_reply r ON r.idempotency_key = 'agent-task-'
    || CAST(t.id AS TEXT) || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || CAST(t.resume_count AS TEXT) END
WHERE t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') GROUP BY 1, 2, 3, 4, 5, 6, 7;

INSERT INTO token_rollup
SELECT t.created_at / 3600000, t.agent_id, t.channel, COALESCE(t.failure_type, ''),
    COALESCE(step_model(s.input), ''), 0, COUNT(*), SUM(s.tokens_in), COALESCE(SUM(s.tokens_out), 0)
FROM agent_task t JOIN agent_step s ON s.task_id = t.id
WHERE t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') AND s.step_type = 'llm'
    AND s.tokens_in IS NOT NULL
GROUP BY 1, 2, 3, 4, 5;

INSERT INTO latency_rollup
SELECT t.created_at / 3600000, t.agent_id, t.channel, COALESCE(t.failure_type, ''),
    COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
             (SELECT MAX(le) FROM latency_bound)), 0, COUNT(*)
FROM agent_task t JOIN outbound_reply r ON r.idempotency_key = 'agent-task-'
    || CAST(t.id AS TEXT) || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || CAST(t.resume_count AS TEXT) END
JOIN im_message m ON m.id = t.message_id
WHERE t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') AND r.status = 'SENT' AND r.placeholder = 0
GROUP BY 1, 2, 3, 4, 5;
