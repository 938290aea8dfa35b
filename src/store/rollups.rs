//! Counts of finished history (migration 0022, issue 35): tasks and replies that reached a
//! terminal state are counted per hour by triggers, in the transaction that finished them;
//! live ones (few) are counted through their partial indexes. So `/metrics` costs the same
//! at a thousand tasks kept as at a million.

use std::collections::BTreeMap;

use super::{Store, StoreResult, on_pool, pending_replies, write_tx};
use crate::domain::{FailureType, JobRunStatus, ReplyStatus, TaskStatus};
use crate::metrics::MetricCounts;

/// The ids of the live tasks, one arm per partial index (`agent_task_pending`, `_running`,
/// `_waiting`, `_paused`), so each is an index scan of the few it holds; finished tasks are
/// in the rollups. Joined to `agent_task` by CROSS JOIN, which SQLite never reorders: its
/// planner does not know they are few and would otherwise walk every task and look each up
/// among them.
pub(super) const LIVE_IDS: &str = "SELECT id FROM agent_task WHERE status = 'PENDING' \
     UNION ALL SELECT id FROM agent_task WHERE status = 'RUNNING' \
     UNION ALL SELECT id FROM agent_task WHERE status = 'WAITING_HUMAN_CONFIRM' \
     UNION ALL SELECT id FROM agent_task WHERE status = 'PAUSED'";

/// The model a journalled request (`input`, a column of `agent_step`) asked for; NULL when
/// it is not JSON (retention keeps only the model: `Store::purge_finished`). A request
/// journalled with `model` first (`llm::journal_text`) is read from its first bytes, the
/// model's JSON string alone, never the prompt after it, which grows with the conversation;
/// others (journalled before, written again without a NUL by `text::storable`, or a model
/// name over a kilobyte) are parsed whole. On SQLite the string runs to the first `",`
/// after it: where that quote is escaped, the cut is not valid JSON and the whole text is
/// parsed instead; the triggers of SQLite's migration 0031 spell this expression out.
/// PostgreSQL: the function of its migration 0038, the same rule.
pub fn step_model(dialect: super::Dialect, input: &str) -> String {
    match dialect {
        super::Dialect::Sqlite => {
            let first = format!(
                "'[' || substr({input}, 10, instr(substr({input}, 11, 1024), '\",') + 1) || ']'"
            );
            format!(
                "(CASE WHEN substr({input}, 1, 10) = '{{\"model\":\"' AND json_valid({first}) \
                 THEN json_extract({first}, '$[0]') \
                 WHEN json_valid({input}) THEN json_extract({input}, '$.model') END)"
            )
        }
        super::Dialect::Postgres => format!("step_model({input})"),
    }
}

/// Lease takeovers of a task row: its claims after the first.
const TAKEOVERS: &str = "CASE WHEN claim_count > 1 THEN claim_count - 1 ELSE 0 END";

/// The terminal task states, the ones the rollups count.
pub(super) const FINISHED: &str = "('SUCCEEDED', 'FAILED', 'CANCELLED')";

/// Where a reply row `r` stands as a chat user sees it: DELIVERED (sent, and not a
/// placeholder still waiting for its answer), PENDING (to be sent, or a placeholder shown),
/// FAILED (given up) or UNKNOWN (given up in doubt). NULL without a row.
pub(super) const ANSWER_STATE: &str = "CASE WHEN r.status = 'SENT' AND r.placeholder = 0 \
     THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END";

/// The key of a task `t`'s answer (`domain::reply_key`).
pub(super) const ANSWER_KEY: &str = "'agent-task-' || CAST(t.id AS TEXT) || \
     CASE WHEN t.resume_count = 0 THEN '' ELSE '-r' || CAST(t.resume_count AS TEXT) END";

/// Task counts per (status, failure type): tasks and lease takeovers. From the rollups plus
/// the live tasks, and from every task row (what the rollups must equal).
fn task_cells(rolled: bool) -> String {
    if rolled {
        format!(
            "SELECT status, NULLIF(failure_type, ''), CAST(SUM(tasks) AS BIGINT), \
             CAST(SUM(takeovers) AS BIGINT) FROM task_rollup GROUP BY 1, 2 \
             UNION ALL SELECT t.status, t.failure_type, COUNT(*), \
             CAST(SUM({TAKEOVERS}) AS BIGINT) FROM ({LIVE_IDS}) l CROSS JOIN agent_task t \
             WHERE t.id = l.id GROUP BY 1, 2"
        )
    } else {
        format!(
            "SELECT status, failure_type, COUNT(*), CAST(SUM({TAKEOVERS}) AS BIGINT) \
             FROM agent_task GROUP BY 1, 2"
        )
    }
}

