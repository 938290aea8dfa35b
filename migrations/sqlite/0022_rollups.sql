-- Counts of finished history (issue 35), kept by triggers in the transactions that finish
-- tasks and settle replies, so `/metrics` (and later the failure summary) reads rollups
-- instead of counting every task ever kept. Only terminal rows are counted here (tasks
-- SUCCEEDED, FAILED or CANCELLED; replies SENT, FAILED or UNKNOWN): a task is written to
-- its rollup once when it finishes (and taken out again, as a -1, if it is resumed or
-- removed), not at each of its state changes. Live rows (tasks pending, running, waiting
-- or paused; replies pending) are few and counted through their partial indexes.
-- Only sums over `slot` mean anything. `assistd rollups rebuild` (Store::rebuild_rollups)
-- recounts them from history.
-- SQLite has one writer at a time: `slot` is always 0 (on PostgreSQL it is the backend that
-- counted, so that concurrent transactions never share a row).
CREATE TABLE task_rollup (
    hour             INTEGER NOT NULL,
    agent_id         INTEGER NOT NULL,
    agent_version_id INTEGER NOT NULL,
    channel          TEXT NOT NULL,
    status           TEXT NOT NULL,
    failure_type     TEXT NOT NULL,
    slot             INTEGER NOT NULL,
    tasks            INTEGER NOT NULL,
    takeovers        INTEGER NOT NULL,
    PRIMARY KEY (hour, agent_id, agent_version_id, channel, status, failure_type, slot)
) WITHOUT ROWID;

CREATE TABLE reply_rollup (
    hour        INTEGER NOT NULL,
    channel     TEXT NOT NULL,
    status      TEXT NOT NULL,
    placeholder INTEGER NOT NULL,
    slot        INTEGER NOT NULL,
    replies     INTEGER NOT NULL,
    PRIMARY KEY (hour, channel, status, placeholder, slot)
) WITHOUT ROWID;

-- Each trigger adds to the sums (the undo of the old state, the count of the new): the order
-- in which a statement's triggers run does not matter.
CREATE TRIGGER task_rollup_finish AFTER UPDATE OF status, failure_type, claim_count ON agent_task
WHEN NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
    AND (OLD.status IS NOT NEW.status OR OLD.failure_type IS NOT NEW.failure_type
         OR OLD.claim_count IS NOT NEW.claim_count)
BEGIN
    INSERT INTO task_rollup VALUES (NEW.created_at / 3600000, NEW.agent_id,
        NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
        0, 1, MAX(NEW.claim_count - 1, 0))
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
END;

CREATE TRIGGER task_rollup_unfinish AFTER UPDATE OF status, failure_type, claim_count ON agent_task
WHEN OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
    AND (OLD.status IS NOT NEW.status OR OLD.failure_type IS NOT NEW.failure_type
         OR OLD.claim_count IS NOT NEW.claim_count)
BEGIN
    INSERT INTO task_rollup VALUES (OLD.created_at / 3600000, OLD.agent_id,
        OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
        0, -1, -MAX(OLD.claim_count - 1, 0))
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
END;

CREATE TRIGGER task_rollup_insert AFTER INSERT ON agent_task
WHEN NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
BEGIN
    INSERT INTO task_rollup VALUES (NEW.created_at / 3600000, NEW.agent_id,
        NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
        0, 1, MAX(NEW.claim_count - 1, 0))
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
END;

CREATE TRIGGER task_rollup_delete AFTER DELETE ON agent_task
WHEN OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
BEGIN
    INSERT INTO task_rollup VALUES (OLD.created_at / 3600000, OLD.agent_id,
        OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
        0, -1, -MAX(OLD.claim_count - 1, 0))
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
END;

CREATE TRIGGER reply_rollup_settle AFTER UPDATE OF status, placeholder ON outbound_reply
WHEN NEW.status <> 'PENDING' AND (OLD.status IS NOT NEW.status OR OLD.placeholder IS NOT NEW.placeholder)
BEGIN
    INSERT INTO reply_rollup VALUES (NEW.created_at / 3600000, NEW.channel, NEW.status,
        NEW.placeholder, 0, 1)
    ON CONFLICT DO UPDATE SET replies = replies + excluded.replies;
END;

CREATE TRIGGER reply_rollup_unsettle AFTER UPDATE OF status, placeholder ON outbound_reply
WHEN OLD.status <> 'PENDING' AND (OLD.status IS NOT NEW.status OR OLD.placeholder IS NOT NEW.placeholder)
BEGIN
    INSERT INTO reply_rollup VALUES (OLD.created_at / 3600000, OLD.channel, OLD.status,
        OLD.placeholder, 0, -1)
    ON CONFLICT DO UPDATE SET replies = replies + excluded.replies;
END;

CREATE TRIGGER reply_rollup_insert AFTER INSERT ON outbound_reply
WHEN NEW.status <> 'PENDING'
BEGIN
    INSERT INTO reply_rollup VALUES (NEW.created_at / 3600000, NEW.channel, NEW.status,
        NEW.placeholder, 0, 1)
    ON CONFLICT DO UPDATE SET replies = replies + excluded.replies;
END;

CREATE TRIGGER reply_rollup_delete AFTER DELETE ON outbound_reply
WHEN OLD.status <> 'PENDING'
BEGIN
    INSERT INTO reply_rollup VALUES (OLD.created_at / 3600000, OLD.channel, OLD.status,
        OLD.placeholder, 0, -1)
    ON CONFLICT DO UPDATE SET replies = replies + excluded.replies;
END;

-- What history holds already.
INSERT INTO task_rollup
SELECT created_at / 3600000, agent_id, agent_version_id, channel, status,
       COALESCE(failure_type, ''), 0, COUNT(*), SUM(MAX(claim_count - 1, 0))
FROM agent_task WHERE status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
GROUP BY 1, 2, 3, 4, 5, 6;

INSERT INTO reply_rollup
SELECT created_at / 3600000, channel, status, placeholder, 0, COUNT(*)
FROM outbound_reply WHERE status <> 'PENDING'
GROUP BY 1, 2, 3, 4;
