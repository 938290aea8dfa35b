//! WeCom (WeChat Work) app callbacks: `msg_signature` = SHA-1 of the sorted token,
//! timestamp, nonce and encrypted message; AES-256-CBC with the key from the EncodingAESKey
//! (IV = its first 16 bytes) and PKCS#7 padding to 32-byte blocks; the plaintext is 16 random
//! bytes, a 4-byte length, the message and the receive id (the corp id, checked). GET
//! verifies the URL by echoing the decrypted `echostr`; POST carries XML messages, answered
//! with an empty 200. Replies use the send-message API with a cached access token; WeCom
//! has no idempotency key, so an unknown outcome becomes UNKNOWN.

use std::collections::HashMap;
use std::time::Duration;

use aes::cipher::{BlockDecryptMut, BlockEncryptMut, KeyIvInit, block_padding::NoPadding};
use base64::Engine;
use serde_json::{Value, json};
use sha1::{Digest, Sha1};
use subtle::ConstantTimeEq;

use super::parts::{TextLimit, Unit};
use super::platform::{
    BoxFuture, Delivered, DeliveryError, Fixed, Inbound, InboundRequest, Parsed, Platform, Refused,
    SettingProblem, TokenAnswer, no_route, require_settings,
};
use crate::domain::NewMessage;
use crate::domain::ReplyRow;

pub const CHANNEL: &str = "wecom";
/// WeCom pads to 32-byte blocks, not to the AES block size.
const PAD_BLOCK: usize = 32;

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeComChannelConfig {
    pub enabled: bool,
    pub corp_id: String,
    pub agent_id: String,
    /// The app's secret, for the send-message API's access token.
    pub secret: String,
    /// Callback token (signatures).
    pub token: String,
    /// Callback EncodingAESKey (43 characters).
    pub encoding_aes_key: String,
    pub api_base_url: String,
    pub agent: String,
    /// Least time between two sends into one chat, in ms (0 = no pacing).
    pub per_chat_interval_ms: u64,
    /// Accepted age of a callback's `timestamp`, in seconds.
    pub timestamp_tolerance_secs: u64,
    /// Send an answer written in Markdown as a `markdown` message (shown formatted in the
    /// WeCom client only; in WeChat a markdown message is not shown, so off by default).
    #[serde(default)]
    pub markdown: bool,
}

impl WeComChannelConfig {
    /// What is wrong with these settings when the channel is enabled, if anything.
    pub fn check(&self) -> Result<(), SettingProblem> {
        require_settings(
            &[
                ("corp_id", &self.corp_id),
                ("agent_id", &self.agent_id),
                ("secret", &self.secret),
                ("token", &self.token),
            ],
            ("api_base_url", &self.api_base_url),
        )?;
        if self.encoding_aes_key.len() != 43 {
            return Err((
                "encoding_aes_key",
                "must be the 43-character EncodingAESKey".into(),
            ));
        }
        Ok(())
    }
}

/// The EncodingAESKey's last character carries spare bits that WeCom does not zero, so the
/// decoder must allow them.
const KEY_ENGINE: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
);

fn aes_key(encoding_aes_key: &str) -> Result<Vec<u8>, String> {
    let key = KEY_ENGINE
        .decode(format!("{encoding_aes_key}="))
        .map_err(|_| "EncodingAESKey is not base64".to_string())?;
    if key.len() != 32 {
        return Err("EncodingAESKey does not give a 32-byte key".into());
    }
    Ok(key)
}

/// SHA-1 of the sorted parts, hex.
pub fn signature(token: &str, timestamp: &str, nonce: &str, encrypted: &str) -> String {
    let mut parts = [token, timestamp, nonce, encrypted];
    parts.sort_unstable();
    hex::encode(Sha1::digest(parts.concat().as_bytes()))
}

