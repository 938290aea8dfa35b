//! Lark/Feishu (event schema 2.0): encrypted bodies (AES-256-CBC, key = SHA-256 of the
//! encrypt key, IV = the first 16 bytes of the decoded payload), `X-Lark-Signature` = hex
//! SHA-256 of timestamp + nonce + encrypt key + raw body, `header.token` check,
//! `url_verification`, `im.message.receive_v1`. Replies go to
//! `POST /open-apis/im/v1/messages/{message_id}/reply` with `uuid` = the reply key, which Lark
//! deduplicates, so a re-send is safe. The tenant access token is cached until it expires.

use std::time::Duration;

use aes::cipher::{BlockDecryptMut, KeyIvInit, block_padding::Pkcs7};
use base64::Engine;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::parts::{TextLimit, Unit};
use super::platform::{Addressing, Conversation, GroupReply, Scope, chatter, question};
use super::platform::{
    BoxFuture, Delivered, DeliveryError, Fixed, Inbound, InboundRequest, Parsed, Platform, Refused,
    SettingProblem, TokenAnswer, require_settings,
};
use crate::domain::CardAction;
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "lark";
pub const TIMESTAMP_HEADER: &str = "x-lark-request-timestamp";
pub const NONCE_HEADER: &str = "x-lark-request-nonce";
pub const SIGNATURE_HEADER: &str = "x-lark-signature";
/// Lark accepts `uuid`s of at most this many characters.
const UUID_MAX: usize = 50;

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LarkChannelConfig {
    pub enabled: bool,
    pub app_id: String,
    pub app_secret: String,
    pub verification_token: String,
    /// Empty = events arrive in plain text (then only the token is checked).
    pub encrypt_key: String,
    pub api_base_url: String,
    pub agent: String,
    /// Least time between two sends into one chat, in ms (0 = no pacing).
    pub per_chat_interval_ms: u64,
    pub timestamp_tolerance_secs: u64,
    /// The bot's open_id: in a group, only a mention of it is a question ("" = any mention).
    #[serde(default)]
    pub bot_open_id: String,
    /// When to answer in group chats: "mention" (the default), "prefix" or "all".
    #[serde(default)]
    pub group_reply: super::platform::GroupReply,
    /// Prefixes that make a group message a question (e.g. "/ask"); a reply to one of the
    /// bot's messages (`parent_id`, looked up) is a question too under "mention".
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// How messages are grouped into conversations: "auto" (a p2p chat per chat; a group
    /// per thread: a question outside one opens a thread), "chat", "thread", "user".
    #[serde(default)]
    pub conversation_scope: Scope,
    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (0, the default: none).
    #[serde(default)]
    pub group_context: usize,
}

impl LarkChannelConfig {
    /// What is wrong with these settings when the channel is enabled, if anything.
    pub fn check(&self) -> Result<(), SettingProblem> {
        require_settings(
            &[
                ("app_id", &self.app_id),
                ("app_secret", &self.app_secret),
                ("verification_token", &self.verification_token),
            ],
            ("api_base_url", &self.api_base_url),
        )
    }
}

type Aes256CbcDec = cbc::Decryptor<aes::Aes256>;

/// Decrypts an `encrypt` payload.
pub fn decrypt(encrypt_key: &str, payload: &str) -> Result<String, String> {
    let data = base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|_| "encrypt is not base64".to_string())?;
    if data.len() < 32 || data.len() % 16 != 0 {
        return Err("encrypt has a bad length".into());
    }
    let key = Sha256::digest(encrypt_key.as_bytes());
    let (iv, ciphertext) = data.split_at(16);
    let plain = Aes256CbcDec::new(key.as_slice().into(), iv.into())
        .decrypt_padded_vec_mut::<Pkcs7>(ciphertext)
        .map_err(|_| "encrypt does not decrypt with the encrypt key".to_string())?;
    String::from_utf8(plain).map_err(|_| "decrypted event is not UTF-8".into())
}

/// Hex SHA-256 of timestamp + nonce + encrypt key + body.
pub fn signature(timestamp: &str, nonce: &str, encrypt_key: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(timestamp.as_bytes());
    hash.update(nonce.as_bytes());
    hash.update(encrypt_key.as_bytes());
    hash.update(body);
    hex::encode(hash.finalize())
}

/// Verifies, decrypts and parses an event request. `headers` gives (timestamp, nonce,
/// signature). URL verification is exempt from the signature (Lark does not sign it) but
/// must carry the verification token.
pub fn parse_event(
    config: &LarkChannelConfig,
    headers: (Option<&str>, Option<&str>, Option<&str>),
    body: &[u8],
    now_secs: i64,
) -> Result<Inbound, Refused> {
    parse_message_event(config, headers, body, now_secs, false).map(|(item, _)| item)
}

