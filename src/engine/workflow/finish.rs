//! How a workflow run ends: compensation of finished compensable steps after a failure,
//! then the terminal status and the one reply in one transaction.

use serde_json::{Value, json};

use crate::domain::TaskOutcome;
use crate::domain::{AuditEvent, FailureType, ReplyType, StepType, TaskStatus, now_ms, truncate};
use crate::engine::reply;
use crate::engine::task::RunError;

use super::runner::{Runner, StepDone, Stop, tool_outcome};
use crate::engine::step::{ERROR_LIMIT, RetryPlan};

impl Runner<'_> {
    /// Undoes the finished compensable steps, newest first; each undo is a journalled step.
    pub(super) async fn compensate(&mut self) -> Result<(), RunError> {
        let svc = self.svc;
        let tools = self.tools.clone();
        let tools = &*tools;
        let tooling = &svc.config.tooling;
        let plan = RetryPlan {
            max_tries: tooling.read_only_attempts,
            base_ms: tooling.retry_backoff_base_ms,
            max_ms: tooling.retry_backoff_max_ms,
            patience: None,
        };
        while let Some(done) = self.compensable.pop() {
            let input = json!({ "args": done.args, "result": done.result });
            let (tool, args, result) = (&done.tool, &done.args, &done.result);
            let outcome = self
                .journal(
                    StepType::Undo,
                    &format!("undo:{tool}"),
                    &input,
                    true,
                    move |key| async move {
                        tool_outcome(tools.undo(tool, args, result, &key).await, plan)
                    },
                )
                .await;
            match outcome {
                Ok(StepDone::Ok { .. }) => {
                    if !svc
                        .journal
                        .mark_step_compensated(self.fence, done.step_no)
                        .await?
                    {
                        return Err(RunError::LostLease);
                    }
                }
                Ok(StepDone::Failed(_, message)) => {
                    tracing::error!(step = done.step_no, tool = %done.tool, error = %message, "compensation failed");
                    svc.store
                        .audit(
                            Some(self.fence.task_id),
                            None,
                            AuditEvent::TaskFailed,
                            &self.fence.owner,
                            &format!(
                                "undo of step {} ({}) failed: {message}",
                                done.step_no, done.tool
                            ),
                            true,
                            now_ms(),
                        )
                        .await?;
                }
                Err(Stop::Run(e)) => return Err(e),
                Err(Stop::Failed(_, message)) => {
                    return Err(RunError::Corrupt(format!(
                        "compensation stopped: {message}"
                    )));
                }
            }
        }
        Ok(())
    }

    pub(super) fn trace_json(&self) -> String {
        json!({ "nodes": self.trace, "steps": self.step_no }).to_string()
    }

    pub(super) async fn finish_success(
        &mut self,
        reply_type: ReplyType,
        content: Value,
        result: String,
    ) -> Result<(), RunError> {
        let task = &self.ctx.task;
        let outcome = TaskOutcome {
            status: TaskStatus::Succeeded,
            result: Some(result),
            trace: Some(self.trace_json()),
            failure_type: None,
            error: None,
            retries: 0,
            step: None,
            reply: task.reply(
                self.ctx.message.external_message_id.clone(),
                reply_type,
                content.to_string(),
            ),
            audit_summary: format!("workflow finished after {} step(s)", self.step_no),
        };
        self.finish(outcome).await
    }

    pub(super) async fn finish_failure(
        &mut self,
        failure: FailureType,
        message: String,
    ) -> Result<(), RunError> {
        tracing::warn!(failure_type = %failure, error = %message, "workflow failed");
        let task = &self.ctx.task;
        let replies = &self.svc.config.replies;
        let (status, notice) = match &self.declined {
            // Declined by a human: cancelled (after the undo), with the notice the
            // decision owes the chat.
            Some(declined) => {
                let text = if declined.expired {
                    replies.timeout_notice.clone()
                } else {
                    replies.rejected_notice.replace("{approver}", &declined.by)
                };
                (
                    TaskStatus::Cancelled,
                    json!({ "text": text.replace("{task_id}", &task.id.to_string()) }),
                )
            }
            None => (
                TaskStatus::Failed,
                reply::failure_notice(&replies.failure_notice, task.id, failure),
            ),
        };
        let outcome = TaskOutcome {
            status,
            result: None,
            trace: Some(self.trace_json()),
            failure_type: Some(failure),
            error: Some(truncate(&message, ERROR_LIMIT)),
            retries: 0,
            step: None,
            reply: task.reply(
                self.ctx.message.external_message_id.clone(),
                ReplyType::Text,
                notice.to_string(),
            ),
            audit_summary: format!("{failure}: {}", truncate(&message, 300)),
        };
        self.finish(outcome).await
    }

    pub(super) async fn finish(&mut self, outcome: TaskOutcome) -> Result<(), RunError> {
        if let Some(feedback) = &self.ctx.feedback {
            feedback.settle().await;
        }
        // The chat sees the typing indicator end before the answer, which may go at once.
        self.svc.running.end_typing(self.fence.task_id).await;
        if !self.svc.journal.finish_task(self.fence, &outcome).await? {
            return Err(RunError::LostLease);
        }
        // The journal rang the outbox (or handed it the reply).
        tracing::info!(status = %outcome.status, steps = self.step_no, "workflow task finished");
        Ok(())
    }
}
