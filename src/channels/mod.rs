//! Chat platforms. Each platform is one file that verifies and parses its inbound webhooks
//! and renders and sends its replies; nothing platform-specific lives outside its file.

use std::time::Duration;

use crate::config::Config;
use crate::domain::ReplyRow;

pub mod cards;
pub mod console;
pub mod dingtalk;
pub mod generic;
pub mod lark;
pub mod matrix;
pub mod slack;
pub mod telegram;
pub mod wecom;

/// What an inbound platform request asks of assistd, once verified and parsed.
#[derive(Debug, Clone)]
pub enum Inbound {
    /// A chat message for intake.
    Message(crate::domain::NewMessage),
    /// An approval decision from a card button; `ack` identifies the platform callback
    /// to acknowledge (Telegram's callback query id), when there is one.
    Action {
        action: crate::domain::CardAction,
        ack: Option<String>,
    },
    /// A handshake answered directly (URL verification): status, content type, body.
    Respond {
        status: u16,
        content_type: &'static str,
        body: String,
    },
    /// Verified but nothing to do (the bot's own message, an edit, an unknown event).
    Ignore(&'static str),
}

/// A request refused before anything is written: 401 (verification) or 400 (malformed).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Refused {
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    BadRequest(String),
}

/// An approval typed (or sent by a card button) as a chat message, for platforms whose
/// cards cannot call back: `approve 7.3` / `reject 7.3` (also `7:3`, and 同意 / 拒绝), where
/// 7 is the task and 3 the step. Returns (approve, task id, step no).
pub fn parse_decision_command(text: &str) -> Option<(bool, i64, i64)> {
    let mut words = text.split_whitespace();
    let approve = match words.next()?.to_lowercase().as_str() {
        "approve" | "同意" => true,
        "reject" | "拒绝" => false,
        _ => return None,
    };
    let (task, step) = words.next()?.split_once(['.', ':'])?;
    if words.next().is_some() {
        return None;
    }
    Some((approve, task.parse().ok()?, step.parse().ok()?))
}

/// Per-chat send pacing for platforms that limit sends per chat (Lark 5/s, Telegram and
/// Slack about 1/s). Each (channel, chat) has the time its next send may start; a reply
/// that comes earlier is deferred to that time instead of being sent into a 429. The pace
/// is kept per instance; across instances the platform's 429 and Retry-After still apply.
#[derive(Default)]
pub struct ChatPacer(std::sync::Mutex<std::collections::HashMap<(String, String), i64>>);

impl ChatPacer {
    /// Takes a send slot for the chat at `now` (ms) with `interval_ms` between sends: `Ok`
    /// to send now, or `Err(at)` with the time to come back.
    pub fn admit(&self, channel: &str, chat: &str, interval_ms: u64, now: i64) -> Result<(), i64> {
        if interval_ms == 0 {
            return Ok(());
        }
        let mut next = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Forget chats that have been quiet for a while, so the map stays small.
        if next.len() > 10_000 {
            next.retain(|_, at| *at > now);
        }
        let key = (channel.to_string(), chat.to_string());
        match next.get(&key) {
            Some(&at) if at > now => Err(at),
            _ => {
                next.insert(key, now + interval_ms as i64);
                Ok(())
            }
        }
    }
}

/// A platform access token fetched on demand and kept until a minute before it expires.
#[derive(Default)]
pub struct TokenCache(std::sync::Mutex<Option<(String, std::time::Instant)>>);

impl TokenCache {
    /// The cached token, or a new one from `fetch` (which returns it with its lifetime in
    /// seconds).
    pub async fn get<F, Fut>(&self, fetch: F) -> Result<String, DeliveryError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(String, u64), DeliveryError>>,
    {
        let cached = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some((token, until)) = cached
            && std::time::Instant::now() < until
        {
            return Ok(token);
        }
        let (token, ttl) = fetch().await?;
        let until = std::time::Instant::now() + Duration::from_secs(ttl.saturating_sub(60));
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((token.clone(), until));
        Ok(token)
    }

    /// Drops the token (the platform said it is no longer valid).
    pub fn forget(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// A reply the platform accepted.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub platform_message_id: Option<String>,
}

/// A reply the platform did not (or may not) have accepted.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct DeliveryError {
    pub message: String,
    /// The platform asked for this pause before the next try.
    pub retry_after: Option<Duration>,
    /// The send may or may not have reached the chat, and the platform has no idempotency
    /// key to make a re-send safe: the reply becomes UNKNOWN instead of being repeated.
    pub unknown: bool,
}

impl DeliveryError {
    pub fn retry(message: impl Into<String>) -> Self {
        DeliveryError {
            message: message.into(),
            retry_after: None,
            unknown: false,
        }
    }
}

/// The configured platforms, by the channel name stored on messages and replies.
#[derive(Clone)]
pub struct Channels {
    pub generic: Option<generic::GenericChannel>,
    pub slack: Option<slack::SlackChannel>,
    pub telegram: Option<telegram::TelegramChannel>,
    pub matrix: Option<matrix::MatrixChannel>,
    pub lark: Option<std::sync::Arc<lark::LarkChannel>>,
    pub dingtalk: Option<std::sync::Arc<dingtalk::DingTalkChannel>>,
    pub wecom: Option<std::sync::Arc<wecom::WeComChannel>>,
    /// Where approval-timeout callbacks go (empty = not sent).
    pub approval_callback_url: String,
    /// Send pacing per chat (see [`Channels::chat_interval_ms`]).
    pub pacer: std::sync::Arc<ChatPacer>,
}

