//! Admin actions on tasks: cancel, resume, pause, unpause and restart. Each is audited
//! with the acting admin and keeps the one-outcome-per-message promise (a cancel sends one
//! notice; a resumed or restarted task answers under a new key).

use std::sync::Arc;

use crate::config::Config;
use crate::definition::ToolKind;
use crate::domain::AuditTarget;
use crate::domain::{AuditEvent, ReplyType, TaskRow, TaskStatus, now_ms};
use crate::domain::{Decision, FailureType, NewReply, StepStatus, StepType};
use crate::engine::RunningTasks;
use crate::store::Store;
use crate::store::StoreResult;
use crate::store::tasks::Control;
use crate::store::workflow::{Decided, Decline, PendingActionRow};
use crate::wake::Wake;

/// What the admin actions on tasks are given by `app.rs`.
pub struct TaskControl {
    pub config: Arc<Config>,
    pub store: Store,
    /// Stops a task running in this instance at once.
    pub running: Arc<RunningTasks>,
    pub wake: Arc<Wake>,
}

/// Cancels a PENDING, RUNNING or WAITING_HUMAN_CONFIRM task; a step running in this
/// instance is stopped at once, one running elsewhere at its next heartbeat or write.
pub async fn cancel_task(svc: &TaskControl, task_id: i64, actor: &str) -> StoreResult<Control> {
    let Some(task) = svc.store.task(task_id).await? else {
        return Ok(Control::NotFound);
    };
    if task.status.is_terminal() {
        return Ok(Control::Conflict(task.status));
    }
    let text = svc
        .config
        .replies
        .cancelled_notice
        .replace("{task_id}", &task_id.to_string());
    let notice = notice(svc, &task, &text).await?;
    let control = svc
        .store
        .cancel_task(task_id, actor, &notice, now_ms())
        .await?;
    if control == Control::Done {
        if svc.running.stop(task_id) {
            tracing::info!(task_id, "told the running step to stop");
        }
        tracing::info!(task_id, actor, "task cancelled");
        svc.wake.replies.notify_one();
        // The next message of the conversation may run now.
        svc.wake.tasks.notify_one();
    }
    Ok(control)
}

/// The one notice a task owes its chat when an admin or approver ends it: `text`, in reply
/// to the task's message, under the task's reply key.
async fn notice(svc: &TaskControl, task: &TaskRow, text: &str) -> StoreResult<NewReply> {
    let in_reply_to = svc
        .store
        .message(task.message_id)
        .await?
        .map(|m| m.external_message_id)
        .unwrap_or_default();
    let content = serde_json::json!({ "text": text }).to_string();
    Ok(task.reply(in_reply_to, ReplyType::Text, content))
}

/// Resumes a FAILED task (or one cancelled by an error) from its last finished step.
pub async fn resume_task(svc: &TaskControl, task_id: i64, actor: &str) -> StoreResult<Control> {
    let control = svc.store.resume_task(task_id, actor, now_ms()).await?;
    if control == Control::Done {
        tracing::info!(task_id, actor, "task resumed");
        svc.wake.tasks.notify_one();
    }
    Ok(control)
}

/// Pauses a PENDING task at once, a RUNNING one at its next step boundary.
pub async fn pause_task(svc: &TaskControl, task_id: i64, actor: &str) -> StoreResult<Control> {
    let control = svc.store.pause_task(task_id, actor, now_ms()).await?;
    if control == Control::Done {
        tracing::info!(task_id, actor, "task paused (or pausing at its next step)");
        // A newer message of the conversation may run now.
        svc.wake.tasks.notify_one();
    }
    Ok(control)
}

/// Puts a PAUSED task back to PENDING (or withdraws a pause not yet reached).
pub async fn unpause_task(svc: &TaskControl, task_id: i64, actor: &str) -> StoreResult<Control> {
    let control = svc.store.unpause_task(task_id, actor, now_ms()).await?;
    if control == Control::Done {
        tracing::info!(task_id, actor, "task unpaused");
        svc.wake.tasks.notify_one();
    }
    Ok(control)
}

/// Runs a finished task again from its first step on a fresh journal.
pub async fn restart_task(svc: &TaskControl, task_id: i64, actor: &str) -> StoreResult<Control> {
    let control = svc.store.restart_task(task_id, actor, now_ms()).await?;
    if control == Control::Done {
        tracing::info!(task_id, actor, "task restarted from its first step");
        svc.wake.tasks.notify_one();
    }
    Ok(control)
}

/// How a human decision on a waiting task went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecisionResult {
    /// Approved: the task continues at the step.
    Resumed,
    /// Rejected: the task is cancelled and the requester told.
    Cancelled,
    NotFound,
    /// Nothing is waiting for a decision (already decided, or never asked).
    NotWaiting(TaskStatus),
    /// The approver may not decide this; audited.
    Forbidden,
    /// The request's deadline has passed (the timeout scan may not have run yet); audited.
    Expired,
    /// The decision names a request that is not the open one (another run, another step,
    /// other arguments, or none is open any more); audited with the reason.
    Stale(String),
}

