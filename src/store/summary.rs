//! Read models for the admin dashboard: grouped counts, latencies, tokens, top errors. The
//! finished history is read from the rollups (migrations 0022, 0023), so a summary costs the
//! same at a thousand tasks kept as at a million; live tasks and the replies not getting
//! through are read from history, through the partial indexes that hold them.

use super::rollups::{ANSWER_KEY, ANSWER_STATE, LIVE_IDS, step_model};
use super::{Store, StoreResult, on_pool, pending_replies};
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

/// The outbox backlog now, per platform: the replies still to be sent and when the oldest
/// of them was queued (through `outbound_reply_due`, `pending_replies!`).
pub const OUTBOX_BACKLOG: &str = concat!(
    "SELECT channel, COUNT(*), MIN(created_at) FROM outbound_reply WHERE ",
    pending_replies!(),
    " GROUP BY channel ORDER BY channel"
);

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

/// Most of the newest failures of the window read for the top errors.
pub const ERROR_SAMPLE: i64 = 10_000;

/// `query` with the five parameters of the filters (`$2` to `$6`) bound from `f`.
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

/// Tasks `t` of the window (milliseconds), agent, platform and failure type.
const TASKS: &str = "t.created_at >= $2 AND t.created_at < $3 \
     AND ($4 IS NULL OR t.agent_id IN (SELECT id FROM agent WHERE name = $4)) \
     AND ($5 IS NULL OR t.channel = $5) AND ($6 IS NULL OR t.failure_type = $6)";

/// Rollup rows `ro` of the window's hours (it is whole hours), agent, platform and failure
/// type (`''` in a rollup for none).
const ROLLED: &str = "ro.hour >= $2 / 3600000 AND ro.hour < $3 / 3600000 \
     AND ($4 IS NULL OR ro.agent_id IN (SELECT id FROM agent WHERE name = $4)) \
     AND ($5 IS NULL OR ro.channel = $5) AND ($6 IS NULL OR ro.failure_type = $6)";

impl SummaryFilter {
    /// The filter over whole hours (the rollups' grain): `since` down, `until` up.
    pub fn whole_hours(&self) -> SummaryFilter {
        const HOUR: i64 = 3_600_000;
        SummaryFilter {
            since: self.since.div_euclid(HOUR) * HOUR,
            until: (self.until + HOUR - 1).div_euclid(HOUR) * HOUR,
            ..self.clone()
        }
    }
}