/// Decrypts a message and checks its receive id; returns the message.
pub fn decrypt(encoding_aes_key: &str, corp_id: &str, encrypted: &str) -> Result<String, String> {
    let key = aes_key(encoding_aes_key)?;
    let mut data = base64::engine::general_purpose::STANDARD
        .decode(encrypted.trim())
        .map_err(|_| "message is not base64".to_string())?;
    if data.is_empty() || data.len() % 16 != 0 {
        return Err("message has a bad length".into());
    }
    let plain = cbc::Decryptor::<aes::Aes256>::new(key.as_slice().into(), key[..16].into())
        .decrypt_padded_mut::<NoPadding>(&mut data)
        .map_err(|_| "message does not decrypt".to_string())?;
    let pad = *plain.last().ok_or("empty message")? as usize;
    if pad == 0 || pad > PAD_BLOCK || pad > plain.len() {
        return Err("bad padding".into());
    }
    let plain = &plain[..plain.len() - pad];
    if plain.len() < 20 {
        return Err("message too short".into());
    }
    let len = u32::from_be_bytes([plain[16], plain[17], plain[18], plain[19]]) as usize;
    let body = plain.get(20..20 + len).ok_or("bad message length")?;
    let receive_id = &plain[20 + len..];
    if receive_id != corp_id.as_bytes() {
        return Err("receive id is not this corp".into());
    }
    String::from_utf8(body.to_vec()).map_err(|_| "message is not UTF-8".into())
}

/// Encrypts `message` as WeCom does (for passive replies and tests); `random` is the
/// 16-byte prefix.
pub fn encrypt(
    encoding_aes_key: &str,
    corp_id: &str,
    message: &str,
    random: [u8; 16],
) -> Result<String, String> {
    let key = aes_key(encoding_aes_key)?;
    let mut plain = random.to_vec();
    plain.extend((message.len() as u32).to_be_bytes());
    plain.extend(message.as_bytes());
    plain.extend(corp_id.as_bytes());
    let pad = PAD_BLOCK - plain.len() % PAD_BLOCK;
    plain.extend(std::iter::repeat_n(pad as u8, pad));
    let len = plain.len();
    let cipher = cbc::Encryptor::<aes::Aes256>::new(key.as_slice().into(), key[..16].into())
        .encrypt_padded_mut::<NoPadding>(&mut plain, len)
        .map_err(|_| "cannot encrypt".to_string())?;
    Ok(base64::engine::general_purpose::STANDARD.encode(cipher))
}

