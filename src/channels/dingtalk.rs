//! DingTalk robot (HTTP mode): requests carry `timestamp` (ms) and `sign` = base64
//! HMAC-SHA256(app secret, timestamp + "\n" + app secret), valid for an hour; messages are
//! deduplicated on `msgId`. Replies go to the message's `sessionWebhook` while it lives, else
//! through the robot API (`/v1.0/robot/groupMessages/send` or `oToMessages/batchSend`) with a
//! cached access token. DingTalk has no idempotency key: a send whose outcome is unknown
//! becomes UNKNOWN instead of being repeated. Cards go out as markdown and actionCard
//! messages (`templates/cards/dingtalk/`). actionCard buttons can only open links, so the
//! approval card's buttons make the user's client send `approve <task>.<step>` (or reject)
//! into the chat; that message reaches the robot signed like any other and decides the
//! request as its sender.

use std::time::Duration;

use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::parts::{TextLimit, Unit};
use super::platform::{Addressing, Conversation, GroupReply, Scope, chatter, question};
use super::platform::{
    BoxFuture, Delivered, DeliveryError, Inbound, InboundRequest, Once, Parsed, Platform, Refused,
    SettingProblem, TokenAnswer, require_settings,
};
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "dingtalk";
/// The `inbound_once` channel under which used timestamp/sign pairs are remembered.
pub const SIGN_KEYS: &str = "dingtalk-sign";

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DingTalkChannelConfig {
    pub enabled: bool,
    pub app_key: String,
    /// Signs inbound requests and authenticates the robot API.
    pub app_secret: String,
    pub robot_code: String,
    pub api_base_url: String,
    pub agent: String,
    /// Least time between two sends into one chat, in ms (0 = no pacing).
    pub per_chat_interval_ms: u64,
    /// Accepted age of the `timestamp` header, in seconds (DingTalk: one hour).
    pub timestamp_tolerance_secs: u64,
    /// Origins (`https://oapi.dingtalk.com`) a message's `sessionWebhook` may point to.
    pub session_webhook_origins: Vec<String>,
    /// The card template placeholders are delivered as; empty = no placeholders.
    pub card_template_id: String,
    /// The template variable that shows the text.
    pub card_content_key: String,
    /// When to answer in group chats: "mention" (the default), "prefix" or "all".
    #[serde(default)]
    pub group_reply: super::platform::GroupReply,
    /// Prefixes that make a group message a question (e.g. "/ask").
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// How messages are grouped into conversations: "auto" (a 1:1 chat per chat; DingTalk
    /// groups have no threads, so a group per member), "chat", "user".
    #[serde(default)]
    pub conversation_scope: Scope,
    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (0, the default: none).
    #[serde(default)]
    pub group_context: usize,
}

impl DingTalkChannelConfig {
    /// What is wrong with these settings when the channel is enabled, if anything.
    pub fn check(&self) -> Result<(), SettingProblem> {
        require_settings(
            &[
                ("app_key", &self.app_key),
                ("app_secret", &self.app_secret),
                ("robot_code", &self.robot_code),
            ],
            ("api_base_url", &self.api_base_url),
        )
    }
}