impl Channels {
    pub fn from_config(config: &Config, store: &crate::store::Store) -> anyhow::Result<Channels> {
        let generic = &config.channels.generic;
        Ok(Channels {
            generic: if generic.enabled && !generic.secret.is_empty() {
                Some(generic::GenericChannel::new(generic, &config.outbox)?)
            } else {
                None
            },
            slack: if config.channels.slack.enabled {
                Some(slack::SlackChannel::new(
                    &config.channels.slack,
                    &config.outbox,
                )?)
            } else {
                None
            },
            telegram: if config.channels.telegram.enabled {
                Some(telegram::TelegramChannel::new(
                    &config.channels.telegram,
                    &config.outbox,
                )?)
            } else {
                None
            },
            matrix: if config.channels.matrix.enabled {
                Some(matrix::MatrixChannel::new(
                    &config.channels.matrix,
                    &config.outbox,
                )?)
            } else {
                None
            },
            lark: if config.channels.lark.enabled {
                Some(std::sync::Arc::new(lark::LarkChannel::new(
                    &config.channels.lark,
                    &config.outbox,
                )?))
            } else {
                None
            },
            dingtalk: if config.channels.dingtalk.enabled {
                Some(std::sync::Arc::new(dingtalk::DingTalkChannel::new(
                    &config.channels.dingtalk,
                    &config.outbox,
                    store.clone(),
                )?))
            } else {
                None
            },
            wecom: if config.channels.wecom.enabled {
                Some(std::sync::Arc::new(wecom::WeComChannel::new(
                    &config.channels.wecom,
                    &config.outbox,
                )?))
            } else {
                None
            },
            approval_callback_url: config
                .scheduler
                .jobs
                .confirm_timeout
                .approval_callback_url
                .clone(),
            pacer: Default::default(),
        })
    }

    /// The least time between two sends into one chat of `channel` (0 = no pacing).
    pub fn chat_interval_ms(config: &Config, channel: &str) -> u64 {
        let c = &config.channels;
        match channel {
            slack::CHANNEL => c.slack.per_chat_interval_ms,
            telegram::CHANNEL => c.telegram.per_chat_interval_ms,
            lark::CHANNEL => c.lark.per_chat_interval_ms,
            dingtalk::CHANNEL => c.dingtalk.per_chat_interval_ms,
            wecom::CHANNEL => c.wecom.per_chat_interval_ms,
            matrix::CHANNEL => c.matrix.per_chat_interval_ms,
            _ => 0,
        }
    }

    /// Whether a re-send of a reply on `channel` could show it twice: the platform has no
    /// idempotency key and no way to look the send up (Telegram, DingTalk, WeCom).
    pub fn resend_is_blind(channel: &str) -> bool {
        matches!(
            channel,
            telegram::CHANNEL | dingtalk::CHANNEL | wecom::CHANNEL
        )
    }

    /// Sends one outbox reply through the platform it belongs to.
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        match reply.channel.as_str() {
            generic::CHANNEL => match &self.generic {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry(
                    "the generic channel is not configured (channels.generic.secret is empty)",
                )),
            },
            crate::domain::CALLBACK_CHANNEL => match &self.generic {
                Some(channel) if !self.approval_callback_url.is_empty() => {
                    channel
                        .send_callback(&self.approval_callback_url, reply)
                        .await
                }
                _ => Err(DeliveryError::retry(
                    "approval callbacks need channels.generic.secret and \
                     scheduler.jobs.confirm_timeout.approval_callback_url",
                )),
            },
            slack::CHANNEL => match &self.slack {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry("the slack channel is not enabled")),
            },
            // The console page reads its replies from the outbox: delivery is the record itself.
            console::CHANNEL => Ok(Delivered {
                platform_message_id: None,
            }),
            dingtalk::CHANNEL => match &self.dingtalk {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry("the dingtalk channel is not enabled")),
            },
            wecom::CHANNEL => match &self.wecom {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry("the wecom channel is not enabled")),
            },
            lark::CHANNEL => match &self.lark {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry("the lark channel is not enabled")),
            },
            matrix::CHANNEL => match &self.matrix {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry("the matrix channel is not enabled")),
            },
            telegram::CHANNEL => match &self.telegram {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError::retry("the telegram channel is not enabled")),
            },
            other => Err(DeliveryError::retry(format!(
                "no channel named `{other}` is configured"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_commands() {
        assert_eq!(parse_decision_command("approve 7.3"), Some((true, 7, 3)));
        assert_eq!(
            parse_decision_command(" Reject  12:1 "),
            Some((false, 12, 1))
        );
        assert_eq!(parse_decision_command("同意 5.2"), Some((true, 5, 2)));
        assert_eq!(parse_decision_command("approve 7"), None);
        assert_eq!(parse_decision_command("approve 7.3 please"), None);
        assert_eq!(parse_decision_command("please approve 7.3"), None);
        assert_eq!(parse_decision_command("approve x.3"), None);
    }

    #[test]
    fn pacing_is_per_chat() {
        let pacer = ChatPacer::default();
        assert_eq!(pacer.admit("lark", "a", 200, 1_000), Ok(()));
        assert_eq!(pacer.admit("lark", "a", 200, 1_100), Err(1_200));
        assert_eq!(pacer.admit("lark", "b", 200, 1_100), Ok(()));
        assert_eq!(pacer.admit("lark", "a", 200, 1_200), Ok(()));
        assert_eq!(pacer.admit("lark", "a", 0, 1_201), Ok(()));
    }
}
