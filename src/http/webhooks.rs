//! Inbound webhooks. Each reads the raw body under the size limit, lets its channel verify
//! and parse it, and hands the message to intake. Bad input is answered before anything is
//! written.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;
use crate::channels::{Inbound, Refused, dingtalk, generic, lark, matrix, slack, telegram, wecom};
use crate::control::DecisionResult;
use crate::domain::now_ms;
use crate::intake::{IntakeError, accept_message, accept_messages};

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/webhooks/generic", post(generic_webhook))
        .route("/webhooks/generic/actions", post(generic_actions))
        .route("/webhooks/telegram", post(telegram_webhook))
        .route("/webhooks/slack", post(slack_events))
        .route("/webhooks/slack/actions", post(slack_actions))
        .route("/webhooks/dingtalk", post(dingtalk_webhook))
        .route(
            "/webhooks/wecom",
            axum::routing::get(wecom_verify).post(wecom_message),
        )
        .route("/webhooks/lark", post(lark_events))
        .route("/webhooks/lark/card", post(lark_card))
        .route(
            "/webhooks/matrix/_matrix/app/v1/transactions/{txn}",
            axum::routing::put(matrix_transaction),
        )
        .route(
            "/webhooks/matrix/transactions/{txn}",
            axum::routing::put(matrix_transaction),
        )
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

/// The raw body of a generic-channel request whose signature and timestamp check out.
async fn generic_verified(
    svc: &ApiContext,
    headers: &HeaderMap,
    body: Body,
) -> Result<Vec<u8>, ApiError> {
    let cfg = &svc.config.channels.generic;
    if !cfg.enabled || cfg.secret.is_empty() {
        return Err(ApiError::NotFound(
            "the generic channel is not configured".into(),
        ));
    }
    let raw = read_body(headers, body, svc.config.server.body_limit_bytes).await?;
    generic::verify(
        &cfg.secret,
        header(headers, generic::TIMESTAMP_HEADER),
        header(headers, generic::SIGNATURE_HEADER),
        &raw,
        now_ms() / 1000,
        cfg.timestamp_tolerance_secs,
    )
    .map_err(ApiError::Unauthorized)?;
    Ok(raw)
}

async fn generic_webhook(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let raw = generic_verified(&svc, &headers, body).await?;
    let message = generic::parse(&raw).map_err(ApiError::BadRequest)?;
    let ingested =
        accept_message(&svc.intake, &message, &svc.config.channels.generic.agent).await?;
    Ok(Json(
        json!({ "task_id": ingested.task_id, "duplicate": ingested.duplicate }),
    ))
}