/// Reply counts per status: from the rollups plus the pending replies, or from every row.
pub fn reply_counts(rolled: bool) -> &'static str {
    if rolled {
        concat!(
            "SELECT status, CAST(SUM(replies) AS BIGINT) FROM reply_rollup GROUP BY status \
             UNION ALL SELECT status, COUNT(*) FROM outbound_reply WHERE ",
            pending_replies!(),
            " GROUP BY status"
        )
    } else {
        "SELECT status, COUNT(*) FROM outbound_reply GROUP BY status"
    }
}

/// Job runs per job and status (pruned by retention: few).
const JOB_RUNS: &str = "SELECT job, status, COUNT(*) FROM job_run GROUP BY job, status";

/// Sums `(key, count)` rows per key, leaving out keys whose sum is 0.
fn summed<K: Ord>(rows: impl IntoIterator<Item = (K, i64)>) -> Vec<(K, i64)> {
    let mut sums: BTreeMap<K, i64> = BTreeMap::new();
    for (key, n) in rows {
        *sums.entry(key).or_default() += n;
    }
    sums.into_iter().filter(|(_, n)| *n != 0).collect()
}

/// One row of [`task_cells`].
type TaskCell = (TaskStatus, Option<FailureType>, i64, i64);

impl Store {
    /// The counts behind `/metrics`: finished history from the rollups, live rows counted.
    pub async fn metric_counts(&self) -> StoreResult<MetricCounts> {
        self.counts(true).await
    }

    /// [`Store::metric_counts`] counted from every row kept (what the rollups must equal;
    /// for tests and for checking a repair).
    pub async fn metric_counts_recounted(&self) -> StoreResult<MetricCounts> {
        self.counts(false).await
    }

    async fn counts(&self, rolled: bool) -> StoreResult<MetricCounts> {
        let tasks = task_cells(rolled);
        let (cells, replies, job_runs) = on_pool!(self, pool => {
            let cells: Vec<TaskCell> = sqlx::query_as(&tasks).fetch_all(pool).await?;
            let replies: Vec<(ReplyStatus, i64)> =
                sqlx::query_as(reply_counts(rolled)).fetch_all(pool).await?;
            let job_runs: Vec<(String, JobRunStatus, i64)> =
                sqlx::query_as(JOB_RUNS).fetch_all(pool).await?;
            (cells, replies, job_runs)
        });
        Ok(MetricCounts {
            tasks_by_status: summed(cells.iter().map(|c| (c.0, c.2))),
            failures_by_type: summed(cells.iter().filter_map(|c| Some((c.1?, c.2)))),
            replies_by_status: summed(replies),
            job_runs,
            lease_takeovers: cells.iter().map(|c| c.3).sum(),
        })
    }

    /// Counts the rollups again from history (after an upgrade or a repair), in one
    /// transaction. On PostgreSQL the rollup tables are locked first: a task finishing
    /// meanwhile waits, then adds itself to the recount (which did not see it).
    pub async fn rebuild_rollups(&self) -> StoreResult<()> {
        let fills = refill(self.dialect());
        write_tx!(self, tx => {
            if matches!(self, Store::Postgres(_)) {
                sqlx::query(
                    "LOCK TABLE task_rollup, reply_rollup, token_rollup, latency_rollup \
                     IN EXCLUSIVE MODE",
                )
                .execute(&mut *tx)
                .await?;
            }
            for rollup in ROLLUPS {
                sqlx::query(&format!("DELETE FROM {}", rollup.table))
                    .execute(&mut *tx)
                    .await?;
            }
            for sql in &fills {
                sqlx::query(sql).execute(&mut *tx).await?;
            }
        });
        Ok(())
    }

    /// Folds the rollups of hours before `before_hour` into one row per cell (PostgreSQL
    /// counts each backend in a row of its own; SQLite has only slot 0) and drops cells
    /// that sum to nothing; the sums do not change. Run by the retention job.
    pub async fn fold_rollups(&self, before_hour: i64) -> StoreResult<u64> {
        let postgres = matches!(self, Store::Postgres(_));
        let folded = write_tx!(self, tx => {
            let mut folded = 0;
            for rollup in ROLLUPS {
                let statements = [
                    postgres.then(|| rollup.fold()),
                    Some(rollup.drop_empty()),
                ];
                for sql in statements.iter().flatten() {
                    folded += sqlx::query(sql)
                        .bind(before_hour)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                }
            }
            folded
        });
        Ok(folded)
    }
}

