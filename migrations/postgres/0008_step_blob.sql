-- Step outputs over `journal.inline_max_bytes` are kept here; the step's `output` holds a
-- reference `{"$blob": <id>, "bytes": <n>}` that replay and the task API read through.
-- Retention removes a task's blobs with its other bodies.
CREATE TABLE step_blob (
    id         BIGSERIAL PRIMARY KEY,
    task_id    BIGINT  NOT NULL REFERENCES agent_task(id),
    step_id    BIGINT  NOT NULL,
    bytes      BIGINT  NOT NULL,
    body       TEXT    NOT NULL,
    created_at BIGINT  NOT NULL
);
CREATE INDEX step_blob_task ON step_blob (task_id);