/// Approves or rejects what task `task_id` waits for. `request`, when given (every chat
/// path: card, callback, command, reaction; the admin page), must name the open request as
/// it stands, its run, step and arguments, so a card of a decided, expired or restarted run,
/// or one with other arguments, cannot decide it; such a decision is refused and audited
/// CONFIRM_DENIED with the reason. `admin` says the decision came through the admin API,
/// which may decide requests that name no approvers.
pub async fn decide(
    svc: &TaskControl,
    task_id: i64,
    request: Option<&crate::domain::ApprovalRef>,
    approve: bool,
    approver: &str,
    admin: bool,
) -> StoreResult<DecisionResult> {
    let Some(task) = svc.store.task(task_id).await? else {
        return Ok(DecisionResult::NotFound);
    };
    let verb = if approve { "approval" } else { "rejection" };
    let open = svc.store.open_pending_action(task_id).await?;
    let deny = |action: Option<i64>, summary: String| async move {
        svc.store
            .audit(
                Some(task_id),
                action.map(AuditTarget::Approval),
                AuditEvent::ConfirmDenied,
                approver,
                &summary,
                true,
                now_ms(),
            )
            .await
    };
    let stale = match (&open, request) {
        (None, None) => return Ok(DecisionResult::NotWaiting(task.status)),
        (None, Some(_)) => Some(format!(
            "no request is open (the task is {}): it was decided, expired or replaced",
            task.status
        )),
        (Some(action), Some(request)) => action.stale(request),
        (Some(_), None) => None,
    };
    if let Some(reason) = stale {
        let named = request.map(|r| r.token()).unwrap_or_default();
        let summary = format!("{verb} by {approver} of request {named} refused: {reason}");
        deny(open.as_ref().map(|a| a.id), summary).await?;
        tracing::warn!(task_id, approver, %reason, "a decision on a stale approval request was refused");
        return Ok(match open {
            None => DecisionResult::NotWaiting(task.status),
            Some(_) => DecisionResult::Stale(reason),
        });
    }
    let Some(action) = open else {
        return Ok(DecisionResult::NotWaiting(task.status));
    };
    let now = now_ms();
    if now > action.deadline {
        let ago = (now - action.deadline) / 1000;
        let summary = format!(
            "{verb} of step {} by {approver} refused: its deadline passed {ago} s ago",
            action.step_no
        );
        deny(Some(action.id), summary).await?;
        return Ok(DecisionResult::Expired);
    }
    let open_to_admin = admin && action.approvers.trim() == "[]";
    if !action.allowed(approver) && !open_to_admin {
        let summary = format!(
            "{approver} may not decide step {} (allowed: {})",
            action.step_no, action.approvers
        );
        deny(Some(action.id), summary).await?;
        return Ok(DecisionResult::Forbidden);
    }
    let text = svc
        .config
        .replies
        .rejected_notice
        .replace("{task_id}", &task_id.to_string())
        .replace("{approver}", approver);
    if !approve && has_undoable_steps(&svc.config, &svc.store, task_id).await? {
        return reject_with_undo(svc, &task, &action, approver).await;
    }
    let notice = notice(svc, &task, &text).await?;
    let decided = svc
        .store
        .decide_pending_action(&action, approve, approver, &notice, now_ms())
        .await?;
    decision_result(svc, &task, approver, decided).await
}

/// What a decision the store applied (or found already applied) came to.
async fn decision_result(
    svc: &TaskControl,
    task: &TaskRow,
    approver: &str,
    decided: Decided,
) -> StoreResult<DecisionResult> {
    let task_id = task.id;
    Ok(match decided {
        Decided::Resumed => {
            tracing::info!(task_id, approver, "approved; task continues");
            svc.wake.tasks.notify_one();
            DecisionResult::Resumed
        }
        Decided::Cancelled => {
            tracing::info!(task_id, approver, "rejected; task cancelled");
            svc.wake.replies.notify_one();
            svc.wake.tasks.notify_one();
            DecisionResult::Cancelled
        }
        Decided::AlreadyDecided(_) => {
            let status = svc
                .store
                .task(task_id)
                .await?
                .map(|t| t.status)
                .unwrap_or(task.status);
            DecisionResult::NotWaiting(status)
        }
    })
}

/// A rejection of a task with earlier compensable steps: a worker undoes them (saga) and
/// ends the task with the rejection notice.
async fn reject_with_undo(
    svc: &TaskControl,
    task: &TaskRow,
    action: &PendingActionRow,
    approver: &str,
) -> StoreResult<DecisionResult> {
    let decline = Decline {
        decision: Decision::Rejected,
        actor: approver,
        reason: format!("rejected by {approver}"),
        failure: FailureType::Cancelled,
    };
    if svc
        .store
        .decline_to_worker(action, &decline, None, now_ms())
        .await?
    {
        tracing::info!(
            task_id = task.id,
            approver,
            "rejected; undoing earlier steps, then cancelling"
        );
        svc.wake.tasks.notify_one();
        return Ok(DecisionResult::Cancelled);
    }
    let status = svc.store.task(task.id).await?.map(|t| t.status);
    Ok(DecisionResult::NotWaiting(status.unwrap_or(task.status)))
}

/// Whether task `task_id` has finished compensable tool steps, which a rejection or an
/// expiry must undo before the task ends (saga): the same test the workflow runner applies
/// when it collects what to compensate.
pub async fn has_undoable_steps(config: &Config, store: &Store, task_id: i64) -> StoreResult<bool> {
    let steps = store.task_steps(task_id).await?;
    Ok(steps.iter().any(|s| {
        s.step_type == StepType::Tool
            && s.status == StepStatus::Succeeded
            && config
                .tools
                .get(&s.tool_name)
                .is_some_and(|t| t.kind == ToolKind::Compensable)
    }))
}

/// The decision a reaction stands for: `None` unless it reacts to an approval request sent
/// on `channel` (found by the platform message id the platform gave that request).
pub async fn reaction_decision(
    store: &Store,
    channel: &str,
    approver: &str,
    approve: bool,
    target: &str,
) -> StoreResult<Option<crate::domain::CardAction>> {
    let asked = store
        .reply_by_platform_message(channel, target)
        .await?
        .and_then(|reply| crate::channels::cards::approval_of(&reply.content));
    Ok(asked.map(|request| crate::domain::CardAction {
        request,
        approve,
        approver: approver.to_string(),
    }))
}
