//! Read models for the admin dashboard and metrics: grouped counts, latencies, top errors.

use super::{Store, StoreResult, on_pool};
use crate::domain::{FailureType, JobRunStatus, ReplyStatus, TaskStatus};
use crate::metrics::MetricCounts;

/// Which tasks a summary covers. Times are UTC milliseconds; `None` filters match all.
#[derive(Debug, Clone)]
pub struct SummaryFilter {
    pub since: i64,
    pub until: i64,
    pub agent: Option<String>,
    pub channel: Option<String>,
    pub failure_type: Option<FailureType>,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SummaryRow {
    pub bucket: i64,
    pub agent: String,
    pub version: i64,
    pub status: TaskStatus,
    pub failure_type: Option<FailureType>,
    pub count: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ErrorRow {
    pub failure_type: FailureType,
    pub error_msg: String,
    pub count: i64,
}

const FILTER: &str = "t.created_at >= $2 AND t.created_at < $3 \
     AND ($4 IS NULL OR a.name = $4) AND ($5 IS NULL OR t.channel = $5) \
     AND ($6 IS NULL OR t.failure_type = $6)";

impl Store {
    /// Task counts per bucket (`bucket_ms` wide), agent, version, status and failure type.
    pub async fn summary_counts(
        &self,
        f: &SummaryFilter,
        bucket_ms: i64,
    ) -> StoreResult<Vec<SummaryRow>> {
        let sql = format!(
            "SELECT (t.created_at / $1) * $1 AS bucket, a.name AS agent, v.version_no AS version, \
             t.status, t.failure_type, COUNT(*) AS count \
             FROM agent_task t JOIN agent a ON a.id = t.agent_id \
             JOIN agent_version v ON v.id = t.agent_version_id WHERE {FILTER} \
             GROUP BY 1, 2, 3, 4, 5 \
             ORDER BY 1"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, SummaryRow>(&sql)
                .bind(bucket_ms)
                .bind(f.since)
                .bind(f.until)
                .bind(&f.agent)
                .bind(&f.channel)
                .bind(f.failure_type)
                .fetch_all(pool)
                .await?
        }))
    }

    /// Milliseconds from webhook to delivered reply, for up to `limit` replies.
    pub async fn reply_latencies(&self, f: &SummaryFilter, limit: i64) -> StoreResult<Vec<i64>> {
        let sql = format!(
            "SELECT r.sent_at - m.received_at FROM outbound_reply r \
             JOIN agent_task t ON t.id = r.task_id JOIN im_message m ON m.id = t.message_id \
             JOIN agent a ON a.id = t.agent_id \
             WHERE r.status = 'SENT' AND r.idempotency_key NOT LIKE '%-confirm-%' AND {FILTER} \
             ORDER BY r.id DESC LIMIT $1"
        );
        let rows: Vec<(i64,)> = on_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(limit)
                .bind(f.since)
                .bind(f.until)
                .bind(&f.agent)
                .bind(&f.channel)
                .bind(f.failure_type)
                .fetch_all(pool)
                .await?
        });
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    /// The most frequent error messages of failed tasks, per failure type.
    pub async fn top_errors(&self, f: &SummaryFilter) -> StoreResult<Vec<ErrorRow>> {
        let sql = format!(
            "SELECT t.failure_type, t.error_msg, COUNT(*) AS count FROM agent_task t \
             JOIN agent a ON a.id = t.agent_id \
             WHERE t.failure_type IS NOT NULL AND t.error_msg IS NOT NULL AND $1 = $1 AND {FILTER} \
             GROUP BY t.failure_type, t.error_msg ORDER BY count DESC LIMIT 200"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, ErrorRow>(&sql)
                .bind(0i64)
                .bind(f.since)
                .bind(f.until)
                .bind(&f.agent)
                .bind(&f.channel)
                .bind(f.failure_type)
                .fetch_all(pool)
                .await?
        }))
    }

    pub async fn metric_counts(&self) -> StoreResult<MetricCounts> {
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
                sqlx::query_as("SELECT job, status, COUNT(*) FROM job_run GROUP BY job, status")
                    .fetch_all(pool)
                    .await?;
            let (lease_takeovers,): (i64,) = sqlx::query_as(
                "SELECT CAST(COALESCE(SUM(claim_count - 1), 0) AS BIGINT) FROM agent_task \
                 WHERE claim_count > 1",
            )
            .fetch_one(pool)
            .await?;
            MetricCounts { tasks_by_status, failures_by_type, replies_by_status, job_runs, lease_takeovers }
        }))
    }
}
