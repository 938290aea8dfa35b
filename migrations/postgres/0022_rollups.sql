-- Counts of finished history (issue 35), kept by triggers in the transactions that finish
-- tasks and settle replies, so `/metrics` (and later the failure summary) reads rollups
-- instead of counting every task ever kept. Only terminal rows are counted here (tasks
-- SUCCEEDED, FAILED or CANCELLED; replies SENT, FAILED or UNKNOWN): a task is written to
-- its rollup once when it finishes (and taken out again, as a -1, if it is resumed or
-- removed), not at each of its state changes. Live rows (tasks pending, running, waiting
-- or paused; replies pending) are few and counted through their partial indexes.
-- Only sums over `slot` mean anything. `assistd rollups rebuild` (Store::rebuild_rollups)
-- recounts them from history.
-- On PostgreSQL `slot` is the backend (connection) that counted: concurrent transactions
-- never share a rollup row, so they neither queue on one row's lock nor deadlock on two (a
-- first version spread rows by task id % 8: batches finishing tasks locked them in different
-- orders, 50 deadlocks in one run of 5,000 messages). The retention job folds finished hours
-- into slot 0 (Store::fold_rollups), so the rows do not grow with connections x hours.
CREATE TABLE task_rollup (
    hour             BIGINT NOT NULL,
    agent_id         BIGINT NOT NULL,
    agent_version_id BIGINT NOT NULL,
    channel          TEXT NOT NULL,
    status           TEXT NOT NULL,
    failure_type     TEXT NOT NULL,
    slot             BIGINT NOT NULL,
    tasks            BIGINT NOT NULL,
    takeovers        BIGINT NOT NULL,
    PRIMARY KEY (hour, agent_id, agent_version_id, channel, status, failure_type, slot)
);

CREATE TABLE reply_rollup (
    hour        BIGINT NOT NULL,
    channel     TEXT NOT NULL,
    status      TEXT NOT NULL,
    placeholder BIGINT NOT NULL,
    slot        BIGINT NOT NULL,
    replies     BIGINT NOT NULL,
    PRIMARY KEY (hour, channel, status, placeholder, slot)
);

CREATE FUNCTION task_rollup_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN
        INSERT INTO task_rollup VALUES (OLD.created_at / 3600000, OLD.agent_id,
            OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
            pg_backend_pid(), -1, -GREATEST(OLD.claim_count - 1, 0))
        ON CONFLICT (hour, agent_id, agent_version_id, channel, status, failure_type, slot)
        DO UPDATE SET tasks = task_rollup.tasks + excluded.tasks,
            takeovers = task_rollup.takeovers + excluded.takeovers;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN
        INSERT INTO task_rollup VALUES (NEW.created_at / 3600000, NEW.agent_id,
            NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
            pg_backend_pid(), 1, GREATEST(NEW.claim_count - 1, 0))
        ON CONFLICT (hour, agent_id, agent_version_id, channel, status, failure_type, slot)
        DO UPDATE SET tasks = task_rollup.tasks + excluded.tasks,
            takeovers = task_rollup.takeovers + excluded.takeovers;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER task_rollup_update AFTER UPDATE OF status, failure_type, claim_count ON agent_task
FOR EACH ROW
WHEN ((OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') OR NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
      AND (OLD.status IS DISTINCT FROM NEW.status
           OR OLD.failure_type IS DISTINCT FROM NEW.failure_type
           OR OLD.claim_count IS DISTINCT FROM NEW.claim_count))
EXECUTE FUNCTION task_rollup_count();

CREATE TRIGGER task_rollup_insert AFTER INSERT ON agent_task
FOR EACH ROW WHEN (NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
EXECUTE FUNCTION task_rollup_count();

CREATE TRIGGER task_rollup_delete AFTER DELETE ON agent_task
FOR EACH ROW WHEN (OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
EXECUTE FUNCTION task_rollup_count();

CREATE FUNCTION reply_rollup_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.status <> 'PENDING' THEN
        INSERT INTO reply_rollup VALUES (OLD.created_at / 3600000, OLD.channel, OLD.status,
            OLD.placeholder, pg_backend_pid(), -1)
        ON CONFLICT (hour, channel, status, placeholder, slot)
        DO UPDATE SET replies = reply_rollup.replies + excluded.replies;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.status <> 'PENDING' THEN
        INSERT INTO reply_rollup VALUES (NEW.created_at / 3600000, NEW.channel, NEW.status,
            NEW.placeholder, pg_backend_pid(), 1)
        ON CONFLICT (hour, channel, status, placeholder, slot)
        DO UPDATE SET replies = reply_rollup.replies + excluded.replies;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER reply_rollup_update AFTER UPDATE OF status, placeholder ON outbound_reply
FOR EACH ROW
WHEN ((OLD.status <> 'PENDING' OR NEW.status <> 'PENDING')
      AND (OLD.status IS DISTINCT FROM NEW.status
           OR OLD.placeholder IS DISTINCT FROM NEW.placeholder))
EXECUTE FUNCTION reply_rollup_count();

CREATE TRIGGER reply_rollup_insert AFTER INSERT ON outbound_reply
FOR EACH ROW WHEN (NEW.status <> 'PENDING')
EXECUTE FUNCTION reply_rollup_count();

CREATE TRIGGER reply_rollup_delete AFTER DELETE ON outbound_reply
FOR EACH ROW WHEN (OLD.status <> 'PENDING')
EXECUTE FUNCTION reply_rollup_count();

-- What history holds already.
INSERT INTO task_rollup
SELECT created_at / 3600000, agent_id, agent_version_id, channel, status,
       COALESCE(failure_type, ''), 0, COUNT(*), SUM(GREATEST(claim_count - 1, 0))
FROM agent_task WHERE status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
GROUP BY 1, 2, 3, 4, 5, 6;

INSERT INTO reply_rollup
SELECT created_at / 3600000, channel, status, placeholder, 0, COUNT(*)
FROM outbound_reply WHERE status <> 'PENDING'
GROUP BY 1, 2, 3, 4;
