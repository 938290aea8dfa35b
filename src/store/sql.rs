//! SQL shared by the store's files: column lists, the current-step expression, and the
//! audit and reply inserts that run inside a caller's transaction.

/// Appends one audit event inside the caller's transaction (`$tx`). A macro rather than a
/// generic function: generic executors make the futures that call them not `Send`.
macro_rules! insert_audit {
    ($tx:expr, $task_id:expr, $event:expr, $actor:expr, $summary:expr, $risk:expr, $now:expr $(,)?) => {
        sqlx::query(
            "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind($task_id)
        .bind($event)
        .bind($actor)
        .bind($crate::redaction::redact(&$crate::domain::truncate(
            $summary, 2000,
        )))
        .bind($risk)
        .bind($now)
        .execute($tx)
        .await
    };
}
pub(crate) use insert_audit;

/// Queues a task's reply inside the caller's transaction; a second insert under the same key
/// is a no-op. A macro for the same reason as `insert_audit!`.
macro_rules! insert_reply {
    ($tx:expr, $task_id:expr, $reply:expr, $now:expr) => {
        sqlx::query(
            "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
             in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 0, $9, $9) \
             ON CONFLICT (idempotency_key) DO NOTHING",
        )
        .bind($task_id)
        .bind(&$reply.idempotency_key)
        .bind(&$reply.channel)
        .bind(&$reply.conversation_id)
        .bind(&$reply.in_reply_to)
        .bind($reply.reply_type)
        .bind(&$reply.content)
        .bind($crate::domain::ReplyStatus::Pending)
        .bind($now)
        .execute($tx)
    };
}

pub(crate) use insert_reply;

/// The highest step journalled for the task in `agent_task` (0 before its first step): the
/// step it is at, or was at when it stopped. Read, not stored, so that beginning a step
/// writes only the step row.
macro_rules! current_step_sql {
    () => {
        "(SELECT COALESCE(MAX(s.step_no), 0) FROM agent_step s WHERE s.task_id = agent_task.id)"
    };
}
pub(super) use current_step_sql;

pub(super) const STEP_COLUMNS: &str = "id, task_id, step_no, step_type, tool_name, idempotency_key, input, \
     output, error, status, tokens_in, tokens_out, duration_ms, attempt, created_at, finished_at";
