//! The task API: everything an admin needs to answer "what happened to this message?".

use std::sync::Arc;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use super::ApiError;
use crate::app::Services;
use crate::domain::truncate;

/// Longest step input/output shown by the API, in bytes.
const STEP_TEXT_LIMIT: usize = 4000;

pub fn router() -> Router<Arc<Services>> {
    Router::new().route("/api/tasks/{id}", get(get_task))
}

/// Proof that the request carried `Authorization: Bearer <admin token>`.
pub struct AdminAuth;

impl FromRequestParts<Arc<Services>> for AdminAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        svc: &Arc<Services>,
    ) -> Result<Self, Self::Rejection> {
        let given = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::Unauthorized("missing bearer token".into()))?;
        if bool::from(given.trim().as_bytes().ct_eq(svc.admin_token.as_bytes())) {
            Ok(AdminAuth)
        } else {
            Err(ApiError::Unauthorized("wrong bearer token".into()))
        }
    }
}

async fn get_task(
    _auth: AdminAuth,
    State(svc): State<Arc<Services>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::BadRequest("task id must be an integer".into()))?;
    let store = &svc.store;
    let task = store
        .task(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no task {id}")))?;
    let version = store.agent_version(task.agent_version_id).await?;
    let message = store.message(task.message_id).await?;
    let steps = store.task_steps(id).await?;
    let reply = store.task_reply(id).await?;
    let audit = store.task_audit(id).await?;
    Ok(Json(json!({
        "id": task.id,
        "status": task.status,
        "failure_type": task.failure_type,
        "error": task.error_msg,
        "result": task.result,
        "task_type": task.task_type,
        "agent": version.as_ref().map(|v| json!({
            "name": v.agent_name,
            "version": v.version_no,
            "version_id": v.id,
        })),
        "channel": task.channel,
        "conversation_id": task.conversation_id,
        "message": message.map(|m| json!({
            "id": m.external_message_id,
            "event_id": m.external_event_id,
            "sender_id": m.sender_id,
            "text": truncate(&m.text, STEP_TEXT_LIMIT),
            "received_at": m.received_at,
        })),
        "retry_count": task.retry_count,
        "claim_count": task.claim_count,
        "owner": task.owner,
        "version": task.version,
        "current_step": task.current_step,
        "created_at": task.created_at,
        "started_at": task.started_at,
        "finished_at": task.finished_at,
        "steps": steps.iter().map(|s| json!({
            "step_no": s.step_no,
            "type": s.step_type,
            "tool": s.tool_name,
            "idempotency_key": s.idempotency_key,
            "status": s.status,
            "attempts": s.attempt,
            "input": s.input.as_deref().map(|t| truncate(t, STEP_TEXT_LIMIT)),
            "output": s.output.as_deref().map(|t| truncate(t, STEP_TEXT_LIMIT)),
            "error": s.error,
            "tokens_in": s.tokens_in,
            "tokens_out": s.tokens_out,
            "duration_ms": s.duration_ms,
        })).collect::<Vec<_>>(),
        "reply": reply.map(|r| json!({
            "idempotency_key": r.idempotency_key,
            "status": r.status,
            "type": r.reply_type,
            "attempts": r.attempts,
            "last_error": r.last_error,
            "sent_at": r.sent_at,
            "content": serde_json::from_str::<Value>(&r.content).unwrap_or(Value::Null),
        })),
        "audit": audit.iter().map(|a| json!({
            "event": a.event,
            "actor": a.actor,
            "summary": a.summary,
            "risk_flag": a.risk_flag,
            "at": a.created_at,
        })).collect::<Vec<_>>(),
    })))
}
