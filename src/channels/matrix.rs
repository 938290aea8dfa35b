//! Matrix application service: the homeserver PUTs transactions of events to
//! `/webhooks/matrix/_matrix/app/v1/transactions/{txnId}` with `Authorization: Bearer
//! <hs_token>`; `m.room.message` events become messages, invites of the bot are accepted.
//! Replies are `PUT /_matrix/client/v3/rooms/{room}/send/m.room.message/{txnId}` with the
//! reply key as txnId, which the homeserver deduplicates, so a re-send is safe. A handled
//! transaction id is recorded, so a repeated transaction repeats nothing (not even a join).
//! Matrix has no buttons: an approval request is a message (`templates/cards/matrix/`) that
//! approvers answer with a ✅ / ❌ reaction, or with `approve <task>.<step>`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::Digest;
use subtle::ConstantTimeEq;

use super::parts::{TextLimit, Unit};
use super::platform::{
    Addressing, BoxFuture, Delivered, DeliveryError, Fixed, GroupReply, Inbound, InboundRequest,
    Once, Parsed, Platform, Refused, SettingProblem, no_route, question, require_settings,
};
use crate::domain::CardAction;
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "matrix";

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

/// One event of a transaction that concerns assistd.
#[derive(Debug, Clone)]
pub enum MatrixEvent {
    /// A text message, with how it calls on the bot as far as the event itself tells.
    Message { message: NewMessage, cue: Cue },
    /// The bot was invited to this room; `direct_with`: the inviter, when the invite marks
    /// the room a direct chat (`is_direct`).
    Invite {
        room: String,
        direct_with: Option<String>,
    },
    /// Someone joined, left or was invited to this room: what is known of its members is
    /// stale.
    Members(String),
    /// `approve 7.3` / `reject 7.3` sent by an approver.
    Decision(CardAction),
    /// A ✅ / ❌ (or 👍 / 👎) reaction by `approver` to the event `target`.
    Reaction {
        approver: String,
        approve: bool,
        target: String,
    },
}

/// How a message calls on the bot, as its event tells: a mention (`m.mentions.user_ids`,
/// the bot's ID in the body, or a pill to it in `formatted_body`), and the event it
/// replies to (`m.in_reply_to`), which may be one of the bot's.
#[derive(Debug, Clone, Default)]
pub struct Cue {
    pub mentioned: bool,
    pub in_reply_to: Option<String>,
}

/// The approval a reaction key stands for, if any.
fn reaction_decision(key: &str) -> Option<bool> {
    // Clients add a variation selector (U+FE0F) to some emoji; compare without it.
    match key.trim_end_matches('\u{fe0f}') {
        "✅" | "✔" | "👍" => Some(true),
        "❌" | "✖" | "👎" => Some(false),
        _ => None,
    }
}

/// Whether a message's content mentions `bot`: intentional mentions (`m.mentions`, client-
/// server API v1.7), the bot's user ID in the plain body, or a pill (a matrix.to link) to
/// it in the HTML body (`body` without a reply's quoted fallback, the HTML after its
/// `<mx-reply>`).
fn mentions(content: &Value, body: &str, bot: &str) -> bool {
    let pill = |html: &str| {
        html.contains(&format!("matrix.to/#/{bot}"))
            || html.contains(&format!("matrix.to/#/{}", bot.replacen('@', "%40", 1)))
    };
    content["m.mentions"]["user_ids"]
        .as_array()
        .is_some_and(|ids| ids.iter().any(|id| id == bot))
        || body.contains(bot)
        || content["formatted_body"]
            .as_str()
            .map(|html| html.split("</mx-reply>").last().unwrap_or(html))
            .is_some_and(pill)
}

/// A reply's own text: without the quoted fallback (`> <@user> …` lines and the blank line
/// after them) that clients put before a rich reply.
fn without_reply_fallback(body: &str) -> &str {
    if !body.starts_with('>') {
        return body;
    }
    match body.find("\n\n") {
        Some(end) if body[..end].lines().all(|l| l.starts_with('>')) => &body[end + 2..],
        _ => body,
    }
}

