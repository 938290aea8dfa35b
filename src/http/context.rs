//! What the HTTP handlers are given by `app.rs`: `ApiContext`, the state of every route.

use std::sync::Arc;

use crate::channels::Channels;
use crate::config::Config;
use crate::control::TaskControl;
use crate::intake::Intake;
use crate::llm::ModelClients;
use crate::scheduler::Jobs;
use crate::store::Store;
use crate::tools::ToolRegistry;

pub struct ApiContext {
    pub config: Arc<Config>,
    pub store: Store,
    /// Inbound messages become messages + tasks here.
    pub intake: Intake,
    /// Cancel, resume and approval decisions.
    pub control: TaskControl,
    /// The platforms' inbound checks and senders.
    pub channels: Arc<Channels>,
    /// The model providers (the console names its model; agents are checked against them).
    pub llm: Arc<ModelClients>,
    /// Tools known to this instance (agents are checked against them).
    pub tools: Arc<ToolRegistry>,
    pub admin_token: String,
    /// The scheduled jobs (run now, switch on and off).
    pub jobs: Arc<Jobs>,
    /// Rings the background ingest worker when a job is committed.
    pub wake: Arc<crate::wake::Wake>,
    /// Knowledge search and ingest (embedding providers, vectors held here).
    pub knowledge: Arc<crate::knowledge::Knowledge>,
}