/// base64 HMAC-SHA256(secret, "<timestamp>\n<secret>").
pub fn sign(secret: &str, timestamp: &str) -> String {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut mac =
        Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(timestamp.as_bytes());
    mac.update(b"\n");
    mac.update(secret.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

pub fn verify(
    secret: &str,
    timestamp: Option<&str>,
    signature: Option<&str>,
    now_ms: i64,
    tolerance_secs: u64,
) -> Result<(), Refused> {
    let unauthorized = |m: &str| Refused::Unauthorized(m.to_string());
    let timestamp = timestamp.ok_or_else(|| unauthorized("missing timestamp header"))?;
    let ts: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| unauthorized("timestamp is not milliseconds"))?;
    if now_ms.abs_diff(ts) > tolerance_secs * 1000 {
        return Err(unauthorized("timestamp is outside the allowed window"));
    }
    let signature = signature.ok_or_else(|| unauthorized("missing sign header"))?;
    let expected = sign(secret, timestamp.trim());
    if bool::from(expected.as_bytes().ct_eq(signature.trim().as_bytes())) {
        Ok(())
    } else {
        Err(unauthorized("sign does not match"))
    }
}

/// Whether `webhook` lies on one of `origins` (`scheme://host[:port]`, as configured).
fn session_webhook_allowed(webhook: &str, origins: &[String]) -> bool {
    url::Url::parse(webhook).is_ok_and(|u| {
        let origin = u.origin().ascii_serialization();
        origins
            .iter()
            .any(|o| o.trim_end_matches('/').eq_ignore_ascii_case(&origin))
    })
}

/// The key a signed header pair is remembered under, and the key of the body it came with.
pub fn signed_pair_keys(timestamp: &str, sign: &str, body: &[u8]) -> (String, String) {
    use sha2::Digest;
    let pair = format!("sign:{}:{}", timestamp.trim(), sign.trim());
    let body = format!("{pair}#{}", hex::encode(Sha256::digest(body)));
    (pair, body)
}

/// Parses a verified robot message; a `sessionWebhook` must lie on `origins`.
pub fn parse(
    body: &[u8],
    origins: &[String],
    group_reply: GroupReply,
    prefixes: &[String],
    scope: Scope,
) -> Result<Inbound, Refused> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::BadRequest(format!("body is not valid JSON: {e}")))?;
    if v["msgtype"].as_str() != Some("text") {
        return Ok(Inbound::Ignore("not a text message"));
    }
    let field = |name: &str| {
        v[name]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Refused::BadRequest(format!("missing field `{name}`")))
    };
    let sender = field("senderId")?;
    if v["chatbotUserId"].as_str() == Some(sender.as_str()) {
        return Ok(Inbound::Ignore("sent by the robot"));
    }
    let text = v["text"]["content"]
        .as_str()
        .unwrap_or("")
        .trim()
        .to_string();
    if text.is_empty() {
        return Ok(Inbound::Ignore("empty message"));
    }
    let staff = v["senderStaffId"].as_str().map(str::to_string);
    if let Some((approve, request)) = super::platform::parse_decision_command(&text) {
        return Ok(Inbound::Action {
            action: crate::domain::CardAction {
                request,
                approve,
                approver: staff.unwrap_or(sender),
            },
            ack: None,
            with_task: false,
        });
    }
    // A group conversation is `conversationType` "2"; `isInAtList`: the robot was @-ed.
    let addressing = Addressing {
        group: v["conversationType"].as_str() == Some("2"),
        mentioned: v["isInAtList"].as_bool() == Some(true),
        reply_to_bot: false,
    };
    let Some(text) = question(group_reply, prefixes, addressing, &text) else {
        let who = staff.as_deref().unwrap_or(&sender);
        let name = v["senderNick"].as_str();
        return Ok(chatter(
            (CHANNEL, &field("msgId")?),
            &field("conversationId")?,
            (who, name),
            &text,
        ));
    };
    let msg_id = field("msgId")?;
    if let Some(webhook) = v["sessionWebhook"].as_str()
        && !session_webhook_allowed(webhook, origins)
    {
        return Err(Refused::BadRequest(
            "sessionWebhook is not on an allowed origin (channels.dingtalk.session_webhook_origins)"
                .into(),
        ));
    }
    let context = json!({
        "session_webhook": v["sessionWebhook"],
        "session_webhook_expires": v["sessionWebhookExpiredTime"],
        "conversation_type": v["conversationType"],
        "conversation_id": v["conversationId"],
        "staff_id": v["senderStaffId"],
    });
    let sender = staff.unwrap_or(sender);
    let conversation = Conversation::scoped(
        scope,
        addressing.group,
        &field("conversationId")?,
        None,
        &sender,
    );
    Ok(Inbound::Message(NewMessage {
        channel: CHANNEL.into(),
        event_id: msg_id.clone(),
        message_id: msg_id,
        conversation_id: conversation.key(),
        sender_id: sender,
        sender_name: v["senderNick"].as_str().map(str::to_string),
        text,
        reply_context: Some(context.to_string()),
        trace_context: None,
    }))
}

