//! Inbound webhooks: one route, `/webhooks/{platform}[/{rest}]`, for every platform. It reads
//! the raw body under the size limit, lets the platform verify and parse it, and hands what
//! it asks to intake (messages) or control (decisions). Bad input is answered before
//! anything is written.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Json, Router};
use serde_json::json;
use tracing::Instrument;

use super::context::ApiContext;
use super::error::ApiError;
use crate::channels::platform::{Fixed, Inbound, InboundRequest, Parsed, Platform, Refused};
use crate::control::{DecisionResult, reaction_decision};
use crate::domain::{NewMessage, now_ms};
use crate::intake::{
    IntakeError, OnceCheck, accept_message, accept_messages, check_once, done_once,
};

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/webhooks/{platform}", any(webhook))
        .route("/webhooks/{platform}/{*rest}", any(webhook))
}

/// Every platform's webhook: verified, then carried out in a `webhook` span that continues
/// the verified caller's `traceparent` (see `crate::telemetry`).
async fn webhook(
    State(svc): State<Arc<ApiContext>>,
    Path(params): Path<HashMap<String, String>>,
    method: Method,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let name = params.get("platform").map(String::as_str).unwrap_or("");
    let Some(platform) = svc.channels.get(name).cloned() else {
        return Err(ApiError::NotFound(
            "no channel is enabled at this path".into(),
        ));
    };
    // The body is read and verified before the `webhook` span starts: only a verified
    // caller's `traceparent` is continued, so an unverified one cannot choose trace ids or
    // sampling (issue 32).
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    let request = InboundRequest {
        method: method.as_str(),
        rest: params.get("rest").map(String::as_str).unwrap_or(""),
        headers: &headers,
        query: query.as_deref(),
        body: &raw,
        now_ms: now_ms(),
    };
    let parsed = match platform.inbound(&request).await {
        Ok(parsed) => parsed,
        Err(refused) => return refusal(refused),
    };
    let span = tracing::info_span!(
        "webhook",
        channel = name,
        otel.kind = "server",
        task_id = tracing::field::Empty
    );
    if parsed.refused.is_none() {
        let caller = headers.get("traceparent").and_then(|v| v.to_str().ok());
        crate::telemetry::continue_trace(&span, caller);
    }
    // Keeps the request to once where the platform says so, then carries out what it asks.
    async {
        if let Some(once) = &parsed.once {
            match check_once(&svc.store, once, now_ms()).await? {
                OnceCheck::Go => {}
                OnceCheck::Done => {
                    tracing::debug!(channel = name, "delivery repeated; nothing to do");
                    return Ok(parsed
                        .answer
                        .map(fixed_response)
                        .unwrap_or_else(|| Json(json!({ "duplicate": true })).into_response()));
                }
                OnceCheck::Replayed => {
                    tracing::warn!(
                        channel = name,
                        "a used timestamp/sign pair came with another body; refused"
                    );
                    return Err(ApiError::Unauthorized(
                        "this timestamp and sign were already used for another message".into(),
                    ));
                }
            }
        }
        if let Some(refused) = parsed.refused {
            return refusal(refused);
        }
        if parsed.transaction {
            return transaction(&svc, platform.as_ref(), parsed).await;
        }
        let Some(item) = parsed.items.into_iter().next() else {
            return Ok(Json(json!({ "ignored": "nothing to do" })).into_response());
        };
        let response = handle_inbound(&svc, platform.as_ref(), item).await?;
        Ok(parsed.answer.map(fixed_response).unwrap_or(response))
    }
    .instrument(span)
    .await
}

/// A refused request's answer: the platform's own format where it has one, else our error.
fn refusal(refused: Refused) -> Result<Response, ApiError> {
    match refused {
        Refused::Unauthorized(m) => Err(ApiError::Unauthorized(m)),
        Refused::BadRequest(m) => Err(ApiError::BadRequest(m)),
        Refused::Answer(fixed) => Ok(fixed_response(fixed)),
    }
}

fn fixed_response(fixed: Fixed) -> Response {
    (
        StatusCode::from_u16(fixed.status).unwrap_or(StatusCode::OK),
        [(axum::http::header::CONTENT_TYPE, fixed.content_type)],
        fixed.body,
    )
        .into_response()
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

/// An agent without a published version is the operator's mistake, not the sender's.
impl From<IntakeError> for ApiError {
    fn from(e: IntakeError) -> Self {
        match e {
            IntakeError::Invalid(reason) => ApiError::BadRequest(reason),
            IntakeError::UnknownAgent(_) => ApiError::Internal(e.into()),
            IntakeError::Store(s) => s.into(),
        }
    }
}

/// Applies an approval decision made in a chat (card button, reaction or command).
async fn decide(
    svc: &ApiContext,
    action: &crate::domain::CardAction,
) -> Result<DecisionResult, ApiError> {
    Ok(crate::control::decide(
        &svc.control,
        action.task_id(),
        Some(&action.request),
        action.approve,
        &action.approver,
        false,
    )
    .await?)
}

/// Applies an approval decision from a chat platform; the outcome in words, for the reply
/// to the platform (and, on Telegram, the button).
async fn decide_action(
    svc: &ApiContext,
    action: &crate::domain::CardAction,
) -> Result<&'static str, ApiError> {
    Ok(match decide(svc, action).await? {
        DecisionResult::Resumed => "approved",
        DecisionResult::Cancelled => "rejected",
        DecisionResult::NotFound => "unknown request",
        DecisionResult::NotWaiting(_) => "already decided",
        DecisionResult::Forbidden => "you may not decide this request",
        DecisionResult::Expired => "the request is past its deadline",
        DecisionResult::Stale(_) => {
            "this card is out of date: the request changed since it was sent"
        }
    })
}

