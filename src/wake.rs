//! The signals the parts send each other within one instance. Each part holds the one
//! `Arc<Wake>` that `app.rs` made; a signal only shortens a wait (every waiter also polls),
//! so a missed one delays work and never loses it.

use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{Notify, Semaphore};

use crate::domain::ReplyRow;

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
    /// Replies this instance's finishing tasks committed already leased to it, for its own
    /// outbox to send without claiming them (`Journal::finish_task`), each with its lease's
    /// end; `None` while the outbox is not running.
    handed: Mutex<Option<Vec<(ReplyRow, i64)>>>,
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

    /// The outbox takes handed replies from now on ([`Wake::hand_reply`]).
    pub fn outbox_started(&self) {
        *self.handed.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
    }

    /// The outbox stopped: replies are not handed to it, and those handed and not taken are
    /// dropped. Their leases are released with the rest of this instance's
    /// (`Store::release_leases_of`) or lapse, after which any instance's outbox claims them.
    pub fn outbox_stopped(&self) {
        *self.handed.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Whether the outbox takes handed replies.
    pub fn outbox_running(&self) -> bool {
        self.handed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Hands `reply`, leased to this instance until `lease_until`, to the outbox; `false`
    /// when the outbox is not running (the reply then waits for its lease to be released
    /// or to lapse).
    pub fn hand_reply(&self, reply: ReplyRow, lease_until: i64) -> bool {
        let handed = {
            let mut handed = self.handed.lock().unwrap_or_else(|p| p.into_inner());
            handed
                .as_mut()
                .map(|q| q.push((reply, lease_until)))
                .is_some()
        };
        if handed {
            self.handed_ready.notify_one();
        }
        handed
    }

    /// Up to `max` handed replies, oldest first, whose lease lasts beyond `min_until` (a
    /// delivery started now ends before its lease does). The others are dropped: their
    /// lease lapses and a claim takes them, so they are never sent under a lease that may
    /// have passed to another instance. Also returns how many were dropped.
    pub fn take_handed(&self, max: usize, min_until: i64) -> (Vec<ReplyRow>, usize) {
        let mut guard = self.handed.lock().unwrap_or_else(|p| p.into_inner());
        let Some(queue) = guard.as_mut() else {
            return (Vec::new(), 0);
        };
        let before = queue.len();
        queue.retain(|(_, until)| *until > min_until);
        let dropped = before - queue.len();
        let n = max.min(queue.len());
        (queue.drain(..n).map(|(r, _)| r).collect(), dropped)
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
    fn replies_are_handed_only_while_the_outbox_runs() {
        let wake = Wake::default();
        assert!(!wake.hand_reply(reply(1), 10_000), "no outbox yet");
        wake.outbox_started();
        assert!(wake.hand_reply(reply(2), 10_000));
        wake.outbox_stopped();
        assert!(!wake.outbox_running());
        wake.outbox_started();
        let (taken, dropped) = wake.take_handed(10, 0);
        assert!(
            taken.is_empty() && dropped == 0,
            "stopping dropped the queue"
        );
    }

    #[test]
    fn handed_replies_go_oldest_first_and_those_near_their_lease_end_are_dropped() {
        let wake = Wake::default();
        wake.outbox_started();
        for (id, until) in [(1, 5_000), (2, 20_000), (3, 30_000), (4, 40_000)] {
            assert!(wake.hand_reply(reply(id), until));
        }
        // A delivery started now may last until 10,000: reply 1's lease ends before that.
        let (taken, dropped) = wake.take_handed(2, 10_000);
        assert_eq!(taken.iter().map(|r| r.id).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(dropped, 1);
        let (taken, dropped) = wake.take_handed(5, 10_000);
        assert_eq!(taken.iter().map(|r| r.id).collect::<Vec<_>>(), [4]);
        assert_eq!(dropped, 0);
    }
}
