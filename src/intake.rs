//! Intake: a parsed chat message becomes a committed message + PENDING task (one
//! transaction shared with the messages that arrived at the same time, see `IntakeQueue` and
//! `Store::ingest_batch`), and only after the commit are workers woken.
//! No model call ever happens here, so the webhook is answered at once.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::app::Services;
use crate::config::IntakeConfig;
use crate::domain::now_ms;
use crate::store::intake::{Ingested, NewMessage};
use crate::store::{Store, StoreError, StoreResult};

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

/// Group commit for intake: webhook handlers queue their message here and wait; `writers`
/// tasks each take whatever is queued (up to `batch_max`) and commit it in one transaction
/// (`Store::ingest_batch`). Under load, the messages that arrive while one batch commits make
/// up the next; a lone message goes at once. The answer to each webhook is sent only after
/// its batch committed.
pub struct IntakeQueue {
    jobs: mpsc::Sender<Job>,
}

struct Job {
    message: NewMessage,
    agent: String,
    done: oneshot::Sender<StoreResult<Ingested>>,
}

impl IntakeQueue {
    /// Starts the writers on the current runtime; they stop when the queue is dropped.
    pub fn start(store: Store, config: &IntakeConfig) -> IntakeQueue {
        let batch_max = config.batch_max.max(1);
        let writers = config.writers.max(1);
        let (jobs, queue) = mpsc::channel(batch_max * writers * 4);
        let queue = Arc::new(tokio::sync::Mutex::new(queue));
        for _ in 0..writers {
            tokio::spawn(write_batches(store.clone(), queue.clone(), batch_max));
        }
        IntakeQueue { jobs }
    }

    /// Commits one message (with its task) and returns its task.
    pub async fn ingest(&self, message: &NewMessage, agent: &str) -> StoreResult<Ingested> {
        let (done, answer) = oneshot::channel();
        let job = Job {
            message: message.clone(),
            agent: agent.to_string(),
            done,
        };
        let stopped = || StoreError::Database(sqlx::Error::PoolClosed);
        self.jobs.send(job).await.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

async fn write_batches(
    store: Store,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    batch_max: usize,
) {
    let mut jobs: Vec<Job> = Vec::with_capacity(batch_max);
    loop {
        {
            let mut queue = queue.lock().await;
            match queue.recv().await {
                Some(job) => jobs.push(job),
                None => return,
            }
            while jobs.len() < batch_max {
                match queue.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
        }
        let batch: Vec<(&NewMessage, &str)> = jobs
            .iter()
            .map(|j| (&j.message, j.agent.as_str()))
            .collect();
        let results = match store.ingest_batch(&batch, now_ms()).await {
            Ok(results) => results,
            // One message may have failed the whole batch (a constraint, an oversized
            // value): commit each alone so only that one fails.
            Err(e) if batch.len() > 1 => {
                tracing::warn!(error = %e, size = batch.len(), "intake batch failed; committing one by one");
                let mut results = Vec::with_capacity(batch.len());
                for one in &batch {
                    results.push(store.ingest_message(one.0, one.1, now_ms()).await);
                }
                results
            }
            Err(e) => vec![Err(e)],
        };
        crate::metrics::count_intake_batch(batch.len());
        for (job, result) in jobs.drain(..).zip(results) {
            // The webhook may have given up waiting; its message is committed regardless.
            let _ = job.done.send(result);
        }
    }
}
