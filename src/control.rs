//! Admin actions on tasks: cancel and resume. Both are audited with the acting admin and
//! keep the one-outcome-per-message promise (a cancel sends one notice; a resumed task
//! answers under a new key).

use crate::app::Services;
use crate::domain::{ReplyType, now_ms, reply_key};
use crate::store::StoreResult;
use crate::store::tasks::{Control, NewReply};

/// Cancels a PENDING, RUNNING or WAITING_HUMAN_CONFIRM task; a step running in this
/// instance is stopped at once, one running elsewhere at its next heartbeat or write.
pub async fn cancel_task(svc: &Services, task_id: i64, actor: &str) -> StoreResult<Control> {
    let Some(task) = svc.store.task(task_id).await? else {
        return Ok(Control::NotFound);
    };
    if task.status.is_terminal() {
        return Ok(Control::Conflict(task.status));
    }
    let in_reply_to = svc
        .store
        .message(task.message_id)
        .await?
        .map(|m| m.external_message_id)
        .unwrap_or_default();
    let text = svc
        .config
        .replies
        .cancelled_notice
        .replace("{task_id}", &task_id.to_string());
    let notice = NewReply {
        idempotency_key: reply_key(task.id, task.resume_count),
        channel: task.channel.clone(),
        conversation_id: task.conversation_id.clone(),
        in_reply_to,
        reply_type: ReplyType::Text,
        content: serde_json::json!({ "text": text }).to_string(),
    };
    let control = svc
        .store
        .cancel_task(task_id, actor, &notice, now_ms())
        .await?;
    if control == Control::Done {
        if svc.stop_running(task_id) {
            tracing::info!(task_id, "told the running step to stop");
        }
        tracing::info!(task_id, actor, "task cancelled");
        svc.reply_wake.notify_one();
        // The next message of the conversation may run now.
        svc.task_wake.notify_one();
    }
    Ok(control)
}

/// Resumes a FAILED task (or one cancelled by an error) from its last finished step.
pub async fn resume_task(svc: &Services, task_id: i64, actor: &str) -> StoreResult<Control> {
    let control = svc.store.resume_task(task_id, actor, now_ms()).await?;
    if control == Control::Done {
        tracing::info!(task_id, actor, "task resumed");
        svc.task_wake.notify_one();
    }
    Ok(control)
}
