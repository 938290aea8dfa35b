//! The step journal, task-finishing and reply-delivered writes made while tasks run and
//! replies go out, as operations that can share one transaction (group commit, see
//! `store::journal`). Each operation is fenced on its own: it lands only while its worker
//! still owns its task (or its sender the reply's lease), and a fence that fails affects
//! that operation alone.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

use serde_json::{Value, json};

use super::sql::{BatchSql, audit_row};
pub use super::sql::{reply_write_sql, step_write_sql};
use super::{Store, StoreResult, write_tx};
use crate::domain::AuditTarget;
use crate::domain::ReplyRow;
use crate::domain::{AuditEvent, ReplyStatus, StepStatus, StepType, TaskStatus};
use crate::domain::{Fence, StepResult, StepRow, TaskOutcome};

/// Runs a batched statement over the JSON `rows` at `now` (and an optional third parameter)
/// inside the caller's transaction; the ids it returned: the rows whose fence held.
macro_rules! landed_ids {
    ($tx:expr, $sql:expr, $rows:expr, $now:expr $(, $extra:expr)?) => {
        sqlx::query_scalar::<_, i64>($sql)
            .bind($rows)
            .bind($now)
            $(.bind($extra))?
            .fetch_all($tx)
            .await?
            .into_iter()
            .collect::<HashSet<i64>>()
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
        /// The end of a delivery lease to take on the reply at once, for this instance's
        /// running outbox (PostgreSQL; see `sql::handed_replies`); `None` to leave the reply
        /// to a claim.
        hand_until: Option<i64>,
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
        kind: SentKind,
    },
}

/// What a delivery showed in the chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SentKind {
    /// A new message with the reply.
    New,
    /// A slow run's placeholder (the reply replaces it later).
    Placeholder,
    /// The reply, by editing its placeholder.
    Edit,
}

/// What an operation came to.
#[derive(Debug, Clone)]
pub enum WriteOut {
    /// `BeginStep`: the journalled step, `None` when the worker no longer owns the task.
    Step(Option<Box<StepRow>>),
    /// `CompleteStep`, `FinishTask`: `false` (and nothing written) when ownership was lost.
    Done(bool),
    /// `FinishTask` that committed its reply leased to its instance (`hand_until`): the
    /// reply as its claim would have returned it.
    Handed(Box<ReplyRow>),
    /// `MarkReplySent` that landed. `more_due`: a reply of its conversation is still
    /// PENDING (it may have waited for this one), or this one is again (a placeholder the
    /// answer took over, to be edited into it); either way a claim may find a reply due.
    Sent { more_due: bool },
}

impl WriteOut {
    pub fn step(self) -> Option<StepRow> {
        match self {
            WriteOut::Step(row) => row.map(|r| *r),
            WriteOut::Done(_) | WriteOut::Handed(_) | WriteOut::Sent { .. } => None,
        }
    }

    pub fn done(self) -> bool {
        match self {
            WriteOut::Done(done) => done,
            WriteOut::Step(row) => row.is_some(),
            WriteOut::Handed(_) | WriteOut::Sent { .. } => true,
        }
    }
}

