//! The signed generic webhook for an in-house IM (contract in README.md).
//!
//! Inbound and outbound bodies are signed the same way: `X-Assistd-Timestamp: <unix secs>`
//! and `X-Assistd-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>`.
//! Verification runs on the raw bytes before anything is parsed.

use std::time::Duration;

use hmac::{Hmac, Mac};
use serde_json::{Map, Value, json};
use sha2::Sha256;

use super::parts::{TextLimit, Unit};
use super::platform::{Addressing, Conversation, Scope, question};
use super::platform::{
    BoxFuture, Delivered, DeliveryError, Inbound, InboundRequest, Parsed, Platform, Progress,
    Refused,
};
use crate::domain::CardAction;
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "generic";
pub const TIMESTAMP_HEADER: &str = "x-assistd-timestamp";
pub const SIGNATURE_HEADER: &str = "x-assistd-signature";
const SIGNATURE_VERSION: &str = "v1=";

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenericChannelConfig {
    pub enabled: bool,
    pub secret: String,
    pub reply_url: String,
    pub agent: String,
    pub timestamp_tolerance_secs: u64,
    /// POST progress lines of workflow nodes while a task runs (default off).
    #[serde(default)]
    pub progress: bool,
    /// The longest reply text the receiving IM takes, in characters; a longer answer goes
    /// as numbered parts (`agent-task-<id>-part-<k>`). 0 (the default): no limit.
    #[serde(default)]
    pub max_text_chars: usize,
    /// When to answer in group chats: "mention" (the default), "prefix" or "all".
    #[serde(default)]
    pub group_reply: super::platform::GroupReply,
    /// Prefixes that make a group message a question (e.g. "/ask").
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// How messages are grouped into conversations: "auto" (a direct chat per chat; a group
    /// per `thread_id` when the message has one, else per sender), "chat", "thread", "user".
    #[serde(default)]
    pub conversation_scope: Scope,
    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (0, the default: none).
    #[serde(default)]
    pub group_context: usize,
}

/// How long the IM shows a typing event, unless renewed or cleared, in ms.
const TYPING_SHOWN_MS: u64 = 30_000;
/// How often a typing event is renewed while the task runs, in ms.
const TYPING_RENEW_MS: u64 = 20_000;

/// Longest accepted id field (event, message, conversation, sender), in bytes.
const MAX_ID_LEN: usize = crate::domain::MAX_ID_BYTES;

type HmacSha256 = Hmac<Sha256>;

/// `v1=<hex>` for `body` sent at `timestamp` (unix seconds).
pub fn sign(secret: &str, timestamp: i64, body: &[u8]) -> String {
    format!(
        "{SIGNATURE_VERSION}{}",
        hex::encode(mac(secret, timestamp, body).finalize().into_bytes())
    )
}

fn mac(secret: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut mac = HmacSha256::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// Checks a request's timestamp and signature headers against the raw body.
pub fn verify(
    secret: &str,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now_secs: i64,
    tolerance_secs: u64,
) -> Result<(), String> {
    let timestamp = timestamp.ok_or("missing X-Assistd-Timestamp header")?;
    let timestamp: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| "X-Assistd-Timestamp is not unix seconds")?;
    if now_secs.abs_diff(timestamp) > tolerance_secs {
        return Err(format!(
            "X-Assistd-Timestamp is more than {tolerance_secs} s from now"
        ));
    }
    let signature = signature.ok_or("missing X-Assistd-Signature header")?;
    let hex_sig = signature
        .trim()
        .strip_prefix(SIGNATURE_VERSION)
        .ok_or("X-Assistd-Signature must start with v1=")?;
    let given = hex::decode(hex_sig).map_err(|_| "X-Assistd-Signature is not hex")?;
    // `verify_slice` compares in constant time.
    mac(secret, timestamp, body)
        .verify_slice(&given)
        .map_err(|_| "signature does not match".to_string())
}

