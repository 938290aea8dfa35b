//! Read models for the admin dashboard and metrics: grouped counts, latencies, top errors.

use super::{Store, StoreResult, on_pool};
use crate::domain::{FailureType, TaskStatus};

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
    /// Where the task's answer stands (`DELIVERY_STATE`): DELIVERED, PENDING, FAILED,
    /// UNKNOWN, or `None` while there is no answer yet.
    pub delivery: Option<String>,
    pub count: i64,
}

/// One platform's replies in a state (`DELIVERY_STATE`), and its outbox backlog.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ChannelDelivery {
    pub channel: String,
    pub state: String,
    pub count: i64,
}

/// One agent's model calls to one model in the window, and their tokens.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TokenRow {
    pub agent: String,
    /// The model the call asked for (from the journalled request; `None` once retention
    /// removed it).
    pub model: Option<String>,
    pub calls: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

/// A reply that is not getting through: given up, in doubt, or retrying.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StuckReply {
    pub id: i64,
    pub task_id: i64,
    pub channel: String,
    pub conversation_id: String,
    pub status: String,
    pub attempts: i64,
    pub last_error: Option<String>,
    pub created_at: i64,
    pub next_attempt_at: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ErrorRow {
    pub failure_type: FailureType,
    pub error_msg: String,
    pub count: i64,
}

/// A reply row `r` as a chat user sees it: DELIVERED (sent, and not a placeholder still
/// waiting for its answer), PENDING (to be sent, or a placeholder shown), FAILED (given up)
/// or UNKNOWN (given up in doubt).
const DELIVERY_STATE: &str = "CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' \
     WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END";

/// The key of a task `t`'s answer (`domain::reply_key`).
const ANSWER_KEY: &str = "'agent-task-' || CAST(t.id AS TEXT) || CASE WHEN t.resume_count = 0 \
     THEN '' ELSE '-r' || CAST(t.resume_count AS TEXT) END";

/// `query` with the five parameters of `FILTER` (`$2` to `$6`) bound from `f`.
macro_rules! with_filter {
    ($query:expr, $f:expr) => {
        $query
            .bind($f.since)
            .bind($f.until)
            .bind(&$f.agent)
            .bind(&$f.channel)
            .bind($f.failure_type)
    };
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
             t.status, t.failure_type, \
             (SELECT {DELIVERY_STATE} FROM outbound_reply r \
                 WHERE r.idempotency_key = {ANSWER_KEY}) AS delivery, COUNT(*) AS count \
             FROM agent_task t JOIN agent a ON a.id = t.agent_id \
             JOIN agent_version v ON v.id = t.agent_version_id WHERE {FILTER} \
             GROUP BY 1, 2, 3, 4, 5, 6 \
             ORDER BY 1"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, SummaryRow>(&sql).bind(bucket_ms), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// The replies of the filtered tasks (answers, notices, placeholders) per platform and
    /// state.
    pub async fn delivery_by_channel(
        &self,
        f: &SummaryFilter,
    ) -> StoreResult<Vec<ChannelDelivery>> {
        let sql = format!(
            "SELECT r.channel, {DELIVERY_STATE} AS state, COUNT(*) AS count \
             FROM outbound_reply r JOIN agent_task t ON t.id = r.task_id \
             JOIN agent a ON a.id = t.agent_id WHERE $1 = $1 AND {FILTER} \
             GROUP BY 1, 2 ORDER BY 1, 2"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, ChannelDelivery>(&sql).bind(0i64), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// The outbox backlog now, whatever the window: per platform, the replies still to be
    /// sent and when the oldest of them was queued.
    pub async fn outbox_backlog(&self) -> StoreResult<Vec<(String, i64, i64)>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT channel, COUNT(*), MIN(created_at) FROM outbound_reply \
                 WHERE status = 'PENDING' GROUP BY channel ORDER BY channel",
            )
            .fetch_all(pool)
            .await?
        }))
    }

    /// Replies of the filtered tasks that are not getting through (given up, in doubt, or
    /// failed at least once and still retrying), newest first.
    pub async fn stuck_replies(
        &self,
        f: &SummaryFilter,
        limit: i64,
    ) -> StoreResult<Vec<StuckReply>> {
        let sql = format!(
            "SELECT r.id, r.task_id, r.channel, r.conversation_id, r.status, r.attempts, \
             r.last_error, r.created_at, r.next_attempt_at FROM outbound_reply r \
             JOIN agent_task t ON t.id = r.task_id JOIN agent a ON a.id = t.agent_id \
             WHERE (r.status IN ('FAILED', 'UNKNOWN') \
                 OR (r.status = 'PENDING' AND r.last_error IS NOT NULL)) AND {FILTER} \
             ORDER BY r.id DESC LIMIT $1"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, StuckReply>(&sql).bind(limit), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// Model calls and tokens of the filtered tasks, per agent and model (the model read
    /// from each journalled request).
    pub async fn tokens_by_agent_model(&self, f: &SummaryFilter) -> StoreResult<Vec<TokenRow>> {
        let model = match self.dialect() {
            super::Dialect::Sqlite => {
                "(CASE WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END)"
            }
            super::Dialect::Postgres => {
                "(CASE WHEN s.input LIKE '{%' THEN s.input::json ->> 'model' END)"
            }
        };
        let sql = format!(
            "SELECT a.name AS agent, {model} AS model, COUNT(*) AS calls, \
             CAST(COALESCE(SUM(s.tokens_in), 0) AS BIGINT) AS prompt_tokens, \
             CAST(COALESCE(SUM(s.tokens_out), 0) AS BIGINT) AS completion_tokens \
             FROM agent_step s JOIN agent_task t ON t.id = s.task_id \
             JOIN agent a ON a.id = t.agent_id \
             WHERE s.step_type = 'llm' AND s.tokens_in IS NOT NULL AND $1 = $1 AND {FILTER} \
             GROUP BY 1, 2 ORDER BY 1, 2"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, TokenRow>(&sql).bind(0i64), f)
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
            with_filter!(sqlx::query_as(&sql).bind(limit), f)
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
            with_filter!(sqlx::query_as::<_, ErrorRow>(&sql).bind(0i64), f)
                .fetch_all(pool)
                .await?
        }))
    }
}