/// A rollup table: its cell (without `hour` and `slot`) and its counts.
struct Rollup {
    table: &'static str,
    cell: &'static [&'static str],
    counts: &'static [&'static str],
}

const ROLLUPS: [Rollup; 4] = [
    Rollup {
        table: "task_rollup",
        cell: &[
            "agent_id",
            "agent_version_id",
            "channel",
            "status",
            "failure_type",
            "delivery",
        ],
        counts: &["tasks", "takeovers"],
    },
    Rollup {
        table: "reply_rollup",
        cell: &["channel", "status", "placeholder"],
        counts: &["replies"],
    },
    Rollup {
        table: "token_rollup",
        cell: &["agent_id", "channel", "failure_type", "model"],
        counts: &["calls", "prompt_tokens", "completion_tokens"],
    },
    Rollup {
        table: "latency_rollup",
        cell: &["agent_id", "channel", "failure_type", "le"],
        counts: &["answers"],
    },
];

impl Rollup {
    /// PostgreSQL: the rows of hours before `$1` moved into slot 0, one per cell.
    fn fold(&self) -> String {
        let (table, cell) = (self.table, self.cell.join(", "));
        let sums: Vec<String> = self.counts.iter().map(|c| format!("SUM({c})")).collect();
        let added: Vec<String> = self
            .counts
            .iter()
            .map(|c| format!("{c} = {table}.{c} + excluded.{c}"))
            .collect();
        format!(
            "WITH moved AS (DELETE FROM {table} WHERE hour < $1 AND slot <> 0 RETURNING *) \
             INSERT INTO {table} (hour, {cell}, slot, {counts}) \
             SELECT hour, {cell}, 0, {sums} FROM moved GROUP BY hour, {cell} \
             ON CONFLICT (hour, {cell}, slot) DO UPDATE SET {added}",
            counts = self.counts.join(", "),
            sums = sums.join(", "),
            added = added.join(", "),
        )
    }

    /// Cells of hours before `$1` whose counts are all 0.
    fn drop_empty(&self) -> String {
        let zero: Vec<String> = self.counts.iter().map(|c| format!("{c} = 0")).collect();
        format!(
            "DELETE FROM {} WHERE hour < $1 AND {}",
            self.table,
            zero.join(" AND ")
        )
    }
}

/// The rollups counted from history (migrations 0022 and 0023 fill them the same way).
fn refill(dialect: super::Dialect) -> [String; 4] {
    let model = step_model(dialect, "s.input");
    [
        format!(
            "INSERT INTO task_rollup SELECT t.created_at / 3600000, t.agent_id, \
             t.agent_version_id, t.channel, t.status, COALESCE(t.failure_type, ''), \
             COALESCE({ANSWER_STATE}, ''), 0, COUNT(*), SUM({TAKEOVERS}) \
             FROM agent_task t LEFT JOIN outbound_reply r ON r.task_id = t.id \
             AND r.idempotency_key = {ANSWER_KEY} \
             WHERE t.status IN {FINISHED} GROUP BY 1, 2, 3, 4, 5, 6, 7"
        ),
        "INSERT INTO reply_rollup SELECT created_at / 3600000, channel, status, placeholder, \
         0, COUNT(*) FROM outbound_reply WHERE status <> 'PENDING' GROUP BY 1, 2, 3, 4"
            .to_string(),
        format!(
            "INSERT INTO token_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel, \
             COALESCE(t.failure_type, ''), COALESCE({model}, ''), 0, COUNT(*), \
             SUM(s.tokens_in), COALESCE(SUM(s.tokens_out), 0) \
             FROM agent_task t JOIN agent_step s ON s.task_id = t.id \
             WHERE t.status IN {FINISHED} AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL \
             GROUP BY 1, 2, 3, 4, 5"
        ),
        format!(
            "INSERT INTO latency_rollup SELECT t.created_at / 3600000, t.agent_id, t.channel, \
             COALESCE(t.failure_type, ''), \
             COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at), \
             (SELECT MAX(le) FROM latency_bound)), 0, COUNT(*) \
             FROM agent_task t JOIN outbound_reply r ON r.task_id = t.id \
             AND r.idempotency_key = {ANSWER_KEY} \
             JOIN im_message m ON m.id = t.message_id \
             WHERE t.status IN {FINISHED} AND r.status = 'SENT' AND r.placeholder = 0 \
             GROUP BY 1, 2, 3, 4, 5"
        ),
    ]
}