/// Parses a verified body into a message (in the conversation `scope` gives) and where it
/// was written (see [`addressing`]); the error names the offending field.
pub fn parse(body: &[u8], scope: Scope) -> Result<(NewMessage, Addressing), String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not valid JSON: {e}"))?;
    let Value::Object(object) = value else {
        return Err("body must be a JSON object".into());
    };
    let addressing = addressing(&object)?;
    let text = required(&object, "text", usize::MAX)?;
    if text.trim().is_empty() {
        return Err("field `text` must not be empty".into());
    }
    let sender_name = match object.get("sender_name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.contains('\0') => return Err(nul_in("sender_name")),
        Some(Value::String(s)) if s.len() <= MAX_ID_LEN => Some(s.clone()),
        Some(Value::String(_)) => {
            return Err(format!(
                "field `sender_name` is longer than {MAX_ID_LEN} bytes"
            ));
        }
        Some(_) => return Err("field `sender_name` must be a string".into()),
    };
    let chat = required(&object, "conversation_id", MAX_ID_LEN)?;
    if Conversation::is_marked(&chat) {
        return Err("field `conversation_id` must not contain `#t=` or `#u=`".into());
    }
    let thread = match object.get("thread_id") {
        None | Some(Value::Null) => None,
        Some(_) => Some(required(&object, "thread_id", MAX_ID_LEN)?),
    };
    let sender_id = required(&object, "sender_id", MAX_ID_LEN)?;
    let conversation = Conversation::scoped(
        scope,
        addressing.group,
        &chat,
        thread.as_deref(),
        &sender_id,
    );
    let message = NewMessage {
        reply_context: None,
        channel: CHANNEL.to_string(),
        event_id: required(&object, "event_id", MAX_ID_LEN)?,
        message_id: required(&object, "message_id", MAX_ID_LEN)?,
        conversation_id: conversation.key(),
        sender_id,
        sender_name,
        text,
        trace_context: None,
    };
    Ok((message, addressing))
}

/// Where a verified message was written and whether it calls on the bot: `chat_type`
/// ("direct", the default, or "group"), `mentioned` and `reply_to_bot` (booleans, default
/// false); the error names the offending field.
fn addressing(value: &serde_json::Map<String, Value>) -> Result<Addressing, String> {
    let flag = |name: &str| match value.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("field `{name}` must be true or false")),
    };
    let group = match value.get("chat_type") {
        None | Some(Value::Null) => false,
        Some(Value::String(kind)) if kind == "direct" => false,
        Some(Value::String(kind)) if kind == "group" => true,
        Some(_) => return Err("field `chat_type` must be \"direct\" or \"group\"".into()),
    };
    Ok(Addressing {
        group,
        mentioned: flag("mentioned")?,
        reply_to_bot: flag("reply_to_bot")?,
    })
}

/// Parses a verified card-action body; the error names the offending field.
pub fn parse_action(body: &[u8]) -> Result<CardAction, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not valid JSON: {e}"))?;
    let request = crate::domain::ApprovalRef::from_card_value(&value).ok_or_else(|| {
        "field `request` must name the approval request as the card's button value \
         carries it (`<task>.<step>.<run>.<digest>`, agreeing with `task_id` and `step_no`)"
            .to_string()
    })?;
    let Value::Object(object) = value else {
        return Err("body must be a JSON object".into());
    };
    let approve = match required(&object, "decision", 16)?.as_str() {
        "approve" => true,
        "reject" => false,
        other => {
            return Err(format!(
                "field `decision` is `{other}`; expected approve or reject"
            ));
        }
    };
    Ok(CardAction {
        request,
        approve,
        approver: required(&object, "approver", MAX_ID_LEN)?,
    })
}

/// PostgreSQL cannot store U+0000 in text; a sender that can fix its message is told so.
fn nul_in(field: &str) -> String {
    format!("field `{field}` contains a NUL character (U+0000)")
}

fn required(object: &Map<String, Value>, field: &str, max_len: usize) -> Result<String, String> {
    match object.get(field) {
        None | Some(Value::Null) => Err(format!("missing field `{field}`")),
        Some(Value::String(s)) if s.is_empty() => Err(format!("field `{field}` must not be empty")),
        Some(Value::String(s)) if s.len() > max_len => {
            Err(format!("field `{field}` is longer than {max_len} bytes"))
        }
        Some(Value::String(s)) if s.contains('\0') => Err(nul_in(field)),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("field `{field}` must be a string")),
    }
}

/// Sends replies to the IM's reply URL.
#[derive(Clone)]
pub struct GenericChannel {
    config: GenericChannelConfig,
    http: reqwest::Client,
    secret: String,
    reply_url: String,
}

