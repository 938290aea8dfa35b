//! Matrix application service: the homeserver PUTs transactions of events to
//! `/webhooks/matrix/_matrix/app/v1/transactions/{txnId}` with `Authorization: Bearer
//! <hs_token>`; `m.room.message` events become messages, invites of the bot are accepted.
//! Replies are `PUT /_matrix/client/v3/rooms/{room}/send/m.room.message/{txnId}` with the
//! reply key as txnId, which the homeserver deduplicates, so a re-send is safe. A handled
//! transaction id is recorded, so a repeated transaction repeats nothing (not even a join).
//! Matrix has no buttons: an approval request is a message (`templates/cards/matrix/`) that
//! approvers answer with a ✅ / ❌ reaction, or with `approve <task>.<step>`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use sha2::Digest;
use subtle::ConstantTimeEq;

use super::parts::{TextLimit, Unit};
use super::platform::{
    BoxFuture, Conversation, Delivered, DeliveryError, Fixed, Inbound, InboundRequest, Once,
    Parsed, Platform, Refused, Scope, SettingProblem, no_route, require_settings,
};
use crate::domain::ReplyRow;

mod events;
mod rooms;

pub use events::{CHANNEL, Cue, MatrixEvent, parse};
use rooms::{Rooms, encode};

/// The largest event content sent with its HTML: an event holds 65,536 bytes in all
/// (client-server API, "Size limits"), the rest is the event's envelope.
const MAX_CONTENT_BYTES: usize = 60_000;

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixChannelConfig {
    pub enabled: bool,
    pub homeserver_url: String,
    /// The application service's token towards the homeserver.
    pub as_token: String,
    /// The homeserver's token towards us (checked on every transaction).
    pub hs_token: String,
    /// The bot's user id, e.g. @assistd:example.org.
    pub bot_user_id: String,
    pub agent: String,
    /// Least time between two sends into one chat, in ms (0 = no pacing).
    pub per_chat_interval_ms: u64,
    /// When the bot answers in a room that is not a direct chat.
    pub group_reply: super::platform::GroupReply,
    /// Prefixes that address the bot in a room (`group_reply = "prefix"` or `"mention"`).
    pub prefixes: Vec<String>,
    /// How long what the homeserver said about a room (its joined members, the bot's
    /// `m.direct` list) is kept, in seconds; a membership event of the room forgets it.
    pub room_kind_ttl_s: u64,
    /// How messages are grouped into conversations: "auto" (a direct chat per room; any
    /// other room per thread: a question outside one opens a thread), "chat", "thread",
    /// "user".
    #[serde(default)]
    pub conversation_scope: Scope,
    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (0, the default: none).
    #[serde(default)]
    pub group_context: usize,
}

impl MatrixChannelConfig {
    /// What is wrong with these settings when the channel is enabled, if anything.
    pub fn check(&self) -> Result<(), SettingProblem> {
        require_settings(
            &[
                ("as_token", &self.as_token),
                ("hs_token", &self.hs_token),
                ("bot_user_id", &self.bot_user_id),
            ],
            ("homeserver_url", &self.homeserver_url),
        )
    }
}

/// Why a transaction was refused, with the Matrix error code to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatrixRefusal {
    /// 401 M_UNAUTHORIZED: no token.
    Unauthorized,
    /// 403 M_FORBIDDEN: a wrong token.
    Forbidden,
}

/// Checks the homeserver token (header, or the legacy `access_token` query parameter).
pub fn verify(
    hs_token: &str,
    bearer: Option<&str>,
    query_token: Option<&str>,
) -> Result<(), MatrixRefusal> {
    let given = bearer
        .and_then(|h| h.strip_prefix("Bearer "))
        .or(query_token)
        .ok_or(MatrixRefusal::Unauthorized)?;
    if bool::from(given.trim().as_bytes().ct_eq(hs_token.as_bytes())) {
        Ok(())
    } else {
        Err(MatrixRefusal::Forbidden)
    }
}

#[derive(Clone)]
pub struct MatrixChannel {
    config: MatrixChannelConfig,
    http: reqwest::Client,
    homeserver: String,
    as_token: String,
    rooms: Arc<Rooms>,
}