/// Carries out what a verified platform request asks. Platforms only need a quick 2xx, so
/// decisions are reported in the body (and, where the platform has one, on the button).
async fn handle_inbound(
    svc: &ApiContext,
    platform: &dyn Platform,
    inbound: Inbound,
) -> Result<Response, ApiError> {
    match inbound {
        Inbound::Message(message) => {
            let ingested = accept_message(&svc.intake, &message, platform.agent()).await?;
            tracing::Span::current().record("task_id", ingested.task_id);
            Ok(
                Json(json!({ "task_id": ingested.task_id, "duplicate": ingested.duplicate }))
                    .into_response(),
            )
        }
        Inbound::Action {
            action,
            with_task: true,
            ..
        } => {
            let result = decide(svc, &action).await?;
            Ok(
                super::tasks::decision_response(svc, action.task_id(), result)
                    .await?
                    .into_response(),
            )
        }
        Inbound::Action { action, ack, .. } => {
            let outcome = decide_action(svc, &action).await?;
            if let Some(id) = ack {
                platform.acknowledge(&id, outcome).await;
            }
            Ok(Json(json!({ "result": outcome })).into_response())
        }
        Inbound::Reaction {
            approver,
            approve,
            target,
        } => {
            let outcome = react(svc, platform, &approver, approve, &target).await?;
            Ok(Json(json!({ "result": outcome.unwrap_or("not a decision") })).into_response())
        }
        Inbound::Invite { room, direct_with } => {
            platform.accept_invite(&room, direct_with.as_deref()).await;
            Ok(Json(json!({ "result": "joined" })).into_response())
        }
        Inbound::Respond(fixed) => Ok(fixed_response(fixed)),
        Inbound::Chatter(message) => {
            let kept = keep_chatter(svc, platform, &message).await?;
            let reason = if kept {
                "a group message not addressed to the bot; kept as context"
            } else {
                "a group message not addressed to the bot"
            };
            Ok(Json(json!({ "ignored": reason })).into_response())
        }
        Inbound::Ignore(reason) => Ok(Json(json!({ "ignored": reason })).into_response()),
    }
}

/// Keeps a group message not addressed to the bot as context of its chat, when the platform
/// keeps some (`group_context`); whether it was kept.
async fn keep_chatter(
    svc: &ApiContext,
    platform: &dyn Platform,
    message: &NewMessage,
) -> Result<bool, ApiError> {
    let keep = platform.group_context();
    if keep == 0 {
        return Ok(false);
    }
    let chat = platform.conversation(&message.conversation_id).chat;
    let chatter = crate::store::context::Chatter {
        channel: platform.name(),
        event_id: &message.event_id,
        chat_id: &chat,
        sender_id: &message.sender_id,
        sender_name: message.sender_name.as_deref(),
        text: &message.text,
    };
    svc.store
        .keep_context(&chatter, keep as i64, now_ms())
        .await?;
    Ok(true)
}

/// A reaction to an approval request is a decision; to anything else, just a reaction.
async fn react(
    svc: &ApiContext,
    platform: &dyn Platform,
    approver: &str,
    approve: bool,
    target: &str,
) -> Result<Option<&'static str>, ApiError> {
    let decision =
        reaction_decision(&svc.store, platform.name(), approver, approve, target).await?;
    let Some(action) = decision else {
        return Ok(None);
    };
    let outcome = decide_action(svc, &action).await?;
    tracing::info!(task_id = action.task_id(), outcome, "approval reaction");
    Ok(Some(outcome))
}

/// A transaction of events (Matrix): decisions and invites in order, then the messages
/// committed together in one intake transaction, so a large transaction finishes well
/// within the homeserver's timeout; then the transaction is recorded as done.
async fn transaction(
    svc: &ApiContext,
    platform: &dyn Platform,
    parsed: Parsed,
) -> Result<Response, ApiError> {
    let mut messages = Vec::new();
    for item in parsed.items {
        match item {
            Inbound::Message(message) => messages.push(message),
            Inbound::Invite { room, direct_with } => {
                platform.accept_invite(&room, direct_with.as_deref()).await
            }
            Inbound::Action { action, .. } => {
                let outcome = decide_action(svc, &action).await?;
                tracing::info!(task_id = action.task_id(), outcome, "approval command");
            }
            Inbound::Reaction {
                approver,
                approve,
                target,
            } => {
                react(svc, platform, &approver, approve, &target).await?;
            }
            Inbound::Chatter(message) => {
                keep_chatter(svc, platform, &message).await?;
            }
            Inbound::Respond(_) | Inbound::Ignore(_) => {}
        }
    }
    let mut created = 0;
    for result in accept_messages(&svc.intake, &messages, platform.agent()).await? {
        match result {
            Ok(ingested) => created += usize::from(!ingested.duplicate),
            // One bad event must not hold back the transaction (the homeserver would resend
            // it, and every later one, forever): it is skipped.
            Err(IntakeError::Invalid(reason)) => {
                tracing::warn!(channel = platform.name(), reason, "event skipped");
            }
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(once) = &parsed.once {
        done_once(&svc.store, once, now_ms()).await?;
    }
    tracing::debug!(channel = platform.name(), created, "transaction handled");
    Ok(parsed
        .answer
        .map(fixed_response)
        .unwrap_or_else(|| Json(json!({})).into_response()))
}
