//! The signals the parts send each other within one instance. Each part holds the one
//! `Arc<Wake>` that `app.rs` made; a signal only shortens a wait (every waiter also polls),
//! so a missed one delays work and never loses it.

use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::domain::ReplyRow;

/// A reply handed to the outbox: its row, its lease's end, its delivery slot.
pub type Handed = (ReplyRow, i64, OwnedSemaphorePermit);

struct Handoff {
    slots: Arc<Semaphore>,
    queue: Vec<Handed>,
}

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
    /// The outbox's delivery slots and the replies this instance's finishing tasks committed
    /// already leased to it, each with its lease's end and the slot reserved for it
    /// (`Journal::finish_task`); `None` while the outbox is not running.
    handoff: Mutex<Option<Handoff>>,
    /// Rung after a reply is handed over.
    pub handed_ready: Notify,
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

    /// The outbox runs with `slots` (its deliveries at once): replies may be handed to it
    /// from now on ([`Wake::reserve_slot`], [`Wake::hand_reply`]).
    pub fn outbox_started(&self, slots: Arc<Semaphore>) {
        *self.handoff.lock().unwrap_or_else(|p| p.into_inner()) = Some(Handoff {
            slots,
            queue: Vec::new(),
        });
    }

    /// The outbox stopped: no more replies are handed to it. Returns those handed and not
    /// taken, for the outbox to put back (never started, see `Store::put_back_unsent`).
    pub fn outbox_stopped(&self) -> Vec<ReplyRow> {
        let handoff = self
            .handoff
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        handoff.map_or_else(Vec::new, |h| h.queue.into_iter().map(|(r, ..)| r).collect())
    }

    /// A free delivery slot of the running outbox, reserved for a reply about to be handed
    /// (dropping it frees it); `None` when the outbox is not running or every slot is busy.
    /// A reply is only committed leased to this instance with its first attempt counted
    /// when its send can start at once: a counted attempt that left no result reads as a
    /// send in doubt (`outbox::attempt`).
    pub fn reserve_slot(&self) -> Option<OwnedSemaphorePermit> {
        let handoff = self.handoff.lock().unwrap_or_else(|p| p.into_inner());
        handoff.as_ref()?.slots.clone().try_acquire_owned().ok()
    }

    /// Hands `reply`, leased to this instance until `lease_until`, with its reserved `slot`
    /// to the outbox; gives the reply back when the outbox stopped meanwhile.
    pub fn hand_reply(
        &self,
        reply: ReplyRow,
        lease_until: i64,
        slot: OwnedSemaphorePermit,
    ) -> Result<(), Box<ReplyRow>> {
        {
            let mut handoff = self.handoff.lock().unwrap_or_else(|p| p.into_inner());
            let Some(h) = handoff.as_mut() else {
                return Err(Box::new(reply));
            };
            h.queue.push((reply, lease_until, slot));
        }
        self.handed_ready.notify_one();
        Ok(())
    }

    /// The handed replies, oldest first, whose lease lasts beyond `min_until` (a delivery
    /// started now ends before its lease does), and apart those whose lease does not: they
    /// must not be sent under a lease that may pass to another instance before the send
    /// ends, and go back to the outbox unsent.
    pub fn take_handed(&self, min_until: i64) -> (Vec<Handed>, Vec<ReplyRow>) {
        let mut handoff = self.handoff.lock().unwrap_or_else(|p| p.into_inner());
        let Some(h) = handoff.as_mut() else {
            return (Vec::new(), Vec::new());
        };
        let (ready, lapsing): (Vec<Handed>, Vec<Handed>) = h
            .queue
            .drain(..)
            .partition(|(_, until, _)| *until > min_until);
        (ready, lapsing.into_iter().map(|(r, ..)| r).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(id: i64) -> ReplyRow {
        ReplyRow {
            id,
            task_id: id,
            idempotency_key: format!("agent-task-{id}"),
            channel: "generic".into(),
            conversation_id: "c".into(),
            in_reply_to: "m".into(),
            reply_type: crate::domain::ReplyType::Text,
            content: "{}".into(),
            status: crate::domain::ReplyStatus::Pending,
            platform_message_id: None,
            attempts: 1,
            next_attempt_at: 0,
            last_error: None,
            created_at: 0,
            sent_at: None,
            placeholder: false,
            edit: false,
            send_key: None,
            parts_sent: 0,
            streamed_parts: None,
            reply_context: None,
        }
    }

    #[test]
    fn replies_are_handed_only_while_the_outbox_runs_and_a_slot_is_free() {
        let wake = Wake::default();
        assert!(wake.reserve_slot().is_none(), "no outbox yet");
        let slots = Arc::new(Semaphore::new(2));
        wake.outbox_started(slots.clone());
        let (a, b) = (wake.reserve_slot().unwrap(), wake.reserve_slot().unwrap());
        assert!(wake.reserve_slot().is_none(), "both slots reserved");
        drop(b);
        assert_eq!(slots.available_permits(), 1, "a slot not used is freed");
        assert!(wake.hand_reply(reply(1), 10_000, a).is_ok());
        assert_eq!(
            slots.available_permits(),
            1,
            "the handed reply keeps its slot"
        );
        let slot = wake.reserve_slot().unwrap();
        let unsent = wake.outbox_stopped();
        assert_eq!(unsent.iter().map(|r| r.id).collect::<Vec<_>>(), [1]);
        assert!(wake.hand_reply(reply(2), 10_000, slot).is_err(), "stopped");
        assert!(wake.reserve_slot().is_none());
        assert_eq!(slots.available_permits(), 2, "every slot freed");
    }

    #[test]
    fn handed_replies_go_oldest_first_and_those_near_their_lease_end_go_back() {
        let wake = Wake::default();
        wake.outbox_started(Arc::new(Semaphore::new(8)));
        for (id, until) in [(1, 5_000), (2, 20_000), (3, 30_000)] {
            let slot = wake.reserve_slot().unwrap();
            assert!(wake.hand_reply(reply(id), until, slot).is_ok());
        }
        // A delivery started now may last until 10,000: reply 1's lease ends before that.
        let (ready, lapsing) = wake.take_handed(10_000);
        assert_eq!(ready.iter().map(|(r, ..)| r.id).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(lapsing.iter().map(|r| r.id).collect::<Vec<_>>(), [1]);
        let (ready, lapsing) = wake.take_handed(10_000);
        assert!(ready.is_empty() && lapsing.is_empty());
    }
}
