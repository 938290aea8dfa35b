//! Reply delivery. Picks due outbox rows under a lease, sends each through its channel with
//! the row's one idempotency key, and marks it SENT or schedules the next try with backoff.
//! A crash between "sent" and "marked sent" leads to a re-send with the same key, never a
//! second key.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backoff;
use crate::channels::Channels;
use crate::channels::platform::{Delivered, DeliveryError};
use crate::config::Config;
use crate::domain::{ReplyRow, ReplyStatus, now_ms};
use crate::store::Store;
use crate::store::journal::Journal;
use crate::wake::Wake;

/// What reply delivery is given by `app.rs`.
pub struct Sender {
    pub config: Arc<Config>,
    pub store: Store,
    /// Records a delivered reply (group commit).
    pub journal: Arc<Journal>,
    pub channels: Arc<Channels>,
    pub instance_id: String,
    pub wake: Arc<Wake>,
}

/// Delivers due replies until `shutdown` fires. Up to `outbox.batch` deliveries run at once.
/// Slots are refilled as deliveries finish, not only once a whole batch is done, so one slow
/// send holds up only its own slot; claims stay batched (`Claims`). Replies this instance's
/// tasks committed already leased to it (PostgreSQL, `Journal::finish_task`) are sent as
/// soon as a slot is free, without a claim. On shutdown the deliveries in flight are
/// finished (each is bounded by `outbox.timeout_secs`).
pub async fn run_outbox(svc: Arc<Sender>, shutdown: CancellationToken) {
    let cfg = &svc.config.outbox;
    let mut sends: JoinSet<Ended> = JoinSet::new();
    let mut claims = Claims::new(cfg);
    let timeout_ms = (cfg.timeout_secs as i64).saturating_mul(1000);
    // A slot per delivery at once, claimed or handed (`Wake::reserve_slot`).
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.batch));
    svc.wake.outbox_started(slots.clone());
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        while let Some(done) = sends.try_join_next() {
            claims.ended(done);
        }
        // First the replies this instance's tasks committed leased to it, each with its
        // slot: no claim needed.
        let (handed, lapsing) = svc.wake.take_handed(now_ms() + timeout_ms);
        put_back(&svc, lapsing).await;
        crate::metrics::count_deliveries(&svc.instance_id, "handed", handed.len());
        for (reply, _, slot) in handed {
            spawn_delivery(&mut sends, &svc, reply, slot);
        }
        let free = slots.available_permits();
        if claims.due(sends.is_empty(), free) {
            let due = claim(&svc, &mut claims, free).await;
            if !start_claimed(&mut sends, &svc, &slots, due).await {
                claims.pending = true;
            }
        }
        let wait = claims.wait(slots.available_permits());
        tokio::select! {
            Some(done) = sends.join_next(), if !sends.is_empty() => claims.ended(done),
            _ = svc.wake.replies.notified() => claims.woken(),
            _ = svc.wake.handed_ready.notified() => {}
            _ = tokio::time::sleep(wait) => claims.timed_out(),
            _ = shutdown.cancelled() => break,
        }
    }
    // No reply is handed from now on; those handed and not started go back unsent.
    put_back(&svc, svc.wake.outbox_stopped()).await;
    while sends.join_next().await.is_some() {}
}

/// When the outbox claims due replies. Claims are batched: after a wake-up (a task
/// finished) the next claim comes when nothing is in flight, when a delivery has finished
/// since the last claim, `outbox.claim_wait_ms` after the wake-up (so slow sends in flight
/// do not hold other chats' answers up to the poll), or on the poll timer; while more
/// replies are due than there were free slots, when half of the slots are free again. A
/// delivery's end calls for a claim only when it may have made a reply due (`note_ended`).
struct Claims {
    poll: Duration,
    claim_wait: Duration,
    batch: usize,
    /// The earliest time a reply held back by its chat's pace may go.
    deferred: Option<i64>,
    /// Replies may be due that no claim has picked up yet.
    pending: bool,
    /// The last claim filled every free slot: more replies may be due.
    backlog: bool,
    /// A delivery finished since the last claim.
    finished: bool,
    timer: bool,
    /// The first wake-up since the last claim: the next claim comes at most `claim_wait`
    /// after it.
    woken: Option<tokio::time::Instant>,
}

impl Claims {
    fn new(cfg: &crate::config::OutboxConfig) -> Self {
        Self {
            poll: Duration::from_millis(cfg.poll_interval_ms),
            claim_wait: Duration::from_millis(cfg.claim_wait_ms),
            batch: cfg.batch,
            deferred: None,
            pending: true,
            backlog: false,
            finished: false,
            timer: false,
            woken: None,
        }
    }