/// The answer to Lark's URL verification: its challenge, when its token is ours.
fn challenge_answer(config: &LarkChannelConfig, v: &Value) -> Result<Inbound, Refused> {
    token_matches(config, v["token"].as_str())?;
    let challenge = v["challenge"]
        .as_str()
        .ok_or_else(|| Refused::BadRequest("missing field `challenge`".into()))?;
    Ok(Inbound::Respond(Fixed {
        status: 200,
        content_type: "application/json",
        body: json!({ "challenge": challenge }).to_string(),
    }))
}

/// A message's text without its `@_user_n` mention keys, spaces collapsed.
fn without_mentions(text: &str, message: &Value) -> String {
    let mut text = text.to_string();
    for mention in message["mentions"].as_array().into_iter().flatten() {
        if let Some(key) = mention["key"].as_str() {
            text = text.replace(key, "");
        }
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Parses a verified event; a message that replies to another names it (`parent_id`), and
/// is a reply to the bot when `replied_to_bot` (the caller looked the parent up).
fn parse_message_event(
    config: &LarkChannelConfig,
    headers: (Option<&str>, Option<&str>, Option<&str>),
    body: &[u8],
    now_secs: i64,
    replied_to_bot: bool,
) -> Result<(Inbound, Option<String>), Refused> {
    let v = open_verified(config, headers, body, now_secs)?;
    if v["type"].as_str() == Some("url_verification") {
        return Ok((challenge_answer(config, &v)?, None));
    }
    require_signed(config, headers)?;
    token_matches(config, v["header"]["token"].as_str())?;
    if v["header"]["event_type"].as_str() != Some("im.message.receive_v1") {
        return Ok((Inbound::Ignore("not a message event"), None));
    }
    let event_id = v["header"]["event_id"]
        .as_str()
        .ok_or_else(|| Refused::BadRequest("missing field `header.event_id`".into()))?;
    let event = &v["event"];
    if event["sender"]["sender_type"].as_str() != Some("user") {
        return Ok((Inbound::Ignore("not sent by a user"), None));
    }
    let message = &event["message"];
    if message["message_type"].as_str() != Some("text") {
        return Ok((Inbound::Ignore("not a text message"), None));
    }
    let field = |name: &str| {
        message[name]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Refused::BadRequest(format!("missing field `event.message.{name}`")))
    };
    let content: Value = serde_json::from_str(&field("content")?)
        .map_err(|_| Refused::BadRequest("event.message.content is not JSON".into()))?;
    // A group chat is `chat_type` "group" (else "p2p"); a message that @-mentions anyone
    // lists them in `mentions` (with `bot_open_id` set, the bot must be among them).
    let mentions = message["mentions"].as_array();
    let addressing = Addressing {
        group: message["chat_type"].as_str() == Some("group"),
        mentioned: mentions.into_iter().flatten().any(|m| {
            config.bot_open_id.is_empty()
                || m["id"]["open_id"].as_str() == Some(&config.bot_open_id)
        }),
        reply_to_bot: replied_to_bot,
    };
    let parent = message["parent_id"]
        .as_str()
        .filter(|p| !p.is_empty())
        .map(str::to_string);
    let text = without_mentions(content["text"].as_str().unwrap_or(""), message);
    if text.is_empty() {
        return Ok((Inbound::Ignore("empty after removing mentions"), None));
    }
    let sender = event["sender"]["sender_id"]["open_id"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let Some(text) = question(config.group_reply, &config.prefixes, addressing, &text) else {
        let said = chatter(
            (CHANNEL, event_id),
            &field("chat_id")?,
            (&sender, None),
            &text,
        );
        return Ok((said, parent));
    };
    let message_id = field("message_id")?;
    // A message in a thread names its root (`root_id`); a question outside one opens a
    // thread rooted at itself (the answer is a reply `reply_in_thread`).
    let thread = message["root_id"]
        .as_str()
        .filter(|r| !r.is_empty())
        .unwrap_or(&message_id);
    let conversation = Conversation::scoped(
        config.conversation_scope,
        addressing.group,
        &field("chat_id")?,
        Some(thread),
        &sender,
    );
    Ok((
        Inbound::Message(NewMessage {
            reply_context: None,
            channel: CHANNEL.into(),
            event_id: event_id.to_string(),
            message_id,
            conversation_id: conversation.key(),
            sender_id: sender,
            sender_name: None,
            text,
            trace_context: None,
        }),
        parent,
    ))
}

/// Verifies and parses a `card.action.trigger` callback.
pub fn parse_card_action(
    config: &LarkChannelConfig,
    headers: (Option<&str>, Option<&str>, Option<&str>),
    body: &[u8],
    now_secs: i64,
) -> Result<Inbound, Refused> {
    let v = open_verified(config, headers, body, now_secs)?;
    if v["type"].as_str() == Some("url_verification") {
        return parse_event(config, headers, body, now_secs);
    }
    require_signed(config, headers)?;
    token_matches(config, v["header"]["token"].as_str())?;
    let value = &v["event"]["action"]["value"];
    let approver = v["event"]["operator"]["open_id"].as_str().unwrap_or("");
    let Some(action) = CardAction::from_card_value(value, approver) else {
        return Ok(Inbound::Ignore("not an approval action"));
    };
    Ok(Inbound::Action {
        action,
        ack: None,
        with_task: false,
    })
}

/// The one answer to an unsigned request in encrypted mode, whatever its body holds, so
/// the answer tells nothing about the ciphertext (no padding oracle).
fn unsigned() -> Refused {
    Refused::Unauthorized("the request is not signed".into())
}

/// With an encrypt key every request but the URL check is signed: refuses one that is not.
fn require_signed(
    config: &LarkChannelConfig,
    headers: (Option<&str>, Option<&str>, Option<&str>),
) -> Result<(), Refused> {
    match headers {
        (Some(_), Some(_), Some(_)) => Ok(()),
        _ if config.encrypt_key.is_empty() => Ok(()),
        _ => Err(unsigned()),
    }
}

/// Verifies a signed request's freshness and signature on the raw body first, and only
/// then decrypts and parses it. An unsigned request (in encrypted mode only Lark's URL check
/// may be one) is still opened, but any failure to open it is the same 401.
fn open_verified(
    config: &LarkChannelConfig,
    headers: (Option<&str>, Option<&str>, Option<&str>),
    body: &[u8],
    now_secs: i64,
) -> Result<Value, Refused> {
    if config.encrypt_key.is_empty() {
        return open(config, body);
    }
    let (Some(ts), Some(nonce), Some(sig)) = headers else {
        return open(config, body).map_err(|_| unsigned());
    };
    let unauthorized = |m: &str| Refused::Unauthorized(m.to_string());
    let ts_secs: i64 = ts
        .trim()
        .parse()
        .map_err(|_| unauthorized("bad X-Lark-Request-Timestamp"))?;
    if now_secs.abs_diff(ts_secs) > config.timestamp_tolerance_secs {
        return Err(unauthorized(
            "X-Lark-Request-Timestamp is outside the allowed window",
        ));
    }
    let expected = signature(ts, nonce, &config.encrypt_key, body);
    if !bool::from(
        expected
            .as_bytes()
            .ct_eq(sig.trim().to_ascii_lowercase().as_bytes()),
    ) {
        return Err(unauthorized("signature does not match"));
    }
    open(config, body)
}

/// The JSON of a request, decrypted when it is `{"encrypt": ...}`.
fn open(config: &LarkChannelConfig, body: &[u8]) -> Result<Value, Refused> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::BadRequest(format!("body is not valid JSON: {e}")))?;
    match v.get("encrypt").and_then(Value::as_str) {
        Some(payload) => {
            if config.encrypt_key.is_empty() {
                return Err(Refused::BadRequest(
                    "encrypted event but no channels.lark.encrypt_key".into(),
                ));
            }
            let plain = decrypt(&config.encrypt_key, payload).map_err(Refused::Unauthorized)?;
            serde_json::from_str(&plain)
                .map_err(|e| Refused::BadRequest(format!("decrypted event is not JSON: {e}")))
        }
        None => Ok(v),
    }
}

