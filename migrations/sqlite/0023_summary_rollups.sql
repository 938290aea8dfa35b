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

-- SQLite triggers cannot call functions: each repeats its statements (generated once from
-- the PostgreSQL functions' logic; slot is always 0, there being one writer).

CREATE TABLE latency_bound (le INTEGER PRIMARY KEY);
INSERT INTO latency_bound VALUES (100), (250), (500), (750), (1000), (1500), (2000), (3000),
    (5000), (7500), (10000), (15000), (20000), (30000), (45000), (60000), (90000), (120000),
    (300000), (600000), (1800000), (3600000), (21600000), (86400000), (604800000);

DROP TRIGGER task_rollup_finish;
DROP TRIGGER task_rollup_unfinish;
DROP TRIGGER task_rollup_insert;
DROP TRIGGER task_rollup_delete;
DROP TABLE task_rollup;
CREATE TABLE task_rollup (
    hour             INTEGER NOT NULL,
    agent_id         INTEGER NOT NULL,
    agent_version_id INTEGER NOT NULL,
    channel          TEXT NOT NULL,
    status           TEXT NOT NULL,
    failure_type     TEXT NOT NULL,
    delivery         TEXT NOT NULL,
    slot             INTEGER NOT NULL,
    tasks            INTEGER NOT NULL,
    takeovers        INTEGER NOT NULL,
    PRIMARY KEY (hour, agent_id, agent_version_id, channel, status, failure_type, delivery, slot)
) WITHOUT ROWID;

CREATE TABLE token_rollup (
    hour              INTEGER NOT NULL,
    agent_id          INTEGER NOT NULL,
    channel           TEXT NOT NULL,
    failure_type      TEXT NOT NULL,
    model             TEXT NOT NULL,
    slot              INTEGER NOT NULL,
    calls             INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    PRIMARY KEY (hour, agent_id, channel, failure_type, model, slot)
) WITHOUT ROWID;

CREATE TABLE latency_rollup (
    hour         INTEGER NOT NULL,
    agent_id     INTEGER NOT NULL,
    channel      TEXT NOT NULL,
    failure_type TEXT NOT NULL,
    le           INTEGER NOT NULL,
    slot         INTEGER NOT NULL,
    answers      INTEGER NOT NULL,
    PRIMARY KEY (hour, agent_id, channel, failure_type, le, slot)
) WITHOUT ROWID;

CREATE INDEX outbound_reply_given_up ON outbound_reply (id) WHERE status IN ('FAILED', 'UNKNOWN');
CREATE INDEX agent_task_failed ON agent_task (created_at) WHERE failure_type IS NOT NULL;

CREATE TRIGGER task_rollup_finish AFTER UPDATE OF status, failure_type, claim_count, resume_count ON agent_task
WHEN NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
    AND (OLD.status IS NOT NEW.status OR OLD.failure_type IS NOT NEW.failure_type
         OR OLD.claim_count IS NOT NEW.claim_count OR OLD.resume_count IS NOT NEW.resume_count)
BEGIN
    INSERT INTO task_rollup SELECT NEW.created_at / 3600000, NEW.agent_id,
        NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END), ''),
        0, 1, MAX(NEW.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, 1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = NEW.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE(CASE WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, 1 * COUNT(*), 1 * SUM(s.tokens_in), 1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = NEW.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER task_rollup_unfinish AFTER UPDATE OF status, failure_type, claim_count, resume_count ON agent_task
WHEN OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
    AND (OLD.status IS NOT NEW.status OR OLD.failure_type IS NOT NEW.failure_type
         OR OLD.claim_count IS NOT NEW.claim_count OR OLD.resume_count IS NOT NEW.resume_count)
BEGIN
    INSERT INTO task_rollup SELECT OLD.created_at / 3600000, OLD.agent_id,
        OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END), ''),
        0, -1, -MAX(OLD.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, -1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = OLD.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE(CASE WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, -1 * COUNT(*), -1 * SUM(s.tokens_in), -1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = OLD.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER task_rollup_insert AFTER INSERT ON agent_task
WHEN NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
BEGIN
    INSERT INTO task_rollup SELECT NEW.created_at / 3600000, NEW.agent_id,
        NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END), ''),
        0, 1, MAX(NEW.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, 1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = NEW.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE(CASE WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, 1 * COUNT(*), 1 * SUM(s.tokens_in), 1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = NEW.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER task_rollup_delete AFTER DELETE ON agent_task
WHEN OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
BEGIN
    INSERT INTO task_rollup SELECT OLD.created_at / 3600000, OLD.agent_id,
        OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END), ''),
        0, -1, -MAX(OLD.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, -1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = OLD.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE(CASE WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, -1 * COUNT(*), -1 * SUM(s.tokens_in), -1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = OLD.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER answer_rollup_insert AFTER INSERT ON outbound_reply
WHEN NEW.idempotency_key LIKE 'agent-task-%'
BEGIN
    INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), '', 0, -1, -MAX(t.claim_count - 1, 0)
    FROM agent_task t WHERE t.id = NEW.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND NEW.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), CASE WHEN NEW.status = 'SENT' AND NEW.placeholder = 0 THEN 'DELIVERED' WHEN NEW.status = 'SENT' THEN 'PENDING' ELSE NEW.status END, 0, 1,
        MAX(t.claim_count - 1, 0)
    FROM agent_task t WHERE t.id = NEW.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND NEW.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel,
        COALESCE(t.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= NEW.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, 1
    FROM agent_task t, im_message m WHERE t.id = NEW.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND NEW.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END AND m.id = t.message_id
        AND NEW.status = 'SENT' AND NEW.placeholder = 0
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
END;

CREATE TRIGGER answer_rollup_update AFTER UPDATE OF status, placeholder ON outbound_reply
WHEN NEW.idempotency_key LIKE 'agent-task-%'
    AND (CASE WHEN OLD.status = 'SENT' AND OLD.placeholder = 0 THEN 'DELIVERED' WHEN OLD.status = 'SENT' THEN 'PENDING' ELSE OLD.status END) IS NOT (CASE WHEN NEW.status = 'SENT' AND NEW.placeholder = 0 THEN 'DELIVERED' WHEN NEW.status = 'SENT' THEN 'PENDING' ELSE NEW.status END)
BEGIN
    INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), CASE WHEN OLD.status = 'SENT' AND OLD.placeholder = 0 THEN 'DELIVERED' WHEN OLD.status = 'SENT' THEN 'PENDING' ELSE OLD.status END, 0, -1,
        -MAX(t.claim_count - 1, 0)
    FROM agent_task t WHERE t.id = OLD.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND OLD.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel,
        COALESCE(t.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= OLD.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, -1
    FROM agent_task t, im_message m WHERE t.id = OLD.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND OLD.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END AND m.id = t.message_id
        AND OLD.status = 'SENT' AND OLD.placeholder = 0
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), CASE WHEN NEW.status = 'SENT' AND NEW.placeholder = 0 THEN 'DELIVERED' WHEN NEW.status = 'SENT' THEN 'PENDING' ELSE NEW.status END, 0, 1,
        MAX(t.claim_count - 1, 0)
    FROM agent_task t WHERE t.id = NEW.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND NEW.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel,
        COALESCE(t.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= NEW.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, 1
    FROM agent_task t, im_message m WHERE t.id = NEW.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND NEW.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END AND m.id = t.message_id
        AND NEW.status = 'SENT' AND NEW.placeholder = 0
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
END;

CREATE TRIGGER answer_rollup_delete AFTER DELETE ON outbound_reply
WHEN OLD.idempotency_key LIKE 'agent-task-%'
BEGIN
    INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), CASE WHEN OLD.status = 'SENT' AND OLD.placeholder = 0 THEN 'DELIVERED' WHEN OLD.status = 'SENT' THEN 'PENDING' ELSE OLD.status END, 0, -1,
        -MAX(t.claim_count - 1, 0)
    FROM agent_task t WHERE t.id = OLD.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND OLD.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel,
        COALESCE(t.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= OLD.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, -1
    FROM agent_task t, im_message m WHERE t.id = OLD.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND OLD.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END AND m.id = t.message_id
        AND OLD.status = 'SENT' AND OLD.placeholder = 0
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, t.agent_version_id,
        t.channel, t.status, COALESCE(t.failure_type, ''), '', 0, 1, MAX(t.claim_count - 1, 0)
    FROM agent_task t WHERE t.id = OLD.task_id AND t.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        AND OLD.idempotency_key = 'agent-task-' || t.id || CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || t.resume_count END
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
END;


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
    COALESCE(CASE WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''), 0, COUNT(*), SUM(s.tokens_in), COALESCE(SUM(s.tokens_out), 0)
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
