-- A superseded step is known by its task, its restart and its id in the journal it came
-- from: SQLite gives a deleted step's id to the next step, so a task restarted a second
-- time could supersede a step with an id already kept (issue 32, "UNIQUE constraint
-- failed: agent_step_superseded.id").
CREATE TABLE agent_step_superseded_keyed (
    id              INTEGER NOT NULL,
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
    superseded_at   INTEGER NOT NULL,
    PRIMARY KEY (task_id, restart_no, id)
);
INSERT INTO agent_step_superseded_keyed (id, task_id, restart_no, step_no, step_type, tool_name,
    idempotency_key, input, output, error, status, tokens_in, tokens_out, duration_ms, attempt,
    created_at, finished_at, superseded_at)
SELECT id, task_id, restart_no, step_no, step_type, tool_name, idempotency_key, input, output,
    error, status, tokens_in, tokens_out, duration_ms, attempt, created_at, finished_at,
    superseded_at FROM agent_step_superseded;
DROP TABLE agent_step_superseded;
ALTER TABLE agent_step_superseded_keyed RENAME TO agent_step_superseded;
CREATE INDEX agent_step_superseded_task ON agent_step_superseded (task_id, restart_no, step_no);
