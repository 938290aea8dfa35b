//! One provider's limits in this instance (issue 32): model calls at once
//! (`max_concurrency`), and a pause after a 429 that holds every call to the provider for
//! its Retry-After, not only the one refused. The workers ask it how many tasks of the
//! provider they may claim (`free_slots`), so a provider at its limit holds up no task of
//! another provider, and the tasks waiting for it stay queued in the database, holding no
//! connection and no memory. The limits hold per instance.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::domain::now_ms;
use crate::store::tasks::ProviderFilter;

/// A 429 without Retry-After pauses the provider this long.
const DEFAULT_PAUSE: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct ProviderGate {
    /// Calls at once; 0 = no limit.
    max: usize,
    calls: Option<Arc<Semaphore>>,
    /// Tasks of this provider running in this instance.
    tasks: AtomicUsize,
    /// No call goes before this time (ms), after a 429.
    paused_until: AtomicI64,
    /// The longest pause one 429 causes (`llm.retry_after_max_secs`): a provider asking
    /// for a day does not silence it for a day.
    pause_max: Duration,
}

impl ProviderGate {
    pub fn new(max_concurrency: usize, pause_max: Duration) -> ProviderGate {
        ProviderGate {
            max: max_concurrency,
            calls: (max_concurrency > 0).then(|| Arc::new(Semaphore::new(max_concurrency))),
            tasks: AtomicUsize::new(0),
            paused_until: AtomicI64::new(0),
            pause_max,
        }
    }

    /// Whether claims must ask this provider first: it has a limit, or it is paused.
    pub fn limits_claims(&self, now: i64) -> bool {
        self.max > 0 || self.paused_until.load(Ordering::Relaxed) > now
    }

    /// Tasks of this provider the workers may claim now (`usize::MAX`: no limit).
    pub fn free_slots(&self, now: i64) -> usize {
        if self.paused_until.load(Ordering::Relaxed) > now {
            return 0;
        }
        if self.max == 0 {
            return usize::MAX;
        }
        self.max.saturating_sub(self.tasks.load(Ordering::Relaxed))
    }

    /// A task of this provider was claimed; it counts until the guard is dropped.
    pub fn task_started(self: &Arc<Self>) -> TaskSlot {
        self.tasks.fetch_add(1, Ordering::Relaxed);
        TaskSlot(self.clone())
    }

    /// Waits out a pause, then takes a call slot (held while the call, its body or its
    /// stream, goes on).
    pub async fn call_slot(&self) -> Option<OwnedSemaphorePermit> {
        loop {
            let wait = self.paused_until.load(Ordering::Relaxed) - now_ms();
            if wait <= 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(wait as u64)).await;
        }
        match &self.calls {
            // The semaphore is never closed.
            Some(calls) => calls.clone().acquire_owned().await.ok(),
            None => None,
        }
    }

    /// The provider refused a call with 429: every call waits `retry_after` (or a second),
    /// at most `pause_max`.
    pub fn refused(&self, retry_after: Option<Duration>) {
        let pause = retry_after.unwrap_or(DEFAULT_PAUSE).min(self.pause_max);
        let until = now_ms() + pause.as_millis() as i64;
        self.paused_until.fetch_max(until, Ordering::Relaxed);
    }
}

/// How a claim of up to `want` tasks respects the limits of `providers` (name, gate) at
/// `now`: `None` when no provider limits claims (one claim of any task, as ever); else one
/// claim per limited provider with free slots (at most that many of its tasks), then one of
/// the tasks of every other provider.
pub fn claim_plan<'a>(
    providers: impl Iterator<Item = (&'a str, &'a ProviderGate)>,
    want: usize,
    now: i64,
) -> Option<Vec<(ProviderFilter, usize)>> {
    let limited: Vec<(&str, usize)> = providers
        .filter(|(_, gate)| gate.limits_claims(now))
        .map(|(name, gate)| (name, gate.free_slots(now)))
        .collect();
    if limited.is_empty() {
        return None;
    }
    let mut left = want;
    let mut plan = Vec::new();
    for (name, free) in &limited {
        let n = (*free).min(left);
        if n > 0 {
            plan.push((ProviderFilter::Only(name.to_string()), n));
            left -= n;
        }
    }
    if left > 0 {
        let except = limited.iter().map(|(n, _)| n.to_string()).collect();
        plan.push((ProviderFilter::Except(except), left));
    }
    Some(plan)
}

/// A claimed task's place in its provider's count.
pub struct TaskSlot(Arc<ProviderGate>);

impl Drop for TaskSlot {
    fn drop(&mut self) {
        self.0.tasks.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_count_tasks_and_a_429_pauses_the_provider() {
        let gate = Arc::new(ProviderGate::new(2, Duration::from_secs(60)));
        let now = now_ms();
        assert!(gate.limits_claims(now));
        assert_eq!(gate.free_slots(now), 2);
        let a = gate.task_started();
        assert_eq!(gate.free_slots(now), 1);
        let _b = gate.task_started();
        assert_eq!(gate.free_slots(now), 0);
        drop(a);
        assert_eq!(gate.free_slots(now), 1);
        gate.refused(Some(Duration::from_millis(200)));
        assert_eq!(gate.free_slots(now_ms()), 0, "paused");
        let started = std::time::Instant::now();
        let _slot = gate.call_slot().await;
        assert!(started.elapsed() >= Duration::from_millis(150));
        let open = ProviderGate::new(0, Duration::from_millis(100));
        // A Retry-After of a day pauses at most `pause_max`.
        open.refused(Some(Duration::from_secs(86_400)));
        let started = std::time::Instant::now();
        let _ = open.call_slot().await;
        assert!(started.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!open.limits_claims(now_ms()));
        assert_eq!(open.free_slots(now_ms()), usize::MAX);
        assert!(open.call_slot().await.is_none());
    }
}
