//! The worker pool: claims tasks, runs each under a heartbeat-renewed lease, and never holds a
//! database connection or transaction while a model call is in flight. Bounded by a
//! semaphore, so thousands of tasks waiting on a model cost memory, not threads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::definition::AgentMode;
use crate::domain::{Fence, MessageRow, TaskRow, now_ms};
use crate::store::intake::HistoryWant;

use super::feedback::{Feedback, Typing};
use super::task::{Prefetched, RunError, agent_of, context_of};
use super::worker::Worker;
use super::{aborts, single_turn, workflow};

async fn run_task(
    svc: &Arc<Worker>,
    fence: &Fence,
    lost: &CancellationToken,
    task: TaskRow,
    prefetched: Prefetched,
) -> Result<(), RunError> {
    let mut ctx = context_of(svc, task, prefetched).await?;
    tracing::Span::current().record("conversation", ctx.task.conversation_id.as_str());
    ctx.feedback = Feedback::start(
        svc,
        fence,
        &ctx.task,
        &ctx.message.external_message_id,
        ctx.agent.placeholder.as_deref(),
    );
    // Ends with the run: a placeholder is only ever queued while its run goes on.
    let _timer = AbortOnDrop(ctx.feedback.as_ref().and_then(Feedback::timer));
    match ctx.agent.mode {
        AgentMode::SingleTurn => single_turn::run(svc, fence, lost, &ctx).await,
        AgentMode::Workflow => workflow::runner::run(svc, fence, lost, &ctx).await,
    }
}

/// The claimed `task`'s place in its provider's count of running tasks, until dropped.
fn provider_slot(svc: &Worker, task: &TaskRow) -> Option<crate::llm::gate::TaskSlot> {
    svc.llm
        .provider(&task.provider)
        .map(|p| p.gate().task_started())
}

