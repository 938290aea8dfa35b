//! Workflow agents: a validated graph of nodes (`config`) run by a replaying runner
//! (`runner`) in which every model call, tool call, undo and approval is a journalled step.

pub mod config;
pub mod runner;