/// Card actions from the IM (Approve/Reject on an approval card), signed like every generic
/// webhook: `{"task_id", "step_no", "decision": "approve"|"reject", "approver"}`.
async fn generic_actions(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let raw = generic_verified(&svc, &headers, body).await?;
    let action = generic::parse_action(&raw).map_err(ApiError::BadRequest)?;
    let result = decide(&svc, &action).await?;
    super::tasks::decision_response(&svc, action.task_id, result).await
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

impl From<Refused> for ApiError {
    fn from(r: Refused) -> Self {
        match r {
            Refused::Unauthorized(m) => ApiError::Unauthorized(m),
            Refused::BadRequest(m) => ApiError::BadRequest(m),
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
        action.task_id,
        Some(action.step_no),
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
    })
}

/// Carries out what a verified platform request asks. Platforms only need a quick 2xx, so
/// decisions are reported in the body (and, for Telegram, on the button).
async fn handle_inbound(
    svc: &ApiContext,
    inbound: Inbound,
    agent: &str,
    platform: &str,
) -> Result<Response, ApiError> {
    match inbound {
        Inbound::Message(message) => {
            let ingested = accept_message(&svc.intake, &message, agent).await?;
            Ok(
                Json(json!({ "task_id": ingested.task_id, "duplicate": ingested.duplicate }))
                    .into_response(),
            )
        }
        Inbound::Action { action, ack } => {
            let outcome = decide_action(svc, &action).await?;
            if let (Some(id), Some(channel)) = (ack, &svc.channels.telegram)
                && platform == telegram::CHANNEL
            {
                channel.answer_callback(&id, outcome).await;
            }
            Ok(Json(json!({ "result": outcome })).into_response())
        }
        Inbound::Respond {
            status,
            content_type,
            body,
        } => Ok((
            axum::http::StatusCode::from_u16(status).unwrap_or(axum::http::StatusCode::OK),
            [(axum::http::header::CONTENT_TYPE, content_type)],
            body,
        )
            .into_response()),
        Inbound::Ignore(reason) => Ok(Json(json!({ "ignored": reason })).into_response()),
    }
}

async fn telegram_webhook(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let cfg = &svc.config.channels.telegram;
    if svc.channels.telegram.is_none() {
        return Err(ApiError::NotFound(
            "the telegram channel is not enabled".into(),
        ));
    }
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    telegram::verify(&cfg.secret_token, header(&headers, telegram::SECRET_HEADER))?;
    let inbound = telegram::parse(&raw, &cfg.bot_username)?;
    handle_inbound(&svc, inbound, &cfg.agent, telegram::CHANNEL).await
}

async fn slack_verified(
    svc: &ApiContext,
    headers: &HeaderMap,
    body: Body,
) -> Result<Vec<u8>, ApiError> {
    let cfg = &svc.config.channels.slack;
    if svc.channels.slack.is_none() {
        return Err(ApiError::NotFound(
            "the slack channel is not enabled".into(),
        ));
    }
    let raw = read_body(headers, body, svc.config.server.body_limit_bytes).await?;
    slack::verify(
        &cfg.signing_secret,
        header(headers, slack::TIMESTAMP_HEADER),
        header(headers, slack::SIGNATURE_HEADER),
        &raw,
        now_ms() / 1000,
        cfg.timestamp_tolerance_secs,
    )?;
    Ok(raw)
}

async fn slack_events(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let raw = slack_verified(&svc, &headers, body).await?;
    let cfg = &svc.config.channels.slack;
    let inbound = slack::parse_event(&raw, &cfg.bot_user_id)?;
    handle_inbound(&svc, inbound, &cfg.agent, slack::CHANNEL).await
}

async fn slack_actions(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let raw = slack_verified(&svc, &headers, body).await?;
    let inbound = slack::parse_action(&raw)?;
    handle_inbound(
        &svc,
        inbound,
        &svc.config.channels.slack.agent,
        slack::CHANNEL,
    )
    .await
}

fn matrix_error(status: axum::http::StatusCode, errcode: &str, error: &str) -> Response {
    (status, Json(json!({ "errcode": errcode, "error": error }))).into_response()
}

/// A Matrix transaction: every event is handled; a repeated transaction repeats nothing
/// (its messages are duplicates by event id).
async fn matrix_transaction(
    State(svc): State<Arc<ApiContext>>,
    axum::extract::Path(txn): axum::extract::Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let cfg = &svc.config.channels.matrix;
    let Some(channel) = &svc.channels.matrix else {
        return Ok(matrix_error(
            axum::http::StatusCode::NOT_FOUND,
            "M_UNRECOGNIZED",
            "the matrix channel is not enabled",
        ));
    };
    let query_token = query.as_deref().and_then(|q| {
        url::form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "access_token")
            .map(|(_, v)| v.into_owned())
    });
    match matrix::verify(
        &cfg.hs_token,
        header(&headers, "authorization"),
        query_token.as_deref(),
    ) {
        Ok(()) => {}
        Err(matrix::MatrixRefusal::Unauthorized) => {
            return Ok(matrix_error(
                axum::http::StatusCode::UNAUTHORIZED,
                "M_UNAUTHORIZED",
                "missing token",
            ));
        }
        Err(matrix::MatrixRefusal::Forbidden) => {
            return Ok(matrix_error(
                axum::http::StatusCode::FORBIDDEN,
                "M_FORBIDDEN",
                "bad token",
            ));
        }
    }
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    let events = matrix::parse(&raw, &cfg.bot_user_id)?;
    if svc.store.inbound_seen(matrix::CHANNEL, &txn).await? {
        tracing::debug!(txn = %txn, "matrix transaction repeated; nothing to do");
        return Ok(Json(json!({})).into_response());
    }
    // Messages are committed together after the loop: one intake transaction, in order, so
    // a large transaction finishes well within the homeserver's timeout.
    let mut messages = Vec::new();
    for event in events {
        match event {
            matrix::MatrixEvent::Invite(room) => channel.join(&room).await,
            matrix::MatrixEvent::Decision(action) => {
                let outcome = decide_action(&svc, &action).await?;
                tracing::info!(task_id = action.task_id, outcome, "matrix approval command");
            }
            matrix::MatrixEvent::Reaction {
                approver,
                approve,
                target,
            } => {
                // A reaction to anything but an approval request is just a reaction.
                if let Some(action) =
                    matrix::reaction_decision_of(&svc.store, &approver, approve, &target).await?
                {
                    let outcome = decide_action(&svc, &action).await?;
                    tracing::info!(
                        task_id = action.task_id,
                        outcome,
                        "matrix approval reaction"
                    );
                }
            }
            matrix::MatrixEvent::Message(message) => messages.push(message),
        }
    }
    let mut created = 0;
    for result in accept_messages(&svc.intake, &messages, &cfg.agent).await? {
        match result {
            Ok(ingested) => created += usize::from(!ingested.duplicate),
            // One bad event must not hold back the transaction (the homeserver would resend
            // it, and every later one, forever): it is skipped.
            Err(IntakeError::Invalid(reason)) => {
                tracing::warn!(txn = %txn, reason, "matrix event skipped");
            }
            Err(e) => return Err(e.into()),
        }
    }
    svc.store
        .record_inbound_once(matrix::CHANNEL, &txn, now_ms())
        .await?;
    tracing::debug!(txn = %txn, created, "matrix transaction");
    Ok(Json(json!({})).into_response())
}