/// Claims up to `want` tasks, of providers with free slots only (`ModelClients::claim_plan`):
/// a provider at its limit, or paused after a 429, leaves its tasks queued in the database
/// and holds up no other provider's.
async fn claim(
    svc: &Worker,
    want: usize,
    lease_until: i64,
    now: i64,
) -> crate::store::StoreResult<Vec<TaskRow>> {
    let owner = &svc.instance_id;
    let Some(plan) = svc.llm.claim_plan(want, now) else {
        return svc.store.claim_tasks(owner, want, lease_until, now).await;
    };
    let mut claimed = Vec::new();
    for (providers, limit) in plan {
        match svc
            .store
            .claim_tasks_of(owner, limit, lease_until, now, &providers)
            .await
        {
            Ok(got) => claimed.extend(got),
            // What was claimed already is run; the rest waits for the next claim.
            Err(e) if !claimed.is_empty() => {
                tracing::warn!(error = %e, "claiming tasks failed; will retry");
                break;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(claimed)
}

/// Claims and runs tasks until `shutdown` fires, then waits up to the grace period for the
/// tasks in flight.
pub async fn run_workers(svc: Arc<Worker>, shutdown: CancellationToken) {
    let worker = &svc.config.worker;
    let permits = Arc::new(Semaphore::new(worker.concurrency));
    svc.wake.workers_started(permits.clone());
    let mut running = tokio::task::JoinSet::new();
    let poll = Duration::from_millis(worker.poll_interval_ms);
    tracing::info!(instance = %svc.instance_id, concurrency = worker.concurrency, "workers started");
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        let free = permits.available_permits();
        if free == 0 {
            tokio::select! {
                _ = svc.slot_free.notified() => continue,
                _ = shutdown.cancelled() => break,
            }
        }
        let want = free.min(worker.claim_batch);
        let now = now_ms();
        let lease_until = now + worker.lease().as_millis() as i64;
        let claimed = match claim(&svc, want, lease_until, now).await {
            Ok(claimed) => claimed,
            Err(e) => {
                tracing::warn!(error = %e, "claiming tasks failed; will retry");
                tokio::select! {
                    _ = tokio::time::sleep(poll) => continue,
                    _ = shutdown.cancelled() => break,
                }
            }
        };
        let got = claimed.len();
        crate::metrics::count_claim(&svc.instance_id, got);
        let mut prefetched = prefetch(&svc, &claimed).await;
        // Reap finished runs so the set only holds what is in flight.
        while running.try_join_next().is_some() {}
        for task in claimed {
            // Safe: at most `free` tasks were claimed and only this loop takes permits.
            let permit = permits
                .clone()
                .try_acquire_owned()
                .expect("permit reserved by claim size");
            let svc = svc.clone();
            let shutdown = shutdown.clone();
            let prefetched = prefetched.remove(&task.id).unwrap_or_default();
            let message = prefetched.message.as_ref();
            let provider_slot = provider_slot(&svc, &task);
            // One span per claim of the task, in the trace its message's intake began.
            let span = tracing::info_span!(
                "claim",
                task_id = task.id,
                conversation = tracing::field::Empty
            );
            crate::telemetry::continue_trace(
                &span,
                message.and_then(|m| m.trace_context.as_deref()),
            );
            running.spawn(
                async move {
                    run_claimed(svc.clone(), task, prefetched, shutdown).await;
                    drop(provider_slot);
                    drop(permit);
                    // A finished task may unblock the next message of its conversation.
                    svc.wake.tasks.notify_one();
                    svc.slot_free.notify_one();
                }
                .instrument(span),
            );
        }
        if got < want {
            tokio::select! {
                _ = svc.wake.tasks.notified() => {}
                _ = tokio::time::sleep(poll) => {}
                _ = shutdown.cancelled() => break,
            }
        }
    }
    // No more claims here: from now on this instance's commits wake the others.
    svc.wake.workers_stopped();
    drain(running, Duration::from_secs(worker.shutdown_grace_secs)).await;
    tracing::info!("workers stopped");
}

/// What each of the `claimed` tasks' runs would read first, read for all of them at once:
/// its message, its agent snapshot parsed, and, for a single-turn agent, its conversation's
/// recent turns. A read that fails leaves each run to read its own.
async fn prefetch(svc: &Worker, claimed: &[TaskRow]) -> HashMap<i64, Prefetched> {
    if claimed.is_empty() {
        return HashMap::new();
    }
    let ids: Vec<i64> = claimed.iter().map(|t| t.message_id).collect();
    let mut messages: HashMap<i64, MessageRow> = match svc.store.messages(&ids).await {
        Ok(rows) => rows.into_iter().map(|m| (m.id, m)).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "reading the claimed tasks' messages failed");
            HashMap::new()
        }
    };
    let mut prefetched: HashMap<i64, Prefetched> = claimed
        .iter()
        .map(|task| {
            let agent = agent_of(task).ok();
            let message = messages.remove(&task.message_id);
            (
                task.id,
                Prefetched {
                    message,
                    agent,
                    history: None,
                },
            )
        })
        .collect();
    let wants: Vec<HistoryWant<'_>> = claimed
        .iter()
        .filter_map(|task| {
            let agent = prefetched.get(&task.id)?.agent.as_ref()?;
            (agent.mode == AgentMode::SingleTurn).then(|| HistoryWant {
                task_id: task.id,
                channel: &task.channel,
                conversation_id: &task.conversation_id,
                up_to_message: task.message_id,
                limit: i64::from(agent.history_messages) + 1,
            })
        })
        .collect();
    match svc.store.conversation_histories(&wants).await {
        Ok(histories) => {
            for (task_id, history) in histories {
                if let Some(p) = prefetched.get_mut(&task_id) {
                    p.history = Some(history);
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "reading the claimed tasks' conversations failed"),
    }
    prefetched
}

/// Waits up to `grace` for the runs in flight, then stops the rest.
async fn drain(mut running: tokio::task::JoinSet<()>, grace: Duration) {
    let drained = tokio::time::timeout(grace, async {
        while running.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            in_flight = running.len(),
            "shutdown grace period over; stopping unfinished tasks"
        );
        running.abort_all();
        while running.join_next().await.is_some() {}
    }
}

async fn run_claimed(
    svc: Arc<Worker>,
    task: TaskRow,
    prefetched: Prefetched,
    shutdown: CancellationToken,
) {
    let fence = Fence {
        task_id: task.id,
        owner: svc.instance_id.clone(),
        version: task.version,
    };
    // Independent of `shutdown`: on shutdown a task in flight may still finish within the
    // grace period; only a lost lease stops it early.
    let lost = CancellationToken::new();
    svc.running.track(task.id, Some(lost.clone()));
    if let Some(typing) = Typing::start(&svc, &task) {
        svc.running
            .show_typing(task.id, Box::new(move || Box::pin(typing.end())));
    }
    let guard = RunGuard {
        heartbeat: tokio::spawn(heartbeat(svc.clone(), fence.clone(), lost.clone())),
        forget: Some(Box::new({
            let (svc, task_id) = (svc.clone(), fence.task_id);
            move || svc.running.track(task_id, None)
        })),
    };
    let mut result = run_task(&svc, &fence, &lost, task, prefetched).await;
    // An outage is waited out, not counted: the run goes on under this claim as soon as the
    // database answers again (the heartbeat renews the lease then, or finds it lost). One
    // deadline for the whole claim, however often the database comes and goes.
    let outage_until =
        std::time::Instant::now() + Duration::from_secs(svc.config.engine.outage_wait_secs);
    while let Err(e) = &result
        && e.is_outage()
        && !shutdown.is_cancelled()
    {
        tracing::warn!(error = %e, "the database is unavailable; the run goes on when it answers again");
        result = match aborts::wait_out_outage(&svc, &fence, &lost, &shutdown, outage_until).await {
            Ok(Some(task)) => run_task(&svc, &fence, &lost, task, Prefetched::default()).await,
            Ok(None) => break,
            Err(e) => Err(e),
        };
    }
    drop(guard);
    // Ended already when the run finished (before its reply was committed).
    svc.running.end_typing(fence.task_id).await;
    match result {
        Ok(()) => {}
        Err(RunError::Parked) => tracing::info!("waiting for a human decision"),
        Err(RunError::Paused) => tracing::info!("paused at a step boundary, as an admin asked"),
        Err(RunError::LostLease) => {
            tracing::warn!("stopped: lost the lease on this task; another instance owns it now")
        }
        Err(RunError::Shutdown) => {
            tracing::info!("interrupted by shutdown; the task resumes after restart")
        }
        Err(e) if shutdown.is_cancelled() => {
            tracing::info!(error = %e, "interrupted during shutdown; the task resumes after restart")
        }
        Err(e) if e.is_outage() => {
            tracing::warn!(error = %e, "stopped by a database outage; the task resumes when its lease expires")
        }
        Err(e) => aborts::count_abort(&svc, &fence, &e).await,
    }
}

/// Aborts a background task when dropped.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            handle.abort();
        }
    }
}

