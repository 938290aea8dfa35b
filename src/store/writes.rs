//! The step journal, task-finishing and reply-delivered writes made while tasks run and
//! replies go out, as operations that can share one transaction (group commit, see
//! `engine::journal`). Each operation is fenced on its own: it lands only while its worker
//! still owns its task (or its sender the reply's lease), and a fence that fails affects
//! that operation alone.

use super::outbox::ReplyRow;
use super::tasks::{
    Fence, STEP_COLUMNS, StepResult, StepRow, TaskOutcome, insert_audit, insert_reply,
};
use super::{Store, StoreResult, write_tx};
use crate::domain::{AuditEvent, ReplyStatus, StepStatus, StepType, TaskStatus};

/// Writes a step's end inside the caller's transaction.
macro_rules! update_step {
    ($tx:expr, $step:expr, $now:expr) => {
        sqlx::query(
            "UPDATE agent_step SET status = $1, output = $2, error = $3, tokens_in = $4, \
             tokens_out = $5, duration_ms = $6, finished_at = $7, attempt = $9 WHERE id = $8",
        )
        .bind($step.status)
        .bind(&$step.output)
        .bind(&$step.error)
        .bind($step.tokens_in)
        .bind($step.tokens_out)
        .bind($step.duration_ms)
        .bind($now)
        .bind($step.step_id)
        .bind($step.attempts)
        .execute($tx)
    };
}

/// One fenced worker write.
#[derive(Debug, Clone)]
pub enum WriteOp {
    /// Journals a step as PENDING before its call (or finds it, on resume).
    BeginStep {
        fence: Fence,
        step_no: i64,
        step_type: StepType,
        tool_name: String,
        idempotency_key: String,
        input: String,
    },
    /// Records how a step ended.
    CompleteStep { fence: Fence, step: StepResult },
    /// Ends a task: terminal status, its last step, its one outbox reply and its audit event.
    FinishTask {
        fence: Fence,
        outcome: Box<TaskOutcome>,
    },
    /// Extends the lease of a task its worker still owns.
    RenewLease { fence: Fence, lease_until: i64 },
    /// Marks a reply delivered, while `owner` still holds its delivery lease.
    MarkReplySent {
        reply_id: i64,
        task_id: i64,
        idempotency_key: String,
        attempts: i64,
        owner: String,
        platform_message_id: Option<String>,
    },
}

/// What an operation came to.
#[derive(Debug, Clone)]
pub enum WriteOut {
    /// `BeginStep`: the journalled step, `None` when the worker no longer owns the task.
    Step(Option<Box<StepRow>>),
    /// `CompleteStep`, `FinishTask`: `false` (and nothing written) when ownership was lost.
    Done(bool),
}

impl WriteOut {
    pub fn step(self) -> Option<StepRow> {
        match self {
            WriteOut::Step(row) => row.map(|r| *r),
            WriteOut::Done(_) => None,
        }
    }

    pub fn done(self) -> bool {
        match self {
            WriteOut::Done(done) => done,
            WriteOut::Step(row) => row.is_some(),
        }
    }
}

