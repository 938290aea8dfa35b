//! HTTP surface. Handlers are thin: they parse, authorise and call a domain function.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

pub mod admin;
pub mod agents;
pub mod console;
pub mod context;
pub mod dashboard;
pub mod error;
pub mod health;
pub mod ingest;
pub mod jobs;
pub mod knowledge;
pub mod pages;
pub mod tasks;
pub mod webhooks;

pub use context::ApiContext;
pub use error::ApiError;

pub fn router(svc: Arc<ApiContext>) -> Router {
    let timeout = Duration::from_secs(svc.config.server.request_timeout_secs);
    Router::new()
        .merge(health::router())
        .merge(webhooks::router())
        .merge(tasks::router())
        .merge(agents::router())
        .merge(knowledge::router(svc.config.knowledge.max_document_bytes))
        .merge(ingest::router(svc.config.knowledge.ingest_max_bytes))
        .merge(admin::router())
        .merge(jobs::router())
        .merge(pages::router())
        .merge(dashboard::router())
        .merge(console::router())
        .layer(axum::middleware::from_fn_with_state(
            svc.clone(),
            count_webhooks,
        ))
        .layer(TraceLayer::new_for_http())
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        .with_state(svc)
}

/// Serves `router` on `listener` until `shutdown`: at most `server.max_connections` open
/// connections (the rest wait in the listen backlog), request headers within
/// `server.header_read_timeout_secs`, and on shutdown the open connections are finished
/// gracefully (bounded by the request timeout). Each request carries its peer address as
/// axum's `ConnectInfo`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    config: &crate::config::ServerConfig,
    shutdown: tokio_util::sync::CancellationToken,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use tower::ServiceExt;
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(config.header_read_timeout_secs));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(tokio::sync::Semaphore::new(config.max_connections));
    loop {
        let permit = tokio::select! {
            // The semaphore is never closed.
            p = open.clone().acquire_owned() => p.expect("connection limit semaphore"),
            _ = shutdown.cancelled() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let router = router.clone();
        let service = hyper::service::service_fn(
            move |mut request: hyper::Request<hyper::body::Incoming>| {
                request
                    .extensions_mut()
                    .insert(axum::extract::ConnectInfo(peer));
                router.clone().oneshot(request.map(axum::body::Body::new))
            },
        );
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    let grace = Duration::from_secs(config.request_timeout_secs);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("open connections did not finish within the request timeout");
    }
}

/// The worker role serves only liveness and readiness.
pub fn health_router(svc: Arc<ApiContext>) -> Router {
    Router::new()
        .merge(health::router())
        .layer(TraceLayer::new_for_http())
        .with_state(svc)
}

/// Counts webhook requests by channel and answer, for `/metrics`: under the name of an
/// enabled platform (from the registry), any other `/webhooks/<x>` as `other`, so that
/// unauthenticated requests cannot grow the label set (or put text into the exposition).
async fn count_webhooks(
    axum::extract::State(svc): axum::extract::State<Arc<ApiContext>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let channel = request
        .uri()
        .path()
        .strip_prefix("/webhooks/")
        .map(|rest| rest.split('/').next().unwrap_or(""))
        .map(|name| svc.channels.get(name).map_or("other", |p| p.name()));
    let response = next.run(request).await;
    if let Some(channel) = channel {
        crate::metrics::count_webhook(channel, response.status().as_u16());
    }
    response
}
