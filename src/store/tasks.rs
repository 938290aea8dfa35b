//! Tasks and their step journal. Every write a worker makes for a task it runs is fenced:
//! it only lands while `owner` and `version` are still the worker's, so a worker that lost
//! its lease cannot overwrite the work of the instance that took the task over.

use super::sql::{STEP_COLUMNS, current_step_sql};
use super::sql::{audit_row, in_json_ids, insert_audits_sql};
use super::{Dialect, Store, StoreResult, on_pool, write_tx};
use crate::domain::AuditTarget;
use crate::domain::{AuditEvent, FailureType, Fence, MessageRow, StepRow, TaskRow, TaskStatus};

/// The result of an admin action on a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Done,
    NotFound,
    /// The task is in a status the action does not apply to.
    Conflict(TaskStatus),
    /// Retention removed the task's bodies; it cannot run again.
    Purged,
}

/// A task's columns; its current step is the highest step of its journal, its snapshot its
/// agent version's definition (tasks claimed before issue 35 hold a copy of it).
const TASK_COLUMNS: &str = concat!(
    "id, agent_id, agent_version_id, task_type, channel, conversation_id, \
     message_id, trigger_user, status, ",
    current_step_sql!(),
    " AS current_step, COALESCE(workflow_snapshot, (SELECT v.definition FROM agent_version v \
     WHERE v.id = agent_task.agent_version_id)) AS workflow_snapshot, context_summary, result, trace, failure_type, \
     error_msg, retry_count, claim_count, resume_count, restart_count, run_aborts, provider, \
     pause_requested <> 0 AS pause_requested, version, owner, lease_expire, confirm_deadline, created_at, updated_at, \
     started_at, finished_at, takeover = 1 AS taken_over, \
     (SELECT a.name FROM agent a WHERE a.id = agent_task.agent_id) AS agent_name"
);

const MESSAGE_COLUMNS: &str = "id, channel, external_event_id, external_message_id, \
     conversation_id, sender_id, sender_name, text, received_at, trace_context";

/// What a task list keeps; `None` and `false` keep everything.
#[derive(Debug, Clone, Default)]
pub struct TaskSearch {
    pub status: Option<TaskStatus>,
    pub failure_type: Option<FailureType>,
    pub conversation_id: Option<String>,
    /// Only tasks with a risk-flagged audit row.
    pub risky: bool,
    pub agent: Option<String>,
    pub channel: Option<String>,
    /// Created at or after / before (UTC milliseconds).
    pub since: Option<i64>,
    pub until: Option<i64>,
    /// Older than this task (paging: the last id of the previous page).
    pub before_id: Option<i64>,
    /// The message's text contains this (any case).
    pub text: Option<String>,
    pub limit: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AuditRow {
    pub id: i64,
    pub task_id: Option<i64>,
    pub event: AuditEvent,
    pub actor: String,
    pub summary: String,
    pub risk_flag: bool,
    pub created_at: i64,
    /// What the event is about (`task`, `step`, `reply`, `approval`, `job`) and its id.
    pub target_type: Option<String>,
    pub target_id: Option<String>,
}

const AUDIT_COLUMNS: &str =
    "id, task_id, event, actor, summary, risk_flag, created_at, target_type, target_id";

/// Whose tasks a claim may take, by the provider their model calls go to (`agent_task.provider`,
/// `""` for `[llm]`; `ModelClients::claim_plan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderFilter {
    Any,
    /// One provider's tasks (`$5`).
    Only(String),
    /// Every other provider's tasks (`$5`, `$6`, …).
    Except(Vec<String>),
}