/// Parses a verified transaction body.
pub fn parse(body: &[u8], bot_user_id: &str) -> Result<Vec<MatrixEvent>, Refused> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::BadRequest(format!("body is not valid JSON: {e}")))?;
    let events = v["events"]
        .as_array()
        .ok_or_else(|| Refused::BadRequest("missing array field `events`".into()))?;
    let mut out = Vec::new();
    for event in events {
        let room = event["room_id"].as_str().unwrap_or("");
        match event["type"].as_str() {
            Some("m.room.member")
                if event["state_key"].as_str() == Some(bot_user_id)
                    && event["content"]["membership"].as_str() == Some("invite") =>
            {
                let direct_with = (event["content"]["is_direct"] == true)
                    .then(|| event["sender"].as_str().map(str::to_string))
                    .flatten();
                out.push(MatrixEvent::Invite {
                    room: room.to_string(),
                    direct_with,
                });
            }
            Some("m.room.member") if !room.is_empty() => {
                out.push(MatrixEvent::Members(room.to_string()));
            }
            Some("m.reaction") => {
                let sender = event["sender"].as_str().unwrap_or("");
                let relates = &event["content"]["m.relates_to"];
                let target = relates["event_id"].as_str().unwrap_or("");
                if sender.is_empty()
                    || sender == bot_user_id
                    || target.is_empty()
                    || relates["rel_type"].as_str() != Some("m.annotation")
                {
                    continue;
                }
                if let Some(approve) = relates["key"].as_str().and_then(reaction_decision) {
                    out.push(MatrixEvent::Reaction {
                        approver: sender.to_string(),
                        approve,
                        target: target.to_string(),
                    });
                }
            }
            Some("m.room.message") => {
                let sender = event["sender"].as_str().unwrap_or("");
                let event_id = event["event_id"].as_str().unwrap_or("");
                let content = &event["content"];
                if sender.is_empty()
                    || sender == bot_user_id
                    || event_id.is_empty()
                    || room.is_empty()
                {
                    continue;
                }
                // Notices are what bots send; only a person's text is a question.
                if content["msgtype"].as_str() != Some("m.text") {
                    continue;
                }
                // An edit (`m.replace`) arrives as a new `m.room.message`: it is not a new
                // question.
                if content["m.relates_to"]["rel_type"] == "m.replace"
                    || content.get("m.new_content").is_some()
                {
                    continue;
                }
                let in_reply_to = content["m.relates_to"]["m.in_reply_to"]["event_id"]
                    .as_str()
                    .map(str::to_string);
                let body = content["body"].as_str().unwrap_or("");
                let body = if in_reply_to.is_some() {
                    without_reply_fallback(body)
                } else {
                    body
                };
                let text = body
                    .replace(bot_user_id, "")
                    .trim_start_matches([':', ',', ' '])
                    .trim()
                    .to_string();
                if text.is_empty() {
                    continue;
                }
                if let Some((approve, request)) = super::platform::parse_decision_command(&text) {
                    out.push(MatrixEvent::Decision(CardAction {
                        request,
                        approve,
                        approver: sender.to_string(),
                    }));
                    continue;
                }
                out.push(MatrixEvent::Message {
                    cue: Cue {
                        mentioned: mentions(content, body, bot_user_id),
                        in_reply_to,
                    },
                    message: NewMessage {
                        reply_context: None,
                        channel: CHANNEL.into(),
                        event_id: event_id.to_string(),
                        message_id: event_id.to_string(),
                        conversation_id: room.to_string(),
                        sender_id: sender.to_string(),
                        sender_name: None,
                        text,
                        trace_context: None,
                    },
                });
            }
            _ => {}
        }
    }
    Ok(out)
}

/// What the bot knows of its rooms' kinds: whether each is a direct chat (at most two
/// joined members and listed in the bot's `m.direct` account data), read from the
/// homeserver and kept for `channels.matrix.room_kind_ttl_s`, forgotten sooner when a
/// membership event of the room arrives.
#[derive(Default)]
struct RoomKinds {
    rooms: std::sync::Mutex<HashMap<String, (bool, Instant)>>,
    direct: std::sync::Mutex<Option<(HashSet<String>, Instant)>>,
}

