//! The engine: the worker pool (`pool`) claims tasks and runs each as a single model call
//! (`single_turn`) or a workflow (`workflow`), every side effect a journalled step
//! (`step`); `worker` is what the engine is given by `app.rs`, `task` what one run knows.

pub mod aborts;
pub mod feedback;
pub mod history;
pub mod knowledge;
pub mod pool;
pub mod reply;
pub mod single_turn;
pub mod step;
pub mod task;
pub mod worker;
pub mod workflow;

pub use pool::run_workers;
pub use worker::{RunningTasks, Worker};