/// A markdown message's title: its first line as plain text, at most 20 characters.
fn markdown_title(markdown: &str) -> String {
    let plain = super::markdown::plain(markdown);
    let first = plain.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    first.trim().chars().take(20).collect()
}

pub struct DingTalkChannel {
    config: DingTalkChannelConfig,
    http: reqwest::Client,
    api: String,
    app_key: String,
    app_secret: String,
    robot_code: String,
    token: super::platform::TokenCache,
}

impl DingTalkChannel {
    pub fn new(config: &DingTalkChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(DingTalkChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            api: config.api_base_url.trim_end_matches('/').to_string(),
            app_key: config.app_key.clone(),
            app_secret: config.app_secret.clone(),
            robot_code: config.robot_code.clone(),
            token: super::platform::TokenCache::default(),
        })
    }

    async fn access_token(&self) -> Result<String, DeliveryError> {
        let url = format!("{}/v1.0/oauth2/accessToken", self.api);
        let body = json!({ "appKey": self.app_key, "appSecret": self.app_secret });
        let answer = TokenAnswer {
            token: "accessToken",
            expires_in: "expireIn",
            ok: |_| true,
        };
        self.token
            .fetch_json("accessToken", || self.http.post(url).json(&body), answer)
            .await
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        if reply.placeholder {
            return self.deliver_card(reply).await;
        }
        let context = Self::reply_context(reply);
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("").to_string();
        // A card renders to {"webhook": <sessionWebhook body>, "api": {msgKey, msgParam}};
        // anything else goes out as text.
        let rendered = match content.get("card").filter(|c| c.is_object()) {
            Some(card) => super::cards::render(CHANNEL, card, &text, &reply.idempotency_key)
                .map_err(DeliveryError::retry)?,
            None => None,
        };
        let (webhook_body, msg_key, msg_param) = match &rendered {
            Some(r) => (
                r["webhook"].clone(),
                r["api"]["msgKey"]
                    .as_str()
                    .unwrap_or("sampleText")
                    .to_string(),
                r["api"]["msgParam"].to_string(),
            ),
            // The model's Markdown as a markdown message (its title is what notifications
            // and the chat list show).
            None if super::markdown::has_formatting(&text) => {
                let title = markdown_title(&text);
                (
                    json!({ "msgtype": "markdown", "markdown": { "title": title, "text": text } }),
                    "sampleMarkdown".to_string(),
                    json!({ "title": title, "text": text }).to_string(),
                )
            }
            None => (
                json!({ "msgtype": "text", "text": { "content": text } }),
                "sampleText".to_string(),
                json!({ "content": text }).to_string(),
            ),
        };
        let unknown = |e: reqwest::Error| DeliveryError {
            unknown: !e.is_connect(),
            permanent: false,
            message: format!("DingTalk send failed: {}", crate::redaction::http_error(e)),
            retry_after: None,
        };
        let alive = context["session_webhook"].as_str().filter(|_| {
            context["session_webhook_expires"].as_i64().unwrap_or(0)
                > crate::domain::now_ms() + 5_000
        });
        let response = if let Some(webhook) = alive {
            self.http
                .post(webhook)
                .json(&webhook_body)
                .send()
                .await
                .map_err(unknown)?
        } else {
            let token = self.access_token().await?;
            let (path, body) = if context["conversation_type"] == "1" {
                (
                    "/v1.0/robot/oToMessages/batchSend",
                    json!({ "robotCode": self.robot_code, "userIds": [context["staff_id"]],
                            "msgKey": msg_key, "msgParam": msg_param }),
                )
            } else {
                (
                    "/v1.0/robot/groupMessages/send",
                    json!({ "robotCode": self.robot_code,
                            "openConversationId": Conversation::parse(&reply.conversation_id).chat,
                            "msgKey": msg_key, "msgParam": msg_param }),
                )
            };
            self.http
                .post(format!("{}{path}", self.api))
                .header("x-acs-dingtalk-access-token", token)
                .json(&body)
                .send()
                .await
                .map_err(unknown)?
        };
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        let ok = status.is_success() && answer["errcode"].as_i64().unwrap_or(0) == 0;
        if ok {
            return Ok(Delivered {
                platform_message_id: answer["processQueryKey"].as_str().map(str::to_string),
            });
        }
        Err(DeliveryError {
            message: format!("DingTalk answered HTTP {}: {answer}", status.as_u16()),
            retry_after: (status.as_u16() == 429).then(|| Duration::from_secs(1)),
            unknown: false,
            permanent: false,
        })
    }
}

