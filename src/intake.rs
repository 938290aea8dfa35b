//! Intake: a parsed chat message becomes a committed message + PENDING task (one
//! transaction shared with the messages that arrived at the same time, see `IntakeQueue` and
//! `Store::ingest_batch`), and only after the commit are workers woken.
//! No model call ever happens here, so the webhook is answered at once.

use std::sync::Arc;

use crate::channels::platform::Once;
use crate::config::IntakeConfig;
use crate::domain::now_ms;
use crate::domain::{Ingested, NewMessage};
use crate::store::group::GroupCommit;
use crate::store::{Store, StoreError, StoreResult};
use crate::wake::Wake;

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

/// What intake is given by `app.rs`: the store, the group commit in front of it, and the
/// workers' wake-up.
pub struct Intake {
    pub store: Store,
    pub queue: IntakeQueue,
    pub wake: Arc<Wake>,
}

/// A message as intake takes it: ids within their size (a U+0000 a platform sent is made
/// storable by the store, `store::text`, as all outside text is; the generic webhook refuses
/// it at parse time instead, since its sender can fix it).
/// While traces are exported, the message carries the intake span's `traceparent`.
fn prepared(message: &NewMessage) -> Result<std::borrow::Cow<'_, NewMessage>, IntakeError> {
    message.check_sizes().map_err(IntakeError::Invalid)?;
    let mut message = std::borrow::Cow::Borrowed(message);
    if let Some(traceparent) = crate::telemetry::traceparent() {
        message.to_mut().trace_context = Some(traceparent);
    }
    Ok(message)
}

/// Commits `messages` (a platform's delivery of several, e.g. a Matrix transaction) in one
/// intake transaction, in their order, and wakes the workers once. Each gets its own result:
/// a message intake cannot take is refused alone.
#[tracing::instrument(name = "intake", skip_all, fields(messages = messages.len()))]
pub async fn accept_messages(
    svc: &Intake,
    messages: &[NewMessage],
    agent: &str,
) -> Result<Vec<Result<Ingested, IntakeError>>, IntakeError> {
    let prepared: Vec<Result<std::borrow::Cow<'_, NewMessage>, IntakeError>> =
        messages.iter().map(prepared).collect();
    let batch: Vec<(&NewMessage, &str)> = prepared
        .iter()
        .filter_map(|p| p.as_ref().ok())
        .map(|m| (m.as_ref(), agent))
        .collect();
    let mut committed = svc
        .store
        .ingest_batch(&batch, now_ms(), svc.wake.others_needed(batch.len()))
        .await
        .map_err(|e| match e {
            StoreError::NotFound => IntakeError::UnknownAgent(agent.to_string()),
            other => IntakeError::Store(other),
        })?
        .into_iter();
    let mut results = Vec::with_capacity(messages.len());
    let mut created = 0;
    for p in prepared {
        results.push(match p {
            Err(e) => Err(e),
            Ok(_) => match committed.next() {
                Some(Ok(ingested)) => {
                    created += usize::from(!ingested.duplicate);
                    Ok(ingested)
                }
                Some(Err(StoreError::NotFound)) => {
                    Err(IntakeError::UnknownAgent(agent.to_string()))
                }
                Some(Err(e)) => Err(IntakeError::Store(e)),
                None => Err(IntakeError::Store(StoreError::NotFound)),
            },
        });
    }
    if created > 0 {
        tracing::info!(created, "tasks created");
        svc.wake.tasks.notify_one();
    }
    Ok(results)
}

#[tracing::instrument(
    name = "intake",
    skip_all,
    fields(channel = %message.channel, conversation = %message.conversation_id, task_id = tracing::field::Empty)
)]
pub async fn accept_message(
    svc: &Intake,
    message: &NewMessage,
    agent: &str,
) -> Result<Ingested, IntakeError> {
    let message = prepared(message)?;
    let message = message.as_ref();
    let ingested = svc
        .queue
        .ingest(message, agent)
        .await
        .map_err(|e| match e {
            StoreError::NotFound => IntakeError::UnknownAgent(agent.to_string()),
            other => IntakeError::Store(other),
        })?;
    tracing::Span::current().record("task_id", ingested.task_id);
    if ingested.duplicate {
        tracing::info!(task_id = ingested.task_id, "duplicate delivery ignored");
    } else {
        tracing::info!(task_id = ingested.task_id, "task created");
        svc.wake.tasks.notify_one();
    }
    Ok(ingested)
}