async fn lark_request(
    svc: &ApiContext,
    headers: &HeaderMap,
    body: Body,
    card: bool,
) -> Result<Response, ApiError> {
    let cfg = &svc.config.channels.lark;
    if svc.channels.lark.is_none() {
        return Err(ApiError::NotFound("the lark channel is not enabled".into()));
    }
    let raw = read_body(headers, body, svc.config.server.body_limit_bytes).await?;
    let parts = (
        header(headers, lark::TIMESTAMP_HEADER),
        header(headers, lark::NONCE_HEADER),
        header(headers, lark::SIGNATURE_HEADER),
    );
    let inbound = if card {
        lark::parse_card_action(cfg, parts, &raw, now_ms() / 1000)?
    } else {
        lark::parse_event(cfg, parts, &raw, now_ms() / 1000)?
    };
    handle_inbound(svc, inbound, &cfg.agent, lark::CHANNEL).await
}

async fn lark_events(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    lark_request(&svc, &headers, body, false).await
}

async fn lark_card(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    lark_request(&svc, &headers, body, true).await
}

async fn dingtalk_webhook(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let cfg = &svc.config.channels.dingtalk;
    if svc.channels.dingtalk.is_none() {
        return Err(ApiError::NotFound(
            "the dingtalk channel is not enabled".into(),
        ));
    }
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    let (timestamp, sign) = (header(&headers, "timestamp"), header(&headers, "sign"));
    dingtalk::verify(
        &cfg.app_secret,
        timestamp,
        sign,
        now_ms(),
        cfg.timestamp_tolerance_secs,
    )?;
    // The sign covers only the timestamp and stays valid for the window, so a captured
    // pair could carry any body: each pair is good for the one body it first came with
    // (DingTalk's retries of that body still pass, and are deduplicated on msgId).
    let (pair, body_key) =
        dingtalk::signed_pair_keys(timestamp.unwrap_or(""), sign.unwrap_or(""), &raw);
    let store = &svc.store;
    if store
        .record_inbound_once(dingtalk::SIGN_KEYS, &pair, now_ms())
        .await?
    {
        store
            .record_inbound_once(dingtalk::SIGN_KEYS, &body_key, now_ms())
            .await?;
    } else if !store.inbound_seen(dingtalk::SIGN_KEYS, &body_key).await? {
        tracing::warn!("dingtalk: a used timestamp/sign pair came with another body; refused");
        return Err(Refused::Unauthorized(
            "this timestamp and sign were already used for another message".into(),
        )
        .into());
    }
    let inbound = dingtalk::parse(&raw, &cfg.session_webhook_origins)?;
    handle_inbound(&svc, inbound, &cfg.agent, dingtalk::CHANNEL).await
}

#[derive(Debug, serde::Deserialize)]
struct WeComQuery {
    msg_signature: Option<String>,
    timestamp: Option<String>,
    nonce: Option<String>,
    echostr: Option<String>,
}

impl WeComQuery {
    fn parts(&self) -> wecom::CallbackQuery<'_> {
        wecom::CallbackQuery {
            msg_signature: self.msg_signature.as_deref(),
            timestamp: self.timestamp.as_deref(),
            nonce: self.nonce.as_deref(),
            echostr: self.echostr.as_deref(),
        }
    }
}

async fn wecom_verify(
    State(svc): State<Arc<ApiContext>>,
    axum::extract::Query(q): axum::extract::Query<WeComQuery>,
) -> Result<Response, ApiError> {
    if svc.channels.wecom.is_none() {
        return Err(ApiError::NotFound(
            "the wecom channel is not enabled".into(),
        ));
    }
    let echo = wecom::verify_url(&svc.config.channels.wecom, &q.parts(), now_ms() / 1000)?;
    Ok(echo.into_response())
}

async fn wecom_message(
    State(svc): State<Arc<ApiContext>>,
    axum::extract::Query(q): axum::extract::Query<WeComQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let cfg = &svc.config.channels.wecom;
    if svc.channels.wecom.is_none() {
        return Err(ApiError::NotFound(
            "the wecom channel is not enabled".into(),
        ));
    }
    let raw = read_body(&headers, body, svc.config.server.body_limit_bytes).await?;
    let inbound = wecom::parse(cfg, &q.parts(), &raw, now_ms() / 1000)?;
    handle_inbound(&svc, inbound, &cfg.agent, wecom::CHANNEL).await?;
    // WeCom reads a non-empty answer as a passive reply: answer nothing.
    Ok(String::new().into_response())
}
