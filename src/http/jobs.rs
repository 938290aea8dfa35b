//! Job control and audit trails by target: run a job's tick now, switch a job off and on
//! for every instance, and read the audit trail of a job, approval, reply, step or task.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;
use super::tasks::{AdminAuth, actor};
use crate::domain::AuditTarget;
use crate::scheduler::{self, JobState, TickOutcome};

const LIMIT_MAX: i64 = 500;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/api/admin/jobs", get(list_jobs))
        .route("/api/admin/jobs/{job}/run", post(run_job))
        .route("/api/admin/jobs/{job}/enabled", post(switch_job))
        .route("/api/admin/audit", get(audit_trail))
}

pub fn job_json(state: &JobState) -> Value {
    json!({
        "job": state.name,
        "cron": state.cron,
        "enabled": state.enabled,
        "source": state.source,
        "switched_by": state.enabled_by,
    })
}

fn known_job(name: &str) -> Result<(), ApiError> {
    if scheduler::JOB_NAMES.contains(&name) {
        Ok(())
    } else {
        Err(ApiError::NotFound(format!(
            "no job {name}; jobs are {}",
            scheduler::JOB_NAMES.join(", ")
        )))
    }
}

async fn list_jobs(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
) -> Result<Json<Value>, ApiError> {
    let states = scheduler::job_states(&svc.jobs).await?;
    Ok(Json(
        json!({ "jobs": states.iter().map(job_json).collect::<Vec<_>>() }),
    ))
}

/// The answer to a run-now, shared with the admin page.
pub async fn run_job_now(svc: &ApiContext, name: &str, actor: &str) -> Result<Value, ApiError> {
    known_job(name)?;
    match scheduler::run_now(&svc.jobs, name, actor).await? {
        None => Err(ApiError::NotFound(format!("no job {name}"))),
        Some(TickOutcome::Ran {
            status,
            counts,
            error,
        }) => Ok(json!({
            "job": name,
            "trigger": "manual",
            "actor": actor,
            "status": status,
            "scanned": counts.scanned,
            "affected": counts.affected,
            "error": error,
        })),
        Some(TickOutcome::Held | TickOutcome::Disabled) => Err(ApiError::Conflict(format!(
            "job {name} is running now (its lock is held); try again when that run ends"
        ))),
    }
}

async fn run_job(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(job): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    run_job_now(&svc, &job, &actor(&headers)).await.map(Json)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SwitchBody {
    enabled: bool,
}

/// Switches a job, shared with the admin page; the job's state after it.
pub async fn switch_job_to(
    svc: &ApiContext,
    name: &str,
    enabled: bool,
    actor: &str,
) -> Result<Value, ApiError> {
    known_job(name)?;
    svc.store
        .set_job_enabled(name, enabled, actor, crate::domain::now_ms())
        .await?;
    tracing::info!(job = name, enabled, actor, "job switched");
    let states = scheduler::job_states(&svc.jobs).await?;
    let state = states
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| ApiError::NotFound(format!("no job {name}")))?;
    Ok(job_json(state))
}

async fn switch_job(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(job): Path<String>,
    headers: HeaderMap,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    known_job(&job)?;
    let Json(body) = body.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let body: SwitchBody = serde_json::from_value(body)
        .map_err(|e| ApiError::BadRequest(format!("expected {{\"enabled\": true|false}}: {e}")))?;
    switch_job_to(&svc, &job, body.enabled, &actor(&headers))
        .await
        .map(Json)
}

#[derive(Debug, Deserialize)]
struct AuditQuery {
    target_type: Option<String>,
    target_id: Option<String>,
    limit: Option<String>,
}

/// `GET /api/admin/audit?target_type=job&target_id=retention`: one target's own trail.
async fn audit_trail(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Query(q): Query<AuditQuery>,
) -> Result<Json<Value>, ApiError> {
    let target_type = q.target_type.as_deref().unwrap_or("");
    if !AuditTarget::TYPES.contains(&target_type) {
        return Err(ApiError::BadRequest(format!(
            "`target_type` must be one of {}",
            AuditTarget::TYPES.join(", ")
        )));
    }
    let target_id = q
        .target_id
        .as_deref()
        .filter(|t| !t.is_empty() && t.len() <= 128)
        .ok_or_else(|| ApiError::BadRequest("`target_id` is required (1-128 bytes)".into()))?;
    let limit = super::error::parse_limit(q.limit.as_deref(), 100, LIMIT_MAX)?;
    let rows = svc
        .store
        .target_audit(target_type, target_id, limit)
        .await?;
    Ok(Json(json!({
        "audit": rows.iter().map(|a| json!({
            "id": a.id,
            "task_id": a.task_id,
            "event": a.event,
            "actor": a.actor,
            "summary": a.summary,
            "risk_flag": a.risk_flag,
            "target_type": a.target_type,
            "target_id": a.target_id,
            "at": a.created_at,
        })).collect::<Vec<_>>(),
    })))
}