impl DingTalkChannel {
    /// The answered message's context (`parse` stored it): session webhook, chat type, sender.
    fn reply_context(reply: &ReplyRow) -> Value {
        reply
            .reply_context
            .as_deref()
            .and_then(|c| serde_json::from_str(c).ok())
            .unwrap_or(Value::Null)
    }

    /// The text a card shows for `reply`: its text (a card answer's text fallback).
    fn card_text(reply: &ReplyRow) -> String {
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        content["text"].as_str().unwrap_or("").to_string()
    }

    /// Creates a placeholder as a card from `card_template_id` under the reply key
    /// (`outTrackId`) and delivers it into the question's group or single chat.
    async fn deliver_card(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let context = Self::reply_context(reply);
        let robot = &self.robot_code;
        let mut body = json!({
            "cardTemplateId": self.config.card_template_id,
            "outTrackId": reply.idempotency_key,
            "callbackType": "STREAM",
            "userIdType": 1,
            "cardData": { "cardParamMap": { &self.config.card_content_key: Self::card_text(reply) } },
        });
        if context["conversation_type"] == "1" {
            let staff = context["staff_id"].as_str().unwrap_or("");
            body["openSpaceId"] = json!(format!("dtv1.card//IM_ROBOT.{staff}"));
            body["userId"] = json!(staff);
            body["imRobotOpenSpaceModel"] = json!({ "supportForward": true });
            body["imRobotOpenDeliverModel"] =
                json!({ "spaceType": "IM_ROBOT", "robotCode": robot });
        } else {
            let chat = Conversation::parse(&reply.conversation_id).chat;
            body["openSpaceId"] = json!(format!("dtv1.card//IM_GROUP.{chat}"));
            body["imGroupOpenSpaceModel"] = json!({ "supportForward": true });
            body["imGroupOpenDeliverModel"] = json!({ "robotCode": robot });
        }
        let answer = self
            .card_call(
                reqwest::Method::POST,
                "/v1.0/card/instances/createAndDeliver",
                &body,
            )
            .await?;
        let refused = answer["result"]["deliverResults"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["success"] != true);
        if let Some(refused) = refused {
            return Err(DeliveryError::retry(format!(
                "card delivery refused: {}",
                refused["errorMsg"].as_str().unwrap_or("")
            )));
        }
        Ok(Delivered {
            platform_message_id: Some(reply.idempotency_key.clone()),
        })
    }

    /// Updates the card `out_track_id` to show `reply` (`PUT /v1.0/card/instances`, by key).
    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn edit(
        &self,
        reply: &ReplyRow,
        out_track_id: &str,
    ) -> Result<Delivered, DeliveryError> {
        let body = json!({
            "outTrackId": out_track_id,
            "cardData": { "cardParamMap": { &self.config.card_content_key: Self::card_text(reply) } },
            "cardUpdateOptions": { "updateCardDataByKey": true },
        });
        self.card_call(reqwest::Method::PUT, "/v1.0/card/instances", &body)
            .await?;
        Ok(Delivered {
            platform_message_id: Some(out_track_id.to_string()),
        })
    }

