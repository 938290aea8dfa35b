//! HTTP surface. Handlers are thin: they parse, authorise and call a domain function.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::app::Services;

pub mod admin;
pub mod agents;
pub mod console;
pub mod error;
pub mod health;
pub mod pages;
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
        .merge(pages::router())
        .merge(console::router())
        .layer(axum::middleware::from_fn(count_webhooks))
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

/// The channels webhook paths are counted under; any other `/webhooks/<x>` is `other`, so
/// unauthenticated requests cannot grow the label set (or put text into the exposition).
const WEBHOOK_CHANNELS: &[&str] = &[
    crate::channels::generic::CHANNEL,
    crate::channels::slack::CHANNEL,
    crate::channels::telegram::CHANNEL,
    crate::channels::matrix::CHANNEL,
    crate::channels::lark::CHANNEL,
    crate::channels::dingtalk::CHANNEL,
    crate::channels::wecom::CHANNEL,
];

/// Counts webhook requests by channel and answer, for `/metrics`.
async fn count_webhooks(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let channel = request
        .uri()
        .path()
        .strip_prefix("/webhooks/")
        .map(|rest| rest.split('/').next().unwrap_or(""))
        .map(|name| {
            WEBHOOK_CHANNELS
                .iter()
                .find(|known| **known == name)
                .copied()
                .unwrap_or("other")
        });
    let response = next.run(request).await;
    if let Some(channel) = channel {
        crate::metrics::count_webhook(channel, response.status().as_u16());
    }
    response
}