    /// A delivery ended: a reply that went (or was given up) may let its conversation's
    /// next one go.
    fn ended(&mut self, done: Result<Ended, tokio::task::JoinError>) {
        self.pending |= note_ended(&mut self.deferred, done);
        self.finished = true;
    }

    /// A task finished (or a reply was queued): replies may be due.
    fn woken(&mut self) {
        self.pending = true;
        self.woken.get_or_insert_with(tokio::time::Instant::now);
    }

    fn timed_out(&mut self) {
        self.pending = true;
        self.timer = true;
    }

    /// Whether to claim now, with `free` slots and nothing in flight when `idle`.
    fn due(&self, idle: bool, free: usize) -> bool {
        let waited = self.woken.is_some_and(|at| at.elapsed() >= self.claim_wait);
        let ready = idle
            || self.timer
            || waited
            || (self.finished && (!self.backlog || free * 2 >= self.batch));
        self.pending && free > 0 && ready
    }

    /// A claim for `free` slots took `got` replies.
    fn claimed(&mut self, got: usize, free: usize) {
        self.backlog = got == free;
        self.pending = self.backlog;
        self.finished = false;
        self.woken = None;
    }

    /// How long to wait for a delivery's end or a wake-up before claiming anyway: the poll,
    /// a paced reply's time, or the rest of `claim_wait` after a wake-up (with a slot free).
    /// Called once per turn of the loop, after the claim decision: a poll that fired counts
    /// for that decision only.
    fn wait(&mut self, free: usize) -> Duration {
        self.timer = false;
        let mut wait = self.deferred.map_or(self.poll, |at| {
            Duration::from_millis((at - now_ms()).max(1) as u64).min(self.poll)
        });
        if let Some(at) = self.woken.filter(|_| free > 0) {
            wait = wait.min(self.claim_wait.saturating_sub(at.elapsed()));
        }
        wait
    }
}

/// Claims up to `free` due replies for this instance (none when the claim fails: the next
/// wake-up or poll tries again).
async fn claim(svc: &Sender, claims: &mut Claims, free: usize) -> Vec<ReplyRow> {
    let cfg = &svc.config.outbox;
    let now = now_ms();
    let lease_until = now + (cfg.lease_secs as i64) * 1000;
    // This claim picks up whatever is due by now; a reply deferred to later is not, so its
    // time is kept for the wait.
    claims.deferred = claims.deferred.filter(|&at| at > now);
    let order_wait_ms = (cfg.order_wait_secs as i64).saturating_mul(1000);
    let due = match svc
        .store
        .claim_due_replies(&svc.instance_id, free, lease_until, now, order_wait_ms)
        .await
    {
        Ok(due) => {
            crate::metrics::count_reply_claim(&svc.instance_id, due.len());
            due
        }
        Err(e) => {
            tracing::warn!(error = %e, "picking due replies failed; will retry");
            Vec::new()
        }
    };
    claims.claimed(due.len(), free);
    due
}

/// Starts the delivery of each claimed reply in a slot of its own. The claim does not hold
/// the free slots while it runs, so a finishing task may reserve one meanwhile
/// (`Wake::reserve_slot`); a reply left without one goes back unsent, to be claimed again
/// (then `false`).
async fn start_claimed(
    sends: &mut JoinSet<Ended>,
    svc: &Arc<Sender>,
    slots: &Arc<tokio::sync::Semaphore>,
    due: Vec<ReplyRow>,
) -> bool {
    let mut unsent = Vec::new();
    let mut started = 0;
    for reply in due {
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                spawn_delivery(sends, svc, reply, slot);
                started += 1;
            }
            Err(_) => unsent.push(reply),
        }
    }
    crate::metrics::count_deliveries(&svc.instance_id, "claimed", started);
    let all = unsent.is_empty();
    put_back(svc, unsent).await;
    all
}

/// Puts handed replies that were never started back, due now, their attempt not counted
/// (`Store::defer_reply`): any instance's claim takes them, and none reads them as a send
/// in doubt.
async fn put_back(svc: &Sender, unsent: Vec<ReplyRow>) {
    for reply in unsent {
        tracing::debug!(task_id = reply.task_id, key = %reply.idempotency_key, "handed reply put back unsent");
        if let Err(e) = svc
            .store
            .defer_reply(&reply, &svc.instance_id, now_ms())
            .await
        {
            tracing::warn!(task_id = reply.task_id, error = %e, "putting back an unsent reply failed; it waits for its lease to lapse");
        }
    }
}

