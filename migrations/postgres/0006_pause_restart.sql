-- Pause, unpause and restart from scratch (docs/architecture.md, "Task state machine").
-- A pause asked of a RUNNING task takes effect at its next step boundary: the flag is
-- read by the fenced step begin, so the call in flight finishes and is recorded.
ALTER TABLE agent_task ADD COLUMN pause_requested INTEGER NOT NULL DEFAULT 0;
-- Restarts so far; a restarted run's step keys carry it (`<task>r<n>:<step>:<tool>`).
ALTER TABLE agent_task ADD COLUMN restart_count BIGINT NOT NULL DEFAULT 0;
CREATE INDEX agent_task_paused ON agent_task (id) WHERE status = 'PAUSED';

-- The journal of a run a restart replaced, kept for the record.
CREATE TABLE agent_step_superseded (
    id              BIGINT  PRIMARY KEY,
    task_id         BIGINT  NOT NULL REFERENCES agent_task(id),
    restart_no      BIGINT  NOT NULL,
    step_no         BIGINT  NOT NULL,
    step_type       TEXT    NOT NULL,
    tool_name       TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    input           TEXT,
    output          TEXT,
    error           TEXT,
    status          TEXT    NOT NULL,
    tokens_in       BIGINT,
    tokens_out      BIGINT,
    duration_ms     BIGINT,
    attempt         BIGINT  NOT NULL,
    created_at      BIGINT  NOT NULL,
    finished_at     BIGINT,
    superseded_at   BIGINT  NOT NULL
);
CREATE INDEX agent_step_superseded_task ON agent_step_superseded (task_id, restart_no, step_no);

-- Approvals are numbered per run: a restarted run may ask again at the same step.
ALTER TABLE pending_action ADD COLUMN restart_no BIGINT NOT NULL DEFAULT 0;
ALTER TABLE pending_action DROP CONSTRAINT pending_action_task_id_step_no_key;
ALTER TABLE pending_action ADD CONSTRAINT pending_action_task_restart_step
    UNIQUE (task_id, restart_no, step_no);
