//! Exponential backoff with jitter, shared by model retries and reply delivery.

use std::time::Duration;

/// The pause before try `attempt + 1` after try `attempt` (1-based) failed: `base * 2^(attempt-1)`
/// capped at `max`, then a random point in its upper half so that many tasks failing together
/// do not retry together. A `retry_after` from the other side wins, capped at `retry_after_max`.
pub fn delay(
    attempt: u32,
    base_ms: u64,
    max_ms: u64,
    retry_after: Option<Duration>,
    retry_after_max: Duration,
) -> Duration {
    if let Some(wait) = retry_after {
        return wait.min(retry_after_max);
    }
    let exp = base_ms.saturating_mul(1u64 << attempt.saturating_sub(1).min(32));
    let capped = exp.min(max_ms).max(1);
    let half = capped / 2;
    Duration::from_millis(half + fastrand::u64(0..=capped - half))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_caps() {
        let max = Duration::from_secs(60);
        for _ in 0..100 {
            let d1 = delay(1, 100, 10_000, None, max).as_millis();
            assert!((50..=100).contains(&d1), "{d1}");
            let d4 = delay(4, 100, 10_000, None, max).as_millis();
            assert!((400..=800).contains(&d4), "{d4}");
            let d30 = delay(30, 100, 10_000, None, max).as_millis();
            assert!((5_000..=10_000).contains(&d30), "{d30}");
        }
        assert_eq!(
            delay(1, 100, 1000, Some(Duration::from_secs(7)), max),
            Duration::from_secs(7)
        );
        assert_eq!(
            delay(1, 100, 1000, Some(Duration::from_secs(700)), max),
            max
        );
    }
}
