//! Counts of finished history (migration 0022, issue 35): tasks and replies that reached a
//! terminal state are counted per hour by triggers, in the transaction that finished them;
//! live ones (few) are counted through their partial indexes. So `/metrics` costs the same
//! at a thousand tasks kept as at a million.

use std::collections::BTreeMap;

use super::{Store, StoreResult, on_pool, write_tx};
use crate::domain::{FailureType, JobRunStatus, ReplyStatus, TaskStatus};
use crate::metrics::MetricCounts;

/// The live tasks, one arm per partial index (`agent_task_pending`, `_running`, `_waiting`,
/// `_paused`), so each is an index scan of the few it holds.
const LIVE_TASKS: &str = "SELECT status, failure_type, claim_count FROM agent_task \
     WHERE status = 'PENDING' \
     UNION ALL SELECT status, failure_type, claim_count FROM agent_task WHERE status = 'RUNNING' \
     UNION ALL SELECT status, failure_type, claim_count FROM agent_task \
     WHERE status = 'WAITING_HUMAN_CONFIRM' \
     UNION ALL SELECT status, failure_type, claim_count FROM agent_task WHERE status = 'PAUSED'";

/// Lease takeovers of a task row: its claims after the first.
const TAKEOVERS: &str = "CASE WHEN claim_count > 1 THEN claim_count - 1 ELSE 0 END";

/// Task counts per (status, failure type): tasks and lease takeovers. From the rollups plus
/// the live tasks, and from every task row (what the rollups must equal).
fn task_cells(rolled: bool) -> String {
    if rolled {
        format!(
            "SELECT status, NULLIF(failure_type, ''), CAST(SUM(tasks) AS BIGINT), \
             CAST(SUM(takeovers) AS BIGINT) FROM task_rollup GROUP BY 1, 2 \
             UNION ALL SELECT status, failure_type, COUNT(*), CAST(SUM({TAKEOVERS}) AS BIGINT) \
             FROM ({LIVE_TASKS}) live GROUP BY 1, 2"
        )
    } else {
        format!(
            "SELECT status, failure_type, COUNT(*), CAST(SUM({TAKEOVERS}) AS BIGINT) \
             FROM agent_task GROUP BY 1, 2"
        )
    }
}

/// Reply counts per status: from the rollups plus the pending replies, or from every row.
fn reply_counts(rolled: bool) -> &'static str {
    if rolled {
        "SELECT status, CAST(SUM(replies) AS BIGINT) FROM reply_rollup GROUP BY status \
         UNION ALL SELECT status, COUNT(*) FROM outbound_reply \
         WHERE status = 'PENDING' GROUP BY status"
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
        let statements = [
            "DELETE FROM task_rollup",
            "DELETE FROM reply_rollup",
            "INSERT INTO task_rollup SELECT created_at / 3600000, agent_id, agent_version_id, \
             channel, status, COALESCE(failure_type, ''), 0, COUNT(*), \
             SUM(CASE WHEN claim_count > 1 THEN claim_count - 1 ELSE 0 END) \
             FROM agent_task WHERE status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') \
             GROUP BY 1, 2, 3, 4, 5, 6",
            "INSERT INTO reply_rollup SELECT created_at / 3600000, channel, status, \
             placeholder, 0, COUNT(*) FROM outbound_reply WHERE status <> 'PENDING' \
             GROUP BY 1, 2, 3, 4",
        ];
        write_tx!(self, tx => {
            if matches!(self, Store::Postgres(_)) {
                sqlx::query("LOCK TABLE task_rollup, reply_rollup IN EXCLUSIVE MODE")
                    .execute(&mut *tx)
                    .await?;
            }
            for sql in statements {
                sqlx::query(sql).execute(&mut *tx).await?;
            }
        });
        Ok(())
    }

    /// Folds the rollups of hours before `before_hour` into one row per cell (PostgreSQL
    /// counts each backend in a row of its own; SQLite has only slot 0) and drops cells
    /// that sum to nothing; the sums do not change. Run by the retention job.
    pub async fn fold_rollups(&self, before_hour: i64) -> StoreResult<u64> {
        let fold = [
            "WITH moved AS (DELETE FROM task_rollup WHERE hour < $1 AND slot <> 0 RETURNING *) \
             INSERT INTO task_rollup SELECT hour, agent_id, agent_version_id, channel, status, \
             failure_type, 0, SUM(tasks), SUM(takeovers) FROM moved GROUP BY 1, 2, 3, 4, 5, 6 \
             ON CONFLICT (hour, agent_id, agent_version_id, channel, status, failure_type, slot) \
             DO UPDATE SET tasks = task_rollup.tasks + excluded.tasks, \
             takeovers = task_rollup.takeovers + excluded.takeovers",
            "WITH moved AS (DELETE FROM reply_rollup WHERE hour < $1 AND slot <> 0 RETURNING *) \
             INSERT INTO reply_rollup SELECT hour, channel, status, placeholder, 0, \
             SUM(replies) FROM moved GROUP BY 1, 2, 3, 4 \
             ON CONFLICT (hour, channel, status, placeholder, slot) \
             DO UPDATE SET replies = reply_rollup.replies + excluded.replies",
        ];
        let empty = [
            "DELETE FROM task_rollup WHERE hour < $1 AND tasks = 0 AND takeovers = 0",
            "DELETE FROM reply_rollup WHERE hour < $1 AND replies = 0",
        ];
        let postgres = matches!(self, Store::Postgres(_));
        let folded = write_tx!(self, tx => {
            let mut folded = 0;
            let statements = if postgres { &fold[..] } else { &[] };
            for sql in statements.iter().chain(&empty) {
                folded += sqlx::query(sql)
                    .bind(before_hour)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            }
            folded
        });
        Ok(folded)
    }
}
