//! Inbound webhooks. Each reads the raw body under the size limit, lets its channel verify
//! and parse it, and hands the message to intake. Bad input is answered before anything is
//! written.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::ApiError;
use crate::app::Services;
use crate::channels::generic;
use crate::domain::now_ms;
use crate::intake::{IntakeError, accept_message};

pub fn router() -> Router<Arc<Services>> {
    Router::new()
        .route("/webhooks/generic", post(generic_webhook))
        .route("/webhooks/generic/actions", post(generic_actions))
}

/// Reads the whole body, refusing more than `limit` bytes with 413.
pub async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => Ok(bytes.to_vec()),
        Err(e) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = source {
                if err.is::<http_body_util::LengthLimitError>() {
                    return Err(ApiError::PayloadTooLarge(limit));
                }
                source = err.source();
            }
            Err(ApiError::BadRequest(format!("could not read body: {e}")))
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn generic_webhook(
    State(svc): State<Arc<Services>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let cfg = &svc.config.channels.generic;
    if !cfg.enabled || cfg.secret.is_empty() {
        return Err(ApiError::NotFound(
            "the generic channel is not configured".into(),
        ));
    }
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    generic::verify(
        &cfg.secret,
        header(&headers, generic::TIMESTAMP_HEADER),
        header(&headers, generic::SIGNATURE_HEADER),
        &raw,
        now_ms() / 1000,
        cfg.timestamp_tolerance_secs,
    )
    .map_err(ApiError::Unauthorized)?;
    let message = generic::parse(&raw).map_err(ApiError::BadRequest)?;
    let ingested = accept_message(&svc, &message, &cfg.agent)
        .await
        .map_err(|e| match e {
            IntakeError::UnknownAgent(_) => ApiError::Internal(e.into()),
            IntakeError::Store(s) => s.into(),
        })?;
    Ok(Json(
        json!({ "task_id": ingested.task_id, "duplicate": ingested.duplicate }),
    ))
}

/// Card actions from the IM (Approve/Reject on an approval card), signed like every generic
/// webhook: `{"task_id", "step_no", "decision": "approve"|"reject", "approver"}`.
async fn generic_actions(
    State(svc): State<Arc<Services>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let cfg = &svc.config.channels.generic;
    if !cfg.enabled || cfg.secret.is_empty() {
        return Err(ApiError::NotFound(
            "the generic channel is not configured".into(),
        ));
    }
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    generic::verify(
        &cfg.secret,
        header(&headers, generic::TIMESTAMP_HEADER),
        header(&headers, generic::SIGNATURE_HEADER),
        &raw,
        now_ms() / 1000,
        cfg.timestamp_tolerance_secs,
    )
    .map_err(ApiError::Unauthorized)?;
    let action = generic::parse_action(&raw).map_err(ApiError::BadRequest)?;
    let result = crate::control::decide(
        &svc,
        action.task_id,
        Some(action.step_no),
        action.approve,
        &action.approver,
        false,
    )
    .await?;
    super::tasks::decision_response(&svc, action.task_id, result).await
}