/// Starts the delivery of `reply` in its `slot`, freed when the delivery ends.
fn spawn_delivery(
    sends: &mut JoinSet<Ended>,
    svc: &Arc<Sender>,
    reply: ReplyRow,
    slot: tokio::sync::OwnedSemaphorePermit,
) {
    let svc = svc.clone();
    sends.spawn(async move {
        let span = delivery_span(&svc, &reply).await;
        let ended = deliver(&svc, reply).instrument(span).await;
        drop(slot);
        ended
    });
}

/// How one delivery try ended, for the outbox's loop.
enum Ended {
    /// Held back by its chat's pace until then (the attempt not counted).
    Paced(i64),
    /// Its outcome recorded. `more_due`: a reply may be due now that was not before (one
    /// of its conversation that waited for it, or this one again), so a claim is worth a
    /// statement.
    Recorded { more_due: bool },
}

/// Keeps the earliest time a delivery was deferred to by its chat's pace; `true` when a
/// claim may find a reply the delivery's end made due. A delivered reply whose
/// conversation has no other PENDING reply makes none (issue 35 part 2: such claims found
/// nothing, 356 in an `end-to-end` run of 5,000); a failure, a retry, a reply given up or
/// a lost lease are counted as making one, as is a delivery that panicked.
fn note_ended(deferred: &mut Option<i64>, done: Result<Ended, tokio::task::JoinError>) -> bool {
    match done {
        Ok(Ended::Paced(at)) => {
            *deferred = Some(deferred.map_or(at, |d| d.min(at)));
            false
        }
        Ok(Ended::Recorded { more_due }) => more_due,
        Err(_) => true,
    }
}

/// The span of one delivery try, in the trace of the message it answers (while traces are
/// exported: the message's stored `traceparent` is read for it).
async fn delivery_span(svc: &Sender, reply: &ReplyRow) -> tracing::Span {
    let span = tracing::info_span!(
        "reply",
        task_id = reply.task_id,
        key = %reply.idempotency_key,
        attempt = reply.attempts,
        otel.kind = "client"
    );
    if crate::telemetry::enabled() && !reply.in_reply_to.is_empty() {
        match svc
            .store
            .trace_context(&reply.channel, &reply.in_reply_to)
            .await
        {
            Ok(parent) => crate::telemetry::continue_trace(&span, parent.as_deref()),
            Err(e) => tracing::debug!(error = %e, "reading the answered message's trace failed"),
        }
    }
    span
}

/// Sends one claimed reply and records the outcome, or defers it to the time its chat's
/// send pace allows (the attempt is not counted).
async fn deliver(svc: &Sender, mut reply: ReplyRow) -> Ended {
    let at = match admit(svc, &reply) {
        Err(at) => at,
        Ok(()) => match attempt(svc, &mut reply).await {
            // The next part of a long reply waits for the chat's pace.
            Ok(Outcome::Paused(at)) => at,
            Ok(Outcome::Delivered(delivered)) => {
                let more_due = record(svc, &reply, Ok(delivered)).await;
                return Ended::Recorded { more_due };
            }
            Err(e) => {
                let more_due = record(svc, &reply, Err(e)).await;
                return Ended::Recorded { more_due };
            }
        },
    };
    tracing::debug!(key = %reply.idempotency_key, wait_ms = at - now_ms(), "reply paced");
    if let Err(e) = svc.store.defer_reply(&reply, &svc.instance_id, at).await {
        tracing::error!(error = %e, "deferring a paced reply failed");
    }
    Ended::Paced(at)
}

/// A send slot in the reply's chat now (`Ok`), or the time the chat's pace allows one.
fn admit(svc: &Sender, reply: &ReplyRow) -> Result<(), i64> {
    svc.channels
        .admit(&reply.channel, &reply.conversation_id, now_ms())
}

/// Records the outcome of a try: SENT, or a failure (`record_failure`). `true` unless it
/// is known that no reply became due by it (`Ended::Recorded`).
async fn record(svc: &Sender, reply: &ReplyRow, result: Result<Delivered, DeliveryError>) -> bool {
    let owner = &svc.instance_id;
    // `Some(more_due)` when recorded, `None` when the lease was lost meanwhile.
    let written = match result {
        Ok(delivered) => {
            tracing::info!(key = %reply.idempotency_key, attempts = reply.attempts, "reply delivered");
            svc.journal
                .mark_reply_sent(reply, owner, delivered.platform_message_id.as_deref())
                .await
        }
        Err(err) => record_failure(svc, reply, err)
            .await
            .map(|held| held.then_some(true)),
    };
    match written {
        Ok(Some(more_due)) => more_due,
        Ok(None) => {
            tracing::warn!("reply lease was lost before its result was recorded");
            true
        }
        Err(e) => {
            tracing::error!(error = %e, "recording the delivery result failed");
            true
        }
    }
}

