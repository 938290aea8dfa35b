//! What happens to a run that stops with an error instead of an outcome. An outage (the
//! database unavailable, a pool timeout, a lost connection) is waited out: the run goes on
//! under the same claim as soon as the database answers again, without counting. Any other
//! error (bad data, a bug) is deterministic as far as anyone can tell: it is counted on the
//! task, the task may be claimed again after a short, growing wait, and at
//! `engine.max_run_aborts` it ends FAILED with INTERNAL, its failure notice in the chat, so
//! no task loops forever and its conversation moves on.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::domain::{FailureType, Fence, ReplyType, TaskOutcome, TaskRow, TaskStatus, now_ms};

use super::reply;
use super::task::RunError;
use super::worker::Worker;

impl RunError {
    /// The run stopped because the database could not be reached; not the task's fault.
    pub fn is_outage(&self) -> bool {
        matches!(self, RunError::Store(e) if e.is_outage())
    }
}

/// Waits until the database answers again after an outage stopped a run, then hands back the
/// task as it stands if this run still owns it (`Ok(None)`: it does not, or the wait is over:
/// `until`, shutdown, or the lease lost). An error that is not an outage is returned, and
/// counts as the run's abort.
pub async fn wait_out_outage(
    svc: &Worker,
    fence: &Fence,
    lost: &CancellationToken,
    shutdown: &CancellationToken,
    until: Instant,
) -> Result<Option<TaskRow>, RunError> {
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = lost.cancelled() => return Ok(None),
            _ = shutdown.cancelled() => return Ok(None),
        }
        match svc.store.task(fence.task_id).await {
            Ok(Some(task)) if still_ours(&task, fence) => return Ok(Some(task)),
            Ok(_) => return Ok(None),
            Err(e) => {
                let e = RunError::from(e);
                if !e.is_outage() {
                    return Err(e);
                }
                if Instant::now() >= until {
                    tracing::warn!(error = %e, "the database is still unavailable; the task resumes when its lease expires");
                    return Ok(None);
                }
            }
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

fn still_ours(task: &TaskRow, fence: &Fence) -> bool {
    task.status == TaskStatus::Running
        && task.version == fence.version
        && task.owner.as_deref() == Some(fence.owner.as_str())
}

/// Counts a run that aborted with `error` (not an outage) and, at the limit, fails the task
/// INTERNAL with its failure notice. The task is read again here, on this rare path, rather
/// than kept from the claim by every run.
pub async fn count_abort(svc: &Worker, fence: &Fence, error: &RunError) {
    let engine = &svc.config.engine;
    let max = i64::from(engine.max_run_aborts);
    // Built here, without secrets: an error names no credential (issue 32), and what the
    // audit and the task keep is redacted as every stored error is.
    let text = crate::redaction::redact(&error.to_string());
    let task = match svc.store.task(fence.task_id).await {
        Ok(Some(task)) if still_ours(&task, fence) => task,
        Ok(_) => {
            tracing::warn!(error = %text, "task run aborted after it lost the task");
            return;
        }
        Err(e) => {
            tracing::error!(error = %text, read_error = %e, "task run aborted; reading the task failed, it resumes when its lease expires");
            return;
        }
    };
    let now = now_ms();
    let lease_ms = svc.config.worker.lease().as_millis() as i64;
    let wait = (engine.abort_retry_ms as i64)
        .saturating_mul(1i64 << task.run_aborts.clamp(0, 20))
        .min(lease_ms);
    let aborts = match svc
        .store
        .record_run_abort(fence, &text, max, now + wait, now)
        .await
    {
        Ok(Some(n)) => n,
        Ok(None) => {
            tracing::warn!(error = %text, "task run aborted after it lost the task");
            return;
        }
        Err(e) => {
            tracing::error!(error = %text, record_error = %e, "task run aborted; recording the abort failed, the task resumes when its lease expires");
            return;
        }
    };
    if aborts < max {
        tracing::error!(error = %text, aborts, max, retry_in_ms = wait, "task run aborted; it runs again after a pause");
        return;
    }
    tracing::error!(error = %text, aborts, "task run aborted too often; failing it INTERNAL");
    match fail_internal(svc, fence, &task, &text, aborts).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!("the task was lost before its failure was recorded"),
        Err(e) => {
            tracing::error!(error = %e, "failing the task failed; it runs again when its lease expires")
        }
    }
}

async fn fail_internal(
    svc: &Worker,
    fence: &Fence,
    task: &TaskRow,
    error: &str,
    aborts: i64,
) -> Result<bool, RunError> {
    let in_reply_to = match svc.store.message(task.message_id).await? {
        Some(message) => message.external_message_id,
        None => String::new(),
    };
    let failure = FailureType::Internal;
    let notice = reply::failure_notice(&svc.config.replies.failure_notice, task.id, failure);
    let error = crate::domain::truncate(&format!("run aborted {aborts} times: {error}"), 1000);
    let outcome = TaskOutcome {
        status: TaskStatus::Failed,
        result: None,
        trace: None,
        failure_type: Some(failure),
        audit_summary: format!("{failure}: {error}"),
        error: Some(error),
        retries: 0,
        step: None,
        reply: task.reply(in_reply_to, ReplyType::Text, notice.to_string()),
    };
    Ok(svc.journal.finish_task(fence, &outcome).await?)
}