impl MatrixChannel {
    pub fn new(config: &MatrixChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        let homeserver = config.homeserver_url.trim_end_matches('/').to_string();
        let rooms = Rooms::new(
            http.clone(),
            &homeserver,
            &config.as_token,
            &config.bot_user_id,
            (
                config.group_reply,
                &config.prefixes,
                config.conversation_scope,
            ),
            Duration::from_secs(config.room_kind_ttl_s),
        );
        Ok(MatrixChannel {
            config: config.clone(),
            http,
            homeserver: config.homeserver_url.trim_end_matches('/').to_string(),
            as_token: config.as_token.clone(),
            rooms: Arc::new(rooms),
        })
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let mut body = Self::message_content(reply)?;
        body["m.relates_to"] = match Conversation::parse(&reply.conversation_id).thread {
            // Into the thread, as a reply to the question for clients without threads.
            Some(root) => json!({ "rel_type": "m.thread", "event_id": root,
                "is_falling_back": true, "m.in_reply_to": { "event_id": reply.in_reply_to } }),
            None => json!({ "m.in_reply_to": { "event_id": reply.in_reply_to } }),
        };
        self.room_send(reply, &reply.idempotency_key, &body).await
    }

    /// Replaces the event `event_id` with `reply`'s content: an `m.replace` edit (the
    /// client-server API's "Event replacements"), whose fallback body is the new text
    /// marked `* `. Its transaction id is derived from the key and the new content, so a
    /// repeated edit is dropped by the homeserver and a different one is not.
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn edit(&self, reply: &ReplyRow, event_id: &str) -> Result<Delivered, DeliveryError> {
        let new_content = Self::message_content(reply)?;
        // The fallback for clients without edits: the new text marked `* `, plain.
        let mut body = json!({
            "msgtype": new_content["msgtype"],
            "body": format!("* {}", new_content["body"].as_str().unwrap_or("")),
        });
        body["m.new_content"] = new_content;
        body["m.relates_to"] = json!({ "rel_type": "m.replace", "event_id": event_id });
        let digest = hex::encode(sha2::Sha256::digest(reply.content.as_bytes()));
        let txn = format!("{}-edit-{}", reply.idempotency_key, &digest[..16]);
        self.room_send(reply, &txn, &body).await?;
        // The message is still known by the event it replaced.
        Ok(Delivered {
            platform_message_id: Some(event_id.to_string()),
        })
    }

    /// The `m.room.message` content of `reply`: text, or a card's rendering.
    fn message_content(reply: &ReplyRow) -> Result<Value, DeliveryError> {
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("");
        let rendered = match content.get("card").filter(|c| c.is_object()) {
            Some(card) => super::cards::render(CHANNEL, card, text, &reply.idempotency_key)
                .map_err(DeliveryError::retry)?,
            None => None,
        };
        Ok(rendered.unwrap_or_else(|| {
            let mut message = json!({ "msgtype": "m.text", "body": text });
            if super::markdown::has_formatting(text) {
                // The Markdown as HTML beside the plain body (`org.matrix.custom.html`).
                message["format"] = json!("org.matrix.custom.html");
                message["formatted_body"] = json!(super::markdown::html(text));
            }
            message
        }))
    }