/// Records a failed try: a new message in place of a gone placeholder, given up (UNKNOWN
/// or FAILED), or another try after a backoff; `false` when the lease was lost meanwhile.
async fn record_failure(
    svc: &Sender,
    reply: &ReplyRow,
    mut err: DeliveryError,
) -> crate::store::StoreResult<bool> {
    let cfg = &svc.config.outbox;
    let owner = &svc.instance_id;
    // What is stored and logged of a failure is redacted (platform error bodies may echo
    // tokens; transport errors are already free of their URLs).
    err.message = crate::redaction::redact(&err.message);
    let now = now_ms();
    if reply.edit && svc.channels.edit_target_gone(&reply.channel, &err) {
        tracing::warn!(key = %reply.idempotency_key, error = %err, "the placeholder is gone; sending the reply as a new message");
        return svc
            .store
            .reply_as_new_message(reply, owner, &err.message, now)
            .await;
    }
    let give_up = if err.unknown {
        tracing::error!(key = %reply.idempotency_key, error = %err, "reply outcome unknown; not re-sent");
        Some(ReplyStatus::Unknown)
    } else if err.permanent {
        tracing::error!(key = %reply.idempotency_key, error = %err, "reply refused for good by the platform; not retried");
        Some(ReplyStatus::Failed)
    } else if cfg.max_attempts > 0 && reply.attempts >= i64::from(cfg.max_attempts) {
        tracing::error!(key = %reply.idempotency_key, error = %err, "reply given up");
        Some(ReplyStatus::Failed)
    } else {
        None
    };
    if let Some(status) = give_up {
        return svc
            .store
            .give_up_reply(reply, owner, status, &err.message, now)
            .await;
    }
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
        .reschedule_reply(reply, owner, now + wait.as_millis() as i64, &err.message)
        .await
}

/// How a try of a reply ended when it did not fail.
enum Outcome {
    Delivered(Delivered),
    /// Some parts of a long reply went; the next waits for the chat's pace until then.
    Paused(i64),
}

/// One try of a claimed reply: a new message, or an edit of its placeholder; a reply longer
/// than its platform allows goes as numbered parts.
async fn attempt(svc: &Sender, reply: &mut ReplyRow) -> Result<Outcome, DeliveryError> {
    // The answer of a placeholder whose send is in doubt goes under its own key.
    if let Some(key) = reply.send_key.take() {
        reply.idempotency_key = key;
    }
    // A previous try was claimed but left no result (its instance died mid-send): where a
    // re-send could show the reply twice, its outcome is unknown and it is not repeated.
    // An edit can be repeated: it shows the same message either way.
    if svc.channels.resend_is_blind(&reply.channel)
        && !reply.edit
        && reply.attempts > 1
        && reply.last_error.is_none()
    {
        Err(DeliveryError {
            message:
                "a previous send was interrupted and the platform cannot tell whether it arrived"
                    .into(),
            retry_after: None,
            unknown: true,
            permanent: false,
        })
    } else if let Err(e) = with_reply_context(svc, reply).await {
        Err(DeliveryError::retry(format!(
            "reply context unavailable: {e}"
        )))
    } else if let Some(parts) = svc.channels.parts(reply) {
        send_parts(svc, reply, parts).await
    } else if reply.edit {
        svc.channels.edit(reply).await.map(Outcome::Delivered)
    } else {
        svc.channels.send(reply).await.map(Outcome::Delivered)
    }
}

