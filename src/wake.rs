//! The signals the parts send each other within one instance. Each part holds the one
//! `Arc<Wake>` that `app.rs` made; a signal only shortens a wait (every waiter also polls),
//! so a missed one delays work and never loses it.

use std::sync::{Arc, RwLock};

use tokio::sync::{Notify, Semaphore};

#[derive(Default)]
pub struct Wake {
    /// This instance's worker slots while its workers run (none in the `api` role, nor while
    /// it stands by for the workers' lease).
    workers: RwLock<Option<Arc<Semaphore>>>,
    /// Rung after a task becomes claimable (intake commit, task finished, approval, resume).
    pub tasks: Notify,
    /// Rung after a reply is committed to the outbox.
    pub replies: Notify,
    /// Rung after a knowledge ingest job is committed.
    pub knowledge: Notify,
}

impl Wake {
    /// Makes `permits` (the workers' slots) what [`Wake::room`] reads.
    pub fn workers_started(&self, permits: Arc<Semaphore>) {
        *self.workers.write().unwrap_or_else(|p| p.into_inner()) = Some(permits);
    }

    /// Makes [`Wake::room`] 0 again: the workers stopped (shutdown, or the workers' lease
    /// went to another instance), so this instance's commits wake the others.
    pub fn workers_stopped(&self) {
        *self.workers.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// How many tasks this instance's workers could start now: 0 without workers.
    pub fn room(&self) -> usize {
        self.workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |p| p.available_permits())
    }

    /// Whether tasks just committed here need other instances woken (PostgreSQL `NOTIFY`):
    /// only when this instance's workers cannot start all `tasks` now. So a wake-up reaches
    /// one claimer, this instance, whenever it can take the work, and a second instance adds
    /// no claims per message (issue 35).
    pub fn others_needed(&self, tasks: usize) -> bool {
        self.room() < tasks
    }
}