    /// `content` without its HTML (`format`, `formatted_body`, also in `m.new_content`)
    /// when the event would outgrow what a homeserver takes: the plain body always fits.
    fn fitted(content: &Value) -> std::borrow::Cow<'_, Value> {
        let size = serde_json::to_string(content).map_or(0, |s| s.len());
        let has_html = content.get("formatted_body").is_some()
            || content["m.new_content"].get("formatted_body").is_some();
        if size <= MAX_CONTENT_BYTES || !has_html {
            return std::borrow::Cow::Borrowed(content);
        }
        let mut plain = content.clone();
        let strip = |v: &mut Value| {
            if let Some(fields) = v.as_object_mut() {
                fields.remove("format");
                fields.remove("formatted_body");
            }
        };
        strip(&mut plain);
        if let Some(new) = plain.get_mut("m.new_content") {
            strip(new);
        }
        std::borrow::Cow::Owned(plain)
    }

    /// `PUT /rooms/{room}/send/m.room.message/{txn}` into the reply's room.
    async fn room_send(
        &self,
        reply: &ReplyRow,
        txn: &str,
        body: &Value,
    ) -> Result<Delivered, DeliveryError> {
        let url = format!(
            "{}/_matrix/client/v3/rooms/{}/send/m.room.message/{}",
            self.homeserver,
            encode(&Conversation::parse(&reply.conversation_id).chat),
            encode(txn)
        );
        let response = self
            .http
            .put(url)
            .bearer_auth(&self.as_token)
            .json(&*Self::fitted(body))
            .send()
            .await
            .map_err(|e| {
                DeliveryError::retry(format!(
                    "room send failed: {}",
                    crate::redaction::http_error(e)
                ))
            })?;
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(Delivered {
                platform_message_id: answer["event_id"].as_str().map(str::to_string),
            });
        }
        Err(DeliveryError {
            message: format!(
                "room send answered HTTP {}: {}",
                status.as_u16(),
                answer["errcode"].as_str().unwrap_or("")
            ),
            retry_after: answer["retry_after_ms"].as_u64().map(Duration::from_millis),
            unknown: false,
            // Client-server API: an event over the size limit (413, M_TOO_LARGE) or one the
            // server cannot read is refused the same way on every try.
            permanent: status.as_u16() == 413
                || matches!(
                    answer["errcode"].as_str(),
                    Some("M_TOO_LARGE" | "M_BAD_JSON" | "M_NOT_JSON" | "M_INVALID_PARAM")
                ),
        })
    }
}

impl Platform for MatrixChannel {
    super::platform::platform_basics!(MatrixChannel);

    fn group_context(&self) -> usize {
        self.config.group_context
    }

    fn can_edit(&self) -> bool {
        true
    }

