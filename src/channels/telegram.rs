//! Telegram Bot API: webhook updates verified by the `X-Telegram-Bot-Api-Secret-Token` given
//! to setWebhook, replies with `sendMessage` (`reply_parameters` to the question), approval
//! cards as inline keyboards whose `callback_query` decides, answered with
//! `answerCallbackQuery`. Telegram has no idempotency key: a send whose outcome is unknown
//! becomes UNKNOWN instead of being repeated.

use std::time::Duration;

use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use super::parts::{TextLimit, Unit};
use super::platform::{Addressing, Conversation, GroupReply, Scope, chatter, question};
use super::platform::{
    BoxFuture, Delivered, DeliveryError, Inbound, InboundRequest, Parsed, Platform, Refused,
    SettingProblem, require_settings,
};
use crate::domain::CardAction;
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "telegram";
pub const SECRET_HEADER: &str = "x-telegram-bot-api-secret-token";

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelegramChannelConfig {
    pub enabled: bool,
    pub bot_token: String,
    pub secret_token: String,
    pub api_base_url: String,
    /// The bot's @username without the @ (mentions of it are stripped).
    pub bot_username: String,
    pub agent: String,
    /// Least time between two sends into one chat, in ms (0 = no pacing).
    pub per_chat_interval_ms: u64,
    /// When to answer in group chats: "mention" (the default), "prefix" or "all".
    #[serde(default)]
    pub group_reply: super::platform::GroupReply,
    /// Prefixes that make a group message a question (e.g. "/ask").
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// How messages are grouped into conversations: "auto" (a private chat per chat; a
    /// group per forum topic, else per member), "chat", "thread", "user".
    #[serde(default)]
    pub conversation_scope: Scope,
    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (0, the default: none).
    #[serde(default)]
    pub group_context: usize,
}

impl TelegramChannelConfig {
    /// What is wrong with these settings when the channel is enabled, if anything.
    pub fn check(&self) -> Result<(), SettingProblem> {
        require_settings(
            &[
                ("bot_token", &self.bot_token),
                ("secret_token", &self.secret_token),
            ],
            ("api_base_url", &self.api_base_url),
        )
    }
}

/// Checks the secret token header in constant time.
pub fn verify(expected: &str, given: Option<&str>) -> Result<(), Refused> {
    let given = given
        .ok_or_else(|| Refused::Unauthorized("missing X-Telegram-Bot-Api-Secret-Token".into()))?;
    if bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
        Ok(())
    } else {
        Err(Refused::Unauthorized("secret token does not match".into()))
    }
}

/// Parses a verified update.
pub fn parse(
    body: &[u8],
    bot_username: &str,
    group_reply: GroupReply,
    prefixes: &[String],
    scope: Scope,
) -> Result<Inbound, Refused> {
    let update: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::BadRequest(format!("body is not valid JSON: {e}")))?;
    let update_id = update
        .get("update_id")
        .and_then(Value::as_i64)
        .ok_or_else(|| Refused::BadRequest("missing integer field `update_id`".into()))?;
    if let Some(query) = update.get("callback_query") {
        return parse_callback(query);
    }
    let Some(message) = update.get("message") else {
        return Ok(Inbound::Ignore("not a new message"));
    };
    let from = &message["from"];
    if from["is_bot"].as_bool().unwrap_or(false) {
        return Ok(Inbound::Ignore("sent by a bot"));
    }
    let Some(text) = message.get("text").and_then(Value::as_str) else {
        return Ok(Inbound::Ignore("no text"));
    };
    let chat = message["chat"]["id"]
        .as_i64()
        .ok_or_else(|| Refused::BadRequest("missing integer field `message.chat.id`".into()))?;
    let message_id = message["message_id"]
        .as_i64()
        .ok_or_else(|| Refused::BadRequest("missing integer field `message.message_id`".into()))?;
    let sender = from["id"]
        .as_i64()
        .ok_or_else(|| Refused::BadRequest("missing integer field `message.from.id`".into()))?;
    // A group, a supergroup (a channel's posts are not `message`s); mentioned by `@name` or
    // by a `text_mention` entity of the bot; or a reply to one of the bot's messages.
    let bot = bot_username.trim_start_matches('@');
    let is_bot_user = |user: &Value| {
        !bot.is_empty()
            && user["username"]
                .as_str()
                .is_some_and(|u| u.eq_ignore_ascii_case(bot))
    };
    let addressing = Addressing {
        group: message["chat"]["type"].as_str() != Some("private"),
        mentioned: (!bot.is_empty()
            && text
                .to_lowercase()
                .contains(&format!("@{}", bot.to_lowercase())))
            || message["entities"].as_array().is_some_and(|entities| {
                entities
                    .iter()
                    .any(|e| e["type"] == "text_mention" && is_bot_user(&e["user"]))
            }),
        reply_to_bot: is_bot_user(&message["reply_to_message"]["from"]),
    };
    let text = strip_mention(text, bot_username);
    if text.is_empty() {
        return Ok(Inbound::Ignore("empty after removing the mention"));
    }
    let sender_name = from["username"]
        .as_str()
        .or_else(|| from["first_name"].as_str());
    let Some(text) = question(group_reply, prefixes, addressing, &text) else {
        let sender = sender.to_string();
        return Ok(chatter(
            (CHANNEL, &update_id.to_string()),
            &chat.to_string(),
            (&sender, sender_name),
            &text,
        ));
    };
    Ok(Inbound::Message(NewMessage {
        reply_context: None,
        channel: CHANNEL.into(),
        event_id: update_id.to_string(),
        message_id: format!("{chat}:{message_id}"),
        // Threads are forum topics (`message_thread_id` of a topic message); the replies
        // of an ordinary group carry a `message_thread_id` too, which is no thread.
        conversation_id: Conversation::scoped(
            scope,
            addressing.group,
            &chat.to_string(),
            message["is_topic_message"]
                .as_bool()
                .unwrap_or(false)
                .then(|| message["message_thread_id"].as_i64())
                .flatten()
                .map(|t| t.to_string())
                .as_deref(),
            &sender.to_string(),
        )
        .key(),
        sender_id: sender.to_string(),
        sender_name: sender_name.map(str::to_string),
        text,
        trace_context: None,
    }))
}

