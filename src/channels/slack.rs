//! Slack: Events API and interactivity requests verified by `X-Slack-Signature`
//! (`v0=` + hex HMAC-SHA256(signing secret, `v0:<timestamp>:<body>`), 5-minute window),
//! `url_verification` answered, replies with `chat.postMessage` in the question's thread,
//! Block Kit cards, `block_actions` for approvals. Slack has no idempotency field, so every
//! reply carries its key in message metadata, and a retry first looks for a message with
//! that key in the thread (reconciliation) before posting again.

use std::time::Duration;

use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

use super::parts::{TextLimit, Unit};
use super::platform::{Addressing, Conversation, GroupReply, Scope, chatter, question};
use super::platform::{
    BoxFuture, Delivered, DeliveryError, Fixed, Inbound, InboundRequest, Parsed, Platform, Refused,
    SettingProblem, require_settings,
};
use crate::domain::CardAction;
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "slack";
pub const TIMESTAMP_HEADER: &str = "x-slack-request-timestamp";
pub const SIGNATURE_HEADER: &str = "x-slack-signature";
/// The metadata event type that carries a reply's key.
const METADATA_EVENT: &str = "assistd_reply";

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlackChannelConfig {
    pub enabled: bool,
    pub signing_secret: String,
    pub bot_token: String,
    pub api_base_url: String,
    /// The bot's own user id (its messages are ignored).
    pub bot_user_id: String,
    pub agent: String,
    /// Least time between two sends into one chat, in ms (0 = no pacing).
    pub per_chat_interval_ms: u64,
    pub timestamp_tolerance_secs: u64,
    /// The assistant thread status shown while a task runs; empty = none.
    pub assistant_status: String,
    /// When to answer in group chats: "mention" (the default), "prefix" or "all".
    #[serde(default)]
    pub group_reply: super::platform::GroupReply,
    /// Prefixes that make a group message a question (e.g. "/ask").
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// How messages are grouped into conversations: "auto" (a direct chat per chat, a
    /// channel per thread: every question in a channel opens one), "chat", "thread", "user".
    #[serde(default)]
    pub conversation_scope: Scope,
    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (0, the default: none).
    #[serde(default)]
    pub group_context: usize,
}

impl SlackChannelConfig {
    /// What is wrong with these settings when the channel is enabled, if anything.
    pub fn check(&self) -> Result<(), SettingProblem> {
        require_settings(
            &[
                ("signing_secret", &self.signing_secret),
                ("bot_token", &self.bot_token),
            ],
            ("api_base_url", &self.api_base_url),
        )
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &str, timestamp: &str, body: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(b"v0:");
    mac.update(timestamp.as_bytes());
    mac.update(b":");
    mac.update(body);
    mac
}

/// `v0=<hex>`, as Slack signs.
pub fn sign(secret: &str, timestamp: &str, body: &[u8]) -> String {
    format!(
        "v0={}",
        hex::encode(mac(secret, timestamp, body).finalize().into_bytes())
    )
}

pub fn verify(
    secret: &str,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now_secs: i64,
    tolerance_secs: u64,
) -> Result<(), Refused> {
    let unauthorized = |m: &str| Refused::Unauthorized(m.to_string());
    let timestamp = timestamp.ok_or_else(|| unauthorized("missing X-Slack-Request-Timestamp"))?;
    let ts: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| unauthorized("X-Slack-Request-Timestamp is not unix seconds"))?;
    if now_secs.abs_diff(ts) > tolerance_secs {
        return Err(unauthorized(
            "X-Slack-Request-Timestamp is outside the allowed window",
        ));
    }
    let signature = signature.ok_or_else(|| unauthorized("missing X-Slack-Signature"))?;
    let given = signature
        .trim()
        .strip_prefix("v0=")
        .and_then(|h| hex::decode(h).ok())
        .ok_or_else(|| unauthorized("X-Slack-Signature must be v0=<hex>"))?;
    mac(secret, timestamp.trim(), body)
        .verify_slice(&given)
        .map_err(|_| unauthorized("signature does not match"))
}

