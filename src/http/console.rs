//! The console page (`GET /`) and its small JSON API.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, header};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;
use crate::channels::console;
use crate::intake::accept_message;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/", get(page))
        .route("/console/messages", post(send))
        .route("/console/conversations/{id}", get(conversation))
        .route("/console/status", get(status))
}

/// The host part of a `Host` header or an origin's authority (`[::1]:8787` → `::1`).
fn host_of(authority: &str) -> &str {
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => authority,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

fn is_loopback_name(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The console answers a loopback peer asking for a loopback `Host`, with an `Origin` (when
/// the browser sends one) of that same host. A page that rebinds its own name to 127.0.0.1
/// sends its own name as `Host`; a reverse proxy on this machine sends the public one: both
/// need an admin session (and an `Origin`, when sent, that matches `Host`).
async fn allowed(svc: &ApiContext, peer: SocketAddr, headers: &HeaderMap) -> Result<(), ApiError> {
    let cfg = &svc.config.channels.console;
    if !cfg.enabled {
        return Err(ApiError::NotFound(
            "the console is not enabled (channels.console.enabled)".into(),
        ));
    }
    if cfg.loopback_only && !peer.ip().is_loopback() {
        return Err(ApiError::Forbidden(
            "the console answers loopback only (channels.console.loopback_only)".into(),
        ));
    }
    let text = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    let host = text(header::HOST).unwrap_or("");
    let origin_matches = match text(header::ORIGIN) {
        None => true,
        Some(origin) => origin
            .split_once("://")
            .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host)),
    };
    if !origin_matches {
        return Err(ApiError::Forbidden(
            "the console refuses requests from another origin".into(),
        ));
    }
    if is_loopback_name(host_of(host)) || super::pages::has_admin_session(svc, headers).await {
        return Ok(());
    }
    Err(ApiError::Forbidden(
        "the console answers requests for localhost; through a proxy, sign in at /admin first"
            .into(),
    ))
}

async fn page(
    State(svc): State<Arc<ApiContext>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    allowed(&svc, peer, &headers).await?;
    Ok(super::pages::render(
        "console.html",
        json!({ "model_endpoint": svc.llm.default_provider().endpoint(), "agent": svc.config.channels.console.agent }),
    ))
}

#[derive(Debug, serde::Deserialize)]
struct ConsoleMessage {
    conversation_id: String,
    text: String,
}

async fn send(
    State(svc): State<Arc<ApiContext>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Result<Json<ConsoleMessage>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    allowed(&svc, peer, &headers).await?;
    let Json(body) = body.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let message =
        console::message(&body.conversation_id, &body.text).map_err(ApiError::BadRequest)?;
    let ingested =
        accept_message(&svc.intake, &message, &svc.config.channels.console.agent).await?;
    Ok(Json(json!({ "task_id": ingested.task_id })))
}

/// The conversation as the page shows it: each question with its task and answer.
async fn conversation(
    State(svc): State<Arc<ApiContext>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    allowed(&svc, peer, &headers).await?;
    let mut out = Vec::new();
    for task in svc.store.conversation_tasks(console::CHANNEL, &id).await? {
        let message = svc.store.message(task.message_id).await?;
        let reply = svc.store.task_reply(task.id).await?;
        let answer = reply
            .as_ref()
            .and_then(|r| serde_json::from_str::<Value>(&r.content).ok())
            .and_then(|c| c["text"].as_str().map(str::to_string));
        // The streamed answer so far, while the task runs on this instance.
        let partial = answer
            .is_none()
            .then(|| svc.channels.live_text(console::CHANNEL, task.id))
            .flatten();
        out.push(json!({
            "task_id": task.id,
            "status": task.status,
            "failure_type": task.failure_type,
            "text": message.map(|m| m.text),
            "answer": answer,
            "partial": partial,
        }));
    }
    Ok(Json(json!({ "messages": out })))
}

/// Whether the model endpoint answers at all, with the setting to change when it does not.
async fn status(
    State(svc): State<Arc<ApiContext>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    allowed(&svc, peer, &headers).await?;
    let base = svc.config.llm.base_url.trim_end_matches('/').to_string();
    // Shown to any loopback client: scheme, host, port and path only (the URL may carry
    // `user:password@` or a key in its query).
    let shown = crate::redaction::endpoint(&base);
    let probe = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| ApiError::Internal(e.into()))?
        .get(format!("{base}/models"))
        .send()
        .await;
    Ok(Json(match probe {
        Ok(_) => json!({ "model_endpoint": shown, "reachable": true }),
        Err(e) => json!({
            "model_endpoint": shown,
            "reachable": false,
            "error": crate::redaction::http_error(e),
            "hint": format!(
                "The model endpoint {shown} does not answer. Start an OpenAI-compatible server there \
                 or set ASSISTD_LLM__BASE_URL (llm.base_url), ASSISTD_LLM__MODEL and ASSISTD_LLM__API_KEY."
            ),
        }),
    }))
}