impl Store {
    /// Applies `ops` in one transaction, ordered by task id (every transaction that holds
    /// several task rows takes them in the same order, so two cannot deadlock on PostgreSQL;
    /// operations of one task keep their order); one answer per operation, in the order
    /// given. An error rolls back all of them.
    pub async fn apply_writes(&self, ops: &[WriteOp], now: i64) -> StoreResult<Vec<WriteOut>> {
        let mut order: Vec<usize> = (0..ops.len()).collect();
        order.sort_by_key(|&i| ops[i].task_id());
        let mut answers: Vec<Option<WriteOut>> = vec![None; ops.len()];
        let done = self
            .apply_in_order(order.iter().map(|&i| &ops[i]), now)
            .await?;
        for (&i, out) in order.iter().zip(done) {
            answers[i] = Some(out);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or(WriteOut::Done(false)))
            .collect())
    }

    async fn apply_in_order<'o>(
        &self,
        ops: impl ExactSizeIterator<Item = &'o WriteOp>,
        now: i64,
    ) -> StoreResult<Vec<WriteOut>> {
        // $1 task, $2 step no, $3 type, $4 tool, $5 key, $6 input, $7 status, $8 now, $9 owner,
        // $10 version. SQLite runs the two statements of its text in one call (`changes()` is
        // the update's row count); PostgreSQL does the same with a data-modifying CTE.
        let fenced_update = "UPDATE agent_task SET current_step = $2, updated_at = $8 \
             WHERE id = $1 AND owner = $9 AND version = $10 AND status = 'RUNNING'";
        let step_insert = "INSERT INTO agent_step (task_id, step_no, step_type, tool_name, \
             idempotency_key, input, status, attempt, created_at) \
             SELECT $1, $2, $3, $4, $5, $6, $7, 0, $8";
        let begin = match self {
            Store::Sqlite(_) => format!(
                "{fenced_update}; {step_insert} WHERE changes() = 1 \
                 ON CONFLICT (idempotency_key) DO NOTHING RETURNING {STEP_COLUMNS}"
            ),
            Store::Postgres(_) => format!(
                "WITH fenced AS ({fenced_update} RETURNING id) {step_insert} FROM fenced \
                 ON CONFLICT (idempotency_key) DO NOTHING RETURNING {STEP_COLUMNS}"
            ),
        };
        let existing = format!(
            "SELECT {STEP_COLUMNS} FROM agent_step WHERE idempotency_key = $1 \
             AND EXISTS (SELECT 1 FROM agent_task t WHERE t.id = $2 AND t.owner = $3 \
             AND t.version = $4 AND t.status = 'RUNNING')"
        );
        let lock = match self {
            Store::Sqlite(_) => "",
            Store::Postgres(_) => " FOR UPDATE",
        };
        let complete = format!(
            "UPDATE agent_step SET status = $1, output = $2, error = $3, tokens_in = $4, \
             tokens_out = $5, duration_ms = $6, finished_at = $7, attempt = $9 WHERE id = $8 \
             AND EXISTS (SELECT 1 FROM agent_task t WHERE t.id = $10 AND t.owner = $11 \
             AND t.version = $12 AND t.status = 'RUNNING'{lock})"
        );
        let out = write_tx!(self, tx => {
            let mut out = Vec::with_capacity(ops.len());
            for op in ops {
                out.push(match op {
                    WriteOp::BeginStep {
                        fence,
                        step_no,
                        step_type,
                        tool_name,
                        idempotency_key,
                        input,
                    } => {
                        // One round trip: the fenced task-row update (which on PostgreSQL
                        // also locks the row, so no claim slips in before commit) and the
                        // insert, which only happens when the fence held.
                        let inserted = sqlx::query_as::<_, StepRow>(&begin)
                            .bind(fence.task_id)
                            .bind(step_no)
                            .bind(step_type)
                            .bind(tool_name)
                            .bind(idempotency_key)
                            .bind(input)
                            .bind(StepStatus::Pending)
                            .bind(now)
                            .bind(&fence.owner)
                            .bind(fence.version)
                            .fetch_all(&mut *tx)
                            .await?
                            .pop();
                        let row = match inserted {
                            Some(row) => Some(row),
                            // Journalled before (a resume): read as it stands, if still ours.
                            None => {
                                sqlx::query_as::<_, StepRow>(&existing)
                                    .bind(idempotency_key)
                                    .bind(fence.task_id)
                                    .bind(&fence.owner)
                                    .bind(fence.version)
                                    .fetch_optional(&mut *tx)
                                    .await?
                            }
                        };
                        WriteOut::Step(row.map(Box::new))
                    }
                    WriteOp::CompleteStep { fence, step } => {
                        // The fence and the write in one statement; on PostgreSQL the task
                        // row is locked as `fence_task!` would, so no claim slips in first.
                        let written = sqlx::query(&complete)
                            .bind(step.status)
                            .bind(&step.output)
                            .bind(&step.error)
                            .bind(step.tokens_in)
                            .bind(step.tokens_out)
                            .bind(step.duration_ms)
                            .bind(now)
                            .bind(step.step_id)
                            .bind(step.attempts)
                            .bind(fence.task_id)
                            .bind(&fence.owner)
                            .bind(fence.version)
                            .execute(&mut *tx)
                            .await?
                            .rows_affected();
                        WriteOut::Done(written == 1)
                    }
                    WriteOp::FinishTask { fence, outcome } => {
                        let owned = sqlx::query(
                            "UPDATE agent_task SET status = $1, result = $2, failure_type = $3, \
                             error_msg = $4, retry_count = retry_count + $5, version = version + 1, \
                             lease_expire = NULL, finished_at = $6, updated_at = $6, trace = $10 \
                             WHERE id = $7 AND owner = $8 AND version = $9 AND status = 'RUNNING'",
                        )
                        .bind(outcome.status)
                        .bind(&outcome.result)
                        .bind(outcome.failure_type)
                        .bind(&outcome.error)
                        .bind(outcome.retries)
                        .bind(now)
                        .bind(fence.task_id)
                        .bind(&fence.owner)
                        .bind(fence.version)
                        .bind(&outcome.trace)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                            == 1;
                        if owned {
                            if let Some(step) = &outcome.step {
                                update_step!(&mut *tx, step, now).await?;
                            }
                            insert_reply!(&mut *tx, fence.task_id, outcome.reply, now).await?;
                            let event = match outcome.status {
                                TaskStatus::Succeeded => AuditEvent::TaskSucceeded,
                                TaskStatus::Cancelled => AuditEvent::TaskCancelled,
                                _ => AuditEvent::TaskFailed,
                            };
                            insert_audit!(
                                &mut *tx,
                                Some(fence.task_id),
                                event,
                                &fence.owner,
                                &outcome.audit_summary,
                                false,
                                now,
                            )?;
                        }
                        WriteOut::Done(owned)
                    }
                    WriteOp::RenewLease { fence, lease_until } => {
                        let renewed = sqlx::query(
                            "UPDATE agent_task SET lease_expire = $1, updated_at = $2 \
                             WHERE id = $3 AND owner = $4 AND version = $5 AND status = 'RUNNING'",
                        )
                        .bind(lease_until)
                        .bind(now)
                        .bind(fence.task_id)
                        .bind(&fence.owner)
                        .bind(fence.version)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                        WriteOut::Done(renewed == 1)
                    }
                    WriteOp::MarkReplySent {
                        reply_id,
                        task_id,
                        idempotency_key,
                        attempts,
                        owner,
                        platform_message_id,
                    } => {
                        let held = sqlx::query(
                            "UPDATE outbound_reply SET status = $1, platform_message_id = $2, \
                             sent_at = $3, locked_by = NULL, locked_until = NULL, last_error = NULL \
                             WHERE id = $4 AND locked_by = $5 AND status = 'PENDING'",
                        )
                        .bind(ReplyStatus::Sent)
                        .bind(platform_message_id)
                        .bind(now)
                        .bind(reply_id)
                        .bind(owner)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                            == 1;
                        if held {
                            let summary = format!(
                                "reply {idempotency_key} delivered after {attempts} attempt(s)"
                            );
                            insert_audit!(
                                &mut *tx,
                                Some(*task_id),
                                AuditEvent::ReplySent,
                                owner,
                                &summary,
                                false,
                                now,
                            )?;
                        }
                        WriteOut::Done(held)
                    }
                });
            }
            out
        });
        Ok(out)
    }

    /// Journals a step as PENDING before its call (or finds it, on resume). `None` when the
    /// worker no longer owns the task.
    pub async fn begin_step(
        &self,
        fence: &Fence,
        step: &super::tasks::NewStep<'_>,
        now: i64,
    ) -> StoreResult<Option<StepRow>> {
        let op = WriteOp::begin_step(fence, step);
        Ok(self.apply_one(op, now).await?.step())
    }

    /// Records how a step ended; `false` when the worker no longer owns the task.
    pub async fn complete_step(
        &self,
        fence: &Fence,
        step: &StepResult,
        now: i64,
    ) -> StoreResult<bool> {
        let op = WriteOp::CompleteStep {
            fence: fence.clone(),
            step: step.clone(),
        };
        Ok(self.apply_one(op, now).await?.done())
    }

    /// Ends a task: terminal status, its last step, its one outbox reply and its audit event,
    /// in one transaction fenced on ownership. Returns false (and writes nothing) when the
    /// worker no longer owns the task.
    pub async fn finish_task(
        &self,
        fence: &Fence,
        outcome: &TaskOutcome,
        now: i64,
    ) -> StoreResult<bool> {
        let op = WriteOp::FinishTask {
            fence: fence.clone(),
            outcome: Box::new(outcome.clone()),
        };
        Ok(self.apply_one(op, now).await?.done())
    }

    /// Extends the lease of a task this worker still owns; false = ownership lost.
    pub async fn renew_lease(
        &self,
        fence: &Fence,
        lease_until: i64,
        now: i64,
    ) -> StoreResult<bool> {
        let op = WriteOp::RenewLease {
            fence: fence.clone(),
            lease_until,
        };
        Ok(self.apply_one(op, now).await?.done())
    }

    /// Marks a reply delivered; false when another instance holds it now.
    pub async fn mark_reply_sent(
        &self,
        reply: &ReplyRow,
        owner: &str,
        platform_message_id: Option<&str>,
        now: i64,
    ) -> StoreResult<bool> {
        let op = WriteOp::mark_reply_sent(reply, owner, platform_message_id);
        Ok(self.apply_one(op, now).await?.done())
    }

    async fn apply_one(&self, op: WriteOp, now: i64) -> StoreResult<WriteOut> {
        let mut out = self.apply_writes(std::slice::from_ref(&op), now).await?;
        Ok(out.pop().unwrap_or(WriteOut::Done(false)))
    }
}