    /// One card API call with the app's access token.
    async fn card_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &Value,
    ) -> Result<Value, DeliveryError> {
        let token = self.access_token().await?;
        let response = self
            .http
            .request(method, format!("{}{path}", self.api))
            .header("x-acs-dingtalk-access-token", token)
            .json(body)
            .send()
            .await
            .map_err(|e| DeliveryError {
                unknown: !e.is_connect(),
                permanent: false,
                message: format!(
                    "DingTalk {path} failed: {}",
                    crate::redaction::http_error(e)
                ),
                retry_after: None,
            })?;
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() && answer["success"] != false {
            return Ok(answer);
        }
        Err(DeliveryError {
            message: format!(
                "DingTalk {path} answered HTTP {}: {answer}",
                status.as_u16()
            ),
            retry_after: (status.as_u16() == 429).then(|| Duration::from_secs(1)),
            unknown: false,
            permanent: false,
        })
    }
}

impl Platform for DingTalkChannel {
    super::platform::platform_basics!(DingTalkChannel);

    fn group_context(&self) -> usize {
        self.config.group_context
    }

    fn can_edit(&self) -> bool {
        !self.config.card_template_id.is_empty()
    }

    /// A placeholder card's `outTrackId` is its key.
    fn message_id_by_key(&self, key: &str, placeholder: bool) -> Option<String> {
        (placeholder && self.can_edit()).then(|| key.to_string())
    }

    fn edit<'a>(
        &'a self,
        reply: &'a ReplyRow,
        out_track_id: &'a str,
    ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
        Box::pin(DingTalkChannel::edit(self, reply, out_track_id))
    }

    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            request.route("POST", &[""])?;
            let (timestamp, sign) = (request.header("timestamp"), request.header("sign"));
            verify(
                &self.config.app_secret,
                timestamp,
                sign,
                request.now_ms,
                self.config.timestamp_tolerance_secs,
            )?;
            // The sign covers only the timestamp and stays valid for the window, so a captured
            // pair could carry any body: each pair is good for the one body it first came with
            // (DingTalk's retries of that body still pass, and are deduplicated on msgId).
            let (pair, body) =
                signed_pair_keys(timestamp.unwrap_or(""), sign.unwrap_or(""), request.body);
            let mut parsed = match parse(
                request.body,
                &self.config.session_webhook_origins,
                self.config.group_reply,
                &self.config.prefixes,
                self.config.conversation_scope,
            ) {
                Ok(item) => Parsed::one(item),
                Err(refused) => Parsed {
                    items: Vec::new(),
                    refused: Some(refused),
                    ..Parsed::one(Inbound::Ignore("refused"))
                },
            };
            parsed.once = Some(Once::SignedPair {
                namespace: SIGN_KEYS,
                pair,
                body,
            });
            Ok(parsed)
        })
    }

    /// DingTalk robot replies through the session webhook: at most 2,000 characters a
    /// message (DingTalk's own connector, dingtalk-real-ai/dingtalk-openclaw-connector,
    /// "单条消息长度限制 2000 字符", sending longer text in several messages).
    fn text_limit(&self) -> TextLimit {
        TextLimit::new(2000, Unit::Chars)
    }

    fn card_limit_bytes(&self) -> Option<usize> {
        Some(6000)
    }

    fn chat_interval_ms(&self) -> u64 {
        self.config.per_chat_interval_ms
    }

    fn resend_is_blind(&self) -> bool {
        true
    }

    fn wants_reply_context(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_matches_openssl() {
        // printf '1700000000000\nSEC123' | openssl dgst -sha256 -hmac SEC123 -binary | base64
        assert_eq!(sign("SEC123", "1700000000000"), OPENSSL_SIGN);
        assert!(
            verify(
                "SEC123",
                Some("1700000000000"),
                Some(OPENSSL_SIGN),
                1_700_000_000_000,
                3600
            )
            .is_ok()
        );
        assert!(
            verify(
                "SEC123",
                Some("1700000000000"),
                Some(OPENSSL_SIGN),
                1_700_003_600_001,
                3600
            )
            .is_err()
        );
        assert!(
            verify(
                "other",
                Some("1700000000000"),
                Some(OPENSSL_SIGN),
                1_700_000_000_000,
                3600
            )
            .is_err()
        );
    }

    const OPENSSL_SIGN: &str = "lkcPI1uoxBY1gUnCnnPH1Kkru0Hqjo7rFpA3haIVhEQ=";
}