fn parse_callback(query: &Value) -> Result<Inbound, Refused> {
    let id = query["id"]
        .as_str()
        .ok_or_else(|| Refused::BadRequest("missing field `callback_query.id`".into()))?;
    let approver = query["from"]["id"]
        .as_i64()
        .ok_or_else(|| Refused::BadRequest("missing field `callback_query.from.id`".into()))?;
    let data = query["data"].as_str().unwrap_or("");
    // `approve|reject:<request>` (`ApprovalRef::token`), within the 64 bytes Telegram allows.
    let Some((decision @ ("approve" | "reject"), request)) = data.split_once(':') else {
        return Ok(Inbound::Ignore("callback data is not an approval"));
    };
    let request = crate::domain::ApprovalRef::parse_token(request)
        .ok_or_else(|| Refused::BadRequest("bad callback data".into()))?;
    Ok(Inbound::Action {
        action: CardAction {
            request,
            approve: decision == "approve",
            approver: approver.to_string(),
        },
        ack: Some(id.to_string()),
        with_task: false,
    })
}

/// Removes `@bot` mentions.
fn strip_mention(text: &str, bot_username: &str) -> String {
    if bot_username.is_empty() {
        return text.trim().to_string();
    }
    text.replace(&format!("@{bot_username}"), "")
        .trim()
        .to_string()
}

#[derive(Clone)]
pub struct TelegramChannel {
    config: TelegramChannelConfig,
    http: reqwest::Client,
    api: String,
}