impl GenericChannel {
    pub fn new(config: &GenericChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(GenericChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            secret: config.secret.clone(),
            reply_url: config.reply_url.clone(),
        })
    }

    /// POSTs the reply, signed, with `Idempotency-Key: agent-task-<id>` (the same on every
    /// try, so the IM can drop a repeat of a send whose answer was lost).
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        if self.reply_url.is_empty() {
            return Err(DeliveryError::retry(
                "channels.generic.reply_url is not set",
            ));
        }
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let conversation = Conversation::parse(&reply.conversation_id);
        let mut body = json!({
            "task_id": reply.task_id,
            "conversation_id": conversation.chat,
            "in_reply_to": reply.in_reply_to,
            "type": reply.reply_type.as_str(),
        });
        if let Some(thread) = conversation.thread {
            body["thread_id"] = json!(thread);
        }
        for field in ["text", "card"] {
            if let Some(v) = content.get(field).filter(|v| !v.is_null()) {
                body[field] = v.clone();
            }
        }
        // The text as written (Markdown, as models write), and rendered as HTML for an IM
        // that shows HTML rather than Markdown.
        if let Some(text) = content["text"].as_str()
            && super::markdown::has_formatting(text)
        {
            body["html"] = json!(super::markdown::html(text));
        }
        let bytes = serde_json::to_vec(&body)
            .map_err(|e| DeliveryError::retry(format!("cannot encode reply: {e}")))?;
        self.post_signed(&self.reply_url, &reply.idempotency_key, bytes)
            .await
    }

    /// POSTs an approval-timeout callback (the outbox row's content) to `url`, signed and
    /// keyed like replies.
    pub async fn send_callback(
        &self,
        url: &str,
        reply: &ReplyRow,
    ) -> Result<Delivered, DeliveryError> {
        self.post_signed(
            url,
            &reply.idempotency_key,
            reply.content.clone().into_bytes(),
        )
        .await
    }

    async fn post_signed(
        &self,
        url: &str,
        key: &str,
        bytes: Vec<u8>,
    ) -> Result<Delivered, DeliveryError> {
        let timestamp = crate::domain::now_ms() / 1000;
        let response = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .header(TIMESTAMP_HEADER, timestamp.to_string())
            .header(SIGNATURE_HEADER, sign(&self.secret, timestamp, &bytes))
            .body(bytes)
            .send()
            .await
            .map_err(|e| {
                DeliveryError::retry(format!(
                    "reply POST failed: {}",
                    crate::redaction::http_error(e)
                ))
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(Delivered {
                platform_message_id: None,
            });
        }
        let retry_after =
            crate::backoff::retry_after(response.headers(), std::time::SystemTime::now());
        Err(DeliveryError {
            message: format!("reply receiver answered HTTP {}", status.as_u16()),
            retry_after,
            unknown: false,
            // The receiver refused this body itself (malformed for it, too large): the same
            // body is refused again. 401/403 may be a secret being rotated, 404 a receiver
            // being deployed: those keep their backoff.
            permanent: matches!(status.as_u16(), 400 | 413 | 422),
        })
    }
}

impl Platform for GenericChannel {
    super::platform::platform_basics!(GenericChannel);

    fn group_context(&self) -> usize {
        self.config.group_context
    }

    fn text_limit(&self) -> TextLimit {
        match self.config.max_text_chars {
            0 => TextLimit::NONE,
            max => TextLimit::new(max, Unit::Chars),
        }
    }

    /// With `channels.generic.progress`, a streamed answer is posted as progress revisions.
    fn streams_progress(&self) -> bool {
        self.config.progress && !self.reply_url.is_empty()
    }

    /// With `channels.generic.progress`, a typing event as the task is claimed, renewed
    /// while it runs (each says how long to show it), and one that clears it at the end.
    fn typing_every(&self) -> Option<std::time::Duration> {
        self.streams_progress()
            .then(|| std::time::Duration::from_millis(TYPING_RENEW_MS))
    }