/// Parses a verified Events API body.
pub fn parse_event(
    body: &[u8],
    bot_user_id: &str,
    group_reply: GroupReply,
    prefixes: &[String],
    scope: Scope,
) -> Result<Inbound, Refused> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::BadRequest(format!("body is not valid JSON: {e}")))?;
    match v["type"].as_str() {
        Some("url_verification") => {
            let challenge = v["challenge"]
                .as_str()
                .ok_or_else(|| Refused::BadRequest("missing field `challenge`".into()))?;
            Ok(Inbound::Respond(Fixed {
                status: 200,
                content_type: "application/json",
                body: json!({ "challenge": challenge }).to_string(),
            }))
        }
        Some("event_callback") => {
            let event_id = v["event_id"]
                .as_str()
                .ok_or_else(|| Refused::BadRequest("missing field `event_id`".into()))?;
            let event = &v["event"];
            if !matches!(event["type"].as_str(), Some("message" | "app_mention")) {
                return Ok(Inbound::Ignore("not a message event"));
            }
            if event.get("bot_id").is_some_and(|b| !b.is_null())
                || event.get("subtype").is_some_and(|s| !s.is_null())
            {
                return Ok(Inbound::Ignore("bot message or edit"));
            }
            let user = event["user"].as_str().unwrap_or("");
            if user.is_empty() || (!bot_user_id.is_empty() && user == bot_user_id) {
                return Ok(Inbound::Ignore("sent by the bot"));
            }
            let field = |name: &str| {
                event[name]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Refused::BadRequest(format!("missing field `event.{name}`")))
            };
            let channel = field("channel")?;
            let ts = field("ts")?;
            // A question outside a thread opens one: the answer goes under it.
            let thread = event["thread_ts"].as_str().unwrap_or(&ts).to_string();
            let raw = field("text")?;
            // A direct message is `channel_type` "im" (a D… channel); a mention is an
            // `app_mention` or `<@bot>` in the text; a thread reply to the bot names it as
            // `parent_user_id`.
            let addressing = Addressing {
                group: match event["channel_type"].as_str() {
                    Some(kind) => kind != "im",
                    None => !channel.starts_with('D'),
                },
                mentioned: event["type"] == "app_mention"
                    || (!bot_user_id.is_empty() && raw.contains(&format!("<@{bot_user_id}>"))),
                reply_to_bot: !bot_user_id.is_empty()
                    && event["parent_user_id"].as_str() == Some(bot_user_id),
            };
            let text = strip_mentions(&raw);
            if text.is_empty() {
                return Ok(Inbound::Ignore("empty after removing mentions"));
            }
            let Some(text) = question(group_reply, prefixes, addressing, &text) else {
                return Ok(chatter((CHANNEL, event_id), &channel, (user, None), &text));
            };
            Ok(Inbound::Message(NewMessage {
                reply_context: None,
                channel: CHANNEL.into(),
                event_id: event_id.to_string(),
                // A mention arrives as both `message` and `app_mention` (two event ids, one
                // message): the channel+ts key makes them one task.
                message_id: format!("{channel}:{ts}"),
                conversation_id: conversation_key(&Conversation::scoped(
                    scope,
                    addressing.group,
                    &channel,
                    Some(&thread),
                    user,
                )),
                sender_id: user.to_string(),
                sender_name: None,
                text,
                trace_context: None,
            }))
        }
        _ => Ok(Inbound::Ignore("unknown request type")),
    }
}

/// The key of a Slack conversation: a thread's is `<channel>:<thread_ts>`, as it has been
/// since the first release (so a thread begun before scopes goes on in the same
/// conversation); a channel's or a member's is `Conversation::key`.
fn conversation_key(conversation: &Conversation) -> String {
    match &conversation.thread {
        Some(thread) => format!("{}:{thread}", conversation.chat),
        None => conversation.key(),
    }
}

