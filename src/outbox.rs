//! Reply delivery. Picks due outbox rows under a lease, sends each through its channel with
//! the row's one idempotency key, and marks it SENT or schedules the next try with backoff.
//! A crash between "sent" and "marked sent" leads to a re-send with the same key, never a
//! second key.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::app::Services;
use crate::channels::Channels;
use crate::domain::{ReplyStatus, now_ms};
use crate::engine::backoff;
use crate::store::outbox::ReplyRow;

pub async fn run_outbox(svc: Arc<Services>, shutdown: CancellationToken) {
    let cfg = &svc.config.outbox;
    let poll = Duration::from_millis(cfg.poll_interval_ms);
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        let now = now_ms();
        let lease_until = now + (cfg.lease_secs as i64) * 1000;
        let due = match svc
            .store
            .claim_due_replies(&svc.instance_id, cfg.batch, lease_until, now)
            .await
        {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "picking due replies failed; will retry");
                Vec::new()
            }
        };
        let full = due.len() == cfg.batch;
        let mut sends = JoinSet::new();
        for reply in due {
            let svc = svc.clone();
            let span = tracing::info_span!("reply", task_id = reply.task_id);
            sends.spawn(async move { deliver(&svc, reply).await }.instrument(span));
        }
        // The earliest time a reply held back by its chat's pace may go.
        let mut deferred: Option<i64> = None;
        while let Some(done) = sends.join_next().await {
            if let Ok(Some(at)) = done {
                deferred = Some(deferred.map_or(at, |d| d.min(at)));
            }
        }
        if full {
            continue;
        }
        let wait = deferred.map_or(poll, |at| {
            Duration::from_millis((at - now_ms()).max(1) as u64).min(poll)
        });
        tokio::select! {
            _ = svc.reply_wake.notified() => {}
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => break,
        }
    }
}

/// Sends one claimed reply and records the outcome; returns the time it was deferred to
/// when its chat's send pace did not allow it yet (the attempt is not counted).
async fn deliver(svc: &Services, reply: ReplyRow) -> Option<i64> {
    let cfg = &svc.config.outbox;
    let owner = &svc.instance_id;
    let interval = Channels::chat_interval_ms(&svc.config, &reply.channel);
    if let Err(at) =
        svc.channels
            .pacer
            .admit(&reply.channel, &reply.conversation_id, interval, now_ms())
    {
        tracing::debug!(key = %reply.idempotency_key, wait_ms = at - now_ms(), "reply paced");
        if let Err(e) = svc.store.defer_reply(&reply, owner, at).await {
            tracing::error!(error = %e, "deferring a paced reply failed");
        }
        return Some(at);
    }
    // A previous try was claimed but left no result (its instance died mid-send): where a
    // re-send could show the reply twice, its outcome is unknown and it is not repeated.
    let result = if Channels::resend_is_blind(&reply.channel)
        && reply.attempts > 1
        && reply.last_error.is_none()
    {
        Err(crate::channels::DeliveryError {
            message:
                "a previous send was interrupted and the platform cannot tell whether it arrived"
                    .into(),
            retry_after: None,
            unknown: true,
        })
    } else {
        svc.channels.send(&reply).await
    };
    let now = now_ms();
    let written = match result {
        Ok(delivered) => {
            tracing::info!(key = %reply.idempotency_key, attempts = reply.attempts, "reply delivered");
            svc.journal
                .mark_reply_sent(&reply, owner, delivered.platform_message_id.as_deref())
                .await
        }
        Err(err) if err.unknown => {
            tracing::error!(key = %reply.idempotency_key, error = %err, "reply outcome unknown; not re-sent");
            svc.store
                .give_up_reply(&reply, owner, ReplyStatus::Unknown, &err.message, now)
                .await
        }
        Err(err) if cfg.max_attempts > 0 && reply.attempts >= i64::from(cfg.max_attempts) => {
            tracing::error!(key = %reply.idempotency_key, error = %err, "reply given up");
            svc.store
                .give_up_reply(&reply, owner, ReplyStatus::Failed, &err.message, now)
                .await
        }
        Err(err) => {
            let wait = backoff::delay(
                reply.attempts.clamp(1, 64) as u32,
                cfg.backoff_base_ms,
                cfg.backoff_max_ms,
                err.retry_after,
                Duration::from_millis(cfg.backoff_max_ms),
            );
            tracing::warn!(
                key = %reply.idempotency_key,
                attempts = reply.attempts,
                wait_ms = wait.as_millis() as u64,
                error = %err,
                "reply delivery failed; will retry with the same key"
            );
            svc.store
                .reschedule_reply(&reply, owner, now + wait.as_millis() as i64, &err.message)
                .await
        }
    };
    match written {
        Ok(true) => {}
        Ok(false) => tracing::warn!("reply lease was lost before its result was recorded"),
        Err(e) => tracing::error!(error = %e, "recording the delivery result failed"),
    }
    None
}
