//! What one run of a task works with: its context (task row, message, agent snapshot), the
//! provider its model calls go to, and why a run stopped early.

use crate::definition::AgentDefinition;
use crate::domain::{MessageRow, TaskRow};
use crate::store::StoreError;
use crate::store::intake::HistoryEntry;

use super::worker::Worker;

/// Why a task run stopped before finishing the task.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("lost ownership of the task (lease expired or taken over)")]
    LostLease,
    #[error("shutting down")]
    Shutdown,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Corrupt(String),
    /// The task now waits for a human (approval, or an interrupted unsafe step).
    #[error("waiting for a human decision")]
    Parked,
    /// An admin paused the task; it stopped at a step boundary.
    #[error("paused by an admin")]
    Paused,
}

/// What a run needs to know about its task, loaded once after the claim.
pub struct TaskContext {
    pub task: TaskRow,
    pub message: MessageRow,
    /// The agent version as snapshotted into the task at its first claim.
    pub agent: AgentDefinition,
    /// Running since this run took the task over from an instance that lost it.
    pub recovery: Option<Recovery>,
    /// The placeholder and streamed edits of this run, where the platform can edit.
    pub feedback: Option<std::sync::Arc<super::feedback::Feedback>>,
    /// The conversation's recent turns as read with the claim (`None`: read when needed).
    pub history: Option<Vec<HistoryEntry>>,
}

/// What the claim read for a task with the others it claimed: its message, its agent
/// snapshot parsed, its conversation's history. Each is read (or parsed) on its own when
/// missing.
#[derive(Default)]
pub struct Prefetched {
    pub message: Option<MessageRow>,
    pub agent: Option<AgentDefinition>,
    pub history: Option<Vec<HistoryEntry>>,
}

pub(crate) async fn load_context(svc: &Worker, task_id: i64) -> Result<TaskContext, RunError> {
    let task = svc
        .store
        .task(task_id)
        .await?
        .ok_or_else(|| RunError::Corrupt("claimed task vanished".into()))?;
    context_of(svc, task, Prefetched::default()).await
}

/// The run context of `task` (as its claim returned it): its message and agent snapshot
/// (each from `prefetched` when the claim read it already).
pub(crate) async fn context_of(
    svc: &Worker,
    task: TaskRow,
    prefetched: Prefetched,
) -> Result<TaskContext, RunError> {
    let message = match prefetched.message {
        Some(message) => message,
        None => svc
            .store
            .message(task.message_id)
            .await?
            .ok_or_else(|| RunError::Corrupt(format!("message {} missing", task.message_id)))?,
    };
    let agent = match prefetched.agent {
        Some(agent) => agent,
        None => agent_of(&task)?,
    };
    Ok(TaskContext {
        recovery: task.taken_over.then(Recovery::start),
        feedback: None,
        history: prefetched.history,
        task,
        message,
        agent,
    })
}

/// The agent version snapshotted into `task` at its first claim.
pub(crate) fn agent_of(task: &TaskRow) -> Result<AgentDefinition, RunError> {
    let snapshot = task
        .workflow_snapshot
        .as_deref()
        .ok_or_else(|| RunError::Corrupt("task has no agent snapshot".into()))?;
    serde_json::from_str(snapshot)
        .map_err(|e| RunError::Corrupt(format!("agent snapshot unreadable: {e}")))
}

/// The provider an agent's model calls go to, and the model name to send.
pub(crate) fn model_of<'a>(
    svc: &'a Worker,
    agent: &AgentDefinition,
) -> Result<(&'a crate::llm::OpenAiClient, String), RunError> {
    let provider = svc.llm.provider(&agent.provider).ok_or_else(|| {
        RunError::Corrupt(format!(
            "the agent's provider `{}` is no longer configured",
            agent.provider
        ))
    })?;
    let model = if agent.model.is_empty() {
        provider.model.clone()
    } else {
        agent.model.clone()
    };
    Ok((provider, model))
}

/// The clock of a takeover: from the claim to the first step it begins
/// (`assistd_recovery_seconds`).
#[derive(Debug)]
pub struct Recovery {
    claimed: std::time::Instant,
    seen: std::sync::atomic::AtomicBool,
}

impl Recovery {
    pub fn start() -> Recovery {
        Recovery {
            claimed: std::time::Instant::now(),
            seen: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub(super) fn step_begun(&self) {
        if !self.seen.swap(true, std::sync::atomic::Ordering::Relaxed) {
            crate::metrics::RECOVERY_SECONDS.observe(self.claimed.elapsed());
        }
    }
}
