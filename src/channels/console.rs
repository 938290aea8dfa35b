//! The chat console: a browser page that is a channel like the others. Its messages go
//! through intake, tasks and the outbox (posted by the page to `/console/messages`, not to a
//! webhook); its "send" is the outbox row itself, which the page reads back, and the text
//! of an answer being streamed is kept for the page to poll (`Platform::keeps_live_text`).

use std::collections::HashMap;
use std::sync::Mutex;

use super::platform::{
    BoxFuture, Delivered, DeliveryError, InboundRequest, Parsed, Platform, Refused, no_route,
};
use crate::domain::{NewMessage, ReplyRow};

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleChannelConfig {
    pub enabled: bool,
    /// Only answer requests from loopback addresses.
    pub loopback_only: bool,
    pub agent: String,
}

/// The console as a platform, with the streamed text so far of its tasks running here.
pub struct ConsoleChannel {
    config: ConsoleChannelConfig,
    live: Mutex<HashMap<i64, String>>,
}

impl ConsoleChannel {
    pub fn new(config: &ConsoleChannelConfig) -> Self {
        ConsoleChannel {
            config: config.clone(),
            live: Mutex::default(),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<i64, String>> {
        // A poisoned lock only means a panic mid-insert; the map is still valid.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The page reads its replies from the outbox: delivery is the record itself.
    async fn send(&self, _reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        Ok(Delivered {
            platform_message_id: None,
        })
    }
}

impl Platform for ConsoleChannel {
    super::platform::platform_basics!(ConsoleChannel);

    /// The console has no webhook: its page posts to `/console/messages`.
    fn inbound<'a>(
        &'a self,
        _request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>> {
        Box::pin(async { Err(no_route()) })
    }

    fn keeps_live_text(&self) -> bool {
        true
    }

    fn keep_live_text(&self, task_id: i64, text: Option<&str>) {
        match text {
            Some(text) => self.live().insert(task_id, text.to_string()),
            None => self.live().remove(&task_id),
        };
    }

    fn live_text(&self, task_id: i64) -> Option<String> {
        self.live().get(&task_id).cloned()
    }
}

pub const CHANNEL: &str = "console";
/// Longest console message, in bytes.
pub const MAX_TEXT: usize = 8000;

/// A console message; the error names the bad field.
pub fn message(conversation_id: &str, text: &str) -> Result<NewMessage, String> {
    let conversation_id = conversation_id.trim();
    if conversation_id.is_empty() || conversation_id.len() > 64 {
        return Err("field `conversation_id` must be 1 to 64 characters".into());
    }
    let text = text.trim();
    if text.is_empty() {
        return Err("field `text` must not be empty".into());
    }
    if text.len() > MAX_TEXT {
        return Err(format!("field `text` is longer than {MAX_TEXT} bytes"));
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    Ok(NewMessage {
        channel: CHANNEL.into(),
        event_id: id.clone(),
        message_id: id,
        conversation_id: conversation_id.to_string(),
        sender_id: "console".into(),
        sender_name: Some("console".into()),
        text: text.to_string(),
        reply_context: None,
        trace_context: None,
    })
}
