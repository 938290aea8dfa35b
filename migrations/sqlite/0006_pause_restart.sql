-- Pause, unpause and restart from scratch (docs/architecture.md, "Task state machine").
-- A pause asked of a RUNNING task takes effect at its next step boundary: the flag is
-- read by the fenced step begin, so the call in flight finishes and is recorded.
ALTER TABLE agent_task ADD COLUMN pause_requested INTEGER NOT NULL DEFAULT 0;
-- Restarts so far; a restarted run's step keys carry it (`<task>r<n>:<step>:<tool>`).
ALTER TABLE agent_task ADD COLUMN restart_count INTEGER NOT NULL DEFAULT 0;
CREATE INDEX agent_task_paused ON agent_task (id) WHERE status = 'PAUSED';

-- The journal of a run a restart replaced, kept for the record.
CREATE TABLE agent_step_superseded (
    id              INTEGER PRIMARY KEY,
    task_id         INTEGER NOT NULL REFERENCES agent_task(id),
    restart_no      INTEGER NOT NULL,
    step_no         INTEGER NOT NULL,
    step_type       TEXT    NOT NULL,
    tool_name       TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    input           TEXT,
    output          TEXT,
    error           TEXT,
    status          TEXT    NOT NULL,
    tokens_in       INTEGER,
    tokens_out      INTEGER,
    duration_ms     INTEGER,
    attempt         INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    finished_at     INTEGER,
    superseded_at   INTEGER NOT NULL
);
CREATE INDEX agent_step_superseded_task ON agent_step_superseded (task_id, restart_no, step_no);

-- Approvals are numbered per run: a restarted run may ask again at the same step. SQLite
-- cannot drop a table constraint, so the table is rebuilt (nothing references it).
CREATE TABLE pending_action_new (
    id          INTEGER PRIMARY KEY,
    task_id     INTEGER NOT NULL REFERENCES agent_task(id),
    restart_no  INTEGER NOT NULL DEFAULT 0,
    step_no     INTEGER NOT NULL,
    kind        TEXT    NOT NULL,
    tool_name   TEXT    NOT NULL,
    args        TEXT    NOT NULL,
    approvers   TEXT    NOT NULL,
    message     TEXT    NOT NULL,
    decision    TEXT    NOT NULL,
    decided_by  TEXT,
    deadline    INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    decided_at  INTEGER,
    UNIQUE (task_id, restart_no, step_no)
);
INSERT INTO pending_action_new (id, task_id, restart_no, step_no, kind, tool_name, args,
    approvers, message, decision, decided_by, deadline, created_at, decided_at)
    SELECT id, task_id, 0, step_no, kind, tool_name, args, approvers, message, decision,
        decided_by, deadline, created_at, decided_at FROM pending_action;
DROP TABLE pending_action;
ALTER TABLE pending_action_new RENAME TO pending_action;
CREATE INDEX pending_action_open ON pending_action (deadline) WHERE decision = 'PENDING';
