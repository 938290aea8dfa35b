//! Approval gates: an irreversible step waits for a human (an approval card, a deadline);
//! a non-idempotent step found interrupted becomes UNKNOWN and waits the same way.

use serde_json::{Value, json};

use crate::domain::{FailureType, PendingKind, ReplyType, StepStatus, StepType, now_ms, reply_key};
use crate::domain::{NewReply, NewStep, StepRow};
use crate::engine::task::RunError;
use crate::store::workflow::NewPendingAction;

use super::runner::{Runner, Stop, parse_output};

impl Runner<'_> {
    /// An approval gate: passes when the journal holds the approval, else parks the task.
    pub(super) async fn gate(
        &mut self,
        kind: PendingKind,
        name: &str,
        args: &Value,
        message: String,
        approvers: Vec<String>,
        deadline_secs: u64,
    ) -> Result<Value, Stop> {
        self.step_no += 1;
        let step_no = self.step_no;
        if let Some(row) = self.journal.get(&step_no) {
            self.expect_name(row, name)?;
            match row.status {
                StepStatus::Succeeded => {
                    return Ok(parse_output(row.output.as_deref()));
                }
                StepStatus::Failed => {
                    let row = row.clone();
                    return Err(self.declined_stop(&row).unwrap_or_else(|| {
                        Stop::Failed(
                            FailureType::Cancelled,
                            row.error.clone().unwrap_or_else(|| "rejected".into()),
                        )
                    }));
                }
                _ => {}
            }
        }
        let key = self.exec().key(step_no, name);
        let input = args.to_string();
        let now = now_ms();
        let action = NewPendingAction {
            step_no,
            kind,
            tool_name: name.to_string(),
            args: input.clone(),
            approvers,
            message: message.clone(),
            deadline: now + (deadline_secs as i64) * 1000,
        };
        let card = self.approval_card(&action);
        let parked = self
            .svc
            .journal
            .park_for_confirmation(
                self.fence,
                &NewStep {
                    step_no,
                    step_type: StepType::Human,
                    tool_name: name,
                    idempotency_key: &key,
                    input: &input,
                },
                &action,
                &card,
                now,
            )
            .await?;
        if !parked {
            return Err(Stop::Run(RunError::LostLease));
        }
        self.svc.wake.replies.notify_one();
        Err(Stop::Run(RunError::Parked))
    }

    /// The approval request sent to the chat: a card with Approve/Reject actions whose
    /// callback is the channel's actions webhook.
    pub(super) fn approval_card(&self, action: &NewPendingAction) -> NewReply {
        let task = &self.ctx.task;
        // The buttons name this request: its run, step and the digest of the arguments
        // shown, so a decision on this card cannot apply to another (issue 32).
        let request = crate::domain::ApprovalRef::new(
            task.id,
            task.restart_count,
            action.step_no,
            &action.args,
        );
        let value = |decision: &str| request.card_value(decision);
        let card = json!({
            "card_type": "approval_request",
            "title": "Approval needed",
            "message": action.message,
            "kind": action.kind.as_str(),
            "tool": action.tool_name,
            "args": serde_json::from_str::<Value>(&action.args).unwrap_or(Value::Null),
            "approvers": action.approvers,
            "deadline": action.deadline,
            "actions": [
                { "id": "approve", "label": "Approve", "callback": "/webhooks/generic/actions", "value": value("approve") },
                { "id": "reject", "label": "Reject", "callback": "/webhooks/generic/actions", "value": value("reject") },
            ],
        });
        NewReply {
            idempotency_key: format!(
                "{}-confirm-{}",
                reply_key(task.id, task.resume_count),
                action.step_no
            ),
            channel: task.channel.clone(),
            conversation_id: task.conversation_id.clone(),
            in_reply_to: self.ctx.message.external_message_id.clone(),
            reply_type: ReplyType::Card,
            content:
                json!({ "text": format!("Approval needed: {}", action.message), "card": card })
                    .to_string(),
        }
    }

    pub(super) fn expect_name(&self, row: &StepRow, name: &str) -> Result<(), Stop> {
        if row.tool_name != name {
            return Err(Stop::Run(RunError::Corrupt(format!(
                "journal diverged at step {}: expected `{name}`, found `{}`",
                row.step_no, row.tool_name
            ))));
        }
        Ok(())
    }

    pub(super) async fn park_unknown(&self, row: &StepRow) -> Stop {
        let now = now_ms();
        let agent = &self.ctx.agent;
        let action = NewPendingAction {
            step_no: row.step_no,
            kind: PendingKind::UnknownStep,
            tool_name: row.tool_name.clone(),
            args: row.input.clone().unwrap_or_else(|| "null".into()),
            approvers: agent.approvers.clone(),
            message: format!(
                "`{}` was interrupted by a crash and may or may not have happened. Approve to run it again, reject to cancel the task.",
                row.tool_name
            ),
            deadline: now + (agent.confirm_deadline_secs as i64) * 1000,
        };
        let card = self.approval_card(&action);
        tracing::warn!(step = row.step_no, tool = %row.tool_name, "interrupted non-idempotent step; waiting for a human");
        match self
            .svc
            .journal
            .park_unknown_step(self.fence, row.id, &action, &card, now)
            .await
        {
            Ok(true) => {
                self.svc.wake.replies.notify_one();
                Stop::Run(RunError::Parked)
            }
            Ok(false) => Stop::Run(RunError::LostLease),
            Err(e) => Stop::Run(RunError::Store(e)),
        }
    }
}