/// Group commit for intake (see `store::group`): webhook handlers queue their message and
/// wait; messages that arrive together are committed by `Store::ingest_batch` in one
/// transaction of a few statements. A webhook is answered only after its batch committed.
pub struct IntakeQueue {
    queue: GroupCommit<(NewMessage, String), Ingested>,
    /// Longest a webhook waits for its commit (`database.acquire_timeout_secs`): past it the
    /// database is taken to be unavailable and the platform is told 503.
    deadline: std::time::Duration,
}

impl IntakeQueue {
    /// Starts the writers on the current runtime; they stop when the queue is dropped.
    pub fn start(
        store: Store,
        config: &IntakeConfig,
        deadline: std::time::Duration,
        wake: Arc<Wake>,
    ) -> IntakeQueue {
        let queue = GroupCommit::start(
            "intake",
            config.writers,
            config.batch_max,
            Arc::new(move |batch: &[(NewMessage, String)]| {
                let (store, wake) = (store.clone(), wake.clone());
                Box::pin(async move {
                    let refs: Vec<(&NewMessage, &str)> =
                        batch.iter().map(|(m, a)| (m, a.as_str())).collect();
                    let wake_others = wake.others_needed(refs.len());
                    store.ingest_batch(&refs, now_ms(), wake_others).await
                })
            }),
        );
        IntakeQueue { queue, deadline }
    }

    /// Commits one message (with its task) and returns its task. Waits at most the
    /// deadline: during an outage a webhook is answered 503 then, not once the batches
    /// queued before it have each waited out the database. A message whose commit lands
    /// after its caller stopped waiting is committed all the same; the platform's retry of
    /// it is then a duplicate (nothing is acknowledged that is not committed, nothing lost).
    pub async fn ingest(&self, message: &NewMessage, agent: &str) -> StoreResult<Ingested> {
        let submit = self.queue.submit((message.clone(), agent.to_string()));
        match tokio::time::timeout(self.deadline, submit).await {
            Ok(result) => result,
            Err(_) => Err(crate::store::StoreError::Unavailable(format!(
                "no commit within {} ms (database.acquire_timeout_secs)",
                self.deadline.as_millis()
            ))),
        }
    }
}

/// Whether a request kept to once (`channels::platform::Once`) may be carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnceCheck {
    /// First time (or a retry of the same body): carry it out.
    Go,
    /// Already done (a repeated Matrix transaction): answer without doing anything.
    Done,
    /// A replayed signature with another body (DingTalk): refuse.
    Replayed,
}

/// Checks (and, for a signed pair, records) the key a request is kept to once under.
pub async fn check_once(store: &Store, once: &Once, now: i64) -> StoreResult<OnceCheck> {
    Ok(match once {
        Once::SignedPair {
            namespace,
            pair,
            body,
        } => {
            if store.record_inbound_once(namespace, pair, now).await? {
                store.record_inbound_once(namespace, body, now).await?;
                OnceCheck::Go
            } else if store.inbound_seen(namespace, body).await? {
                OnceCheck::Go
            } else {
                OnceCheck::Replayed
            }
        }
        Once::Transaction { namespace, id } => {
            if store.inbound_seen(namespace, id).await? {
                OnceCheck::Done
            } else {
                OnceCheck::Go
            }
        }
    })
}

/// Records a transaction as done, once all its events were handled.
pub async fn done_once(store: &Store, once: &Once, now: i64) -> StoreResult<()> {
    if let Once::Transaction { namespace, id } = once {
        store.record_inbound_once(namespace, id, now).await?;
    }
    Ok(())
}
