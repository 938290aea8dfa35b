//! Step-level writes of workflow runs and the human decisions they wait for. Fenced like
//! every worker write; a decision is one transaction that moves the task on.

use super::sql::{insert_audit, insert_reply};
use super::{Store, StoreResult, on_pool, write_tx};
use crate::domain::AuditTarget;
use crate::domain::{AuditEvent, Decision, FailureType, PendingKind, StepStatus, TaskStatus};
use crate::domain::{Fence, NewReply, NewStep};

/// Takes the task row under the fence (and, on PostgreSQL, its row lock); `false` = lost.
macro_rules! fence_task {
    ($tx:expr, $fence:expr, $now:expr) => {
        sqlx::query(
            "UPDATE agent_task SET updated_at = $1 \
             WHERE id = $2 AND owner = $3 AND version = $4 AND status = 'RUNNING'",
        )
        .bind($now)
        .bind($fence.task_id)
        .bind(&$fence.owner)
        .bind($fence.version)
        .execute($tx)
        .await?
        .rows_affected()
            == 1
    };
}

/// Inserts a pending action inside the caller's transaction.
macro_rules! insert_pending_action {
    ($tx:expr, $task_id:expr, $action:expr, $now:expr) => {
        sqlx::query_as::<_, (i64,)>(
            "INSERT INTO pending_action (task_id, restart_no, step_no, kind, tool_name, args, \
             approvers, message, decision, deadline, created_at) \
             VALUES ($1, (SELECT restart_count FROM agent_task WHERE id = $1), $2, $3, $4, $5, \
             $6, $7, $8, $9, $10) \
             ON CONFLICT (task_id, restart_no, step_no) DO NOTHING RETURNING id",
        )
        .bind($task_id)
        .bind($action.step_no)
        .bind($action.kind)
        .bind(&$action.tool_name)
        .bind($crate::store::text::storable(&$action.args))
        .bind(serde_json::to_string(&$action.approvers).unwrap_or_else(|_| "[]".into()))
        .bind($crate::store::text::storable(&$action.message))
        .bind(Decision::Pending)
        .bind($action.deadline)
        .bind($now)
        .fetch_optional($tx)
    };
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PendingActionRow {
    pub id: i64,
    pub task_id: i64,
    /// The task's restart number when the request was made (its run).
    pub restart_no: i64,
    pub step_no: i64,
    pub kind: PendingKind,
    pub tool_name: String,
    pub args: String,
    /// JSON array of the user ids allowed to decide.
    pub approvers: String,
    pub message: String,
    pub decision: Decision,
    pub decided_by: Option<String>,
    pub deadline: i64,
    pub created_at: i64,
    pub decided_at: Option<i64>,
}

impl PendingActionRow {
    /// Why `request` does not name this request as it stands (`None`: it does).
    pub fn stale(&self, request: &crate::domain::ApprovalRef) -> Option<String> {
        request.stale_against(self.restart_no, self.step_no, &self.args)
    }

    pub fn allowed(&self, approver: &str) -> bool {
        serde_json::from_str::<Vec<String>>(&self.approvers)
            .map(|list| list.iter().any(|a| a == approver))
            .unwrap_or(false)
    }
}

const ACTION_COLUMNS: &str = "id, task_id, restart_no, step_no, kind, tool_name, args, approvers, message, \
     decision, decided_by, deadline, created_at, decided_at";

/// What a task parks on.
#[derive(Debug, Clone)]
pub struct NewPendingAction {
    pub step_no: i64,
    pub kind: PendingKind,
    pub tool_name: String,
    pub args: String,
    pub approvers: Vec<String>,
    pub message: String,
    pub deadline: i64,
}

/// The result of a human decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decided {
    /// Approved: the task is PENDING again and continues at the step.
    Resumed,
    /// Rejected: the task is CANCELLED and the requester is told.
    Cancelled,
    /// Somebody decided first (or the deadline passed).
    AlreadyDecided(Decision),
}

