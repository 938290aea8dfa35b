//! Intake: a parsed chat message becomes a committed message + PENDING task (one
//! transaction, see `Store::ingest_message`), and only after the commit are workers woken.
//! No model call ever happens here, so the webhook is answered at once.

use crate::app::Services;
use crate::domain::now_ms;
use crate::store::StoreError;
use crate::store::intake::{Ingested, NewMessage};

#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
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
    let ingested = svc
        .store
        .ingest_message(message, agent, now_ms())
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