/// The elements directly under an XML document's root, by name, with their text (CDATA, or
/// text with the predefined entities and character references resolved), read by a real XML
/// parser: text inside a message (`<Content>`) cannot pose as one of its fields, and nested
/// elements count for nothing. The first of equal names wins; a DOCTYPE or an unknown entity
/// is refused (no entity expansion, no external references).
pub fn xml_fields(xml: &str) -> Result<HashMap<String, String>, String> {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut fields = HashMap::new();
    let mut depth = 0usize;
    let mut current: Option<(String, String)> = None;
    loop {
        let event = reader.read_event().map_err(|e| format!("not XML: {e}"))?;
        match event {
            Event::DocType(_) => return Err("XML with a DOCTYPE is refused".into()),
            Event::Start(e) => {
                depth += 1;
                if depth == 2 {
                    let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                    current = Some((name, String::new()));
                }
            }
            Event::End(_) => {
                if depth == 2
                    && let Some((name, value)) = current.take()
                {
                    fields.entry(name).or_insert(value);
                }
                depth = depth.saturating_sub(1);
            }
            Event::Empty(e) if depth == 1 => {
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                fields.entry(name).or_insert_with(String::new);
            }
            Event::Text(t) if depth == 2 => {
                let text = t.decode().map_err(|e| format!("not XML: {e}"))?;
                if let Some((_, value)) = current.as_mut() {
                    value.push_str(&text);
                }
            }
            Event::CData(c) if depth == 2 => {
                let text = c.decode().map_err(|e| format!("not XML: {e}"))?;
                if let Some((_, value)) = current.as_mut() {
                    value.push_str(&text);
                }
            }
            Event::GeneralRef(r) if depth == 2 => {
                let resolved = match r.resolve_char_ref().map_err(|e| format!("not XML: {e}"))? {
                    Some(c) => c,
                    None => match &*r {
                        b"amp" => '&',
                        b"lt" => '<',
                        b"gt" => '>',
                        b"quot" => '"',
                        b"apos" => '\'',
                        other => {
                            return Err(format!(
                                "unknown entity &{};",
                                String::from_utf8_lossy(other)
                            ));
                        }
                    },
                };
                if let Some((_, value)) = current.as_mut() {
                    value.push(resolved);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    Ok(fields)
}

/// Field `name` of parsed XML fields, trimmed.
fn xml_field(fields: &HashMap<String, String>, name: &str) -> Option<String> {
    fields.get(name).map(|v| v.trim().to_string())
}

/// The query of a callback request.
pub struct CallbackQuery<'a> {
    pub msg_signature: Option<&'a str>,
    pub timestamp: Option<&'a str>,
    pub nonce: Option<&'a str>,
    pub echostr: Option<&'a str>,
}

fn check(
    config: &WeComChannelConfig,
    q: &CallbackQuery,
    encrypted: &str,
    now_secs: i64,
) -> Result<(), Refused> {
    let (Some(sig), Some(ts), Some(nonce)) = (q.msg_signature, q.timestamp, q.nonce) else {
        return Err(Refused::Unauthorized(
            "missing msg_signature, timestamp or nonce".into(),
        ));
    };
    let fresh = ts
        .trim()
        .parse::<i64>()
        .is_ok_and(|t| now_secs.abs_diff(t) <= config.timestamp_tolerance_secs);
    if !fresh {
        return Err(Refused::Unauthorized(
            "timestamp is outside the allowed window".into(),
        ));
    }
    let expected = signature(&config.token, ts, nonce, encrypted);
    if bool::from(expected.as_bytes().ct_eq(sig.as_bytes())) {
        Ok(())
    } else {
        Err(Refused::Unauthorized("msg_signature does not match".into()))
    }
}

/// GET URL verification: the decrypted `echostr`.
pub fn verify_url(
    config: &WeComChannelConfig,
    q: &CallbackQuery,
    now_secs: i64,
) -> Result<String, Refused> {
    let echostr = q
        .echostr
        .ok_or_else(|| Refused::BadRequest("missing echostr".into()))?;
    check(config, q, echostr, now_secs)?;
    decrypt(&config.encoding_aes_key, &config.corp_id, echostr).map_err(Refused::Unauthorized)
}

/// POST: verifies, decrypts and parses a message.
pub fn parse(
    config: &WeComChannelConfig,
    q: &CallbackQuery,
    body: &[u8],
    now_secs: i64,
) -> Result<Inbound, Refused> {
    let xml =
        std::str::from_utf8(body).map_err(|_| Refused::BadRequest("body is not UTF-8".into()))?;
    let envelope = xml_fields(xml).map_err(Refused::BadRequest)?;
    let encrypted = xml_field(&envelope, "Encrypt")
        .ok_or_else(|| Refused::BadRequest("missing <Encrypt>".into()))?;
    check(config, q, &encrypted, now_secs)?;
    let message = decrypt(&config.encoding_aes_key, &config.corp_id, &encrypted)
        .map_err(Refused::Unauthorized)?;
    let message = xml_fields(&message).map_err(Refused::BadRequest)?;
    let msg_type = xml_field(&message, "MsgType");
    if msg_type.as_deref() == Some("event") {
        return parse_card_event(&message);
    }
    if msg_type.as_deref() != Some("text") {
        return Ok(Inbound::Ignore("not a text message"));
    }
    let field = |name: &str| {
        xml_field(&message, name).ok_or_else(|| Refused::BadRequest(format!("missing <{name}>")))
    };
    let from = field("FromUserName")?;
    let msg_id = field("MsgId")?;
    let text = field("Content")?;
    if text.is_empty() {
        return Ok(Inbound::Ignore("empty message"));
    }
    Ok(Inbound::Message(NewMessage {
        channel: CHANNEL.into(),
        event_id: msg_id.clone(),
        message_id: msg_id,
        conversation_id: from.clone(),
        sender_id: from,
        sender_name: None,
        text,
        reply_context: None,
        trace_context: None,
    }))
}

/// A `template_card_event` (a button of an approval card): `EventKey` is
/// `approve|reject:<request>` (`ApprovalRef::token`), the clicking user is `FromUserName`.
fn parse_card_event(message: &HashMap<String, String>) -> Result<Inbound, Refused> {
    if xml_field(message, "Event").as_deref() != Some("template_card_event") {
        return Ok(Inbound::Ignore("not a card event"));
    }
    let key = xml_field(message, "EventKey").unwrap_or_default();
    let approver = xml_field(message, "FromUserName")
        .ok_or_else(|| Refused::BadRequest("missing <FromUserName>".into()))?;
    let Some((decision @ ("approve" | "reject"), request)) = key.split_once(':') else {
        return Ok(Inbound::Ignore("card event is not an approval"));
    };
    let request = crate::domain::ApprovalRef::parse_token(request)
        .ok_or_else(|| Refused::BadRequest("bad EventKey".into()))?;
    Ok(Inbound::Action {
        action: crate::domain::CardAction {
            request,
            approve: decision == "approve",
            approver,
        },
        ack: None,
        with_task: false,
    })
}

pub struct WeComChannel {
    config: WeComChannelConfig,
    http: reqwest::Client,
    api: String,
    corp_id: String,
    secret: String,
    agent_id: String,
    token: super::platform::TokenCache,
}

impl WeComChannel {
    pub fn new(config: &WeComChannelConfig, timeout: Duration) -> anyhow::Result<Self> {
        Ok(WeComChannel {
            config: config.clone(),
            http: reqwest::Client::builder().timeout(timeout).build()?,
            api: config.api_base_url.trim_end_matches('/').to_string(),
            corp_id: config.corp_id.clone(),
            secret: config.secret.clone(),
            agent_id: config.agent_id.clone(),
            token: super::platform::TokenCache::default(),
        })
    }

    async fn access_token(&self) -> Result<String, DeliveryError> {
        let url = format!("{}/cgi-bin/gettoken", self.api);
        let query = [("corpid", &self.corp_id), ("corpsecret", &self.secret)];
        let answer = TokenAnswer {
            token: "access_token",
            expires_in: "expires_in",
            ok: |a| a["errcode"].as_i64().unwrap_or(0) == 0,
        };
        self.token
            .fetch_json("gettoken", || self.http.get(url).query(&query), answer)
            .await
    }

    #[tracing::instrument(skip_all, fields(task_id = reply.task_id, key = %reply.idempotency_key))]
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let token = self.access_token().await?;
        let content: Value = serde_json::from_str(&reply.content).unwrap_or(Value::Null);
        let text = content["text"].as_str().unwrap_or("").to_string();
        let card = content
            .get("card")
            .filter(|c| c.is_object())
            .map(|card| super::cards::render(CHANNEL, card, &text, &reply.idempotency_key))
            .transpose()
            .map_err(DeliveryError::retry)?
            .flatten();
        let response = self
            .http
            .post(format!("{}/cgi-bin/message/send", self.api))
            .query(&[("access_token", token.as_str())])
            .json(&{
                let mut body = json!({
                    "touser": reply.conversation_id,
                    "agentid": self.agent_id.parse::<i64>().unwrap_or(0),
                    "enable_duplicate_check": 1,
                    "duplicate_check_interval": 1800,
                });
                match card {
                    Some(card) => {
                        body["msgtype"] = json!("template_card");
                        body["template_card"] = card;
                    }
                    None if self.config.markdown && super::markdown::has_formatting(&text) => {
                        body["msgtype"] = json!("markdown");
                        body["markdown"] = json!({ "content": text });
                    }
                    None => {
                        body["msgtype"] = json!("text");
                        body["text"] = json!({ "content": text });
                    }
                }
                body
            })
            .send()
            .await
            .map_err(|e| DeliveryError {
                unknown: !e.is_connect(),
                permanent: false,
                message: format!("message/send failed: {}", crate::redaction::http_error(e)),
                retry_after: None,
            })?;
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        match answer["errcode"].as_i64() {
            Some(0) => Ok(Delivered {
                platform_message_id: answer["msgid"].as_str().map(str::to_string),
            }),
            Some(code) => {
                if matches!(code, 40014 | 42001) {
                    self.token.forget();
                }
                Err(DeliveryError {
                    message: format!("message/send: {answer}"),
                    retry_after: (code == 45009).then(|| Duration::from_secs(1)),
                    unknown: false,
                    permanent: false,
                })
            }
            None => Err(DeliveryError::retry(format!(
                "message/send unreadable answer: {answer}"
            ))),
        }
    }
}

impl Platform for WeComChannel {
    super::platform::platform_basics!(WeComChannel);

    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async move {
            let (msg_signature, timestamp, nonce, echostr) = (
                request.query_param("msg_signature"),
                request.query_param("timestamp"),
                request.query_param("nonce"),
                request.query_param("echostr"),
            );
            let query = CallbackQuery {
                msg_signature: msg_signature.as_deref(),
                timestamp: timestamp.as_deref(),
                nonce: nonce.as_deref(),
                echostr: echostr.as_deref(),
            };
            let now = request.now_ms / 1000;
            match (request.method, request.rest) {
                // The URL check when the callback is configured: answer the decrypted echo.
                ("GET", "") => Ok(Parsed::one(Inbound::Respond(Fixed {
                    status: 200,
                    content_type: PLAIN_TEXT,
                    body: verify_url(&self.config, &query, now)?,
                }))),
                ("POST", "") => {
                    let mut parsed = Parsed::one(parse(&self.config, &query, request.body, now)?);
                    // WeCom reads a non-empty answer as a passive reply: answer nothing.
                    parsed.answer = Some(Fixed {
                        status: 200,
                        content_type: PLAIN_TEXT,
                        body: String::new(),
                    });
                    Ok(parsed)
                }
                _ => Err(no_route()),
            }
        })
    }

    /// WeCom, 发送应用消息: text "消息内容，最长不超过2048个字节，超过将截断" (the
    /// markdown and template card fields likewise), in UTF-8 bytes.
    fn text_limit(&self) -> TextLimit {
        TextLimit::new(2048, Unit::Bytes)
    }

    fn card_limit_bytes(&self) -> Option<usize> {
        Some(2048)
    }

    fn chat_interval_ms(&self) -> u64 {
        self.config.per_chat_interval_ms
    }

    fn resend_is_blind(&self) -> bool {
        true
    }
}