/// The Slack conversation a stored `conversation_id` names (`conversation_key` read back).
pub fn conversation(id: &str) -> Conversation {
    let parsed = Conversation::parse(id);
    match (&parsed.thread, &parsed.user, id.split_once(':')) {
        (None, None, Some((channel, thread))) => Conversation {
            chat: channel.to_string(),
            thread: Some(thread.to_string()),
            user: None,
        },
        _ => parsed,
    }
}

/// Parses a verified interactivity request (form-encoded `payload`).
pub fn parse_action(body: &[u8]) -> Result<Inbound, Refused> {
    let payload = url::form_urlencoded::parse(body)
        .find(|(k, _)| k == "payload")
        .map(|(_, v)| v.into_owned())
        .ok_or_else(|| Refused::BadRequest("missing form field `payload`".into()))?;
    let v: Value = serde_json::from_str(&payload)
        .map_err(|e| Refused::BadRequest(format!("payload is not JSON: {e}")))?;
    if v["type"].as_str() != Some("block_actions") {
        return Ok(Inbound::Ignore("not a block action"));
    }
    let approver = v["user"]["id"]
        .as_str()
        .ok_or_else(|| Refused::BadRequest("missing field `user.id`".into()))?;
    let Some(value) = v["actions"][0]["value"].as_str() else {
        return Ok(Inbound::Ignore("action without a value"));
    };
    let Ok(value) = serde_json::from_str::<Value>(value) else {
        return Ok(Inbound::Ignore("action value is not ours"));
    };
    let Some(action) = CardAction::from_card_value(&value, approver) else {
        return Ok(Inbound::Ignore("action value is not an approval"));
    };
    Ok(Inbound::Action {
        action,
        ack: None,
        with_task: false,
    })
}

