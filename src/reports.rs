//! Reports built from the store's counts: the failure summary behind
//! `GET /api/admin/failure-summary` and the dashboard (the web layer only checks the query).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::store::summary::{SummaryFilter, SummaryRow};
use crate::store::{Store, StoreResult};

/// Most reply latencies read for the percentiles.
const LATENCY_SAMPLE: i64 = 100_000;
/// Top error messages kept per failure type.
const TOP_ERRORS: usize = 5;

/// Counts by status and failure type per bucket (`bucket_ms` wide), agent and version;
/// success rate; p50/p95 webhook-to-reply time; the top (redacted) error messages per
/// failure type.
pub async fn failure_summary(
    store: &Store,
    filter: &SummaryFilter,
    bucket_ms: i64,
) -> StoreResult<Value> {
    let rows = store.summary_counts(filter, bucket_ms).await?;
    let mut latencies = store.reply_latencies(filter, LATENCY_SAMPLE).await?;
    latencies.sort_unstable();
    let errors = store.top_errors(filter).await?;

    #[derive(Default)]
    struct Tally {
        by_status: BTreeMap<&'static str, i64>,
        by_failure_type: BTreeMap<&'static str, i64>,
    }
    impl Tally {
        fn add(&mut self, row: &SummaryRow) {
            *self.by_status.entry(row.status.as_str()).or_default() += row.count;
            if let Some(f) = row.failure_type {
                *self.by_failure_type.entry(f.as_str()).or_default() += row.count;
            }
        }
        fn json(&self) -> Value {
            let count = |s: &str| self.by_status.get(s).copied().unwrap_or(0);
            let done = count("SUCCEEDED") + count("FAILED") + count("CANCELLED");
            json!({
                "tasks": self.by_status.values().sum::<i64>(),
                "by_status": self.by_status,
                "by_failure_type": self.by_failure_type,
                "success_rate": (done > 0).then(|| count("SUCCEEDED") as f64 / done as f64),
            })
        }
    }
    let mut totals = Tally::default();
    let mut buckets: BTreeMap<i64, Tally> = BTreeMap::new();
    let mut agents: BTreeMap<(String, i64), Tally> = BTreeMap::new();
    for row in &rows {
        totals.add(row);
        buckets.entry(row.bucket).or_default().add(row);
        agents
            .entry((row.agent.clone(), row.version))
            .or_default()
            .add(row);
    }
    let mut top: BTreeMap<&'static str, Vec<Value>> = BTreeMap::new();
    for e in &errors {
        let list = top.entry(e.failure_type.as_str()).or_default();
        if list.len() < TOP_ERRORS {
            list.push(json!({
                "message": crate::redaction::redact(&crate::domain::truncate(&e.error_msg, 300)),
                "count": e.count,
            }));
        }
    }
    Ok(json!({
        "since": filter.since,
        "until": filter.until,
        "bucket": if bucket_ms == 3_600_000 { "hour" } else { "day" },
        "totals": totals.json(),
        "buckets": buckets.iter().map(|(start, t)| {
            let mut v = t.json();
            v["start"] = json!(start);
            v
        }).collect::<Vec<_>>(),
        "by_agent": agents.iter().map(|((agent, version), t)| {
            let mut v = t.json();
            v["agent"] = json!(agent);
            v["version"] = json!(version);
            v
        }).collect::<Vec<_>>(),
        "latency_ms": {
            "count": latencies.len(),
            "p50": percentile(&latencies, 0.50),
            "p95": percentile(&latencies, 0.95),
        },
        "top_errors": top,
    }))
}

fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}
