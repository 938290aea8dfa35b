//! Intake: a parsed chat message becomes a committed message + PENDING task (one
//! transaction shared with the messages that arrived at the same time, see `IntakeQueue` and
//! `Store::ingest_batch`), and only after the commit are workers woken.
//! No model call ever happens here, so the webhook is answered at once.

use std::sync::Arc;

use crate::app::Services;
use crate::config::IntakeConfig;
use crate::domain::now_ms;
use crate::store::group::GroupCommit;
use crate::store::intake::{Ingested, NewMessage};
use crate::store::{Store, StoreError, StoreResult};

#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    /// The message cannot be taken as it is (the sender's mistake or a forgery).
    #[error("{0}")]
    Invalid(String),
    #[error("agent `{0}` has no published version")]
    UnknownAgent(String),
    #[error(transparent)]
    Store(StoreError),
}

#[tracing::instrument(skip_all, fields(channel = %message.channel, conversation = %message.conversation_id))]
pub async fn accept_message(
    svc: &Services,
    message: &NewMessage,
    agent: &str,
) -> Result<Ingested, IntakeError> {
    message.check_sizes().map_err(IntakeError::Invalid)?;
    // Platforms retry until they get a 2xx, so a NUL is dropped here rather than refused
    // (the generic webhook refuses it with 400 at parse time instead).
    let cleaned;
    let message = if message.has_nul() {
        tracing::warn!("dropped U+0000 from an inbound message");
        cleaned = message.without_nul();
        &cleaned
    } else {
        message
    };
    let ingested = svc
        .intake
        .ingest(message, agent)
        .await
        .map_err(|e| match e {
            StoreError::NotFound => IntakeError::UnknownAgent(agent.to_string()),
            other => IntakeError::Store(other),
        })?;
    if ingested.duplicate {
        tracing::info!(task_id = ingested.task_id, "duplicate delivery ignored");
    } else {
        tracing::info!(task_id = ingested.task_id, "task created");
        svc.task_wake.notify_one();
    }
    Ok(ingested)
}

/// Group commit for intake (see `store::group`): webhook handlers queue their message and
/// wait; messages that arrive together are committed by `Store::ingest_batch` in one
/// transaction of a few statements. A webhook is answered only after its batch committed.
pub struct IntakeQueue(GroupCommit<(NewMessage, String), Ingested>);

impl IntakeQueue {
    /// Starts the writers on the current runtime; they stop when the queue is dropped.
    pub fn start(store: Store, config: &IntakeConfig) -> IntakeQueue {
        IntakeQueue(GroupCommit::start(
            "intake",
            config.writers,
            config.batch_max,
            Arc::new(move |batch: &[(NewMessage, String)]| {
                let store = store.clone();
                Box::pin(async move {
                    let refs: Vec<(&NewMessage, &str)> =
                        batch.iter().map(|(m, a)| (m, a.as_str())).collect();
                    store.ingest_batch(&refs, now_ms()).await
                })
            }),
        ))
    }

    /// Commits one message (with its task) and returns its task.
    pub async fn ingest(&self, message: &NewMessage, agent: &str) -> StoreResult<Ingested> {
        self.0.submit((message.clone(), agent.to_string())).await
    }
}