impl RoomKinds {
    fn room(&self, room: &str, ttl: Duration) -> Option<bool> {
        let rooms = self.rooms.lock().unwrap_or_else(|p| p.into_inner());
        rooms
            .get(room)
            .filter(|(_, at)| at.elapsed() < ttl)
            .map(|(direct, _)| *direct)
    }

    fn remember(&self, room: &str, direct: bool) {
        let mut rooms = self.rooms.lock().unwrap_or_else(|p| p.into_inner());
        if rooms.len() > 10_000 {
            rooms.clear();
        }
        rooms.insert(room.to_string(), (direct, Instant::now()));
    }

    fn forget(&self, room: &str) {
        self.rooms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(room);
    }

    fn direct_rooms(&self, ttl: Duration) -> Option<HashSet<String>> {
        let direct = self.direct.lock().unwrap_or_else(|p| p.into_inner());
        direct
            .as_ref()
            .filter(|(_, at)| at.elapsed() < ttl)
            .map(|(rooms, _)| rooms.clone())
    }

    fn set_direct_rooms(&self, rooms: Option<HashSet<String>>) {
        *self.direct.lock().unwrap_or_else(|p| p.into_inner()) = rooms.map(|r| (r, Instant::now()));
    }
}

#[derive(Clone)]
pub struct MatrixChannel {
    config: MatrixChannelConfig,
    http: reqwest::Client,
    homeserver: String,
    as_token: String,
    rooms: Arc<RoomKinds>,
}

fn encode(segment: &str) -> String {
    url::form_urlencoded::byte_serialize(segment.as_bytes()).collect()
}

