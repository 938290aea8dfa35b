//! Exponential backoff with jitter, shared by model retries and reply delivery.

use std::time::{Duration, SystemTime};

/// The wait a `Retry-After` header asks for (RFC 9110 §10.2.3): delay-seconds (a
/// fraction too, as some model servers send) or an HTTP-date (`httpdate`), the latter
/// counted from `now` (a date already past is no wait). `None` without the header or when
/// it is neither.
pub fn retry_after(headers: &reqwest::header::HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

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

    #[test]
    fn retry_after_takes_seconds_and_http_dates() {
        use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};
        let now = httpdate::parse_http_date("Wed, 02 Dec 2026 04:00:00 GMT").unwrap();
        let of = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(RETRY_AFTER, HeaderValue::from_str(v).unwrap());
            retry_after(&h, now)
        };
        assert_eq!(of("120"), Some(Duration::from_secs(120)));
        assert_eq!(of(" 1.5 "), Some(Duration::from_millis(1500)));
        assert_eq!(
            of("Wed, 02 Dec 2026 04:00:30 GMT"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(of("Wed, 02 Dec 2026 03:59:00 GMT"), Some(Duration::ZERO));
        assert_eq!(of("-3"), None);
        assert_eq!(of("soon"), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }
}