impl ProviderFilter {
    /// The condition on `t`, its parameters from `$5` on.
    fn condition(&self) -> String {
        match self {
            ProviderFilter::Any => String::new(),
            ProviderFilter::Except(names) if names.is_empty() => String::new(),
            // `agent_task_pending_provider` holds named providers' tasks only (migration
            // 0031): the literal lets every plan use it.
            ProviderFilter::Only(name) if !name.is_empty() => {
                " AND t.provider = $5 AND t.provider <> ''".into()
            }
            ProviderFilter::Only(_) => " AND t.provider = $5".into(),
            ProviderFilter::Except(names) => format!(
                " AND t.provider NOT IN ({})",
                (5..5 + names.len())
                    .map(|i| format!("${i}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    fn names(&self) -> Vec<&str> {
        match self {
            ProviderFilter::Any => Vec::new(),
            ProviderFilter::Only(name) => vec![name.as_str()],
            ProviderFilter::Except(names) => names.iter().map(String::as_str).collect(),
        }
    }
}

/// The claim's choice of tasks (parameters: `$3` now, `$4` limit). Each read is backed by a
/// partial index, so claiming never reads finished history, nor a conversation's backlog
/// (see [`claim_pick_sql_for`]). PostgreSQL locks what it picks and skips rows another
/// instance is claiming.
pub fn claim_pick_sql(dialect: Dialect) -> String {
    claim_pick_sql_for(dialect, &ProviderFilter::Any)
}

/// [`claim_pick_sql`] of the tasks `providers` allows (one named provider's: its pending
/// tasks through `agent_task_pending_provider`; the default provider's, `""`, through
/// `agent_task_pending`, as most pending tasks are theirs).
///
/// A pending task is claimable when it is the oldest pending task of its conversation (its
/// head) and nothing else of the conversation runs. The pick takes the `$4` oldest
/// claimable tasks: first from the oldest `2 × $4` due pending tasks (the walk, probed in id
/// order until `$4` are found on PostgreSQL: enough when most are claimable, one message per
/// conversation); only when fewer than `$4` of those are claimable and there are more, from
/// the heads of all conversations with pending tasks (`heads`, a loose scan of
/// `agent_task_pending_conversation`: one index probe per conversation). Either way the
/// result is the `$4` oldest claimable tasks, as every claimable task is a head.
/// Before, the pick walked every pending task until `$4` were found: with
/// fewer claimable (a busy channel's backlog behind its running task, a recovery after an
/// outage) a claim read the whole backlog, 21.5 ms per claim at 5,000 messages round 64
/// conversations (docs/benchmarks.md).
pub fn claim_pick_sql_for(dialect: Dialect, providers: &ProviderFilter) -> String {
    let only = providers.condition();
    // The oldest active task of its conversation, and nothing else of the conversation
    // running: an older task put back to PENDING (resumed, approved) waits for a newer one
    // that is running now. Two checks, each through its own partial index: no older
    // pending task (`agent_task_pending_conversation`) and no other running one
    // (`agent_task_one_running_per_conversation`); one index over both states got a new
    // entry at every claim (issue 35 part 2).
    // PostgreSQL: each probe ends in `OFFSET 0` (`per_row`), so it stays a lookup per
    // candidate through its index's `(channel, conversation_id)`: as anti joins, a young
    // table's estimates (one row) had each candidate read the whole partial index (every
    // pending task, for each one picked; `auto_explain` of `assistd-bench instances`).
    let per_row = super::sql::per_row(dialect == Dialect::Sqlite);
    let claimable = |t: &str| {
        format!(
            "NOT EXISTS (SELECT 1 FROM agent_task o \
             WHERE o.channel = {t}.channel AND o.conversation_id = {t}.conversation_id \
             AND o.status = 'PENDING' AND o.id < {t}.id{per_row}) \
             AND NOT EXISTS (SELECT 1 FROM agent_task o \
             WHERE o.channel = {t}.channel AND o.conversation_id = {t}.conversation_id \
             AND o.status = 'RUNNING' AND o.id <> {t}.id{per_row})"
        )
    };
    let oldest_in_conversation = claimable("t");
    let due = "t.status = 'PENDING' AND t.run_after <= $3";
    // The walk, a subquery rather than a CTE: on PostgreSQL its order is known to the `ok`
    // around it, so the probes stop at the `$4`-th claimable task (over a CTE, PostgreSQL
    // sorted all of it and probed every task). SQLite still sorts it: it probes all
    // `2 × $4` (in process, each probe one B-tree search).
    let walk = format!(
        "SELECT t.id, t.channel, t.conversation_id FROM agent_task t \
         WHERE {due}{only} ORDER BY t.id LIMIT 2 * $4"
    );
    let ok = format!(
        "ok AS (SELECT w.id FROM ({walk}) w WHERE {} ORDER BY w.id LIMIT $4)",
        claimable("w")
    );
    // The first head: the loose scan starts only when the walk fell short (counted in this
    // order, the walk is read again, in full, only then). The scan says
    // `conversation_id IS NOT NULL`, which its index requires (migration 0042).
    let first = format!(
        "SELECT f.channel, f.conversation_id, f.id FROM (SELECT p.channel, \
         p.conversation_id, p.id FROM agent_task p WHERE p.status = 'PENDING' \
         AND p.conversation_id IS NOT NULL AND (SELECT count(*) FROM ok) < $4 \
         AND (SELECT count(*) FROM ({walk}) x) = 2 * $4 \
         ORDER BY p.channel, p.conversation_id, p.id LIMIT 1) f"
    );
    // The next conversation's head (after `h`'s): its first entry in the index.
    let next = |after: &str| {
        format!(
            "SELECT o.channel, o.conversation_id, o.id FROM agent_task o \
             WHERE o.status = 'PENDING' AND o.conversation_id IS NOT NULL AND {after} \
             ORDER BY o.channel, o.conversation_id, o.id LIMIT 1"
        )
    };
    match dialect {
        // SQLite reads a row value inequality on an index by its first column alone: the
        // next conversation of the channel, else the first of the next channel.
        Dialect::Sqlite => format!(
            "WITH RECURSIVE {ok}, \
             heads(channel, conversation_id, id) AS ({first} UNION ALL \
                 SELECT n.channel, n.conversation_id, n.id FROM heads h \
                 JOIN agent_task n ON n.id = COALESCE(\
                     (SELECT id FROM ({same}) s), (SELECT id FROM ({later}) s))) \
             SELECT id FROM (\
             SELECT t.id FROM agent_task t WHERE t.id IN (SELECT id FROM ok UNION SELECT id FROM heads) \
                 AND {due}{only} AND {oldest_in_conversation} \
             UNION ALL \
             SELECT t.id FROM agent_task t WHERE t.status = 'RUNNING' AND t.lease_expire < $3{only} \
                 AND {oldest_in_conversation}) \
             ORDER BY id LIMIT $4",
            same = next("o.channel = h.channel AND o.conversation_id > h.conversation_id"),
            later = next("o.channel > h.channel"),
        ),
        // One locking pick per branch: under `OR`, PostgreSQL walked the primary key and
        // filtered out every finished task below the first pending one (23 ms per claim
        // with 100,000 finished tasks, against 0.3 ms this way; docs/benchmarks.md).
        // `FOR UPDATE` is not allowed under `UNION`, hence the CTEs; up to twice `$4` rows
        // are locked for the length of the claim. The candidates are locked one by one in
        // id order, each found by its id (under `= ANY` of them all, stale statistics that
        // call the pending tasks few had the lock read every pending task), the latest
        // version of each checked again (a task another instance claimed meanwhile is no
        // longer PENDING), until `$4` are locked.
        Dialect::Postgres => format!(
            "WITH RECURSIVE {ok}, \
             heads(channel, conversation_id, id) AS ({first} UNION ALL \
                 SELECT n.channel, n.conversation_id, n.id FROM heads h, LATERAL ({}) n), \
             due AS (SELECT l.id FROM (SELECT id FROM ok UNION SELECT id FROM heads \
                 ORDER BY id) c CROSS JOIN LATERAL (SELECT t.id FROM agent_task t \
                 WHERE t.id = c.id AND {due}{only} AND {oldest_in_conversation} \
                 FOR UPDATE OF t SKIP LOCKED) l ORDER BY c.id LIMIT $4), \
             expired AS (SELECT t.id FROM agent_task t \
                 WHERE t.status = 'RUNNING' AND t.lease_expire < $3{only} AND {oldest_in_conversation} \
                 ORDER BY t.id LIMIT $4 FOR UPDATE OF t SKIP LOCKED) \
             SELECT id FROM (SELECT id FROM due UNION ALL SELECT id FROM expired) picked \
             ORDER BY id LIMIT $4",
            next("(o.channel, o.conversation_id) > (h.channel, h.conversation_id)")
        ),
    }
}

/// The task list's "risky only" filter (`TaskSearch::risky`), probed per listed task: on
/// PostgreSQL through `audit_log_risky`, which holds risky rows alone (migration 0029).
pub const RISKY_FILTER: &str =
    " AND EXISTS (SELECT 1 FROM audit_log a WHERE a.task_id = agent_task.id AND a.risk_flag)";

/// A task's audit rows (`$1` the task), oldest first: on PostgreSQL a bitmap scan of the
/// BRIN summaries of `audit_log_task` (migration 0029), on SQLite its B-tree.
pub fn task_audit_sql() -> String {
    format!("SELECT {AUDIT_COLUMNS} FROM audit_log WHERE task_id = $1 ORDER BY id")
}

impl Store {
    /// Atomically takes up to `limit` claimable tasks for `owner`: PENDING ones that are due
    /// and RUNNING ones whose lease has expired, but only the oldest active task of each
    /// conversation. Writes TASK_RUNNING for each. The task runs its agent version's
    /// definition, read with the row (`TASK_COLUMNS`): versions never change, so a copy in
    /// every task (as before issue 35) was the same text written again in each claim's and
    /// each finish's row version.
    pub async fn claim_tasks(
        &self,
        owner: &str,
        limit: usize,
        lease_until: i64,
        now: i64,
    ) -> StoreResult<Vec<TaskRow>> {
        self.claim_tasks_of(owner, limit, lease_until, now, &ProviderFilter::Any)
            .await
    }

    /// [`claim_tasks`](Self::claim_tasks) of the tasks `providers` allows.
    pub async fn claim_tasks_of(
        &self,
        owner: &str,
        limit: usize,
        lease_until: i64,
        now: i64,
        providers: &ProviderFilter,
    ) -> StoreResult<Vec<TaskRow>> {
        let pick = claim_pick_sql_for(self.dialect(), providers);
        // PostgreSQL: the picked ids as an array, so the update finds its rows through the
        // primary key; under `IN` a young table's estimates had it hash a sequential scan of
        // every task against the few picked.
        let picked = match self.dialect() {
            Dialect::Sqlite => format!("id IN ({pick})"),
            Dialect::Postgres => format!("id = ANY(ARRAY({pick}))"),
        };
        let sql = format!(
            "UPDATE agent_task SET status = 'RUNNING', owner = $1, lease_expire = $2, \
             version = version + 1, claim_count = claim_count + 1, \
             takeover = CASE WHEN status = 'RUNNING' OR takeover = 2 THEN 1 ELSE 0 END, \
             started_at = COALESCE(started_at, $3), updated_at = $3 \
             WHERE {picked} RETURNING {TASK_COLUMNS}"
        );
        let claimed = write_tx!(self, tx => {
            // The whole row as the claim left it, so the worker need not read it again.
            let mut query = sqlx::query_as(&sql)
                .bind(owner)
                .bind(lease_until)
                .bind(now)
                .bind(limit as i64);
            for name in providers.names() {
                query = query.bind(name);
            }
            let mut claimed: Vec<TaskRow> = query.fetch_all(&mut *tx).await?;
            claimed.sort_by_key(|c| c.id);
            if !claimed.is_empty() {
                // One statement for all the claim's audit rows: a claim holds the write
                // lock, and a statement per row was a round trip each.
                let audits: Vec<serde_json::Value> = claimed
                    .iter()
                    .map(|task| {
                        let summary = if task.claim_count > 1 {
                            format!("claimed by {owner} (claim {}, resumed)", task.claim_count)
                        } else {
                            format!("claimed by {owner}")
                        };
                        audit_row(
                            task.id,
                            AuditEvent::TaskRunning,
                            owner,
                            &summary,
                            &AuditTarget::Task(task.id),
                        )
                    })
                    .collect();
                sqlx::query(insert_audits_sql(self.dialect()))
                    .bind(super::text::storable_rows(audits))
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
            claimed
        });
        Ok(claimed)
    }

    /// Expires every lease `owner` holds, on tasks and on replies being delivered, so they
    /// can be claimed at once. Used when an instance stops gracefully and when it starts
    /// again under the same id: its tasks cannot be running anywhere else then.
    pub async fn release_leases_of(&self, owner: &str, now: i64) -> StoreResult<(u64, u64)> {
        let released = write_tx!(self, tx => {
            let tasks = sqlx::query(
                "UPDATE agent_task SET lease_expire = $1, updated_at = $2 \
                 WHERE owner = $3 AND status = 'RUNNING'",
            )
            .bind(now - 1)
            .bind(now)
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            let replies = sqlx::query(
                "UPDATE outbound_reply SET locked_until = NULL, locked_by = NULL \
                 WHERE locked_by = $1 AND status = 'PENDING'",
            )
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            (tasks, replies)
        });
        Ok(released)
    }

    pub async fn task(&self, id: i64) -> StoreResult<Option<TaskRow>> {
        let sql = format!("SELECT {TASK_COLUMNS} FROM agent_task WHERE id = $1");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, TaskRow>(&sql).bind(id).fetch_optional(pool).await?
        }))
    }

    /// Tasks of one conversation, oldest first.
    pub async fn conversation_tasks(
        &self,
        channel: &str,
        conversation_id: &str,
    ) -> StoreResult<Vec<TaskRow>> {
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM agent_task WHERE channel = $1 AND conversation_id = $2 \
             ORDER BY id"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, TaskRow>(&sql)
                .bind(channel)
                .bind(conversation_id)
                .fetch_all(pool)
                .await?
        }))
    }

    pub async fn message(&self, id: i64) -> StoreResult<Option<MessageRow>> {
        let sql = format!("SELECT {MESSAGE_COLUMNS} FROM im_message WHERE id = $1");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, MessageRow>(&sql)
                .bind(id)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// The messages with these ids (those that exist, in no particular order): the
    /// messages of a claim's tasks in one statement rather than one each. On PostgreSQL
    /// each id is looked up on its own (a lateral subquery the planner cannot flatten):
    /// as one set, the planner's small estimate of a young table sent it to a sequential
    /// scan of every message on every claim, still there at 3,000 messages (issue 22).
    pub async fn messages(&self, ids: &[i64]) -> StoreResult<Vec<MessageRow>> {
        let sql = match self.dialect() {
            Dialect::Sqlite => format!(
                "SELECT {MESSAGE_COLUMNS} FROM im_message WHERE {}",
                in_json_ids(Dialect::Sqlite, "id")
            ),
            Dialect::Postgres => format!(
                "SELECT m.* FROM json_array_elements_text($1::text::json) AS ids, \
                 LATERAL (SELECT {MESSAGE_COLUMNS} FROM im_message \
                 WHERE id = ids.value::bigint OFFSET 0) AS m"
            ),
        };
        let ids = serde_json::Value::from(ids.to_vec()).to_string();
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, MessageRow>(&sql).bind(ids).fetch_all(pool).await?
        }))
    }

    /// Records that try number `attempt` of a step is starting; false = ownership lost.
    pub async fn record_step_attempt(
        &self,
        fence: &Fence,
        step_id: i64,
        attempt: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            sqlx::query(
                "UPDATE agent_step SET attempt = $1 WHERE id = $2 AND task_id = $3 \
                 AND EXISTS (SELECT 1 FROM agent_task t WHERE t.id = $3 AND t.owner = $4 \
                 AND t.version = $5 AND t.status = 'RUNNING')",
            )
            .bind(attempt)
            .bind(step_id)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// Tasks, newest first, optionally of one status and/or one conversation.
    pub async fn list_tasks(
        &self,
        status: Option<TaskStatus>,
        conversation_id: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<TaskRow>> {
        self.find_tasks(&TaskSearch {
            status,
            conversation_id: conversation_id.map(str::to_string),
            limit,
            ..TaskSearch::default()
        })
        .await
    }

    /// Tasks, newest first, matching every filter `search` sets (see [`TaskSearch`]).
    pub async fn find_tasks(&self, search: &TaskSearch) -> StoreResult<Vec<TaskRow>> {
        let (matching, text) = match search.text.as_deref() {
            Some(t) => {
                let (sql, pattern) = message_search(self.dialect(), t);
                (sql, Some(pattern))
            }
            None => ("SELECT id FROM im_message WHERE false", None),
        };
        let risk = if search.risky { RISKY_FILTER } else { "" };
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM agent_task \
             WHERE ($1 IS NULL OR status = $1) AND ($2 IS NULL OR conversation_id = $2) \
             AND ($4 IS NULL OR failure_type = $4) AND ($5 IS NULL OR channel = $5) \
             AND ($6 IS NULL OR agent_id = (SELECT id FROM agent WHERE name = $6)) \
             AND ($7 IS NULL OR created_at >= $7) AND ($8 IS NULL OR created_at < $8) \
             AND ($9 IS NULL OR id < $9) \
             AND ($10 IS NULL OR id IN (SELECT task_id FROM im_message WHERE id IN ({matching}))){risk} \
             ORDER BY id DESC LIMIT $3"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, TaskRow>(&sql)
                .bind(search.status.map(|s| s.as_str()))
                .bind(search.conversation_id.as_deref())
                .bind(search.limit)
                .bind(search.failure_type.map(|f| f.as_str()))
                .bind(search.channel.as_deref())
                .bind(search.agent.as_deref())
                .bind(search.since)
                .bind(search.until)
                .bind(search.before_id)
                .bind(text.as_deref())
                .fetch_all(pool)
                .await?
        }))
    }

    /// Instances holding leases on running tasks: (owner, tasks, earliest lease end).
    pub async fn lease_holders(&self) -> StoreResult<Vec<(String, i64, i64)>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT owner, COUNT(*), MIN(lease_expire) FROM agent_task \
                 WHERE status = 'RUNNING' AND owner IS NOT NULL GROUP BY owner ORDER BY owner",
            )
            .fetch_all(pool)
            .await?
        }))
    }

    /// The task's journal, oldest step first, outputs kept by reference read through.
    pub async fn task_steps(&self, task_id: i64) -> StoreResult<Vec<StepRow>> {
        let sql =
            format!("SELECT {STEP_COLUMNS} FROM agent_step WHERE task_id = $1 ORDER BY step_no");
        let mut steps = on_pool!(self, pool => {
            sqlx::query_as::<_, StepRow>(&sql).bind(task_id).fetch_all(pool).await?
        });
        self.read_through_blobs(&mut steps).await?;
        Ok(steps)
    }

    /// Finished steps in the journal and the time from the first step's start to the last
    /// step's end, in milliseconds (`assistd-bench steps`).
    pub async fn finished_steps_span(&self) -> StoreResult<(i64, i64)> {
        let (count, first, last): (i64, Option<i64>, Option<i64>) = on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT COUNT(*), MIN(created_at), MAX(finished_at) FROM agent_step \
                 WHERE finished_at IS NOT NULL",
            )
            .fetch_one(pool)
            .await?
        });
        Ok((count, last.unwrap_or(0) - first.unwrap_or(0)))
    }

    /// The task's audit trail, oldest first (`task_audit_sql`).
    pub async fn task_audit(&self, task_id: i64) -> StoreResult<Vec<AuditRow>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, AuditRow>(&task_audit_sql())
            .bind(task_id)
            .fetch_all(pool)
            .await?
        }))
    }

    /// The audit trail of one target (a job, approval, reply, step or task), newest first.
    /// A task's rows, and a reply's (which name the reply's task), are read through
    /// `audit_log_task`; the target index leaves them out (migrations 0010 and 0027), and
    /// its predicate is spelt out so the planner can use it.
    pub async fn target_audit(
        &self,
        target_type: &str,
        target_id: &str,
        limit: i64,
    ) -> StoreResult<Vec<AuditRow>> {
        if target_type == "task" {
            let Ok(task_id) = target_id.parse::<i64>() else {
                return Ok(Vec::new());
            };
            return Ok(on_pool!(self, pool => {
                sqlx::query_as::<_, AuditRow>(&format!(
                    "SELECT {AUDIT_COLUMNS} FROM audit_log WHERE task_id = $1 \
                     AND target_type = 'task' ORDER BY id DESC LIMIT $2"
                ))
                .bind(task_id)
                .bind(limit)
                .fetch_all(pool)
                .await?
            }));
        }
        if target_type == "reply" {
            let Ok(reply_id) = target_id.parse::<i64>() else {
                return Ok(Vec::new());
            };
            return Ok(on_pool!(self, pool => {
                sqlx::query_as::<_, AuditRow>(&format!(
                    "SELECT {AUDIT_COLUMNS} FROM audit_log WHERE task_id = \
                     (SELECT task_id FROM outbound_reply WHERE id = $1) \
                     AND target_type = 'reply' AND target_id = $2 ORDER BY id DESC LIMIT $3"
                ))
                .bind(reply_id)
                .bind(target_id)
                .bind(limit)
                .fetch_all(pool)
                .await?
            }));
        }
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, AuditRow>(&format!(
                "SELECT {AUDIT_COLUMNS} FROM audit_log WHERE target_type = $1 AND target_id = $2 \
                 AND target_type NOT IN ('task', 'reply') ORDER BY id DESC LIMIT $3"
            ))
            .bind(target_type)
            .bind(target_id)
            .bind(limit)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Row counts of the tables intake writes, for tests that prove bad input wrote nothing.
    pub async fn intake_row_counts(&self) -> StoreResult<(i64, i64, i64)> {
        Ok(on_pool!(self, pool => {
            let (m,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM im_message").fetch_one(pool).await?;
            let (t,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM agent_task").fetch_one(pool).await?;
            let (a,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM audit_log WHERE task_id IS NOT NULL")
                .fetch_one(pool)
                .await?;
            (m, t, a)
        }))
    }
}

/// The ids of messages whose text holds `text` in any case, as a statement over `$10` and
/// what to bind there: through the trigram index of migration 0024 (SQLite: a phrase of the
/// text's trigrams in FTS5, its quotes doubled; PostgreSQL: `LIKE` on the text lowercased
/// under the ICU root collation, which pg_trgm's index serves). A text under three
/// characters has no trigram: SQLite scans the messages (case folded for ASCII only there),
/// PostgreSQL reads its whole index. A `LIKE` substring takes its own `%`, `_` and `\`
/// literally.
fn message_search(dialect: super::Dialect, text: &str) -> (&'static str, String) {
    let like = || {
        let escaped = text
            .to_lowercase()
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        format!("%{escaped}%")
    };
    match dialect {
        super::Dialect::Sqlite if text.chars().count() >= 3 => (
            "SELECT rowid FROM im_message_trigram WHERE im_message_trigram MATCH $10",
            format!("\"{}\"", text.replace('"', "\"\"")),
        ),
        super::Dialect::Sqlite => (
            "SELECT id FROM im_message WHERE LOWER(text) LIKE $10 ESCAPE '\\'",
            like(),
        ),
        super::Dialect::Postgres => (
            "SELECT id FROM im_message \
             WHERE lower(text COLLATE \"und-x-icu\") LIKE $10 ESCAPE '\\'",
            like(),
        ),
    }
}