fn token_matches(config: &LarkChannelConfig, token: Option<&str>) -> Result<(), Refused> {
    let token = token.ok_or_else(|| Refused::Unauthorized("missing verification token".into()))?;
    if bool::from(token.as_bytes().ct_eq(config.verification_token.as_bytes())) {
        Ok(())
    } else {
        Err(Refused::Unauthorized(
            "verification token does not match".into(),
        ))
    }
}

pub struct LarkChannel {
    config: LarkChannelConfig,
    http: reqwest::Client,
    api: String,
    app_id: String,
    app_secret: String,
    token: super::platform::TokenCache,
}

impl LarkChannel {
    pub fn new(config: &LarkChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(LarkChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            api: config.api_base_url.trim_end_matches('/').to_string(),
            app_id: config.app_id.clone(),
            app_secret: config.app_secret.clone(),
            token: super::platform::TokenCache::default(),
        })
    }

    /// The tenant access token, fetched when missing or within a minute of expiry.
    async fn tenant_token(&self) -> Result<String, DeliveryError> {
        let url = format!(
            "{}/open-apis/auth/v3/tenant_access_token/internal",
            self.api
        );
        let body = json!({ "app_id": self.app_id, "app_secret": self.app_secret });
        let answer = TokenAnswer {
            token: "tenant_access_token",
            expires_in: "expire",
            ok: |a| a["code"].as_i64() == Some(0),
        };
        self.token
            .fetch_json(
                "tenant_access_token",
                || self.http.post(url).json(&body),
                answer,
            )
            .await
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("");
        let card = content
            .get("card")
            .filter(|c| c.is_object())
            .map(|card| super::cards::render(CHANNEL, card, text, &reply.idempotency_key))
            .transpose()
            .map_err(DeliveryError::retry)?
            .flatten();
        // A placeholder goes as a card the answer can replace: Lark updates cards
        // (`PATCH`) but cannot turn a text message into one.
        let (msg_type, body_content) = match card {
            Some(card) => ("interactive", card.to_string()),
            None if reply.placeholder => ("interactive", Self::editable_card(reply)?.to_string()),
            // The model's Markdown as a post with an `md` element, which Lark renders.
            None if super::markdown::has_formatting(text) => (
                "post",
                json!({ "zh_cn": { "content": [[{ "tag": "md", "text": text }]] } }).to_string(),
            ),
            None => ("text", json!({ "text": text }).to_string()),
        };
        let uuid: String = reply.idempotency_key.chars().take(UUID_MAX).collect();
        let url = format!(
            "{}/open-apis/im/v1/messages/{}/reply",
            self.api, reply.in_reply_to
        );
        let mut body = json!({ "msg_type": msg_type, "content": body_content, "uuid": uuid });
        if Conversation::parse(&reply.conversation_id).thread.is_some() {
            // Into the question's thread (opening one under it when it is in none).
            body["reply_in_thread"] = json!(true);
        }
        let answer = match self
            .call("message reply", reqwest::Method::POST, url.clone(), &body)
            .await
        {
            // The post refused for its content (230001): once more as plain text.
            Err(e) if msg_type == "post" && e.message.contains("code 230001") => {
                tracing::warn!(error = %e.message, "formatting refused; sending as plain text");
                body["msg_type"] = json!("text");
                body["content"] =
                    json!(json!({ "text": super::markdown::plain(text) }).to_string());
                self.call("message reply", reqwest::Method::POST, url, &body)
                    .await
            }
            other => other,
        };
        answer.map(|answer| Delivered {
            platform_message_id: answer["data"]["message_id"].as_str().map(str::to_string),
        })
    }

    /// Whether the message `message_id` was sent by this app (`GET /im/v1/messages/{id}`:
    /// its sender is the app). A failed lookup counts as no: the message is then chatter,
    /// and Lark's 3-second answer deadline is kept.
    async fn sent_by_app(&self, message_id: &str) -> bool {
        let url = format!("{}/open-apis/im/v1/messages/{message_id}", self.api);
        match self
            .call("message get", reqwest::Method::GET, url, &Value::Null)
            .await
        {
            Ok(answer) => {
                let sender = &answer["data"]["items"][0]["sender"];
                sender["sender_type"] == "app" && sender["id"] == self.config.app_id.as_str()
            }
            Err(e) => {
                tracing::warn!(error = %e.message, "lark: the replied-to message could not be read");
                false
            }
        }
    }

    /// Updates the card `message_id` (a placeholder) to `reply`: a card answer as its card,
    /// a text answer as a card with the text (`PATCH /im/v1/messages/{id}`, which updates
    /// shared cards, those sent with `config.update_multi`).
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn edit(
        &self,
        reply: &ReplyRow,
        message_id: &str,
    ) -> Result<Delivered, DeliveryError> {
        let url = format!("{}/open-apis/im/v1/messages/{message_id}", self.api);
        let body = json!({ "content": Self::editable_card(reply)?.to_string() });
        self.call("message update", reqwest::Method::PATCH, url, &body)
            .await?;
        Ok(Delivered {
            platform_message_id: Some(message_id.to_string()),
        })
    }

    /// `reply` as a shared card (one that can be updated): its card, or its text.
    fn editable_card(reply: &ReplyRow) -> Result<Value, DeliveryError> {
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("");
        let rendered = match content.get("card").filter(|c| c.is_object()) {
            Some(card) => super::cards::render(CHANNEL, card, text, &reply.idempotency_key)
                .map_err(DeliveryError::retry)?,
            None => None,
        };
        let mut card = rendered.unwrap_or_else(|| {
            json!({ "elements": [{ "tag": "div", "text": { "tag": "lark_md", "content": text } }] })
        });
        card["config"]["update_multi"] = json!(true);
        Ok(card)
    }

    /// One authenticated Open API call; its answer when `code` is 0.
    async fn call(
        &self,
        what: &str,
        method: reqwest::Method,
        url: String,
        body: &Value,
    ) -> Result<Value, DeliveryError> {
        let token = self.tenant_token().await?;
        let request = self.http.request(method, url).bearer_auth(token);
        // A body only where there is one (`Value::Null`: a GET).
        let request = if body.is_null() {
            request
        } else {
            request.json(body)
        };
        let response = request.send().await.map_err(|e| {
            DeliveryError::retry(format!(
                "{what} failed: {}",
                crate::redaction::http_error(e)
            ))
        })?;
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() && answer["code"].as_i64() == Some(0) {
            return Ok(answer);
        }
        if matches!(answer["code"].as_i64(), Some(99991663 | 99991661)) {
            // The token was revoked or expired early: fetch a new one next time.
            self.token.forget();
        }
        Err(DeliveryError {
            message: format!(
                "{what} answered HTTP {}: code {} {}",
                status.as_u16(),
                answer["code"],
                answer["msg"].as_str().unwrap_or("")
            ),
            retry_after: (status.as_u16() == 429).then(|| Duration::from_secs(1)),
            unknown: false,
            permanent: false,
        })
    }
}