/// A rejection or an expiry handed to a worker because earlier compensable steps must be
/// undone first (see [`Store::decline_to_worker`]).
#[derive(Debug, Clone)]
pub struct Decline<'a> {
    /// REJECTED (by `actor`) or EXPIRED.
    pub decision: Decision,
    pub actor: &'a str,
    /// Why, on the step and in the audit.
    pub reason: String,
    /// How the task will end: CANCELLED (rejected) or TIMEOUT (expired).
    pub failure: FailureType,
}

impl Store {
    /// Keeps the latest rolling summary of a long task (never in `result`).
    pub async fn set_context_summary(
        &self,
        fence: &Fence,
        summary: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            sqlx::query(
                "UPDATE agent_task SET context_summary = $1, updated_at = $2 \
                 WHERE id = $3 AND owner = $4 AND version = $5 AND status = 'RUNNING'",
            )
            .bind(super::text::storable(summary))
            .bind(now)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// The newest history summary of the conversation that covers only messages before
    /// `before` (a message id), made by the task of a message from `since` on (the history
    /// window a task reads: a walk of at most that many messages of the conversation's index)
    /// other than `task_id`: the journalled output of the `summary` step that made it (blob
    /// references read through) and the id of the newest message it covers.
    pub async fn conversation_summary(
        &self,
        channel: &str,
        conversation_id: &str,
        (since, before): (i64, i64),
        task_id: i64,
    ) -> StoreResult<Option<(String, i64)>> {
        // Each message's task's steps by the task's key (`agent_step_task_id_step_no_key`).
        // Retention empties a step's output; a restart moves its steps aside.
        let found: Option<(String, i64)> = on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT s.output, s.summary_through FROM im_message m \
                 JOIN agent_step s ON s.task_id = m.task_id \
                 WHERE m.channel = $1 AND m.conversation_id = $2 AND m.id >= $3 AND m.id <= $4 \
                 AND s.task_id <> $5 AND s.summary_through < $4 AND s.output IS NOT NULL \
                 ORDER BY s.summary_through DESC LIMIT 1",
            )
            .bind(channel)
            .bind(conversation_id)
            .bind(since)
            .bind(before)
            .bind(task_id)
            .fetch_optional(pool)
            .await?
        });
        let Some((output, through)) = found else {
            return Ok(None);
        };
        let Some(id) = super::blobs::blob_id(&output) else {
            return Ok(Some((output, through)));
        };
        let body = self.blob_bodies(&[id]).await?.pop();
        Ok(body.map(|(_, body)| (body, through)))
    }

    /// Marks a compensable step undone (its undo step succeeded).
    pub async fn mark_step_compensated(
        &self,
        fence: &Fence,
        step_no: i64,
        now: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            if !fence_task!(&mut *tx, fence, now) {
                return Ok(false);
            }
            let step: Option<(i64,)> = sqlx::query_as(
                "UPDATE agent_step SET status = $1 WHERE task_id = $2 AND step_no = $3 RETURNING id",
            )
            .bind(StepStatus::Compensated)
            .bind(fence.task_id)
            .bind(step_no)
            .fetch_optional(&mut *tx)
            .await?;
            insert_audit!(
                &mut *tx,
                Some(fence.task_id),
                AuditEvent::StepCompensated,
                &fence.owner,
                &format!("step {step_no} compensated"),
                false,
                now,
                target = step.map(|(id,)| AuditTarget::Step(id)),
            )?;
            true
        });
        Ok(done)
    }

    /// Parks the task for a human: WAITING_HUMAN_CONFIRM with a deadline, the gate step
    /// PENDING, the pending action, and the approval card queued for the chat.
    pub async fn park_for_confirmation(
        &self,
        fence: &Fence,
        step: &NewStep<'_>,
        action: &NewPendingAction,
        card: &NewReply,
        now: i64,
    ) -> StoreResult<bool> {
        let parked = write_tx!(self, tx => {
            let n = sqlx::query(
                "UPDATE agent_task SET status = $1, confirm_deadline = $2, \
                 version = version + 1, lease_expire = NULL, updated_at = $3 \
                 WHERE id = $4 AND owner = $5 AND version = $6 AND status = 'RUNNING'",
            )
            .bind(TaskStatus::WaitingHumanConfirm)
            .bind(action.deadline)
            .bind(now)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n != 1 {
                return Ok(false);
            }
            sqlx::query(
                "INSERT INTO agent_step (task_id, step_no, step_type, tool_name, \
                 idempotency_key, input, status, attempt, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 0, $8) \
                 ON CONFLICT (task_id, step_no) DO NOTHING",
            )
            .bind(fence.task_id)
            .bind(step.step_no)
            .bind(step.step_type)
            .bind(step.tool_name)
            .bind(step.idempotency_key)
            .bind(super::text::storable(step.input))
            .bind(StepStatus::Pending)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            let approval: Option<(i64,)> =
                insert_pending_action!(&mut *tx, fence.task_id, action, now).await?;
            insert_reply!(&mut *tx, fence.task_id, card, now).await?;
            insert_audit!(
                &mut *tx,
                Some(fence.task_id),
                AuditEvent::TaskWaitingConfirm,
                &fence.owner,
                &format!("step {} waits for {}: {}", action.step_no, action.kind, action.message),
                false,
                now,
                target = approval.map(|(id,)| AuditTarget::Approval(id)),
            )?;
            true
        });
        Ok(parked)
    }

    /// A non-idempotent step found PENDING after a crash: its outcome is unknown, so it is
    /// marked UNKNOWN (risk-flagged) and the task waits for a human instead of guessing.
    pub async fn park_unknown_step(
        &self,
        fence: &Fence,
        step_id: i64,
        action: &NewPendingAction,
        card: &NewReply,
        now: i64,
    ) -> StoreResult<bool> {
        let parked = write_tx!(self, tx => {
            let n = sqlx::query(
                "UPDATE agent_task SET status = $1, confirm_deadline = $2, \
                 version = version + 1, lease_expire = NULL, updated_at = $3 \
                 WHERE id = $4 AND owner = $5 AND version = $6 AND status = 'RUNNING'",
            )
            .bind(TaskStatus::WaitingHumanConfirm)
            .bind(action.deadline)
            .bind(now)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n != 1 {
                return Ok(false);
            }
            sqlx::query("UPDATE agent_step SET status = $1 WHERE id = $2 AND task_id = $3")
                .bind(StepStatus::Unknown)
                .bind(step_id)
                .bind(fence.task_id)
                .execute(&mut *tx)
                .await?;
            let _: Option<(i64,)> =
                insert_pending_action!(&mut *tx, fence.task_id, action, now).await?;
            insert_reply!(&mut *tx, fence.task_id, card, now).await?;
            insert_audit!(
                &mut *tx,
                Some(fence.task_id),
                AuditEvent::StepUnknown,
                &fence.owner,
                &format!(
                    "step {} ({}) was interrupted and is not safe to repeat; waiting for a human",
                    action.step_no, action.tool_name
                ),
                true,
                now,
                target = Some(AuditTarget::Step(step_id)),
            )?;
            true
        });
        Ok(parked)
    }

    /// The open (undecided) pending action of a task, if any.
    pub async fn open_pending_action(&self, task_id: i64) -> StoreResult<Option<PendingActionRow>> {
        let sql = format!(
            "SELECT {ACTION_COLUMNS} FROM pending_action WHERE task_id = $1 AND decision = 'PENDING' \
             ORDER BY id DESC LIMIT 1"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, PendingActionRow>(&sql).bind(task_id).fetch_optional(pool).await?
        }))
    }

    pub async fn pending_action(&self, id: i64) -> StoreResult<Option<PendingActionRow>> {
        let sql = format!("SELECT {ACTION_COLUMNS} FROM pending_action WHERE id = $1");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, PendingActionRow>(&sql).bind(id).fetch_optional(pool).await?
        }))
    }

    pub async fn task_pending_actions(&self, task_id: i64) -> StoreResult<Vec<PendingActionRow>> {
        let sql =
            format!("SELECT {ACTION_COLUMNS} FROM pending_action WHERE task_id = $1 ORDER BY id");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, PendingActionRow>(&sql).bind(task_id).fetch_all(pool).await?
        }))
    }

    // long: one fenced transaction (decision, task, notice, audit) per dialect.
    /// Applies a decision on a still-open pending action, atomically: approve puts the task
    /// back to PENDING at the step; reject cancels it and queues `notice` for the chat.
    pub async fn decide_pending_action(
        &self,
        action: &PendingActionRow,
        approve: bool,
        approver: &str,
        notice: &NewReply,
        now: i64,
    ) -> StoreResult<Decided> {
        let decided = write_tx!(self, tx => {
            let decision = if approve { Decision::Approved } else { Decision::Rejected };
            let n = sqlx::query(
                "UPDATE pending_action SET decision = $1, decided_by = $2, decided_at = $3 \
                 WHERE id = $4 AND decision = 'PENDING'",
            )
            .bind(decision)
            .bind(approver)
            .bind(now)
            .bind(action.id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n != 1 {
                let (current,): (Decision,) =
                    sqlx::query_as("SELECT decision FROM pending_action WHERE id = $1")
                        .bind(action.id)
                        .fetch_one(&mut *tx)
                        .await?;
                return Ok(Decided::AlreadyDecided(current));
            }
            let output = serde_json::json!({
                "decision": if approve { "approve" } else { "reject" },
                "approver": approver,
            })
            .to_string();
            if approve {
                // An unknown step stays UNKNOWN: the runner runs it again. A gate step
                // succeeds with the decision as its output.
                if action.kind != PendingKind::UnknownStep {
                    sqlx::query(
                        "UPDATE agent_step SET status = $1, output = $2, finished_at = $3 \
                         WHERE task_id = $4 AND step_no = $5",
                    )
                    .bind(StepStatus::Succeeded)
                    .bind(super::text::storable(&output))
                    .bind(now)
                    .bind(action.task_id)
                    .bind(action.step_no)
                    .execute(&mut *tx)
                    .await?;
                }
                let moved = sqlx::query(
                    "UPDATE agent_task SET status = $1, confirm_deadline = NULL, run_after = $2, \
                     owner = NULL, version = version + 1, updated_at = $2 \
                     WHERE id = $3 AND status = $4",
                )
                .bind(TaskStatus::Pending)
                .bind(now)
                .bind(action.task_id)
                .bind(TaskStatus::WaitingHumanConfirm)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if moved != 1 {
                    // The task stopped waiting (cancelled, timed out): nothing to decide.
                    return Ok(Decided::AlreadyDecided(Decision::Expired));
                }
                insert_audit!(
                    &mut *tx,
                    Some(action.task_id),
                    AuditEvent::TaskConfirmed,
                    approver,
                    &format!("{} at step {} approved by {approver}", action.kind, action.step_no),
                    false,
                    now,
                target = Some(AuditTarget::Approval(action.id)),
                )?;
                Decided::Resumed
            } else {
                sqlx::query(
                    "UPDATE agent_step SET status = $1, error = $2, finished_at = $3 \
                     WHERE task_id = $4 AND step_no = $5",
                )
                .bind(StepStatus::Failed)
                .bind(format!("rejected by {approver}"))
                .bind(now)
                .bind(action.task_id)
                .bind(action.step_no)
                .execute(&mut *tx)
                .await?;
                let moved = sqlx::query(
                    "UPDATE agent_task SET status = $1, failure_type = 'CANCELLED', \
                     error_msg = $2, confirm_deadline = NULL, version = version + 1, \
                     finished_at = $3, updated_at = $3 WHERE id = $4 AND status = $5",
                )
                .bind(TaskStatus::Cancelled)
                .bind(format!("rejected by {approver}"))
                .bind(now)
                .bind(action.task_id)
                .bind(TaskStatus::WaitingHumanConfirm)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if moved != 1 {
                    return Ok(Decided::AlreadyDecided(Decision::Expired));
                }
                insert_reply!(&mut *tx, action.task_id, notice, now).await?;
                insert_audit!(
                    &mut *tx,
                    Some(action.task_id),
                    AuditEvent::TaskRejected,
                    approver,
                    &format!("{} at step {} rejected by {approver}", action.kind, action.step_no),
                    false,
                    now,
                target = Some(AuditTarget::Approval(action.id)),
                )?;
                Decided::Cancelled
            }
        });
        Ok(decided)
    }

    // long: one transaction (decision, gate step, task, audit, callback) per dialect.
    /// Declines what a task waits for and hands the task to a worker instead of ending it:
    /// the request decided, its step FAILED with `{"declined", "failure_type", "by"}` in
    /// its output, the task PENDING again. The worker replays the journal, meets the
    /// declined step, undoes the earlier compensable steps (saga) and ends the task
    /// CANCELLED with the one notice. `false` when it was decided or ended first.
    pub async fn decline_to_worker(
        &self,
        action: &PendingActionRow,
        decline: &Decline<'_>,
        callback: Option<&NewReply>,
        now: i64,
    ) -> StoreResult<bool> {
        let declined = if decline.decision == Decision::Rejected {
            "rejected"
        } else {
            "expired"
        };
        let output = serde_json::json!({
            "declined": declined,
            "failure_type": decline.failure.as_str(),
            "error": decline.reason,
            "by": decline.actor,
        })
        .to_string();
        let done = write_tx!(self, tx => {
            let n = sqlx::query(
                "UPDATE pending_action SET decision = $1, decided_by = $2, decided_at = $3 \
                 WHERE id = $4 AND decision = 'PENDING'",
            )
            .bind(decline.decision)
            .bind((decline.decision == Decision::Rejected).then_some(decline.actor))
            .bind(now)
            .bind(action.id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n != 1 {
                return Ok(false);
            }
            let moved = sqlx::query(
                "UPDATE agent_task SET status = 'PENDING', confirm_deadline = NULL, \
                 run_after = $1, owner = NULL, version = version + 1, updated_at = $1 \
                 WHERE id = $2 AND status = 'WAITING_HUMAN_CONFIRM'",
            )
            .bind(now)
            .bind(action.task_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if moved != 1 {
                return Ok(false);
            }
            sqlx::query(
                "UPDATE agent_step SET status = $1, output = $2, error = $3, finished_at = $4 \
                 WHERE task_id = $5 AND step_no = $6",
            )
            .bind(StepStatus::Failed)
            .bind(super::text::storable(&output))
            .bind(super::text::storable(&decline.reason))
            .bind(now)
            .bind(action.task_id)
            .bind(action.step_no)
            .execute(&mut *tx)
            .await?;
            if let Some(callback) = callback {
                insert_reply!(&mut *tx, action.task_id, callback, now).await?;
            }
            let event = if decline.decision == Decision::Rejected {
                AuditEvent::TaskRejected
            } else {
                AuditEvent::TaskTimeoutCancelled
            };
            insert_audit!(
                &mut *tx,
                Some(action.task_id),
                event,
                decline.actor,
                &format!(
                    "{} at step {}: {}; earlier steps are undone before the task is cancelled",
                    action.kind, action.step_no, decline.reason
                ),
                false,
                now,
                target = Some(AuditTarget::Approval(action.id)),
            )?;
            true
        });
        Ok(done)
    }

    /// Appends one audit event on its own.
    /// `target`: what the event is about when not its task (see [`AuditTarget`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn audit(
        &self,
        task_id: Option<i64>,
        target: Option<AuditTarget>,
        event: AuditEvent,
        actor: &str,
        summary: &str,
        risk_flag: bool,
        now: i64,
    ) -> StoreResult<()> {
        write_tx!(self, tx => {
            let target = target.or(task_id.map(AuditTarget::Task));
            insert_audit!(&mut *tx, task_id, event, actor, summary, risk_flag, now, target = target)?;
        });
        Ok(())
    }
}