impl Store {
    // long: one transaction applying every kind of fenced write, one statement per kind.
    /// Applies `ops` in one transaction; one answer per operation, in the order given. An
    /// error rolls back all of them.
    ///
    /// Each kind of operation goes as one statement whatever the batch size (the rows come
    /// as one JSON array, so the statement text, and its prepared statement, stays the same),
    /// every row fenced on its own: lease renewals, step begins, step completions (with the
    /// last step of finishing tasks on SQLite; PostgreSQL completes it in the finish's own
    /// statement, fenced by the task's update), task finishes, their replies,
    /// reply-delivered marks, and the audit rows of finishes and marks. A running task has
    /// one runner write in flight (its heartbeat may add a renewal), so this order gives the
    /// same result as any other. Should two operations of a batch name the same row (a stale write next to a
    /// current one), the later goes in a later round of the same statement, so each answer
    /// is its own row's.
    ///
    /// Rows are locked by the statements that write them, with no locking statement first:
    /// the journal sends all writes of a task to the same writer (`GroupCommit::start_by_key`),
    /// so two batches committing at once never hold the same task row. Should a batch still
    /// deadlock (two instances during a takeover, each with a stale write to a task the
    /// other runs), PostgreSQL rolls it back and group commit applies its operations one by
    /// one, each fenced as ever. A claim that takes a task before its stale finish lands makes
    /// that finish's fence fail, as when it comes before the batch.
    pub async fn apply_writes(&self, ops: &[WriteOp], now: i64) -> StoreResult<Vec<WriteOut>> {
        let mut answers: Vec<Option<WriteOut>> = vec![None; ops.len()];
        let sql = BatchSql::get(self.dialect());
        let renewals = rounds(ops, |op| match op {
            WriteOp::RenewLease { fence, lease_until } => Some((
                fence.task_id,
                fenced_row(fence, json!({ "lease_until": lease_until })),
            )),
            _ => None,
        });
        let begins = rounds(ops, |op| match op {
            WriteOp::BeginStep {
                fence,
                step_no,
                step_type,
                tool_name,
                idempotency_key,
                input,
            } => Some((
                idempotency_key.as_str(),
                fenced_row(
                    fence,
                    json!({
                        "step_no": step_no,
                        "step_type": step_type.as_str(),
                        "tool_name": tool_name,
                        "idempotency_key": idempotency_key,
                        "input": input,
                    }),
                ),
            )),
            _ => None,
        });
        // PostgreSQL completes a finishing task's last step in the finish's own statement.
        let finish_steps_apart = self.dialect() == super::Dialect::Sqlite;
        let completions = rounds(ops, |op| {
            if !finish_steps_apart && matches!(op, WriteOp::FinishTask { .. }) {
                return None;
            }
            let (fence, step) = op.step_result()?;
            let row = Value::Object(step_fields(step, "status", "error"));
            Some((step.step_id, fenced_row(fence, row)))
        });
        let finishes = rounds(ops, |op| match op {
            WriteOp::FinishTask { fence, outcome, .. } => {
                let mut row = json!({
                    "status": outcome.status.as_str(),
                    "result": outcome.result,
                    "failure_type": outcome.failure_type.map(|f| f.as_str()),
                    "error": outcome.error,
                    "retries": outcome.retries,
                    "trace": outcome.trace,
                });
                if let (false, Some(step), Value::Object(map)) =
                    (finish_steps_apart, &outcome.step, &mut row)
                {
                    map.extend(step_fields(step, "step_status", "step_error"));
                }
                Some((fence.task_id, fenced_row(fence, row)))
            }
            _ => None,
        });
        let marks = rounds(ops, |op| match op {
            WriteOp::MarkReplySent {
                reply_id,
                owner,
                platform_message_id,
                kind,
                ..
            } => Some((
                *reply_id,
                json!({
                    "reply_id": reply_id,
                    "owner": owner,
                    "platform_message_id": platform_message_id,
                    "placeholder": i64::from(*kind == SentKind::Placeholder),
                }),
            )),
            _ => None,
        });
        write_tx!(self, tx => {
            for round in &renewals {
                let rows = round.rows.as_str();
                let renewed = landed_ids!(&mut *tx, &sql.renew, rows, now);
                for &i in &round.ops {
                    answers[i] = Some(WriteOut::Done(renewed.contains(&ops[i].task_id())));
                }
            }
            for round in &begins {
                let rows = round.rows.as_str();
                // Only the new rows' ids come back: the rest of each row is the operation's.
                let inserted: HashMap<String, i64> =
                    sqlx::query_as::<_, (i64, String)>(&sql.begin)
                        .bind(rows)
                        .bind(now)
                        .bind(StepStatus::Pending)
                        .fetch_all(&mut *tx)
                        .await?
                        .into_iter()
                        .map(|(id, key)| (key, id))
                        .collect();
                for &i in &round.ops {
                    let op = &ops[i];
                    let WriteOp::BeginStep {
                        fence,
                        idempotency_key,
                        ..
                    } = op
                    else {
                        continue;
                    };
                    let row = match inserted.get(idempotency_key) {
                        Some(&id) => op.begun_step(id, now),
                        // Journalled before (a resume), or no longer ours: read it as it
                        // stands, if still ours.
                        None => {
                            sqlx::query_as::<_, StepRow>(&sql.existing_step)
                                .bind(idempotency_key)
                                .bind(fence.task_id)
                                .bind(&fence.owner)
                                .bind(fence.version)
                                .fetch_optional(&mut *tx)
                                .await?
                        }
                    };
                    answers[i] = Some(WriteOut::Step(row.map(Box::new)));
                }
            }
            // Before the finishes: a finishing task's last step (SQLite) is fenced on the
            // version the finish is about to bump.
            for round in &completions {
                let rows = round.rows.as_str();
                let written = landed_ids!(&mut *tx, &sql.complete, rows, now);
                for &i in &round.ops {
                    if let WriteOp::CompleteStep { step, .. } = &ops[i] {
                        answers[i] = Some(WriteOut::Done(written.contains(&step.step_id)));
                    }
                }
            }
            let mut audits: Vec<Value> = Vec::new();
            for round in &finishes {
                let rows = round.rows.as_str();
                let owned = landed_ids!(&mut *tx, &sql.finish, rows, now);
                let mut replies: Vec<Value> = Vec::new();
                for &i in &round.ops {
                    let WriteOp::FinishTask {
                        fence,
                        outcome,
                        hand_until,
                    } = &ops[i]
                    else {
                        continue;
                    };
                    let done = owned.contains(&fence.task_id);
                    answers[i] = Some(WriteOut::Done(done));
                    if !done {
                        continue;
                    }
                    let reply = &outcome.reply;
                    replies.push(json!({
                        "task_id": fence.task_id,
                        "idempotency_key": reply.idempotency_key,
                        "channel": reply.channel,
                        "conversation_id": reply.conversation_id,
                        "in_reply_to": reply.in_reply_to,
                        "reply_type": reply.reply_type.as_str(),
                        "content": reply.content,
                        "owner": fence.owner,
                        "hand_until": hand_until,
                    }));
                    let event = match outcome.status {
                        TaskStatus::Succeeded => AuditEvent::TaskSucceeded,
                        TaskStatus::Cancelled => AuditEvent::TaskCancelled,
                        _ => AuditEvent::TaskFailed,
                    };
                    audits.push(audit_row(
                        fence.task_id,
                        event,
                        &fence.owner,
                        &outcome.audit_summary,
                        &AuditTarget::Task(fence.task_id),
                    ));
                }
                if !replies.is_empty() {
                    let replies = super::text::storable_rows(replies);
                    // PostgreSQL returns the replies it leased to their instance at once.
                    let handed: Vec<ReplyRow> = sqlx::query_as(&sql.insert_replies)
                        .bind(replies.as_str())
                        .bind(now)
                        .bind(ReplyStatus::Pending)
                        .fetch_all(&mut *tx)
                        .await?;
                    for reply in handed {
                        let task = reply.task_id;
                        if let Some(&i) = round.ops.iter().find(|&&i| ops[i].task_id() == task) {
                            answers[i] = Some(WriteOut::Handed(Box::new(reply)));
                        }
                    }
                }
            }
            for round in &marks {
                let rows = round.rows.as_str();
                let held: HashMap<i64, bool> = sqlx::query_as(&sql.mark_sent)
                    .bind(rows)
                    .bind(now)
                    .bind(ReplyStatus::Sent)
                    .fetch_all(&mut *tx)
                    .await?
                    .into_iter()
                    .collect();
                for &i in &round.ops {
                    let WriteOp::MarkReplySent {
                        reply_id,
                        task_id,
                        idempotency_key,
                        attempts,
                        owner,
                        kind,
                        ..
                    } = &ops[i]
                    else {
                        continue;
                    };
                    let landed = held.get(reply_id).copied();
                    answers[i] = Some(match landed {
                        Some(more_due) => WriteOut::Sent { more_due },
                        None => WriteOut::Done(false),
                    });
                    if landed.is_some() {
                        let summary = format!(
                            "{} {idempotency_key} {} after {attempts} attempt(s)",
                            if *kind == SentKind::Placeholder { "placeholder" } else { "reply" },
                            if *kind == SentKind::Edit {
                                "delivered by editing its placeholder"
                            } else {
                                "delivered"
                            }
                        );
                        audits.push(audit_row(
                            *task_id,
                            AuditEvent::ReplySent,
                            owner,
                            &summary,
                            &AuditTarget::Reply(*reply_id),
                        ));
                    }
                }
            }
            if !audits.is_empty() {
                sqlx::query(&sql.insert_audits)
                    .bind(super::text::storable_rows(audits))
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
        });
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or(WriteOut::Done(false)))
            .collect())
    }

    /// Journals a step as PENDING before its call (or finds it, on resume). `None` when the
    /// worker no longer owns the task.
    pub async fn begin_step(
        &self,
        fence: &Fence,
        step: &crate::domain::NewStep<'_>,
        now: i64,
    ) -> StoreResult<Option<StepRow>> {
        let op = WriteOp::begin_step(fence, step);
        Ok(self.apply_one(op, now).await?.step())
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
            hand_until: None,
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

    /// Applies one operation in a transaction of its own.
    pub async fn apply_one(&self, op: WriteOp, now: i64) -> StoreResult<WriteOut> {
        let mut out = self.apply_writes(std::slice::from_ref(&op), now).await?;
        Ok(out.pop().unwrap_or(WriteOut::Done(false)))
    }
}

