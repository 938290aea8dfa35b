-- assistd schema, PostgreSQL dialect. Times are UTC milliseconds since the epoch (BIGINT);
-- JSON documents are TEXT. Keep in step with migrations/sqlite/0001_initial.sql.

CREATE TABLE agent (
    id                 BIGSERIAL PRIMARY KEY,
    name               TEXT    NOT NULL UNIQUE,
    current_version_id BIGINT,
    created_at         BIGINT  NOT NULL,
    updated_at         BIGINT  NOT NULL
);

CREATE TABLE agent_version (
    id          BIGSERIAL PRIMARY KEY,
    agent_id    BIGINT  NOT NULL REFERENCES agent(id),
    version_no  BIGINT  NOT NULL,
    mode        TEXT    NOT NULL,
    definition  TEXT    NOT NULL,
    created_at  BIGINT  NOT NULL,
    UNIQUE (agent_id, version_no)
);

CREATE TABLE im_message (
    id                  BIGSERIAL PRIMARY KEY,
    channel             TEXT    NOT NULL,
    external_event_id   TEXT    NOT NULL,
    external_message_id TEXT    NOT NULL,
    conversation_id     TEXT    NOT NULL,
    sender_id           TEXT    NOT NULL,
    sender_name         TEXT,
    text                TEXT    NOT NULL,
    reply_context       TEXT,
    received_at         BIGINT  NOT NULL,
    UNIQUE (channel, external_message_id),
    UNIQUE (channel, external_event_id)
);
CREATE INDEX im_message_conversation ON im_message (channel, conversation_id, id);

CREATE TABLE agent_task (
    id                BIGSERIAL PRIMARY KEY,
    agent_id          BIGINT  NOT NULL REFERENCES agent(id),
    agent_version_id  BIGINT  NOT NULL REFERENCES agent_version(id),
    task_type         TEXT    NOT NULL,
    channel           TEXT    NOT NULL,
    conversation_id   TEXT    NOT NULL,
    message_id        BIGINT  NOT NULL REFERENCES im_message(id),
    trigger_user      TEXT    NOT NULL,
    status            TEXT    NOT NULL,
    current_step      BIGINT  NOT NULL DEFAULT 0,
    workflow_snapshot TEXT,
    context_summary   TEXT,
    result            TEXT,
    trace             TEXT,
    failure_type      TEXT,
    error_msg         TEXT,
    retry_count       BIGINT  NOT NULL DEFAULT 0,
    claim_count       BIGINT  NOT NULL DEFAULT 0,
    resume_count      BIGINT  NOT NULL DEFAULT 0,
    version           BIGINT  NOT NULL DEFAULT 0,
    owner             TEXT,
    lease_expire      BIGINT,
    run_after         BIGINT  NOT NULL,
    confirm_deadline  BIGINT,
    created_at        BIGINT  NOT NULL,
    updated_at        BIGINT  NOT NULL,
    started_at        BIGINT,
    finished_at       BIGINT,
    purged_at         BIGINT
);
CREATE UNIQUE INDEX agent_task_message ON agent_task (message_id);
-- The database, not the worker, guarantees one RUNNING task per conversation.
CREATE UNIQUE INDEX agent_task_one_running_per_conversation
    ON agent_task (channel, conversation_id) WHERE status = 'RUNNING';
-- Claim paths only ever touch claimable rows.
CREATE INDEX agent_task_pending ON agent_task (id) WHERE status = 'PENDING';
CREATE INDEX agent_task_running ON agent_task (id, lease_expire) WHERE status = 'RUNNING';
CREATE INDEX agent_task_active_conversation
    ON agent_task (channel, conversation_id, id) WHERE status IN ('PENDING', 'RUNNING');
CREATE INDEX agent_task_created ON agent_task (created_at);
CREATE INDEX agent_task_waiting ON agent_task (confirm_deadline) WHERE status = 'WAITING_HUMAN_CONFIRM';
CREATE INDEX agent_task_unpurged ON agent_task (finished_at) WHERE purged_at IS NULL AND finished_at IS NOT NULL;