/// Ends a run's heartbeat and forgets the run when the run ends, by return or by a panic:
/// a panicking run must not leave its lease renewed forever (the lease then expires and the
/// orphan reclaim gives the task to a worker again).
struct RunGuard {
    heartbeat: tokio::task::JoinHandle<()>,
    /// Forgets the run (`RunningTasks::track`).
    forget: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.heartbeat.abort();
        if let Some(forget) = self.forget.take() {
            forget();
        }
    }
}

/// Renews the task's lease every third of its length; cancels `lost` when the task is no
/// longer ours so the runner stops before its next side effect.
async fn heartbeat(svc: Arc<Worker>, fence: Fence, lost: CancellationToken) {
    let lease = svc.config.worker.lease();
    let every = lease / 3;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = lost.cancelled() => return,
        }
        let now = now_ms();
        match svc
            .journal
            .renew_lease(&fence, now + lease.as_millis() as i64)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(
                    task_id = fence.task_id,
                    "lease renewal refused: ownership lost"
                );
                lost.cancel();
                return;
            }
            Err(e) => tracing::warn!(task_id = fence.task_id, error = %e, "lease renewal failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use super::*;

    /// Issue 17, item 12: a run that panics stops its heartbeat and is forgotten.
    #[tokio::test]
    async fn a_panicking_run_stops_its_heartbeat() {
        let beats = Arc::new(AtomicU64::new(0));
        let forgotten = Arc::new(AtomicBool::new(false));
        let (b, f) = (beats.clone(), forgotten.clone());
        let run = tokio::spawn(async move {
            let _guard = RunGuard {
                heartbeat: tokio::spawn(async move {
                    loop {
                        b.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }),
                forget: Some(Box::new(move || f.store(true, Ordering::SeqCst))),
            };
            tokio::time::sleep(Duration::from_millis(20)).await;
            panic!("a bug inside a task run");
        });
        assert!(run.await.unwrap_err().is_panic());
        assert!(forgotten.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let after = beats.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            beats.load(Ordering::SeqCst),
            after,
            "the heartbeat still runs"
        );
    }
}
