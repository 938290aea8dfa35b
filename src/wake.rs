//! The signals the parts send each other within one instance. Each part holds the one
//! `Arc<Wake>` that `app.rs` made; a signal only shortens a wait (every waiter also polls),
//! so a missed one delays work and never loses it.

use tokio::sync::Notify;

#[derive(Default)]
pub struct Wake {
    /// Rung after a task becomes claimable (intake commit, task finished, approval, resume).
    pub tasks: Notify,
    /// Rung after a reply is committed to the outbox.
    pub replies: Notify,
    /// Rung after a knowledge ingest job is committed.
    pub knowledge: Notify,
}
