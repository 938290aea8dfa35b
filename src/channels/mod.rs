//! Chat platforms. Each platform is one file that verifies and parses its inbound webhooks
//! and renders and sends its replies (`platform::Platform`); nothing platform-specific lives
//! outside its file. `Channels` is the registry: channel name → platform.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::domain::{CALLBACK_CHANNEL, ORPHAN_ALERT_CHANNEL, ReplyRow};
use platform::{ChatPacer, Delivered, DeliveryError, Platform};

pub mod cards;
pub mod console;
pub mod conversation;
pub mod dingtalk;
pub mod generic;
pub mod lark;
pub mod markdown;
pub mod matrix;
pub mod parts;
pub mod platform;
pub mod slack;
pub mod telegram;
pub mod wecom;

/// `[channels.*]`: each platform's section, defined with its platform.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelsConfig {
    pub generic: generic::GenericChannelConfig,
    pub slack: slack::SlackChannelConfig,
    pub telegram: telegram::TelegramChannelConfig,
    pub matrix: matrix::MatrixChannelConfig,
    pub lark: lark::LarkChannelConfig,
    pub dingtalk: dingtalk::DingTalkChannelConfig,
    pub wecom: wecom::WeComChannelConfig,
    pub console: console::ConsoleChannelConfig,
}

/// The enabled platforms, by the channel name stored on messages and replies.
pub struct Channels {
    platforms: BTreeMap<&'static str, Arc<dyn Platform>>,
    /// Approval-timeout callbacks and orphan alerts go out through the generic channel's
    /// signed transport (when it has a secret)...
    generic: Option<Arc<generic::GenericChannel>>,
    /// ...to the URL configured for their outbox channel.
    callbacks: BTreeMap<&'static str, String>,
    /// Send pacing per chat (see [`Platform::chat_interval_ms`]), taken through `admit`.
    pacer: ChatPacer,
}

