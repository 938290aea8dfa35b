//! The worker's fenced writes (step journal, lease renewals, task finish, reply delivered),
//! committed through group commit (`store::group`): the writes of many running tasks that
//! are ready together share one transaction, each still fenced on its own. SQLite has one
//! writer; on PostgreSQL `worker.group_commit_writers` batches commit at once, each writer
//! taking the writes of its own share of the tasks, so no two batches hold the same task row.

use std::sync::Arc;

use crate::config::WorkerConfig;
use crate::domain::ReplyRow;
use crate::domain::now_ms;
use crate::domain::{Fence, NewReply, NewStep, StepResult, StepRow, TaskOutcome};
use crate::store::group::GroupCommit;
use crate::store::workflow::NewPendingAction;
use crate::store::writes::{WriteOp, WriteOut};
use crate::store::{Dialect, Store, StoreResult};
use crate::wake::Wake;

pub struct Journal {
    store: Store,
    /// `None` when `worker.group_commit_max` is 1: every write is its own transaction.
    grouped: Option<GroupCommit<WriteOp, WriteOut>>,
    /// Step outputs longer than this go to `step_blob` (`journal.inline_max_bytes`).
    inline_max: usize,
    /// Where a finished task's reply goes: rung on `replies` for a claim, or, on PostgreSQL
    /// while this instance's outbox runs, committed leased to this instance for
    /// `lease_ms` and handed to that outbox (`Wake::hand_reply`).
    handoff: Option<Handoff>,
}

struct Handoff {
    wake: Arc<Wake>,
    lease_ms: i64,
}

impl Journal {
    /// Starts the group-commit writers on the current runtime (unless `group_commit_max` is 1).
    pub fn start(store: Store, config: &WorkerConfig) -> Journal {
        if config.group_commit_max <= 1 {
            return Journal {
                store,
                grouped: None,
                inline_max: usize::MAX,
                handoff: None,
            };
        }
        let writer = store.clone();
        // By task: a task's writes (its runner's and its heartbeat's) always go to the same
        // writer, so two batches committing at once never hold the same task row.
        let grouped = GroupCommit::start_by_key(
            "journal",
            // SQLite has one writer; PostgreSQL commits several batches at once.
            match store.dialect() {
                Dialect::Sqlite => 1,
                Dialect::Postgres => config.group_commit_writers,
            },
            config.group_commit_max,
            |op| op.task_id() as u64,
            Arc::new(move |ops: &[WriteOp]| {
                let store = writer.clone();
                Box::pin(async move {
                    let out = store.apply_writes(ops, now_ms()).await?;
                    Ok(out.into_iter().map(Ok).collect())
                })
            }),
        );
        Journal {
            store,
            grouped: Some(grouped),
            inline_max: usize::MAX,
            handoff: None,
        }
    }

    /// Keeps step outputs over `bytes` by reference (`step_blob`).
    pub fn with_inline_max(mut self, bytes: usize) -> Journal {
        self.inline_max = bytes;
        self
    }

    /// Rings `wake` after a task finished, and on PostgreSQL hands its reply to this
    /// instance's outbox under a delivery lease of `lease_secs` (`outbox.lease_secs`).
    pub fn with_handoff(mut self, wake: Arc<Wake>, lease_secs: u64) -> Journal {
        self.handoff = Some(Handoff {
            wake,
            lease_ms: (lease_secs as i64).saturating_mul(1000),
        });
        self
    }

    /// `step` as the journal row keeps it: an output over the inline limit written to a
    /// blob first and replaced by its reference.
    async fn by_reference(&self, task_id: i64, step: &StepResult) -> StoreResult<StepResult> {
        let mut step = step.clone();
        if let Some(output) = &step.output
            && crate::store::blobs::needs_blob(output, self.inline_max)
        {
            let reference = self
                .store
                .put_blob(task_id, step.step_id, output, now_ms())
                .await?;
            step.output = Some(reference);
        }
        Ok(step)
    }

    async fn write(&self, op: WriteOp) -> StoreResult<WriteOut> {
        match &self.grouped {
            None => self.store.apply_one(op, now_ms()).await,
            Some(queue) => queue.submit(op).await,
        }
    }

    /// Journals a step as PENDING before its call (or finds it, on resume); `None` when the
    /// worker no longer owns the task.
    pub async fn begin_step(
        &self,
        fence: &Fence,
        step: &NewStep<'_>,
    ) -> StoreResult<Option<StepRow>> {
        let Some(row) = self.write(WriteOp::begin_step(fence, step)).await?.step() else {
            return Ok(None);
        };
        // A step found journalled (a resumed task) may hold its output by reference.
        let mut rows = [row];
        self.store.read_through_blobs(&mut rows).await?;
        let [row] = rows;
        Ok(Some(row))
    }

    /// Parks the task PAUSED at a step boundary if an admin asked (see
    /// [`Store::pause_at_boundary`]); `false` when no pause was asked.
    pub async fn pause_at_boundary(&self, fence: &Fence) -> StoreResult<bool> {
        self.store
            .pause_at_boundary(fence, crate::domain::now_ms())
            .await
    }