/// Sends the parts of a long reply that the platform has not accepted yet, in order: the
/// first under the reply's key (editing its placeholder when it has one), part `k` under
/// `<key>-part-<k>`. Each accepted part is recorded before the next goes, so a delivery
/// resumed after a crash or a failed part sends only the missing ones; between parts the
/// chat's send pace is kept (the reply is put back until the pace allows the next).
async fn send_parts(
    svc: &Sender,
    reply: &ReplyRow,
    parts: Vec<String>,
) -> Result<Outcome, DeliveryError> {
    let total = parts.len();
    let start = usize::try_from(reply.parts_sent).unwrap_or(0).min(total);
    let streamed: serde_json::Map<String, serde_json::Value> = reply
        .streamed_parts
        .as_deref()
        .and_then(|p| serde_json::from_str(p).ok())
        .unwrap_or_default();
    let mut first = reply.platform_message_id.clone();
    for (k, content) in parts.into_iter().enumerate().skip(start) {
        // The parts before `k` are recorded already: the reply waits for the chat's pace
        // like any paced reply, and goes on from part `k`.
        if k > start
            && let Err(at) = admit(svc, reply)
        {
            return Ok(Outcome::Paused(at));
        }
        let mut part = reply.clone();
        part.content = content;
        part.reply_type = crate::domain::ReplyType::Text;
        let streamed = streamed.get(&(k + 1).to_string());
        if k > 0 {
            part.idempotency_key = format!("{}-part-{}", reply.idempotency_key, k + 1);
        }
        let delivered = deliver_part(svc, &mut part, k, streamed).await?;
        tracing::info!(key = %part.idempotency_key, part = k + 1, parts = total, "reply part delivered");
        if k == 0 {
            first = delivered.platform_message_id.or(first);
        }
        if k + 1 < total {
            note_parts(svc, reply, k + 1, first.as_deref()).await?;
        }
    }
    Ok(Outcome::Delivered(Delivered {
        platform_message_id: first,
    }))
}

/// Delivers part `k` (from 0) of a long reply. A later part the streamed answer already
/// shows (`streamed` is its message id) is edited into its final text; one whose send is in
/// doubt (`null`: it may be in the chat, its id unrecorded) is edited by the id its key
/// gives where the platform names messages by key (DingTalk cards), else sent again as a
/// retry — which the platform drops as a repeat (Matrix, Lark) or finds by its key (Slack) —
/// as the editable kind streamed parts are, and then edited; where a resend is blind
/// (Telegram) the answer's fate is unknown instead.
async fn deliver_part(
    svc: &Sender,
    part: &mut ReplyRow,
    k: usize,
    streamed: Option<&serde_json::Value>,
) -> Result<Delivered, DeliveryError> {
    let shown = streamed.and_then(|id| id.as_str());
    let in_doubt = k > 0 && streamed.is_some_and(|id| id.is_null());
    if k > 0 {
        part.edit = shown.is_some();
        part.platform_message_id = shown.map(str::to_string);
    }
    if !in_doubt {
        return if part.edit {
            svc.channels.edit(part).await
        } else {
            svc.channels.send(part).await
        };
    }
    part.placeholder = true;
    if let Some(id) = svc
        .channels
        .message_id_by_key(&part.channel, &part.idempotency_key, true)
    {
        let mut edit = part.clone();
        edit.edit = true;
        edit.platform_message_id = Some(id);
        match svc.channels.edit(&edit).await {
            Ok(delivered) => return Ok(delivered),
            // Not there: it was never sent.
            Err(e) => {
                tracing::info!(key = %part.idempotency_key, error = %e, "streamed part not found by its key; sending it")
            }
        }
        return svc.channels.send(part).await;
    }
    if svc.channels.resend_is_blind(&part.channel) {
        return Err(DeliveryError {
            message: format!(
                "part {} of the streamed answer may have been sent and the platform cannot \
                 tell; its later parts were not sent",
                k + 1
            ),
            retry_after: None,
            unknown: true,
            permanent: false,
        });
    }
    part.attempts = part.attempts.max(2);
    let sent = svc.channels.send(part).await?;
    part.placeholder = false;
    part.edit = true;
    part.platform_message_id = sent.platform_message_id.clone();
    if part.platform_message_id.is_some() {
        svc.channels.edit(part).await?;
    }
    Ok(sent)
}

/// Records how many parts of `reply` went (see `Store::note_parts_sent`); a failure to
/// record, or a lost lease, ends this try (the unrecorded part goes again under its key).
async fn note_parts(
    svc: &Sender,
    reply: &ReplyRow,
    sent: usize,
    first: Option<&str>,
) -> Result<(), DeliveryError> {
    match svc
        .store
        .note_parts_sent(reply, &svc.instance_id, sent as i64, first)
        .await
    {
        Ok(true) => Ok(()),
        Ok(false) => Err(DeliveryError::retry(
            "the reply's lease was lost between two of its parts",
        )),
        Err(e) => Err(DeliveryError::retry(format!(
            "recording the reply's parts failed: {e}"
        ))),
    }
}

/// Puts the answered message's `reply_context` on the reply, for platforms that send with it
/// (DingTalk's session webhook).
async fn with_reply_context(svc: &Sender, reply: &mut ReplyRow) -> crate::store::StoreResult<()> {
    if svc.channels.wants_reply_context(&reply.channel) {
        reply.reply_context = svc
            .store
            .reply_context(&reply.channel, &reply.in_reply_to)
            .await?;
    }
    Ok(())
}