    fn typing<'a>(
        &'a self,
        conversation_id: &'a str,
        on: bool,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            if !self.streams_progress() {
                return Ok(());
            }
            let conversation = Conversation::parse(conversation_id);
            let mut body = json!({
                "type": "typing",
                "conversation_id": conversation.chat,
                "typing": on,
                "timeout_ms": if on { TYPING_SHOWN_MS } else { 0 },
            });
            if let Some(thread) = conversation.thread {
                body["thread_id"] = json!(thread);
            }
            let bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
            let key = format!("typing-{}", uuid::Uuid::new_v4());
            self.post_signed(&self.reply_url, &key, bytes)
                .await
                .map(|_| ())
                .map_err(|e| e.message)
        })
    }

    /// With `channels.generic.progress`, a signed progress POST to `reply_url`.
    fn progress<'a>(&'a self, update: &'a Progress) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            if !self.config.progress || self.reply_url.is_empty() {
                return Ok(());
            }
            let conversation = Conversation::parse(&update.conversation_id);
            let mut body = json!({
                "type": "progress",
                "task_id": update.task_id,
                "conversation_id": conversation.chat,
                "in_reply_to": update.in_reply_to,
                "revision": update.revision,
                "text": update.text,
            });
            if let Some(thread) = conversation.thread {
                body["thread_id"] = json!(thread);
            }
            let bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
            self.post_signed(&self.reply_url, &update.key, bytes)
                .await
                .map(|_| ())
                .map_err(|e| e.message)
        })
    }

    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            let action = request.route("POST", &["", "actions"])? == "actions";
            verify(
                &self.config.secret,
                request.header(TIMESTAMP_HEADER),
                request.header(SIGNATURE_HEADER),
                request.body,
                request.now_ms / 1000,
                self.config.timestamp_tolerance_secs,
            )
            .map_err(Refused::Unauthorized)?;
            Ok(Parsed::one(if action {
                Inbound::Action {
                    action: parse_action(request.body).map_err(Refused::BadRequest)?,
                    ack: None,
                    with_task: true,
                }
            } else {
                let (message, addressing) = parse(request.body, self.config.conversation_scope)
                    .map_err(Refused::BadRequest)?;
                match question(
                    self.config.group_reply,
                    &self.config.prefixes,
                    addressing,
                    &message.text,
                ) {
                    Some(text) => Inbound::Message(NewMessage { text, ..message }),
                    None => {
                        let chat = Conversation::parse(&message.conversation_id).chat;
                        Inbound::Chatter(NewMessage {
                            conversation_id: chat,
                            ..message
                        })
                    }
                }
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_values_decide_only_approve_or_reject() {
        let request = crate::domain::ApprovalRef::new(7, 0, 3, "{}");
        let v = |d: &str| request.card_value(d);
        let yes = CardAction::from_card_value(&v("approve"), "ada").unwrap();
        assert_eq!(
            (yes.request.clone(), yes.approve, yes.approver.as_str()),
            (request.clone(), true, "ada")
        );
        assert!(
            !CardAction::from_card_value(&v("reject"), "ada")
                .unwrap()
                .approve
        );
        assert!(CardAction::from_card_value(&v("maybe"), "ada").is_none());
        assert!(CardAction::from_card_value(&serde_json::json!({"task_id": 7}), "ada").is_none());
        // Task and step without the request (run and digest) decide nothing.
        let old = serde_json::json!({"task_id": 7, "step_no": 3, "decision": "approve"});
        assert!(CardAction::from_card_value(&old, "ada").is_none());
        // A request that disagrees with the value's own task or step decides nothing.
        let mut forged = v("approve");
        forged["step_no"] = 4.into();
        assert!(CardAction::from_card_value(&forged, "ada").is_none());
    }

    #[test]
    fn signature_known_answer() {
        // printf '%s' '1700000000.{"a":1}' | openssl dgst -sha256 -hmac secret
        assert_eq!(
            sign("secret", 1_700_000_000, br#"{"a":1}"#),
            "v1=49f24e537407743fa4a0242bb63b94b9a47ee99cbbe071ccd8a22550ae411686"
        );
    }

    #[test]
    fn verify_accepts_own_signature_and_rejects_others() {
        let body = br#"{"x":"y"}"#;
        let sig = sign("s3cret", 1000, body);
        assert!(verify("s3cret", Some("1000"), Some(&sig), body, 1100, 300).is_ok());
        assert!(verify("other", Some("1000"), Some(&sig), body, 1100, 300).is_err());
        assert!(verify("s3cret", Some("1000"), Some(&sig), b"{}", 1100, 300).is_err());
        let stale = verify("s3cret", Some("1000"), Some(&sig), body, 1301, 300).unwrap_err();
        assert!(stale.contains("300"), "{stale}");
        assert!(verify("s3cret", None, Some(&sig), body, 1000, 300).is_err());
        assert!(verify("s3cret", Some("1000"), Some("v1=zz"), body, 1000, 300).is_err());
    }

    #[test]
    fn parse_names_the_field() {
        let e = parse(
            br#"{"event_id":"e","message_id":"m","conversation_id":"c","sender_id":"s"}"#,
            Scope::Auto,
        )
        .unwrap_err();
        assert!(e.contains("`text`"), "{e}");
        let e = parse(
            br#"{"event_id":"e","message_id":7,"conversation_id":"c","sender_id":"s","text":"t"}"#,
            Scope::Auto,
        )
        .unwrap_err();
        assert!(e.contains("`message_id`"), "{e}");
        assert!(
            parse(b"not json", Scope::Auto)
                .unwrap_err()
                .contains("JSON")
        );
    }
}
