//! Admin APIs beyond tasks and agents: job runs, the failure summary and the MCP servers.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;
use super::tasks::AdminAuth;

const LIMIT_MAX: i64 = 500;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/api/admin/job-runs", get(job_runs))
        .route("/api/admin/failure-summary", get(failure_summary))
        .route("/api/admin/mcp", get(mcp_servers))
        .route("/api/admin/replies/{id}/retry", post(retry_reply))
}

/// "Retry delivery now" for a reply, shared with the admin page: due now (PENDING) or
/// sent out again (FAILED), audited; 409 for one delivered, in doubt or being sent.
pub async fn retry_reply_now(svc: &ApiContext, id: i64, actor: &str) -> Result<Value, ApiError> {
    let now = crate::domain::now_ms();
    match svc.store.retry_reply(id, actor, now).await? {
        None => Err(ApiError::NotFound(format!("no reply {id}"))),
        Some(Err(why)) => Err(ApiError::Conflict(format!("reply {id} not retried: {why}"))),
        Some(Ok(reply)) => {
            svc.control.wake.replies.notify_one();
            Ok(
                json!({ "id": reply.id, "task_id": reply.task_id, "status": reply.status,
                       "attempts": reply.attempts, "next_attempt_at": reply.next_attempt_at }),
            )
        }
    }
}

async fn retry_reply(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(id): Path<i64>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    retry_reply_now(&svc, id, &super::tasks::actor(&headers))
        .await
        .map(Json)
}

/// The MCP servers, their connection state and their tools with the kinds assistd gives
/// them.
async fn mcp_servers(_auth: AdminAuth, State(svc): State<Arc<ApiContext>>) -> Json<Value> {
    Json(svc.tools.mcp_servers())
}

/// Longest span one summary may cover.
const SPAN_MAX_MS: i64 = 400 * 86_400_000;

#[derive(Debug, Default, Deserialize)]
pub struct SummaryQuery {
    pub since: Option<String>,
    pub until: Option<String>,
    pub bucket: Option<String>,
    pub agent: Option<String>,
    pub channel: Option<String>,
    pub failure_type: Option<String>,
}

fn millis(field: &str, value: Option<&str>, default: i64) -> Result<i64, ApiError> {
    match value.filter(|v| !v.is_empty()) {
        None => Ok(default),
        Some(v) => v
            .parse::<i64>()
            .map_err(|_| ApiError::BadRequest(format!("`{field}` must be unix milliseconds"))),
    }
}

/// Counts by status and failure type per bucket, agent and version; success rate; p50/p95
/// webhook-to-reply time; the top (redacted) error messages per failure type.
async fn failure_summary(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Query(q): Query<SummaryQuery>,
) -> Result<Json<Value>, ApiError> {
    build_summary(&svc, q).await.map(Json)
}

/// The failure summary as JSON, shared by the API and the admin page.
/// Checks the query and hands the window and filters to `reports::failure_summary`.
pub async fn build_summary(svc: &ApiContext, q: SummaryQuery) -> Result<Value, ApiError> {
    let bucket_ms = match q.bucket.as_deref().unwrap_or("hour") {
        "hour" => 3_600_000,
        "day" => 86_400_000,
        other => {
            return Err(ApiError::BadRequest(format!(
                "`bucket` is `{other}`; expected hour or day"
            )));
        }
    };
    let now = crate::domain::now_ms();
    let until = millis("until", q.until.as_deref(), now + 1)?;
    let since = millis("since", q.since.as_deref(), until - 86_400_000)?;
    if since >= until || until - since > SPAN_MAX_MS {
        return Err(ApiError::BadRequest(
            "`since` must be before `until`, at most 400 days apart".into(),
        ));
    }
    let failure_type = match q.failure_type.as_deref().filter(|f| !f.is_empty()) {
        None => None,
        Some(f) => Some(
            crate::domain::FailureType::parse(&f.to_ascii_uppercase())
                .ok_or_else(|| ApiError::BadRequest(format!("unknown `failure_type` {f}")))?,
        ),
    };
    let filter = crate::store::summary::SummaryFilter {
        since,
        until,
        agent: q.agent.filter(|a| !a.is_empty()),
        channel: q.channel.filter(|c| !c.is_empty()),
        failure_type,
    };
    Ok(crate::reports::failure_summary(&svc.store, &filter, bucket_ms, &svc.config.llm).await?)
}

#[derive(Debug, Deserialize)]
struct JobRunsQuery {
    job: Option<String>,
    limit: Option<String>,
}

async fn job_runs(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Query(q): Query<JobRunsQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = super::error::parse_limit(q.limit.as_deref(), 50, LIMIT_MAX)?;
    let job = q.job.as_deref().filter(|j| !j.is_empty());
    let runs = svc.store.job_runs(job, limit).await?;
    Ok(Json(json!({
        "job_runs": runs.iter().map(|r| json!({
            "id": r.id,
            "job": r.job,
            "instance": r.instance,
            "started_at": r.started_at,
            "finished_at": r.finished_at,
            "status": r.status,
            "scanned": r.scanned,
            "affected": r.affected,
            "error": r.error,
            "trigger": r.trigger_kind,
            "actor": r.actor,
        })).collect::<Vec<_>>(),
    })))
}