    /// Records how a step ended; `false` when the worker no longer owns the task.
    pub async fn complete_step(&self, fence: &Fence, step: &StepResult) -> StoreResult<bool> {
        let op = WriteOp::CompleteStep {
            fence: fence.clone(),
            step: self.by_reference(fence.task_id, step).await?,
        };
        Ok(self.write(op).await?.done())
    }

    /// Records that try `attempt` of a step starts (a retry); `false` when the worker no
    /// longer owns the task. Retries are rare, so this is not batched.
    pub async fn record_step_attempt(
        &self,
        fence: &Fence,
        step_id: i64,
        attempt: i64,
    ) -> StoreResult<bool> {
        self.store
            .record_step_attempt(fence, step_id, attempt)
            .await
    }

    /// Marks finished step `step_no` COMPENSATED (its undo succeeded).
    pub async fn mark_step_compensated(&self, fence: &Fence, step_no: i64) -> StoreResult<bool> {
        self.store
            .mark_step_compensated(fence, step_no, now_ms())
            .await
    }

    /// Keeps a workflow's rolling summary on its task.
    pub async fn set_context_summary(&self, fence: &Fence, summary: &str) -> StoreResult<bool> {
        self.store
            .set_context_summary(fence, summary, now_ms())
            .await
    }

    /// Journals an approval step and parks the task for it (pending action and card reply
    /// in the same transaction).
    pub async fn park_for_confirmation(
        &self,
        fence: &Fence,
        step: &NewStep<'_>,
        action: &NewPendingAction,
        card: &NewReply,
        now: i64,
    ) -> StoreResult<bool> {
        self.store
            .park_for_confirmation(fence, step, action, card, now)
            .await
    }

    /// Marks an interrupted non-idempotent step UNKNOWN and parks the task for a human.
    pub async fn park_unknown_step(
        &self,
        fence: &Fence,
        step_id: i64,
        action: &NewPendingAction,
        card: &NewReply,
        now: i64,
    ) -> StoreResult<bool> {
        self.store
            .park_unknown_step(fence, step_id, action, card, now)
            .await
    }

    /// Extends a task's lease; `false` when the worker no longer owns the task.
    pub async fn renew_lease(&self, fence: &Fence, lease_until: i64) -> StoreResult<bool> {
        let op = WriteOp::RenewLease {
            fence: fence.clone(),
            lease_until,
        };
        Ok(self.write(op).await?.done())
    }

    /// Marks a reply delivered: `Some(more_due)`, whether a reply of its conversation may be
    /// due now (see [`WriteOut::Sent`]); `None` when another instance holds its lease now.
    pub async fn mark_reply_sent(
        &self,
        reply: &ReplyRow,
        owner: &str,
        platform_message_id: Option<&str>,
    ) -> StoreResult<Option<bool>> {
        let op = WriteOp::mark_reply_sent(reply, owner, platform_message_id);
        Ok(match self.write(op).await? {
            WriteOut::Sent { more_due } => Some(more_due),
            _ => None,
        })
    }

    /// Ends a task (status, last step, reply, audit); `false` when ownership was lost. The
    /// reply goes to the outbox: handed to this instance's (see [`Journal::with_handoff`]),
    /// or left for a claim, with the outbox rung.
    pub async fn finish_task(&self, fence: &Fence, outcome: &TaskOutcome) -> StoreResult<bool> {
        let mut outcome = outcome.clone();
        if let Some(step) = &outcome.step {
            outcome.step = Some(self.by_reference(fence.task_id, step).await?);
        }
        // A slot of this instance's outbox, reserved so the send starts as soon as the
        // reply is committed with its attempt counted (`Wake::reserve_slot`).
        let slot = self
            .handoff
            .as_ref()
            .filter(|_| self.store.dialect() == Dialect::Postgres)
            .and_then(|h| h.wake.reserve_slot());
        let hand_until = match (&slot, &self.handoff) {
            (Some(_), Some(h)) => Some(now_ms().saturating_add(h.lease_ms)),
            _ => None,
        };
        let op = WriteOp::FinishTask {
            fence: fence.clone(),
            outcome: Box::new(outcome),
            hand_until,
        };
        let out = self.write(op).await?;
        let Some(handoff) = &self.handoff else {
            return Ok(out.done());
        };
        match (out, hand_until, slot) {
            (WriteOut::Handed(reply), Some(until), Some(slot)) => {
                if let Err(reply) = handoff.wake.hand_reply(*reply, until, slot) {
                    // The outbox stopped meanwhile: the reply goes back unsent, due now. The
                    // task finished all the same; should this write fail, the reply waits
                    // for its lease to lapse (or to be released at shutdown).
                    let put_back = self.store.defer_reply(&reply, &fence.owner, now_ms());
                    if let Err(e) = put_back.await {
                        tracing::warn!(task_id = fence.task_id, error = %e, "putting back an unsent reply failed; it waits for its lease");
                    }
                }
                Ok(true)
            }
            (out, ..) => {
                let done = out.done();
                if done {
                    handoff.wake.replies.notify_one();
                }
                Ok(done)
            }
        }
    }
}
