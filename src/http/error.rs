//! One error type for every handler: each variant is a status code with a one-line reason in
//! `{"error": ...}`. Internal errors are logged and their detail hidden.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    #[error("{0}")]
    Unavailable(String),
    #[error("internal error")]
    Internal(#[from] anyhow::Error),
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Busy => ApiError::Unavailable("database busy, try again".into()),
            StoreError::Unavailable(_) => {
                ApiError::Unavailable("database unavailable, try again".into())
            }
            other => ApiError::Internal(other.into()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(e) => {
                tracing::error!(error = ?e, "request failed");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        let mut response = (status, Json(json!({ "error": self.to_string() }))).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            // When to come back: the time a connection is waited for
            // (`database.acquire_timeout_secs`).
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(RETRY_AFTER_SECS.load(Ordering::Relaxed)),
            );
        }
        response
    }
}

/// The `Retry-After` of a 503, in seconds (`set_retry_after`).
static RETRY_AFTER_SECS: AtomicU64 = AtomicU64::new(5);

/// Sets the `Retry-After` of every 503 (`database.acquire_timeout_secs`, at start-up).
pub fn set_retry_after(secs: u64) {
    RETRY_AFTER_SECS.store(secs.max(1), Ordering::Relaxed);
}

/// A `limit` query value: `default` when absent or empty, else 1 to `max`.
pub fn parse_limit(value: Option<&str>, default: i64, max: i64) -> Result<i64, ApiError> {
    match value {
        None | Some("") => Ok(default),
        Some(l) => l
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| ApiError::BadRequest(format!("limit must be 1 to {max}"))),
    }
}