const PLAIN_TEXT: &str = "text/plain; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    // The URL-verification example of WeCom's WXBizMsgCrypt samples.
    const TOKEN: &str = "QDG6eK";
    const CORP: &str = "wx5823bf96d3bd56c7";
    const AES_KEY: &str = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C";
    const ECHOSTR: &str =
        "P9nAzCzyDtyTWESHep1vC5X9xho/qYX3Zpb4yKa9SKld1DsH3Iyt3tP3zNdtp+4RPcs8TgAE7OaBO+FZXvnaqQ==";

    #[test]
    fn known_answer_from_the_wecom_samples() {
        assert_eq!(
            signature(TOKEN, "1409659589", "263014780", ECHOSTR),
            "5c45ff5e21c57e6ad56bac8758b79b1d9ac89fd3"
        );
        assert_eq!(
            decrypt(AES_KEY, CORP, ECHOSTR).unwrap(),
            "1616140317555161061"
        );
        assert!(decrypt(AES_KEY, "another-corp", ECHOSTR).is_err());
    }

    #[test]
    fn encrypt_round_trips() {
        let enc = encrypt(AES_KEY, CORP, "<xml><Content>hi</Content></xml>", [7; 16]).unwrap();
        assert_eq!(
            decrypt(AES_KEY, CORP, &enc).unwrap(),
            "<xml><Content>hi</Content></xml>"
        );
        let fields = xml_fields("<xml><A><![CDATA[x y]]></A><B>2 &amp; &#51;</B></xml>").unwrap();
        assert_eq!(fields["A"], "x y");
        assert_eq!(fields["B"], "2 & 3");
    }

    /// Issue 17, item 9: a `<MsgId>` written inside the message text is text, not the
    /// message's id; nested elements and DOCTYPEs do not count.
    #[test]
    fn fields_are_read_by_structure_not_by_string_search() {
        let xml = "<xml><Content><![CDATA[hi <MsgId>1</MsgId>]]></Content><Other><MsgId>2</MsgId></Other><MsgId>42</MsgId></xml>";
        let fields = xml_fields(xml).unwrap();
        assert_eq!(fields["MsgId"], "42");
        assert_eq!(fields["Content"], "hi <MsgId>1</MsgId>");
        assert!(xml_fields("<!DOCTYPE x [<!ENTITY e \"boom\">]><xml><A>&e;</A></xml>").is_err());
        assert!(xml_fields("<xml><A>&e;</A></xml>").is_err());
    }
}
