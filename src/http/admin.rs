//! Admin APIs beyond tasks and agents: job runs.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::ApiError;
use super::tasks::AdminAuth;
use crate::app::Services;

const LIMIT_MAX: i64 = 500;

pub fn router() -> Router<Arc<Services>> {
    Router::new().route("/api/admin/job-runs", get(job_runs))
}

#[derive(Debug, Deserialize)]
struct JobRunsQuery {
    job: Option<String>,
    limit: Option<String>,
}

async fn job_runs(
    _auth: AdminAuth,
    State(svc): State<Arc<Services>>,
    Query(q): Query<JobRunsQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = match q.limit.as_deref() {
        None | Some("") => 50,
        Some(l) => l
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=LIMIT_MAX).contains(n))
            .ok_or_else(|| ApiError::BadRequest(format!("limit must be 1 to {LIMIT_MAX}")))?,
    };
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
        })).collect::<Vec<_>>(),
    })))
}