/// Removes `<@U123>` user mentions.
fn strip_mentions(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("<@") {
        out.push_str(&rest[..start]);
        match rest[start..].find('>') {
            Some(end) => rest = &rest[start + end + 1..],
            None => {
                rest = &rest[start..];
                break;
            }
        }
    }
    out.push_str(rest);
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[derive(Clone)]
pub struct SlackChannel {
    config: SlackChannelConfig,
    http: reqwest::Client,
    api: String,
    token: String,
}

impl SlackChannel {
    pub fn new(config: &SlackChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(SlackChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            api: config.api_base_url.trim_end_matches('/').to_string(),
            token: config.bot_token.clone(),
        })
    }

    /// The channel and thread (empty: none) a reply goes to.
    fn target(reply: &ReplyRow) -> (String, String) {
        let conversation = conversation(&reply.conversation_id);
        (conversation.chat, conversation.thread.unwrap_or_default())
    }

    /// Looks among the latest messages where the reply goes (its thread's replies, or the
    /// channel's history for a top-level reply) for one carrying its key (a send whose
    /// answer was lost). `Ok(Some(ts))` = already posted.
    async fn reconcile(&self, reply: &ReplyRow) -> Result<Option<String>, DeliveryError> {
        let (channel, thread) = Self::target(reply);
        let mut query = vec![
            ("channel", channel.as_str()),
            ("include_all_metadata", "true"),
            ("limit", "200"),
        ];
        let method = if thread.is_empty() {
            "conversations.history"
        } else {
            query.push(("ts", thread.as_str()));
            "conversations.replies"
        };
        let response = self
            .http
            .get(format!("{}/{method}", self.api))
            .bearer_auth(&self.token)
            .query(&query)
            .send()
            .await
            .map_err(|e| {
                DeliveryError::retry(format!(
                    "{method} failed: {}",
                    crate::redaction::http_error(e)
                ))
            })?;
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if answer["ok"].as_bool() != Some(true) {
            return Err(DeliveryError::retry(format!(
                "{method}: {}",
                answer["error"].as_str().unwrap_or("unreadable answer")
            )));
        }
        let found = answer["messages"].as_array().and_then(|messages| {
            messages.iter().find(|m| {
                m["metadata"]["event_type"] == METADATA_EVENT
                    && m["metadata"]["event_payload"]["key"] == reply.idempotency_key.as_str()
            })
        });
        Ok(found.and_then(|m| m["ts"].as_str().map(str::to_string)))
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        if reply.attempts > 1
            && let Some(ts) = self.reconcile(reply).await?
        {
            tracing::info!(ts = %ts, "reply was already posted; not posting again");
            return Ok(Delivered {
                platform_message_id: Some(ts),
            });
        }
        let mut body = Self::message_body(reply)?;
        let (_, thread) = Self::target(reply);
        body["metadata"] = json!({ "event_type": METADATA_EVENT, "event_payload": { "key": reply.idempotency_key } });
        if !thread.is_empty() {
            body["thread_ts"] = json!(thread);
        }
        // Timeouts and lost answers are retried: the next attempt reconciles first.
        self.call("chat.postMessage", &body).await
    }

    /// `chat.update` of the bot's message `ts` in the reply's channel. Slack accepts an
    /// update to the same content again.
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn edit(&self, reply: &ReplyRow, ts: &str) -> Result<Delivered, DeliveryError> {
        let mut body = Self::message_body(reply)?;
        body["ts"] = json!(ts);
        self.call("chat.update", &body).await
    }

    /// The message fields of `reply`: channel, text, and a card's blocks.
    fn message_body(reply: &ReplyRow) -> Result<Value, DeliveryError> {
        let (channel, _) = Self::target(reply);
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("").to_string();
        // The model's Markdown as mrkdwn; any text with `&`, `<`, `>` escaped, as Slack
        // requires of a `text` field.
        let shown = if super::markdown::has_formatting(&text) {
            super::markdown::slack_mrkdwn(&text)
        } else {
            text.replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
        };
        let mut body = json!({ "channel": channel, "text": shown });
        if let Some(card) = content.get("card").filter(|c| c.is_object())
            && let Some(blocks) = super::cards::render(CHANNEL, card, &text, &reply.idempotency_key)
                .map_err(DeliveryError::retry)?
        {
            body["blocks"] = blocks;
        }
        Ok(body)
    }

    /// One Web API call answering a message (`ts`).
    async fn call(&self, method: &str, body: &Value) -> Result<Delivered, DeliveryError> {
        let response = self
            .http
            .post(format!("{}/{method}", self.api))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .map_err(|e| {
                DeliveryError::retry(format!(
                    "{method} failed: {}",
                    crate::redaction::http_error(e)
                ))
            })?;
        let status = response.status();
        let retry_after =
            crate::backoff::retry_after(response.headers(), std::time::SystemTime::now());
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() && answer["ok"].as_bool() == Some(true) {
            return Ok(Delivered {
                platform_message_id: answer["ts"].as_str().map(str::to_string),
            });
        }
        Err(DeliveryError {
            message: format!(
                "{method} answered HTTP {}: {}",
                status.as_u16(),
                answer["error"].as_str().unwrap_or("")
            ),
            permanent: PERMANENT_ERRORS.contains(&answer["error"].as_str().unwrap_or("")),
            retry_after,
            unknown: false,
        })
    }
}

/// Web API errors of `chat.postMessage` / `chat.update` that a retry cannot cure (Slack's
/// method docs): the reply ends FAILED with it instead of being retried forever.
const PERMANENT_ERRORS: &[&str] = &[
    "msg_too_long",
    "no_text",
    "invalid_blocks",
    "invalid_blocks_format",
    "invalid_arguments",
    "invalid_attachments",
    "too_many_attachments",
    "channel_not_found",
    "is_archived",
    "not_in_channel",
    "restricted_action",
    "cant_update_message",
    "edit_window_closed",
];

