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

/// Tasks this instance is running, with the token that stops each (cancel, lost lease).
#[derive(Default)]
pub struct RunningTasks(Mutex<HashMap<i64, CancellationToken>>);

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

    /// Tells a task running in this instance to stop before its next side effect.
    pub fn stop(&self, task_id: i64) -> bool {
        let running = self.0.lock().unwrap_or_else(|p| p.into_inner());
        running.get(&task_id).map(|t| t.cancel()).is_some()
    }
}