impl TelegramChannel {
    pub fn new(config: &TelegramChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(TelegramChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            api: format!(
                "{}/bot{}",
                config.api_base_url.trim_end_matches('/'),
                config.bot_token
            ),
        })
    }

    /// Answers a callback query (stops the button's spinner), best effort.
    pub async fn answer_callback(&self, callback_id: &str, text: &str) {
        let result = self
            .http
            .post(format!("{}/answerCallbackQuery", self.api))
            .json(&json!({ "callback_query_id": callback_id, "text": text }))
            .send()
            .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "answerCallbackQuery failed");
        }
    }

    /// The message fields of `reply`: its text, and a card's inline keyboard.
    fn message_body(reply: &ReplyRow) -> Result<Value, DeliveryError> {
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("").to_string();
        let conversation = Conversation::parse(&reply.conversation_id);
        let mut body = json!({ "chat_id": conversation.chat, "text": text });
        if content.get("card").is_none_or(Value::is_null) && super::markdown::has_formatting(&text)
        {
            // The model's Markdown in Telegram's HTML parse mode (entities count after
            // parsing, so the text limit holds as for the plain text).
            body["text"] = json!(super::markdown::telegram_html(&text));
            body["parse_mode"] = json!("HTML");
        }
        if let Some(thread) = conversation.thread.and_then(|t| t.parse::<i64>().ok()) {
            body["message_thread_id"] = thread.into();
        }
        if let Some(card) = content.get("card").filter(|c| c.is_object()) {
            let rendered = super::cards::render(CHANNEL, card, &text, &reply.idempotency_key)
                .map_err(DeliveryError::retry)?;
            if let Some(Value::Object(fields)) = rendered {
                for (k, v) in fields {
                    body[k] = v;
                }
            }
        }
        Ok(body)
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let mut body = Self::message_body(reply)?;
        if let Some(mid) = reply
            .in_reply_to
            .rsplit(':')
            .next()
            .and_then(|m| m.parse::<i64>().ok())
        {
            body["reply_parameters"] =
                json!({ "message_id": mid, "allow_sending_without_reply": true });
        }
        self.call_formatted("sendMessage", body, reply).await
    }

    /// A call with formatted text, sent once more as plain text when Telegram refuses the
    /// formatting ("can't parse entities"; nothing was shown, so the resend is safe).
    async fn call_formatted(
        &self,
        method: &str,
        mut body: Value,
        reply: &ReplyRow,
    ) -> Result<Delivered, DeliveryError> {
        match self.call(method, &body).await {
            Err(e)
                if body.get("parse_mode").is_some()
                    && e.message.contains("can't parse entities") =>
            {
                tracing::warn!(error = %e.message, "formatting refused; sending as plain text");
                let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
                let text = content["text"].as_str().unwrap_or("");
                body["text"] = json!(super::markdown::plain(text));
                if let Some(fields) = body.as_object_mut() {
                    fields.remove("parse_mode");
                }
                self.call(method, &body).await
            }
            other => other,
        }
    }

    /// `editMessageText` of the bot's message `message_id` in the reply's chat. An edit to
    /// the text the message already shows is refused by Telegram as "message is not
    /// modified": the message shows the reply, so that is a success.
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn edit(
        &self,
        reply: &ReplyRow,
        message_id: &str,
    ) -> Result<Delivered, DeliveryError> {
        let mut body = Self::message_body(reply)?;
        body["message_id"] = message_id
            .parse::<i64>()
            .map_err(|_| DeliveryError::retry(format!("not a Telegram message id: {message_id}")))?
            .into();
        match self.call_formatted("editMessageText", body, reply).await {
            Err(e) if e.message.contains("message is not modified") => Ok(Delivered {
                platform_message_id: Some(message_id.to_string()),
            }),
            other => other,
        }
    }

    /// One Bot API call answering a message (`result.message_id`).
    async fn call(&self, method: &str, body: &Value) -> Result<Delivered, DeliveryError> {
        let response = self
            .http
            .post(format!("{}/{method}", self.api))
            .json(body)
            .send()
            .await
            .map_err(|e| DeliveryError {
                // Refused connections never reached Telegram; anything later might have.
                unknown: !e.is_connect(),
                permanent: false,
                message: format!("{method} failed: {}", crate::redaction::http_error(e)),
                retry_after: None,
            })?;
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if answer["ok"].as_bool() == Some(true) {
            return Ok(Delivered {
                platform_message_id: answer["result"]["message_id"]
                    .as_i64()
                    .map(|m| m.to_string()),
            });
        }
        Err(DeliveryError {
            message: format!(
                "{method} answered HTTP {}: {}",
                status.as_u16(),
                answer["description"].as_str().unwrap_or("")
            ),
            retry_after: answer["parameters"]["retry_after"]
                .as_u64()
                .map(Duration::from_secs),
            unknown: false,
            // Bot API: 400 is a request Telegram will never take (too long, bad entities),
            // 403 a chat the bot may not write to; 429 and 5xx pass.
            permanent: matches!(status.as_u16(), 400 | 403),
        })
    }
}

impl Platform for TelegramChannel {
    super::platform::platform_basics!(TelegramChannel);