impl MatrixChannel {
    pub fn new(config: &MatrixChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(MatrixChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            homeserver: config.homeserver_url.trim_end_matches('/').to_string(),
            as_token: config.as_token.clone(),
            rooms: Arc::default(),
        })
    }

    /// A client-server API `GET` as the bot: `Ok(None)` when the homeserver answers 404
    /// (`M_NOT_FOUND`), an error in words (no token in it) when it cannot be read.
    async fn get_json(&self, path: &str) -> Result<Option<Value>, String> {
        let response = self
            .http
            .get(format!("{}{path}", self.homeserver))
            .bearer_auth(&self.as_token)
            .send()
            .await
            .map_err(|e| crate::redaction::http_error(e).to_string())?;
        let status = response.status();
        if status.as_u16() == 404 {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(format!("HTTP {}", status.as_u16()));
        }
        response
            .json()
            .await
            .map(Some)
            .map_err(|e| format!("unreadable answer: {}", crate::redaction::http_error(e)))
    }

    /// The rooms the bot's `m.direct` account data lists (user ID → room IDs), fresh.
    async fn read_direct(&self) -> Result<(Value, HashSet<String>), String> {
        let path = format!(
            "/_matrix/client/v3/user/{}/account_data/m.direct",
            encode(&self.config.bot_user_id)
        );
        let data = self
            .get_json(&path)
            .await
            .map_err(|e| format!("reading m.direct: {e}"))?
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}));
        let rooms = data
            .as_object()
            .into_iter()
            .flat_map(|o| o.values())
            .filter_map(Value::as_array)
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect();
        Ok((data, rooms))
    }

    fn room_ttl(&self) -> Duration {
        Duration::from_secs(self.config.room_kind_ttl_s)
    }

    /// Whether `room` is a direct chat: at most two joined members (the bot and one
    /// person) and marked direct in the bot's `m.direct`; anything else is a group.
    async fn is_direct(&self, room: &str) -> Result<bool, String> {
        let ttl = self.room_ttl();
        if let Some(direct) = self.rooms.room(room, ttl) {
            return Ok(direct);
        }
        let path = format!("/_matrix/client/v3/rooms/{}/joined_members", encode(room));
        let members = self
            .get_json(&path)
            .await
            .map_err(|e| format!("reading the members of {room}: {e}"))?
            .and_then(|v| v["joined"].as_object().map(|j| j.len()))
            .ok_or_else(|| format!("reading the members of {room}: no `joined` map"))?;
        // A room missing from a kept `m.direct` list is looked up afresh: another
        // instance may have accepted its invite since.
        let direct = members <= 2
            && match self.rooms.direct_rooms(ttl) {
                Some(rooms) if rooms.contains(room) => true,
                _ => {
                    let (_, rooms) = self.read_direct().await?;
                    let direct = rooms.contains(room);
                    self.rooms.set_direct_rooms(Some(rooms));
                    direct
                }
            };
        self.rooms.remember(room, direct);
        Ok(direct)
    }

    /// Whether the event `event_id` of `room` was sent by the bot.
    async fn sent_by_bot(&self, room: &str, event_id: &str) -> Result<bool, String> {
        let path = format!(
            "/_matrix/client/v3/rooms/{}/event/{}",
            encode(room),
            encode(event_id)
        );
        let event = self
            .get_json(&path)
            .await
            .map_err(|e| format!("reading the replied-to event: {e}"))?;
        Ok(event.is_some_and(|e| e["sender"] == self.config.bot_user_id.as_str()))
    }

    /// The message as a question for the bot (a prefix removed), or `None`: a room
    /// message not addressed to it. The homeserver is asked only when the event itself
    /// does not settle it.
    async fn question(
        &self,
        mut message: NewMessage,
        cue: Cue,
    ) -> Result<Option<NewMessage>, String> {
        let group = Addressing {
            group: true,
            mentioned: cue.mentioned,
            reply_to_bot: false,
        };
        let ask = |addressing| {
            question(
                self.config.group_reply,
                &self.config.prefixes,
                addressing,
                &message.text,
            )
        };
        let text = match ask(group) {
            Some(text) => Some(text),
            None if self.is_direct(&message.conversation_id).await? => ask(Addressing::default()),
            None => match (&cue.in_reply_to, self.config.group_reply) {
                (Some(target), GroupReply::Mention)
                    if self.sent_by_bot(&message.conversation_id, target).await? =>
                {
                    ask(Addressing {
                        reply_to_bot: true,
                        ..group
                    })
                }
                _ => None,
            },
        };
        Ok(text.map(|text| {
            message.text = text;
            message
        }))
    }

    /// Adds `room` to the bot's `m.direct` account data under `with`, as clients do for
    /// a direct chat they join. Best effort.
    async fn mark_direct(&self, room: &str, with: &str) -> Result<(), String> {
        let (mut data, _) = self.read_direct().await?;
        let rooms = data[with].as_array().cloned().unwrap_or_default();
        if rooms.iter().any(|r| r == room) {
            return Ok(());
        }
        let mut rooms = rooms;
        rooms.push(json!(room));
        data[with] = Value::Array(rooms);
        let response = self
            .http
            .put(format!(
                "{}/_matrix/client/v3/user/{}/account_data/m.direct",
                self.homeserver,
                encode(&self.config.bot_user_id)
            ))
            .bearer_auth(&self.as_token)
            .json(&data)
            .send()
            .await
            .map_err(|e| crate::redaction::http_error(e).to_string())?;
        self.rooms.set_direct_rooms(None);
        self.rooms.forget(room);
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("HTTP {}", response.status().as_u16()))
        }
    }

    /// Joins a room the bot was invited to, best effort.
    pub async fn join(&self, room: &str) {
        let result = self
            .http
            .post(format!(
                "{}/_matrix/client/v3/rooms/{}/join",
                self.homeserver,
                encode(room)
            ))
            .bearer_auth(&self.as_token)
            .json(&json!({}))
            .send()
            .await;
        match result {
            Ok(r) if r.status().is_success() => tracing::info!(room, "joined room"),
            Ok(r) => tracing::warn!(room, status = r.status().as_u16(), "could not join room"),
            Err(e) => tracing::warn!(room, error = %e, "could not join room"),
        }
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let mut body = Self::message_content(reply)?;
        body["m.relates_to"] = json!({ "m.in_reply_to": { "event_id": reply.in_reply_to } });
        self.room_send(reply, &reply.idempotency_key, &body).await
    }

    /// Replaces the event `event_id` with `reply`'s content: an `m.replace` edit (the
    /// client-server API's "Event replacements"), whose fallback body is the new text
    /// marked `* `. Its transaction id is derived from the key and the new content, so a
    /// repeated edit is dropped by the homeserver and a different one is not.
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn edit(&self, reply: &ReplyRow, event_id: &str) -> Result<Delivered, DeliveryError> {
        let new_content = Self::message_content(reply)?;
        let mut body = new_content.clone();
        body["body"] = json!(format!("* {}", new_content["body"].as_str().unwrap_or("")));
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
        Ok(rendered.unwrap_or_else(|| json!({ "msgtype": "m.text", "body": text })))
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
            encode(&reply.conversation_id),
            encode(txn)
        );
        let response = self
            .http
            .put(url)
            .bearer_auth(&self.as_token)
            .json(body)
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
                        let question = self.question(message, cue).await.map_err(|e| {
                            tracing::warn!(error = %e, "matrix: cannot tell how a message is addressed");
                            refuse(503, "M_UNKNOWN", "the homeserver could not be asked about the room")
                        })?;
                        match question {
                            Some(message) => Inbound::Message(message),
                            None => Inbound::Ignore("a room message not addressed to the bot"),
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
            self.join(room).await;
            if let Some(with) = direct_with
                && let Err(e) = self.mark_direct(room, with).await
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

    fn typing<'a>(&'a self, room: &'a str, on: bool) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
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

    #[test]
    fn mentions_replies_and_members() {
        let body = br#"{"events": [
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m1", "content": {"msgtype": "m.text", "body": "bot: hi", "m.mentions": {"user_ids": ["@bot:hs"]}}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m2", "content": {"msgtype": "m.text", "body": "bot: hi", "format": "org.matrix.custom.html", "formatted_body": "<a href=\"https://matrix.to/#/%40bot:hs\">bot</a>: hi"}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m3", "content": {"msgtype": "m.text", "body": "> <@bot:hs> the office is on floor 3\n\nand the canteen?", "m.relates_to": {"m.in_reply_to": {"event_id": "$a1"}}}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m4", "content": {"msgtype": "m.text", "body": "lunch?"}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m5", "content": {"msgtype": "m.notice", "body": "a bot's notice"}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m6", "content": {"msgtype": "m.text", "body": "* lunch!", "m.new_content": {"msgtype": "m.text", "body": "lunch!"}, "m.relates_to": {"rel_type": "m.replace", "event_id": "$m4"}}},
            {"type": "m.room.member", "room_id": "!g:hs", "sender": "@bob:hs", "state_key": "@bob:hs", "event_id": "$j", "content": {"membership": "join"}},
            {"type": "m.room.member", "room_id": "!dm:hs", "sender": "@ada:hs", "state_key": "@bot:hs", "event_id": "$i", "content": {"membership": "invite", "is_direct": true}}
        ]}"#;
        let events = parse(body, "@bot:hs").unwrap();
        let cues: Vec<(String, bool, Option<String>)> = events
            .iter()
            .filter_map(|e| match e {
                MatrixEvent::Message { message, cue } => {
                    Some((message.text.clone(), cue.mentioned, cue.in_reply_to.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            cues,
            vec![
                ("bot: hi".into(), true, None),
                ("bot: hi".into(), true, None),
                ("and the canteen?".into(), false, Some("$a1".into())),
                ("lunch?".into(), false, None),
            ],
            "notices and edits are no questions; a reply loses its quoted fallback"
        );
        assert!(matches!(&events[4], MatrixEvent::Members(r) if r == "!g:hs"));
        assert!(matches!(
            &events[5],
            MatrixEvent::Invite { room, direct_with: Some(with) } if room == "!dm:hs" && with == "@ada:hs"
        ));
    }
}
