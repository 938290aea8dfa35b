//! Reports built from the store's counts: the failure summary behind
//! `GET /api/admin/failure-summary` and the dashboard (the web layer only checks the query).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::store::summary::{SummaryFilter, SummaryRow};
use crate::store::{Store, StoreResult};

/// Top error messages kept per failure type.
const TOP_ERRORS: usize = 5;

/// Replies not getting through listed on the summary.
const STUCK_REPLIES: i64 = 50;

/// Counts by status, failure type and delivery of the answer per bucket (`bucket_ms`
/// wide), agent and version; the success rate (a task counts only once its answer was
/// delivered) beside the outcome rate; p50/p95 webhook-to-answer time (upper bounds of the
/// histogram's buckets); the top (redacted) error messages per failure type among the
/// newest failures; answers per platform, the outbox backlog and the replies not getting
/// through. The window is widened to whole hours, the rollups' grain (`since` and `until`
/// in the answer are the ones used).
pub async fn failure_summary(
    store: &Store,
    filter: &SummaryFilter,
    bucket_ms: i64,
    llm: &crate::config::LlmConfig,
) -> StoreResult<Value> {
    let filter = &filter.whole_hours();
    // Independent reads, each on a connection of its own.
    let (rows, latencies, errors, delivery, tokens) = tokio::try_join!(
        store.summary_counts(filter, bucket_ms),
        store.answer_latencies(filter),
        store.top_errors(filter, crate::store::summary::ERROR_SAMPLE),
        delivery(store, filter),
        tokens(store, filter, llm),
    )?;

    #[derive(Default)]
    struct Tally {
        by_status: BTreeMap<&'static str, i64>,
        by_failure_type: BTreeMap<&'static str, i64>,
        /// Where each task's answer stands; NONE while it has none.
        answers: BTreeMap<String, i64>,
        succeeded_and_delivered: i64,
    }
    impl Tally {
        fn add(&mut self, row: &SummaryRow) {
            *self.by_status.entry(row.status.as_str()).or_default() += row.count;
            if let Some(f) = row.failure_type {
                *self.by_failure_type.entry(f.as_str()).or_default() += row.count;
            }
            let delivery = row.delivery.clone().unwrap_or_else(|| "NONE".into());
            if row.status == crate::domain::TaskStatus::Succeeded && delivery == "DELIVERED" {
                self.succeeded_and_delivered += row.count;
            }
            *self.answers.entry(delivery).or_default() += row.count;
        }
        fn json(&self) -> Value {
            let count = |s: &str| self.by_status.get(s).copied().unwrap_or(0);
            let done = count("SUCCEEDED") + count("FAILED") + count("CANCELLED");
            let rate = |n: i64| (done > 0).then(|| n as f64 / done as f64);
            json!({
                "tasks": self.by_status.values().sum::<i64>(),
                "by_status": self.by_status,
                "by_failure_type": self.by_failure_type,
                "answers": self.answers,
                "answered": self.succeeded_and_delivered,
                "success_rate": rate(self.succeeded_and_delivered),
                "outcome_success_rate": rate(count("SUCCEEDED")),
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
        "delivery": delivery,
        "tokens": tokens,
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
            "count": latencies.iter().map(|(_, n)| n).sum::<i64>(),
            "p50": percentile(&latencies, 0.50),
            "p95": percentile(&latencies, 0.95),
        },
        "top_errors": top,
    }))
}

/// Delivery per platform in the window (replies by state) with each platform's outbox
/// backlog now (count, age of the oldest), and the replies not getting through.
async fn delivery(store: &Store, filter: &SummaryFilter) -> StoreResult<Value> {
    let now = crate::domain::now_ms();
    let (by_channel, backlogs, stuck) = tokio::try_join!(
        store.delivery_by_channel(filter),
        store.outbox_backlog(),
        store.stuck_replies(filter, STUCK_REPLIES),
    )?;
    let mut channels: BTreeMap<String, Value> = BTreeMap::new();
    let blank = || json!({ "DELIVERED": 0, "PENDING": 0, "FAILED": 0, "UNKNOWN": 0, "backlog": 0, "oldest_pending_age_ms": null });
    for row in by_channel {
        channels.entry(row.channel).or_insert_with(blank)[row.state.as_str()] = json!(row.count);
    }
    let (mut backlog, mut oldest) = (0, None::<i64>);
    for (channel, count, first) in backlogs {
        let entry = channels.entry(channel).or_insert_with(blank);
        entry["backlog"] = json!(count);
        entry["oldest_pending_age_ms"] = json!(now - first);
        backlog += count;
        oldest = Some(oldest.map_or(first, |o| o.min(first)));
    }
    Ok(json!({
        "backlog": backlog,
        "oldest_pending_age_ms": oldest.map(|first| now - first),
        "by_channel": channels.into_iter().map(|(channel, mut v)| {
            v["channel"] = json!(channel);
            v
        }).collect::<Vec<_>>(),
        "stuck": stuck.iter().map(|r| json!({
            "id": r.id,
            "task_id": r.task_id,
            "channel": r.channel,
            "conversation_id": r.conversation_id,
            "status": r.status,
            "attempts": r.attempts,
            "last_error": r.last_error.as_deref().map(|e| {
                crate::redaction::redact(&crate::domain::truncate(e, 300))
            }),
            "created_at": r.created_at,
            "next_attempt_at": r.next_attempt_at,
        })).collect::<Vec<_>>(),
    }))
}

/// Model calls, tokens and the estimated cost (`llm.prices`, in `llm.price_currency`) per
/// agent and model; the cost is `null` for a model without a price.
async fn tokens(
    store: &Store,
    filter: &SummaryFilter,
    llm: &crate::config::LlmConfig,
) -> StoreResult<Value> {
    let rows = store.tokens_by_agent_model(filter).await?;
    let mut total_cost = 0.0;
    let by_agent_model: Vec<Value> = rows
        .iter()
        .map(|r| {
            let price = r.model.as_ref().and_then(|m| llm.prices.get(m));
            let cost = price.map(|p| p.cost(r.prompt_tokens, r.completion_tokens));
            total_cost += cost.unwrap_or(0.0);
            json!({
                "agent": r.agent,
                "model": r.model,
                "calls": r.calls,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "estimated_cost": cost,
            })
        })
        .collect();
    Ok(json!({
        "currency": llm.price_currency,
        "estimated_cost": total_cost,
        "by_agent_model": by_agent_model,
    }))
}

/// The upper bound of the histogram bucket (`(bound, count)`, ascending) that holds the
/// `p` quantile.
fn percentile(histogram: &[(i64, i64)], p: f64) -> Option<i64> {
    let total: i64 = histogram.iter().map(|(_, n)| n).sum();
    if total <= 0 {
        return None;
    }
    let rank = ((p * total as f64).ceil() as i64).clamp(1, total);
    let mut seen = 0;
    histogram.iter().find_map(|(bound, n)| {
        seen += n;
        (seen >= rank).then_some(*bound)
    })
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_are_the_bounds_of_the_buckets_holding_them() {
        assert_eq!(percentile(&[], 0.5), None);
        let h = [(100, 5), (250, 4), (1000, 1)];
        assert_eq!(percentile(&h, 0.5), Some(100));
        assert_eq!(percentile(&h, 0.51), Some(250));
        assert_eq!(percentile(&h, 0.9), Some(250));
        assert_eq!(percentile(&h, 0.95), Some(1000));
        assert_eq!(percentile(&[(500, 1)], 0.0), Some(500));
    }
}
