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

impl Store {
    /// The counts behind `/metrics`: finished history from the rollups, live rows counted.
    pub async fn metric_counts(&self) -> StoreResult<MetricCounts> {
        let tasks = format!(
            "SELECT status, CAST(SUM(tasks) AS BIGINT) FROM task_rollup GROUP BY status \
             UNION ALL SELECT status, COUNT(*) FROM ({LIVE_TASKS}) live GROUP BY status"
        );
        let failures = format!(
            "SELECT failure_type, CAST(SUM(tasks) AS BIGINT) FROM task_rollup \
             WHERE failure_type <> '' GROUP BY failure_type \
             UNION ALL SELECT failure_type, COUNT(*) FROM ({LIVE_TASKS}) live \
             WHERE failure_type IS NOT NULL GROUP BY failure_type"
        );
        let takeovers = format!(
            "SELECT CAST(COALESCE((SELECT SUM(takeovers) FROM task_rollup), 0) \
             + COALESCE((SELECT SUM(claim_count - 1) FROM ({LIVE_TASKS}) live \
             WHERE claim_count > 1), 0) AS BIGINT)"
        );
        Ok(on_pool!(self, pool => {
            let tasks_by_status: Vec<(TaskStatus, i64)> =
                sqlx::query_as(&tasks).fetch_all(pool).await?;
            let failures_by_type: Vec<(FailureType, i64)> =
                sqlx::query_as(&failures).fetch_all(pool).await?;
            let replies_by_status: Vec<(ReplyStatus, i64)> = sqlx::query_as(
                "SELECT status, CAST(SUM(replies) AS BIGINT) FROM reply_rollup GROUP BY status \
                 UNION ALL SELECT status, COUNT(*) FROM outbound_reply \
                 WHERE status = 'PENDING' GROUP BY status",
            )
            .fetch_all(pool)
            .await?;
            let job_runs: Vec<(String, JobRunStatus, i64)> =
                sqlx::query_as(JOB_RUNS).fetch_all(pool).await?;
            let (lease_takeovers,): (i64,) = sqlx::query_as(&takeovers).fetch_one(pool).await?;
            MetricCounts {
                tasks_by_status: summed(tasks_by_status),
                failures_by_type: summed(failures_by_type),
                replies_by_status: summed(replies_by_status),
                job_runs,
                lease_takeovers,
            }
        }))
    }

    /// [`Store::metric_counts`] counted from every row kept (what the rollups must equal;
    /// for tests and for checking a repair).
    pub async fn metric_counts_recounted(&self) -> StoreResult<MetricCounts> {
        Ok(on_pool!(self, pool => {
            let tasks_by_status: Vec<(TaskStatus, i64)> =
                sqlx::query_as("SELECT status, COUNT(*) FROM agent_task GROUP BY status")
                    .fetch_all(pool)
                    .await?;
            let failures_by_type: Vec<(FailureType, i64)> = sqlx::query_as(
                "SELECT failure_type, COUNT(*) FROM agent_task WHERE failure_type IS NOT NULL \
                 GROUP BY failure_type",
            )
            .fetch_all(pool)
            .await?;
            let replies_by_status: Vec<(ReplyStatus, i64)> =
                sqlx::query_as("SELECT status, COUNT(*) FROM outbound_reply GROUP BY status")
                    .fetch_all(pool)
                    .await?;
            let job_runs: Vec<(String, JobRunStatus, i64)> =
                sqlx::query_as(JOB_RUNS).fetch_all(pool).await?;
            let (lease_takeovers,): (i64,) = sqlx::query_as(
                "SELECT CAST(COALESCE(SUM(claim_count - 1), 0) AS BIGINT) FROM agent_task \
                 WHERE claim_count > 1",
            )
            .fetch_one(pool)
            .await?;
            MetricCounts {
                tasks_by_status: summed(tasks_by_status),
                failures_by_type: summed(failures_by_type),
                replies_by_status: summed(replies_by_status),
                job_runs,
                lease_takeovers,
            }
        }))
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