impl Platform for LarkChannel {
    super::platform::platform_basics!(LarkChannel);

    fn group_context(&self) -> usize {
        self.config.group_context
    }

    fn can_edit(&self) -> bool {
        true
    }

    fn edit<'a>(
        &'a self,
        reply: &'a ReplyRow,
        message_id: &'a str,
    ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
        Box::pin(LarkChannel::edit(self, reply, message_id))
    }

    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            let card = request.route("POST", &["", "card"])? == "card";
            let parts = (
                request.header(TIMESTAMP_HEADER),
                request.header(NONCE_HEADER),
                request.header(SIGNATURE_HEADER),
            );
            let now = request.now_ms / 1000;
            if card {
                return Ok(Parsed::one(parse_card_action(
                    &self.config,
                    parts,
                    request.body,
                    now,
                )?));
            }
            let (item, parent) =
                parse_message_event(&self.config, parts, request.body, now, false)?;
            // A group message that replies to one of the bot's messages is a question: its
            // parent is looked up only when nothing else made it one.
            let item = match (item, parent) {
                (Inbound::Chatter(_), Some(parent))
                    if self.config.group_reply == GroupReply::Mention
                        && self.sent_by_app(&parent).await =>
                {
                    parse_message_event(&self.config, parts, request.body, now, true)?.0
                }
                (item, _) => item,
            };
            Ok(Parsed::one(item))
        })
    }

    /// Lark Open API, send and reply to messages: a card's request body holds at most
    /// 30 KB (a text message 150 KB). Answers that may edit a placeholder are cards, so the
    /// card's limit holds for every part, counted as the text escaped into the card's JSON.
    fn text_limit(&self) -> TextLimit {
        TextLimit::new(28 * 1024, Unit::JsonBytes)
    }

    fn card_limit_bytes(&self) -> Option<usize> {
        Some(28 * 1024)
    }

    fn chat_interval_ms(&self) -> u64 {
        self.config.per_chat_interval_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decryption example of Lark's "Encrypt Key" documentation.
    #[test]
    fn decrypt_known_answer_from_lark_docs() {
        assert_eq!(
            decrypt("test key", "P37w+VZImNgPEO1RBhJ6RtKl7n6zymIbEG1pReEzghk=").unwrap(),
            "hello world"
        );
        assert!(decrypt("other key", "P37w+VZImNgPEO1RBhJ6RtKl7n6zymIbEG1pReEzghk=").is_err());
    }

    #[test]
    fn signature_is_sha256_of_the_parts() {
        // printf '%s' '1700000000nonce1keybody' | sha256sum
        assert_eq!(
            signature("1700000000", "nonce1", "key", b"body"),
            "b09dfc48e99e32fd3d92c94007987868864da55b09cd747a55ddc4292c364431"
        );
    }
}
