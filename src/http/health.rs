//! Liveness and readiness.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

async fn readyz(State(svc): State<Arc<ApiContext>>) -> Result<Json<Value>, ApiError> {
    // Ready means able to take a message: a write, not just a read.
    svc.store
        .ping_write()
        .await
        .map_err(|e| ApiError::Unavailable(format!("database cannot take writes: {e}")))?;
    Ok(Json(json!({ "status": "ready" })))
}

/// Prometheus text exposition.
async fn metrics(
    State(svc): State<Arc<ApiContext>>,
) -> Result<impl axum::response::IntoResponse, ApiError> {
    let counts = svc.store.metric_counts().await?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        crate::metrics::render(&counts, &svc.config.llm),
    ))
}