CREATE TABLE agent_step (
    id              BIGSERIAL PRIMARY KEY,
    task_id         BIGINT  NOT NULL REFERENCES agent_task(id),
    step_no         BIGINT  NOT NULL,
    step_type       TEXT    NOT NULL,
    tool_name       TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL UNIQUE,
    input           TEXT,
    output          TEXT,
    error           TEXT,
    status          TEXT    NOT NULL,
    tokens_in       BIGINT,
    tokens_out      BIGINT,
    duration_ms     BIGINT,
    attempt         BIGINT  NOT NULL DEFAULT 0,
    created_at      BIGINT  NOT NULL,
    finished_at     BIGINT,
    UNIQUE (task_id, step_no)
);

CREATE TABLE pending_action (
    id          BIGSERIAL PRIMARY KEY,
    task_id     BIGINT  NOT NULL REFERENCES agent_task(id),
    step_no     BIGINT  NOT NULL,
    kind        TEXT    NOT NULL,
    tool_name   TEXT    NOT NULL,
    args        TEXT    NOT NULL,
    approvers   TEXT    NOT NULL,
    message     TEXT    NOT NULL,
    decision    TEXT    NOT NULL,
    decided_by  TEXT,
    deadline    BIGINT  NOT NULL,
    created_at  BIGINT  NOT NULL,
    decided_at  BIGINT,
    UNIQUE (task_id, step_no)
);

CREATE INDEX pending_action_open ON pending_action (deadline) WHERE decision = 'PENDING';

CREATE TABLE outbound_reply (
    id                  BIGSERIAL PRIMARY KEY,
    task_id             BIGINT  NOT NULL REFERENCES agent_task(id),
    idempotency_key     TEXT    NOT NULL UNIQUE,
    channel             TEXT    NOT NULL,
    conversation_id     TEXT    NOT NULL,
    in_reply_to         TEXT    NOT NULL,
    reply_type          TEXT    NOT NULL,
    content             TEXT    NOT NULL,
    status              TEXT    NOT NULL,
    platform_message_id TEXT,
    attempts            BIGINT  NOT NULL DEFAULT 0,
    next_attempt_at     BIGINT  NOT NULL,
    locked_by           TEXT,
    locked_until        BIGINT,
    last_error          TEXT,
    created_at          BIGINT  NOT NULL,
    sent_at             BIGINT
);
CREATE INDEX outbound_reply_task ON outbound_reply (task_id, id);
CREATE INDEX outbound_reply_due ON outbound_reply (next_attempt_at) WHERE status = 'PENDING';

CREATE TABLE audit_log (
    id         BIGSERIAL PRIMARY KEY,
    task_id    BIGINT  REFERENCES agent_task(id),
    event      TEXT    NOT NULL,
    actor      TEXT    NOT NULL,
    summary    TEXT    NOT NULL,
    risk_flag  BOOLEAN NOT NULL DEFAULT FALSE,
    created_at BIGINT  NOT NULL
);
CREATE INDEX audit_log_task ON audit_log (task_id, id);

CREATE TABLE job_lock (
    name        TEXT PRIMARY KEY,
    holder      TEXT,
    lease_until BIGINT  NOT NULL DEFAULT 0,
    last_tick   BIGINT  NOT NULL DEFAULT 0
);

CREATE TABLE job_run (
    id          BIGSERIAL PRIMARY KEY,
    job         TEXT    NOT NULL,
    instance    TEXT    NOT NULL,
    started_at  BIGINT  NOT NULL,
    finished_at BIGINT,
    status      TEXT    NOT NULL,
    scanned     BIGINT  NOT NULL DEFAULT 0,
    affected    BIGINT  NOT NULL DEFAULT 0,
    error       TEXT
);
CREATE INDEX job_run_job ON job_run (job, id);
