//! What the engine is given: `Worker` holds exactly the parts a task run uses, built once by
//! `app.rs`; `RunningTasks` is the stop switch of every task this instance runs, shared with
//! the admin actions that cancel one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::llm::ModelClients;
use crate::store::Store;
use crate::store::journal::Journal;
use crate::tools::ToolRegistry;
use crate::wake::Wake;

pub struct Worker {
    pub config: Arc<Config>,
    pub store: Store,
    /// The fenced writes of task runs (group commit).
    pub journal: Arc<Journal>,
    /// The model providers (`[llm]` and `[llm.providers.*]`).
    pub llm: Arc<ModelClients>,
    pub tools: Arc<ToolRegistry>,
    pub instance_id: String,
    pub wake: Arc<Wake>,
    pub running: Arc<RunningTasks>,
    /// Rung when a worker frees a slot.
    pub slot_free: Notify,
    /// The platforms, for the typing indicator shown while a task runs.
    pub channels: Arc<crate::channels::Channels>,
    /// Knowledge search for agents that answer from collections.
    pub knowledge: Arc<crate::knowledge::Knowledge>,
}

/// Tasks this instance is running, with the token that stops each (cancel, lost lease), and
/// the typing indicator shown for each.
#[derive(Default)]
pub struct RunningTasks(
    Mutex<HashMap<i64, CancellationToken>>,
    Mutex<HashMap<i64, EndTyping>>,
);

/// Ends a typing indicator: stops renewing it and sends its clearing (`feedback::Typing`).
pub type EndTyping =
    Box<dyn FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send>;

impl RunningTasks {
    /// Records (`Some`) or forgets (`None`) the stop token of a task running here.
    pub fn track(&self, task_id: i64, token: Option<CancellationToken>) {
        // A poisoned lock only means another task panicked mid-insert; the map is still valid.
        let mut running = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match token {
            Some(t) => {
                running.insert(task_id, t);
            }
            None => {
                running.remove(&task_id);
            }
        }
    }

    /// Keeps the typing indicator shown for a task's run, until [`RunningTasks::end_typing`].
    pub fn show_typing(&self, task_id: i64, end: EndTyping) {
        let mut shown = self.1.lock().unwrap_or_else(|p| p.into_inner());
        shown.insert(task_id, end);
    }

    /// Stops the typing indicator of a task's run and waits for its clearing to be sent: a
    /// finishing run calls this before it commits its reply, which its instance's outbox
    /// may send at once (`Journal::finish_task`), so the chat sees the indicator end before
    /// the answer (README, generic progress).
    pub async fn end_typing(&self, task_id: i64) {
        let typing = self
            .1
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&task_id);
        if let Some(end) = typing {
            end().await;
        }
    }

    /// Tells a task running in this instance to stop before its next side effect.
    pub fn stop(&self, task_id: i64) -> bool {
        let running = self.0.lock().unwrap_or_else(|p| p.into_inner());
        running.get(&task_id).map(|t| t.cancel()).is_some()
    }
}
