//! HTTP surface. Handlers are thin: they parse, authorise and call a domain function.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::app::Services;

pub mod admin;
pub mod agents;
pub mod error;
pub mod health;
pub mod tasks;
pub mod webhooks;

pub use error::ApiError;

pub fn router(svc: Arc<Services>) -> Router {
    let timeout = Duration::from_secs(svc.config.server.request_timeout_secs);
    Router::new()
        .merge(health::router())
        .merge(webhooks::router())
        .merge(tasks::router())
        .merge(agents::router())
        .merge(admin::router())
        .layer(TraceLayer::new_for_http())
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        .with_state(svc)
}

/// The worker role serves only liveness and readiness.
pub fn health_router(svc: Arc<Services>) -> Router {
    Router::new()
        .merge(health::router())
        .layer(TraceLayer::new_for_http())
        .with_state(svc)
}