impl Channels {
    /// The platforms enabled in `c`, each network call bounded by `timeout`; `callbacks`:
    /// the URLs of the outbox channels posted through the generic channel's signed
    /// transport (approval-timeout callbacks, orphan alerts), where set.
    pub fn new(
        c: &ChannelsConfig,
        timeout: Duration,
        callbacks: [(&'static str, &str); 2],
    ) -> anyhow::Result<Channels> {
        let mut platforms: BTreeMap<&'static str, Arc<dyn Platform>> = BTreeMap::new();
        let mut add = |p: Arc<dyn Platform>| {
            platforms.insert(p.name(), p);
        };
        let generic = (c.generic.enabled && !c.generic.secret.is_empty())
            .then(|| generic::GenericChannel::new(&c.generic, timeout).map(Arc::new))
            .transpose()?;
        if let Some(g) = &generic {
            add(g.clone());
        }
        if c.slack.enabled {
            add(Arc::new(slack::SlackChannel::new(&c.slack, timeout)?));
        }
        if c.telegram.enabled {
            add(Arc::new(telegram::TelegramChannel::new(
                &c.telegram,
                timeout,
            )?));
        }
        if c.matrix.enabled {
            add(Arc::new(matrix::MatrixChannel::new(&c.matrix, timeout)?));
        }
        if c.lark.enabled {
            add(Arc::new(lark::LarkChannel::new(&c.lark, timeout)?));
        }
        if c.dingtalk.enabled {
            add(Arc::new(dingtalk::DingTalkChannel::new(
                &c.dingtalk,
                timeout,
            )?));
        }
        if c.wecom.enabled {
            add(Arc::new(wecom::WeComChannel::new(&c.wecom, timeout)?));
        }
        if c.console.enabled {
            add(Arc::new(console::ConsoleChannel::new(&c.console)));
        }
        let callbacks = callbacks
            .into_iter()
            .filter(|(_, url)| !url.is_empty())
            .map(|(channel, url)| (channel, url.to_string()))
            .collect();
        Ok(Channels {
            platforms,
            generic,
            callbacks,
            pacer: ChatPacer::default(),
        })
    }

    /// The enabled platform named `name`.
    /// The names of the configured platforms.
    pub fn names(&self) -> Vec<&'static str> {
        self.platforms.keys().copied().collect()
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Platform>> {
        self.platforms.get(name)
    }

    /// A send slot now (`Ok`) in the chat of the conversation `conversation_id` of
    /// `channel`, or the time its pace allows one: sends are paced per chat, whatever
    /// conversations (threads, members) the chat holds.
    pub fn admit(&self, channel: &str, conversation_id: &str, now: i64) -> Result<(), i64> {
        let Some(platform) = self.get(channel) else {
            return Ok(());
        };
        let interval = platform.chat_interval_ms();
        if interval == 0 {
            return Ok(());
        }
        let chat = platform.conversation(conversation_id).chat;
        self.pacer.admit(channel, &chat, interval, now)
    }

    /// Whether a re-send of a reply on `channel` could show it twice (see
    /// [`Platform::resend_is_blind`]).
    pub fn resend_is_blind(&self, channel: &str) -> bool {
        self.get(channel).is_some_and(|p| p.resend_is_blind())
    }

    /// Shows a progress line in a conversation of `channel`, best effort.
    pub async fn progress(&self, channel: &str, update: &platform::Progress) -> Result<(), String> {
        match self.get(channel) {
            Some(p) => p.progress(update).await,
            None => Ok(()),
        }
    }

    /// How often the typing indicator of `channel` must be renewed; `None`: it has none.
    pub fn typing_every(&self, channel: &str) -> Option<std::time::Duration> {
        self.get(channel).and_then(|p| p.typing_every())
    }

    /// Shows or clears the typing indicator in a conversation of `channel`, best effort.
    pub async fn typing(
        &self,
        channel: &str,
        conversation_id: &str,
        on: bool,
    ) -> Result<(), String> {
        match self.get(channel) {
            Some(platform) => platform.typing(conversation_id, on).await,
            None => Ok(()),
        }
    }

    /// How many unaddressed group messages `channel` keeps per chat as context (0: none).
    pub fn group_context(&self, channel: &str) -> usize {
        self.get(channel).map_or(0, |p| p.group_context())
    }

    /// The conversation the stored `conversation_id` of `channel` names.
    pub fn conversation(&self, channel: &str, conversation_id: &str) -> platform::Conversation {
        match self.get(channel) {
            Some(p) => p.conversation(conversation_id),
            None => platform::Conversation::parse(conversation_id),
        }
    }

    /// Whether the streamed text of an answer on `channel` is kept for its page to poll.
    pub fn keeps_live_text(&self, channel: &str) -> bool {
        self.get(channel).is_some_and(|p| p.keeps_live_text())
    }

    /// Keeps (`Some`) or forgets (`None`) the streamed text so far of a task on `channel`.
    pub fn keep_live_text(&self, channel: &str, task_id: i64, text: Option<&str>) {
        if let Some(platform) = self.get(channel) {
            platform.keep_live_text(task_id, text);
        }
    }

    /// The streamed text so far of a task on `channel` running here.
    pub fn live_text(&self, channel: &str, task_id: i64) -> Option<String> {
        self.get(channel).and_then(|p| p.live_text(task_id))
    }

    /// Whether a streamed answer on `channel` is shown as progress lines.
    pub fn streams_progress(&self, channel: &str) -> bool {
        self.get(channel).is_some_and(|p| p.streams_progress())
    }

    /// Whether replies on `channel` need their message's `reply_context`.
    pub fn wants_reply_context(&self, channel: &str) -> bool {
        self.get(channel).is_some_and(|p| p.wants_reply_context())
    }

    /// Whether replies on `channel` can be edited after they were sent (placeholders and
    /// streamed answers need it).
    pub fn can_edit(&self, channel: &str) -> bool {
        self.get(channel).is_some_and(|p| p.can_edit())
    }

    /// Whether an edit's `error` on `channel` says the message is gone for good.
    pub fn edit_target_gone(&self, channel: &str, error: &DeliveryError) -> bool {
        self.get(channel).is_some_and(|p| p.edit_target_gone(error))
    }

    /// What `reply` goes out as: `None` when it fits its platform as it is (one message);
    /// otherwise its text as numbered parts (`parts::split`), each an outbox content
    /// `{"text": …}`. A card larger than the platform takes goes as its text.
    pub fn parts(&self, reply: &ReplyRow) -> Option<Vec<String>> {
        let platform = self.get(&reply.channel)?;
        let limit = platform.text_limit();
        if limit == parts::TextLimit::NONE && platform.card_limit_bytes().is_none() {
            return None;
        }
        let content: serde_json::Value = serde_json::from_str(&reply.content).ok()?;
        let text = content["text"].as_str().unwrap_or("");
        match content.get("card").filter(|card| card.is_object()) {
            Some(card)
                if platform
                    .card_limit_bytes()
                    .is_none_or(|max| card.to_string().len() <= max) =>
            {
                return None;
            }
            Some(_) => {}
            None if limit.fits(text) => return None,
            None => {}
        }
        let parts = parts::split(text, &limit);
        Some(
            parts
                .into_iter()
                .map(|part| serde_json::json!({ "text": part }).to_string())
                .collect(),
        )
    }

    /// Whether a streamed answer on `channel` goes on in its next parts while it is written
    /// (a platform that can edit its messages), rather than stopping at its first part
    /// until the answer is complete.
    pub fn streams_parts(&self, channel: &str) -> bool {
        self.get(channel).is_some_and(|p| p.can_edit())
    }

    /// The messages a streamed text of `channel` is shown in (see `parts::streamed_pieces`).
    pub fn streamed_pieces(&self, channel: &str, text: &str) -> Vec<String> {
        match self.get(channel) {
            Some(platform) => parts::streamed_pieces(text, &platform.text_limit()),
            None => vec![text.to_string()],
        }
    }

    /// See [`Platform::message_id_by_key`].
    pub fn message_id_by_key(&self, channel: &str, key: &str, placeholder: bool) -> Option<String> {
        self.get(channel)?.message_id_by_key(key, placeholder)
    }

    /// What a streamed answer may show in one message of `channel`: the text so far while
    /// it fits, else its first part (the rest follows as the answer's next parts).
    pub fn streamed_view(&self, channel: &str, text: &str) -> String {
        match self.get(channel) {
            Some(platform) => parts::first_piece(text, &platform.text_limit()),
            None => text.to_string(),
        }
    }

    /// Shows `reply` by editing the message it names (`platform_message_id`).
    pub async fn edit(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        let (Some(platform), Some(message_id)) = (
            self.get(&reply.channel),
            reply.platform_message_id.as_deref(),
        ) else {
            return Err(DeliveryError::retry(format!(
                "reply {} cannot be edited on {}",
                reply.idempotency_key, reply.channel
            )));
        };
        platform.edit(reply, message_id).await
    }

    /// Sends one outbox reply through the platform it belongs to.
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        match reply.channel.as_str() {
            channel @ (CALLBACK_CHANNEL | ORPHAN_ALERT_CHANNEL) => {
                match (&self.generic, self.callbacks.get(channel)) {
                    (Some(generic), Some(url)) => generic.send_callback(url, reply).await,
                    _ => Err(DeliveryError::retry(format!(
                        "{channel} posts need channels.generic.secret and {}",
                        if channel == CALLBACK_CHANNEL {
                            "scheduler.jobs.confirm_timeout.approval_callback_url"
                        } else {
                            "scheduler.jobs.orphan_reclaim.alert_url"
                        }
                    ))),
                }
            }
            name => match self.get(name) {
                Some(platform) => platform.send(reply).await,
                None => Err(DeliveryError::retry(format!(
                    "the {name} channel is not enabled"
                ))),
            },
        }
    }
}