impl WriteOp {
    /// The task whose row the operation locks first.
    pub fn task_id(&self) -> i64 {
        match self {
            WriteOp::BeginStep { fence, .. }
            | WriteOp::CompleteStep { fence, .. }
            | WriteOp::RenewLease { fence, .. }
            | WriteOp::FinishTask { fence, .. } => fence.task_id,
            WriteOp::MarkReplySent { task_id, .. } => *task_id,
        }
    }

    pub fn mark_reply_sent(
        reply: &ReplyRow,
        owner: &str,
        platform_message_id: Option<&str>,
    ) -> WriteOp {
        WriteOp::MarkReplySent {
            reply_id: reply.id,
            task_id: reply.task_id,
            idempotency_key: reply.idempotency_key.clone(),
            attempts: reply.attempts,
            owner: owner.to_string(),
            platform_message_id: platform_message_id.map(str::to_string),
        }
    }

    pub fn begin_step(fence: &Fence, step: &super::tasks::NewStep<'_>) -> WriteOp {
        WriteOp::BeginStep {
            fence: fence.clone(),
            step_no: step.step_no,
            step_type: step.step_type,
            tool_name: step.tool_name.to_string(),
            idempotency_key: step.idempotency_key.to_string(),
            input: step.input.to_string(),
        }
    }
}