    fn edit<'a>(
        &'a self,
        reply: &'a ReplyRow,
        event_id: &'a str,
    ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
        Box::pin(MatrixChannel::edit(self, reply, event_id))
    }

    /// A transaction (`PUT .../transactions/{txn}`, with or without the
    /// `_matrix/app/v1/` prefix): every event is handled; a repeated transaction repeats
    /// nothing (its messages are duplicates by event id).
    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            let txn = request
                .rest
                .strip_prefix("_matrix/app/v1/")
                .unwrap_or(request.rest)
                .strip_prefix("transactions/")
                .filter(|t| !t.is_empty() && !t.contains('/'));
            let (Some(txn), "PUT") = (txn, request.method) else {
                return Err(no_route());
            };
            let refuse = |status: u16, errcode: &str, error: &str| {
                Refused::Answer(Fixed {
                    status,
                    content_type: "application/json",
                    body: json!({ "errcode": errcode, "error": error }).to_string(),
                })
            };
            match verify(
                &self.config.hs_token,
                request.header("authorization"),
                request.query_param("access_token").as_deref(),
            ) {
                Ok(()) => {}
                Err(MatrixRefusal::Unauthorized) => {
                    return Err(refuse(401, "M_UNAUTHORIZED", "missing token"));
                }
                Err(MatrixRefusal::Forbidden) => {
                    return Err(refuse(403, "M_FORBIDDEN", "bad token"));
                }
            }
            let mut items = Vec::new();
            for event in parse(request.body, &self.config.bot_user_id)? {
                items.push(match event {
                    MatrixEvent::Message { message, cue } => {
                        // Unknown room kinds are refused with 503: nothing is written and
                        // the homeserver sends the transaction again.
                        let question = self.rooms.question(message, cue).await.map_err(|e| {
                            tracing::warn!(error = %e, "matrix: cannot tell how a message is addressed");
                            refuse(503, "M_UNKNOWN", "the homeserver could not be asked about the room")
                        })?;
                        match question {
                            Ok(message) => Inbound::Message(message),
                            Err(chatter) => Inbound::Chatter(chatter),
                        }
                    }
                    MatrixEvent::Members(room) => {
                        self.rooms.forget(&room);
                        Inbound::Ignore("a membership change")
                    }
                    MatrixEvent::Invite { room, direct_with } => {
                        self.rooms.forget(&room);
                        Inbound::Invite { room, direct_with }
                    }
                    MatrixEvent::Decision(action) => Inbound::Action {
                        action,
                        ack: None,
                        with_task: false,
                    },
                    MatrixEvent::Reaction {
                        approver,
                        approve,
                        target,
                    } => Inbound::Reaction {
                        approver,
                        approve,
                        target,
                    },
                });
            }
            Ok(Parsed {
                items,
                once: Some(Once::Transaction {
                    namespace: CHANNEL,
                    id: txn.to_string(),
                }),
                transaction: true,
                answer: Some(Fixed {
                    status: 200,
                    content_type: "application/json",
                    body: "{}".into(),
                }),
                refused: None,
            })
        })
    }

    fn accept_invite<'a>(
        &'a self,
        room: &'a str,
        direct_with: Option<&'a str>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.rooms.join(room).await;
            if let Some(with) = direct_with
                && let Err(e) = self.rooms.mark_direct(room, with).await
            {
                tracing::warn!(room, error = %e, "could not mark the room direct");
            }
        })
    }

    /// Matrix: an event's JSON holds at most 65,536 bytes (client-server API, "Size
    /// limits"), and an edit (`m.replace`) carries the text twice (its fallback `body` and
    /// `m.new_content`): so a message's text, as JSON, at most 30,000 bytes.
    fn text_limit(&self) -> TextLimit {
        TextLimit::new(30_000, Unit::JsonBytes)
    }

    fn card_limit_bytes(&self) -> Option<usize> {
        Some(30_000)
    }

    fn chat_interval_ms(&self) -> u64 {
        self.config.per_chat_interval_ms
    }

    /// Typing notifications last `timeout` (30 s here) unless renewed or cleared.
    fn typing_every(&self) -> Option<Duration> {
        Some(Duration::from_secs(20))
    }

    fn typing<'a>(&'a self, conversation: &'a str, on: bool) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let room = &Conversation::parse(conversation).chat;
            let body = if on {
                json!({ "typing": true, "timeout": 30_000 })
            } else {
                json!({ "typing": false })
            };
            let response = self
                .http
                .put(format!(
                    "{}/_matrix/client/v3/rooms/{}/typing/{}",
                    self.homeserver,
                    encode(room),
                    encode(&self.config.bot_user_id)
                ))
                .bearer_auth(&self.as_token)
                .json(&body)
                .send()
                .await
                .map_err(|e| format!("typing failed: {}", crate::redaction::http_error(e)))?;
            if response.status().is_success() {
                Ok(())
            } else {
                Err(format!(
                    "typing answered HTTP {}",
                    response.status().as_u16()
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_events() {
        assert_eq!(verify("hs", Some("Bearer hs"), None), Ok(()));
        assert_eq!(verify("hs", None, Some("hs")), Ok(()));
        assert_eq!(
            verify("hs", Some("Bearer no"), None),
            Err(MatrixRefusal::Forbidden)
        );
        assert_eq!(verify("hs", None, None), Err(MatrixRefusal::Unauthorized));
        let body = br#"{"events": [
            {"type": "m.room.message", "room_id": "!r:hs", "sender": "@ada:hs", "event_id": "$e1", "content": {"msgtype": "m.text", "body": "@bot:hs: hello"}},
            {"type": "m.room.message", "room_id": "!r:hs", "sender": "@bot:hs", "event_id": "$e2", "content": {"msgtype": "m.text", "body": "mine"}},
            {"type": "m.room.member", "room_id": "!new:hs", "sender": "@ada:hs", "state_key": "@bot:hs", "event_id": "$e3", "content": {"membership": "invite"}}
        ]}"#;
        let events = parse(body, "@bot:hs").unwrap();
        assert_eq!(events.len(), 2);
        match &events[0] {
            MatrixEvent::Message { message, cue } => {
                assert_eq!(message.text, "hello");
                assert!(cue.mentioned);
            }
            other => panic!("{other:?}"),
        }
        assert!(
            matches!(&events[1], MatrixEvent::Invite { room, direct_with: None } if room == "!new:hs")
        );
    }
}