impl Store {
    /// Task counts per bucket (`bucket_ms` wide, whole hours), agent, version, status,
    /// failure type and answer state: finished tasks from `task_rollup`, live ones from
    /// history. The filter's window must be whole hours ([`SummaryFilter::whole_hours`]).
    pub async fn summary_counts(
        &self,
        f: &SummaryFilter,
        bucket_ms: i64,
    ) -> StoreResult<Vec<SummaryRow>> {
        let sql = format!(
            "SELECT c.bucket, a.name AS agent, v.version_no AS version, c.status, \
             c.failure_type, c.delivery, c.count FROM ( \
             SELECT (ro.hour * 3600000 / $1) * $1 AS bucket, ro.agent_id, ro.agent_version_id, \
             ro.status, NULLIF(ro.failure_type, '') AS failure_type, \
             NULLIF(ro.delivery, '') AS delivery, CAST(SUM(ro.tasks) AS BIGINT) AS count \
             FROM task_rollup ro WHERE {ROLLED} GROUP BY 1, 2, 3, 4, 5, 6 \
             HAVING SUM(ro.tasks) <> 0 \
             UNION ALL SELECT (t.created_at / $1) * $1, t.agent_id, t.agent_version_id, \
             t.status, t.failure_type, {ANSWER_STATE}, COUNT(*) \
             FROM ({LIVE_IDS}) l CROSS JOIN agent_task t \
             LEFT JOIN outbound_reply r ON r.task_id = t.id AND r.idempotency_key = {ANSWER_KEY} \
             WHERE t.id = l.id AND {TASKS} \
             GROUP BY 1, 2, 3, 4, 5, 6) c \
             JOIN agent a ON a.id = c.agent_id JOIN agent_version v ON v.id = c.agent_version_id \
             ORDER BY 1"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, SummaryRow>(&sql).bind(bucket_ms), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// The answers of the filtered tasks per platform and state (from `task_rollup`, live
    /// tasks from history).
    pub async fn delivery_by_channel(
        &self,
        f: &SummaryFilter,
    ) -> StoreResult<Vec<ChannelDelivery>> {
        let sql = format!(
            "SELECT channel, state, CAST(SUM(count) AS BIGINT) AS count FROM ( \
             SELECT ro.channel, ro.delivery AS state, SUM(ro.tasks) AS count \
             FROM task_rollup ro WHERE ro.delivery <> '' AND $1 = $1 AND {ROLLED} \
             GROUP BY 1, 2 \
             UNION ALL SELECT t.channel, {ANSWER_STATE}, COUNT(*) \
             FROM ({LIVE_IDS}) l CROSS JOIN agent_task t CROSS JOIN outbound_reply r \
             WHERE t.id = l.id AND r.task_id = t.id AND r.idempotency_key = {ANSWER_KEY} AND {TASKS} \
             GROUP BY 1, 2) d GROUP BY 1, 2 HAVING SUM(count) <> 0 ORDER BY 1, 2"
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
            sqlx::query_as(OUTBOX_BACKLOG)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Replies of the filtered tasks that are not getting through (given up, in doubt, or
    /// failed at least once and still retrying), newest first: read through the partial
    /// indexes of given-up and pending replies, not the whole outbox.
    pub async fn stuck_replies(
        &self,
        f: &SummaryFilter,
        limit: i64,
    ) -> StoreResult<Vec<StuckReply>> {
        let sql = format!(
            "SELECT r.id, r.task_id, r.channel, r.conversation_id, r.status, r.attempts, \
             r.last_error, r.created_at, r.next_attempt_at FROM ( \
             SELECT id FROM outbound_reply WHERE status IN ('FAILED', 'UNKNOWN') \
             UNION ALL SELECT id FROM outbound_reply \
             WHERE {pending} AND last_error IS NOT NULL) s \
             CROSS JOIN outbound_reply r CROSS JOIN agent_task t \
             WHERE r.id = s.id AND t.id = r.task_id AND {TASKS} ORDER BY r.id DESC LIMIT $1",
            pending = pending_replies!()
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, StuckReply>(&sql).bind(limit), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// Model calls and tokens of the filtered tasks, per agent and model (the model read
    /// from each journalled request): finished tasks from `token_rollup`, live ones from
    /// their steps.
    pub async fn tokens_by_agent_model(&self, f: &SummaryFilter) -> StoreResult<Vec<TokenRow>> {
        let model = step_model(self.dialect(), "s.input");
        let sql = format!(
            "SELECT a.name AS agent, NULLIF(c.model, '') AS model, \
             CAST(SUM(c.calls) AS BIGINT) AS calls, \
             CAST(SUM(c.prompt_tokens) AS BIGINT) AS prompt_tokens, \
             CAST(SUM(c.completion_tokens) AS BIGINT) AS completion_tokens FROM ( \
             SELECT ro.agent_id, ro.model, ro.calls, ro.prompt_tokens, ro.completion_tokens \
             FROM token_rollup ro WHERE $1 = $1 AND {ROLLED} \
             UNION ALL SELECT t.agent_id, COALESCE({model}, ''), 1, s.tokens_in, \
             COALESCE(s.tokens_out, 0) FROM ({LIVE_IDS}) l CROSS JOIN agent_task t \
             CROSS JOIN agent_step s WHERE t.id = l.id AND s.task_id = t.id \
             AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL AND {TASKS}) c \
             JOIN agent a ON a.id = c.agent_id GROUP BY 1, 2 HAVING SUM(c.calls) <> 0 \
             ORDER BY 1, 2"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, TokenRow>(&sql).bind(0i64), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// Webhook-to-answer times of the filtered tasks' delivered answers, as a histogram:
    /// (upper bound in ms, answers), ascending (`latency_rollup`).
    pub async fn answer_latencies(&self, f: &SummaryFilter) -> StoreResult<Vec<(i64, i64)>> {
        let sql = format!(
            "SELECT ro.le, CAST(SUM(ro.answers) AS BIGINT) FROM latency_rollup ro \
             WHERE $1 = $1 AND {ROLLED} GROUP BY ro.le HAVING SUM(ro.answers) <> 0 ORDER BY 1"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as(&sql).bind(0i64), f)
                .fetch_all(pool)
                .await?
        }))
    }

    /// The most frequent error messages among the newest `sample` failures of the filtered
    /// tasks, per failure type (read through the partial index of failed tasks).
    pub async fn top_errors(&self, f: &SummaryFilter, sample: i64) -> StoreResult<Vec<ErrorRow>> {
        let sql = format!(
            "SELECT failure_type, error_msg, COUNT(*) AS count FROM ( \
             SELECT t.failure_type, t.error_msg FROM agent_task t \
             WHERE t.failure_type IS NOT NULL AND {TASKS} \
             ORDER BY t.created_at DESC LIMIT $1) e \
             WHERE error_msg IS NOT NULL GROUP BY failure_type, error_msg \
             ORDER BY count DESC LIMIT 200"
        );
        Ok(on_pool!(self, pool => {
            with_filter!(sqlx::query_as::<_, ErrorRow>(&sql).bind(sample), f)
                .fetch_all(pool)
                .await?
        }))
    }
}