impl Platform for SlackChannel {
    super::platform::platform_basics!(SlackChannel);

    fn group_context(&self) -> usize {
        self.config.group_context
    }

    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            let action = request.route("POST", &["", "actions"])? == "actions";
            verify(
                &self.config.signing_secret,
                request.header(TIMESTAMP_HEADER),
                request.header(SIGNATURE_HEADER),
                request.body,
                request.now_ms / 1000,
                self.config.timestamp_tolerance_secs,
            )?;
            Ok(Parsed::one(if action {
                parse_action(request.body)?
            } else {
                parse_event(
                    request.body,
                    &self.config.bot_user_id,
                    self.config.group_reply,
                    &self.config.prefixes,
                    self.config.conversation_scope,
                )?
            }))
        })
    }

    fn can_edit(&self) -> bool {
        true
    }

    fn edit<'a>(
        &'a self,
        reply: &'a ReplyRow,
        ts: &'a str,
    ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
        Box::pin(SlackChannel::edit(self, reply, ts))
    }

    fn edit_target_gone(&self, error: &DeliveryError) -> bool {
        error.message.ends_with("message_not_found")
            || error.message.ends_with("cant_update_message")
    }

    /// Slack Web API, `chat.postMessage` and `chat.update`: "For best results, limit the
    /// number of characters in the text field to 4,000 characters" (longer messages are
    /// truncated at 40,000 or refused as `msg_too_long`).
    fn text_limit(&self) -> TextLimit {
        TextLimit::new(4000, Unit::Chars)
    }

    /// Blocks: a section's text holds at most 3,000 characters.
    fn card_limit_bytes(&self) -> Option<usize> {
        Some(3000)
    }

    fn chat_interval_ms(&self) -> u64 {
        self.config.per_chat_interval_ms
    }

    fn conversation(&self, conversation_id: &str) -> Conversation {
        conversation(conversation_id)
    }

    /// The assistant thread status, where configured (`assistant_status`).
    fn typing_every(&self) -> Option<Duration> {
        (!self.config.assistant_status.is_empty()).then(|| Duration::from_secs(60))
    }

    /// `assistant.threads.setStatus` in the question's thread; an empty status clears it.
    fn typing<'a>(&'a self, conversation: &'a str, on: bool) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let conversation = self::conversation(conversation);
            let (channel, Some(thread)) = (conversation.chat, conversation.thread) else {
                // Not in a thread: there is no assistant thread to show a status in.
                return Ok(());
            };
            let status = if on {
                self.config.assistant_status.as_str()
            } else {
                ""
            };
            let body = json!({ "channel_id": channel, "thread_ts": thread, "status": status });
            self.call("assistant.threads.setStatus", &body)
                .await
                .map(|_| ())
                .map_err(|e| e.message)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example from Slack's "Verifying requests from Slack".
    #[test]
    fn signature_known_answer_from_slack_docs() {
        let body = "token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let expected = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";
        assert_eq!(
            sign(
                "8f742231b10e8888abcd99yyyzzz85a5",
                "1531420618",
                body.as_bytes()
            ),
            expected
        );
        assert!(
            verify(
                "8f742231b10e8888abcd99yyyzzz85a5",
                Some("1531420618"),
                Some(expected),
                body.as_bytes(),
                1_531_420_618,
                300
            )
            .is_ok()
        );
        assert!(
            verify(
                "8f742231b10e8888abcd99yyyzzz85a5",
                Some("1531420618"),
                Some(expected),
                body.as_bytes(),
                1_531_420_618 + 301,
                300
            )
            .is_err()
        );
    }

    #[test]
    fn mentions_are_stripped() {
        assert_eq!(
            strip_mentions("<@U123> what is   up <@U9|bob>"),
            "what is up"
        );
        assert_eq!(strip_mentions("plain"), "plain");
    }
}