    fn group_context(&self) -> usize {
        self.config.group_context
    }

    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            request.route("POST", &[""])?;
            verify(&self.config.secret_token, request.header(SECRET_HEADER))?;
            Ok(Parsed::one(parse(
                request.body,
                &self.config.bot_username,
                self.config.group_reply,
                &self.config.prefixes,
                self.config.conversation_scope,
            )?))
        })
    }

    fn acknowledge<'a>(&'a self, ack: &'a str, outcome: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(self.answer_callback(ack, outcome))
    }

    fn can_edit(&self) -> bool {
        true
    }

    fn edit<'a>(
        &'a self,
        reply: &'a ReplyRow,
        message_id: &'a str,
    ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
        Box::pin(TelegramChannel::edit(self, reply, message_id))
    }

    fn edit_target_gone(&self, error: &DeliveryError) -> bool {
        error.message.contains("message to edit not found")
    }

    /// Telegram Bot API, `sendMessage` and `editMessageText`: "Text of the message to be
    /// sent, 1-4096 characters after entities parsing", counted in UTF-16 code units.
    fn text_limit(&self) -> TextLimit {
        TextLimit::new(4096, Unit::Utf16)
    }

    /// A card is shown as a message of its rendered text and buttons: its JSON is a bound
    /// on that text.
    fn card_limit_bytes(&self) -> Option<usize> {
        Some(4096)
    }

    fn chat_interval_ms(&self) -> u64 {
        self.config.per_chat_interval_ms
    }

    fn resend_is_blind(&self) -> bool {
        true
    }

    /// `sendChatAction` shows "typing…" for five seconds (or until the bot's next message).
    fn typing_every(&self) -> Option<Duration> {
        Some(Duration::from_secs(4))
    }

    fn typing<'a>(&'a self, conversation: &'a str, on: bool) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            if !on {
                // Telegram has no call to clear it: it ends by itself or with the answer.
                return Ok(());
            }
            let conversation = Conversation::parse(conversation);
            let mut body = json!({ "chat_id": conversation.chat, "action": "typing" });
            if let Some(thread) = conversation.thread.and_then(|t| t.parse::<i64>().ok()) {
                body["message_thread_id"] = thread.into();
            }
            let response = self
                .http
                .post(format!("{}/sendChatAction", self.api))
                .json(&body)
                .send()
                .await
                .map_err(|e| {
                    format!("sendChatAction failed: {}", crate::redaction::http_error(e))
                })?;
            let status = response.status();
            let answer: Value = response.json().await.unwrap_or(Value::Null);
            if answer["ok"].as_bool() == Some(true) {
                Ok(())
            } else {
                Err(format!(
                    "sendChatAction answered HTTP {}: {}",
                    status.as_u16(),
                    answer["description"].as_str().unwrap_or("")
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_token_is_checked() {
        assert!(verify("s3cret", Some("s3cret")).is_ok());
        assert!(verify("s3cret", Some("other")).is_err());
        assert!(verify("s3cret", None).is_err());
    }

    #[test]
    fn parses_messages_and_callbacks() {
        let body = br#"{"update_id": 10, "message": {"message_id": 5, "from": {"id": 42, "is_bot": false, "first_name": "Ada"}, "chat": {"id": -100, "type": "group"}, "date": 1, "text": "@helper_bot what is up"}}"#;
        match parse(body, "helper_bot", GroupReply::Mention, &[], Scope::Auto).unwrap() {
            Inbound::Message(m) => {
                assert_eq!(m.text, "what is up");
                assert_eq!(m.message_id, "-100:5");
                assert_eq!(m.conversation_id, "-100#u=42", "a group per member");
                assert_eq!(m.event_id, "10");
            }
            other => panic!("{other:?}"),
        }
        let bot = br#"{"update_id": 11, "message": {"message_id": 6, "from": {"id": 1, "is_bot": true}, "chat": {"id": 1}, "text": "hi"}}"#;
        assert!(matches!(
            parse(bot, "", GroupReply::Mention, &[], Scope::Auto).unwrap(),
            Inbound::Ignore(_)
        ));
        let cb = br#"{"update_id": 12, "callback_query": {"id": "cq1", "from": {"id": 42, "is_bot": false}, "data": "approve:7.3.1.5f1d2a9c0b7e"}}"#;
        match parse(cb, "", GroupReply::Mention, &[], Scope::Auto).unwrap() {
            Inbound::Action { action, ack, .. } => {
                assert_eq!(
                    (
                        action.request.task_id,
                        action.request.step_no,
                        action.request.run,
                        action.approve
                    ),
                    (7, 3, 1, true)
                );
                assert_eq!(action.approver, "42");
                assert_eq!(ack.as_deref(), Some("cq1"));
            }
            other => panic!("{other:?}"),
        }
    }
}
