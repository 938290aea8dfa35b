//! The worker's fenced writes (step journal, lease renewals, task finish, reply delivered),
//! committed through group commit (`store::group`): the writes of many running tasks that
//! are ready together share one transaction, each still fenced on its own. SQLite has one
//! writer; on PostgreSQL `worker.group_commit_writers` batches commit at once. Every batch
//! takes its task rows in id order (`Store::apply_writes`), so two cannot deadlock.

use std::sync::Arc;

use crate::config::WorkerConfig;
use crate::domain::ReplyRow;
use crate::domain::now_ms;
use crate::domain::{Fence, NewStep, StepResult, StepRow, TaskOutcome};
use crate::store::group::GroupCommit;
use crate::store::writes::{WriteOp, WriteOut};
use crate::store::{Dialect, Store, StoreResult};

pub enum Journal {
    Direct(Store),
    Grouped(GroupCommit<WriteOp, WriteOut>),
}

impl Journal {
    /// Starts the group-commit writers on the current runtime (unless `group_commit_max` is 1).
    pub fn start(store: Store, config: &WorkerConfig) -> Journal {
        if config.group_commit_max <= 1 {
            return Journal::Direct(store);
        }
        Journal::Grouped(GroupCommit::start(
            "journal",
            // SQLite has one writer; PostgreSQL commits several batches at once.
            match store.dialect() {
                Dialect::Sqlite => 1,
                Dialect::Postgres => config.group_commit_writers,
            },
            config.group_commit_max,
            Arc::new(move |ops: &[WriteOp]| {
                let store = store.clone();
                Box::pin(async move {
                    let out = store.apply_writes(ops, now_ms()).await?;
                    Ok(out.into_iter().map(Ok).collect())
                })
            }),
        ))
    }

    async fn write(&self, op: WriteOp) -> StoreResult<WriteOut> {
        match self {
            Journal::Direct(store) => store.apply_one(op, now_ms()).await,
            Journal::Grouped(queue) => queue.submit(op).await,
        }
    }

    /// Journals a step as PENDING before its call (or finds it, on resume); `None` when the
    /// worker no longer owns the task.
    pub async fn begin_step(
        &self,
        fence: &Fence,
        step: &NewStep<'_>,
    ) -> StoreResult<Option<StepRow>> {
        Ok(self.write(WriteOp::begin_step(fence, step)).await?.step())
    }

    /// Records how a step ended; `false` when the worker no longer owns the task.
    pub async fn complete_step(&self, fence: &Fence, step: &StepResult) -> StoreResult<bool> {
        let op = WriteOp::CompleteStep {
            fence: fence.clone(),
            step: step.clone(),
        };
        Ok(self.write(op).await?.done())
    }

    /// Extends a task's lease; `false` when the worker no longer owns the task.
    pub async fn renew_lease(&self, fence: &Fence, lease_until: i64) -> StoreResult<bool> {
        let op = WriteOp::RenewLease {
            fence: fence.clone(),
            lease_until,
        };
        Ok(self.write(op).await?.done())
    }

    /// Marks a reply delivered; `false` when another instance holds its lease now.
    pub async fn mark_reply_sent(
        &self,
        reply: &ReplyRow,
        owner: &str,
        platform_message_id: Option<&str>,
    ) -> StoreResult<bool> {
        let op = WriteOp::mark_reply_sent(reply, owner, platform_message_id);
        Ok(self.write(op).await?.done())
    }

    /// Ends a task (status, last step, reply, audit); `false` when ownership was lost.
    pub async fn finish_task(&self, fence: &Fence, outcome: &TaskOutcome) -> StoreResult<bool> {
        let op = WriteOp::FinishTask {
            fence: fence.clone(),
            outcome: Box::new(outcome.clone()),
        };
        Ok(self.write(op).await?.done())
    }
}
