//! Chat platforms. Each platform is one file that verifies and parses its inbound webhooks
//! and renders and sends its replies; nothing platform-specific lives outside its file.

use std::time::Duration;

use crate::config::Config;
use crate::store::outbox::ReplyRow;

pub mod generic;

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
}

/// The configured platforms, by the channel name stored on messages and replies.
#[derive(Clone)]
pub struct Channels {
    pub generic: Option<generic::GenericChannel>,
    /// Where approval-timeout callbacks go (empty = not sent).
    pub approval_callback_url: String,
}

impl Channels {
    pub fn from_config(config: &Config) -> anyhow::Result<Channels> {
        let generic = &config.channels.generic;
        Ok(Channels {
            generic: if generic.enabled && !generic.secret.is_empty() {
                Some(generic::GenericChannel::new(generic, &config.outbox)?)
            } else {
                None
            },
            approval_callback_url: config
                .scheduler
                .jobs
                .confirm_timeout
                .approval_callback_url
                .clone(),
        })
    }

    /// Sends one outbox reply through the platform it belongs to.
    pub async fn send(&self, reply: &ReplyRow) -> Result<Delivered, DeliveryError> {
        match reply.channel.as_str() {
            generic::CHANNEL => match &self.generic {
                Some(channel) => channel.send(reply).await,
                None => Err(DeliveryError {
                    message: "the generic channel is not configured \
                              (channels.generic.secret is empty)"
                        .into(),
                    retry_after: None,
                }),
            },
            crate::scheduler::CALLBACK_CHANNEL => match &self.generic {
                Some(channel) if !self.approval_callback_url.is_empty() => {
                    channel
                        .send_callback(&self.approval_callback_url, reply)
                        .await
                }
                _ => Err(DeliveryError {
                    message: "approval callbacks need channels.generic.secret and \
                              scheduler.jobs.confirm_timeout.approval_callback_url"
                        .into(),
                    retry_after: None,
                }),
            },
            other => Err(DeliveryError {
                message: format!("no channel named `{other}` is configured"),
                retry_after: None,
            }),
        }
    }
}