impl WriteOp {
    /// The step result an operation writes: a completion's, or a finish's last step.
    fn step_result(&self) -> Option<(&Fence, &StepResult)> {
        match self {
            WriteOp::CompleteStep { fence, step } => Some((fence, step)),
            WriteOp::FinishTask { fence, outcome, .. } => outcome.step.as_ref().map(|s| (fence, s)),
            _ => None,
        }
    }

    /// The PENDING step row a `BeginStep` inserted as `id` at `now` (`None` for any other
    /// operation), as the begin statement wrote it.
    fn begun_step(&self, id: i64, now: i64) -> Option<StepRow> {
        let WriteOp::BeginStep {
            fence,
            step_no,
            step_type,
            tool_name,
            idempotency_key,
            input,
        } = self
        else {
            return None;
        };
        Some(StepRow {
            id,
            task_id: fence.task_id,
            step_no: *step_no,
            step_type: *step_type,
            tool_name: tool_name.clone(),
            idempotency_key: idempotency_key.clone(),
            input: Some(input.clone()),
            output: None,
            error: None,
            status: StepStatus::Pending,
            tokens_in: None,
            tokens_out: None,
            duration_ms: None,
            attempt: 0,
            created_at: now,
            finished_at: None,
        })
    }

    /// The task the operation is about.
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
            kind: if reply.placeholder {
                SentKind::Placeholder
            } else if reply.edit {
                SentKind::Edit
            } else {
                SentKind::New
            },
            reply_id: reply.id,
            task_id: reply.task_id,
            idempotency_key: reply.idempotency_key.clone(),
            attempts: reply.attempts,
            owner: owner.to_string(),
            platform_message_id: platform_message_id.map(str::to_string),
        }
    }

    pub fn begin_step(fence: &Fence, step: &crate::domain::NewStep<'_>) -> WriteOp {
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

/// One statement's share of a batch: the operations it carries (indices into the batch) and
/// their rows, as the JSON array bound as `$1`.
struct Round {
    ops: Vec<usize>,
    rows: String,
}

/// The operations of `ops` that have a key, split into rounds in which no key repeats: the
/// first operation of each key in the first round, the second in the second, and so on.
/// `keyed_row` gives an operation's key and row; the rows are built here, before the batch
/// takes its write turn.
fn rounds<'a, K: Eq + Hash>(
    ops: &'a [WriteOp],
    keyed_row: impl Fn(&'a WriteOp) -> Option<(K, Value)>,
) -> Vec<Round> {
    let mut seen: HashMap<K, usize> = HashMap::new();
    let mut rounds: Vec<(Vec<usize>, Vec<Value>)> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        if let Some((k, row)) = keyed_row(op) {
            let n = seen.entry(k).or_insert(0);
            if rounds.len() <= *n {
                rounds.push((Vec::new(), Vec::new()));
            }
            rounds[*n].0.push(i);
            rounds[*n].1.push(row);
            *n += 1;
        }
    }
    rounds
        .into_iter()
        .map(|(ops, rows)| Round {
            ops,
            rows: super::text::storable_rows(rows),
        })
        .collect()
}

/// A step result's columns for `complete` (and PostgreSQL's `finish`, which names its
/// status and error fields apart from the task's).
fn step_fields(step: &StepResult, status: &str, error: &str) -> serde_json::Map<String, Value> {
    let mut fields = serde_json::Map::new();
    fields.insert("step_id".into(), step.step_id.into());
    fields.insert(status.into(), step.status.as_str().into());
    fields.insert("output".into(), json!(step.output));
    fields.insert(error.into(), json!(step.error));
    fields.insert("tokens_in".into(), json!(step.tokens_in));
    fields.insert("tokens_out".into(), json!(step.tokens_out));
    fields.insert("duration_ms".into(), json!(step.duration_ms));
    fields.insert("attempts".into(), json!(step.attempts));
    fields.insert("summary_through".into(), json!(step.summary_through));
    fields
}

/// `fields` with the fence of `fence` added.
fn fenced_row(fence: &Fence, mut fields: Value) -> Value {
    if let Value::Object(map) = &mut fields {
        map.insert("task_id".into(), fence.task_id.into());
        map.insert("owner".into(), fence.owner.clone().into());
        map.insert("version".into(), fence.version.into());
    }
    fields
}
