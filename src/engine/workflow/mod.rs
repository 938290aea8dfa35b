//! Workflow agents: a validated graph of nodes (`config`) run by a replaying runner
//! (`runner`) in which every model call, tool call, undo and approval is a journalled step.

mod agent;

mod finish;
mod gates;
pub mod runner;
mod step;
