//! Admin APIs beyond tasks and agents: job runs.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::ApiError;
use super::tasks::AdminAuth;
use crate::app::Services;

const LIMIT_MAX: i64 = 500;

pub fn router() -> Router<Arc<Services>> {
    Router::new()
        .route("/api/admin/job-runs", get(job_runs))
        .route("/api/admin/failure-summary", get(failure_summary))
}

/// Longest span one summary may cover.
const SPAN_MAX_MS: i64 = 400 * 86_400_000;
/// Most reply latencies read for the percentiles.
const LATENCY_SAMPLE: i64 = 100_000;
/// Top error messages kept per failure type.
const TOP_ERRORS: usize = 5;

#[derive(Debug, Default, Deserialize)]
pub struct SummaryQuery {
    pub since: Option<String>,
    pub until: Option<String>,
    pub bucket: Option<String>,
    pub agent: Option<String>,
    pub channel: Option<String>,
    pub failure_type: Option<String>,
}

fn millis(field: &str, value: Option<&str>, default: i64) -> Result<i64, ApiError> {
    match value.filter(|v| !v.is_empty()) {
        None => Ok(default),
        Some(v) => v
            .parse::<i64>()
            .map_err(|_| ApiError::BadRequest(format!("`{field}` must be unix milliseconds"))),
    }
}

fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// Counts by status and failure type per bucket, agent and version; success rate; p50/p95
/// webhook-to-reply time; the top (redacted) error messages per failure type.
async fn failure_summary(
    _auth: AdminAuth,
    State(svc): State<Arc<Services>>,
    Query(q): Query<SummaryQuery>,
) -> Result<Json<Value>, ApiError> {
    build_summary(&svc, q).await.map(Json)
}

/// The failure summary as JSON, shared by the API and the admin page.
pub async fn build_summary(svc: &Services, q: SummaryQuery) -> Result<Value, ApiError> {
    use std::collections::BTreeMap;
    let bucket_ms = match q.bucket.as_deref().unwrap_or("hour") {
        "hour" => 3_600_000,
        "day" => 86_400_000,
        other => {
            return Err(ApiError::BadRequest(format!(
                "`bucket` is `{other}`; expected hour or day"
            )));
        }
    };
    let now = crate::domain::now_ms();
    let until = millis("until", q.until.as_deref(), now + 1)?;
    let since = millis("since", q.since.as_deref(), until - 86_400_000)?;
    if since >= until || until - since > SPAN_MAX_MS {
        return Err(ApiError::BadRequest(
            "`since` must be before `until`, at most 400 days apart".into(),
        ));
    }
    let failure_type = match q.failure_type.as_deref().filter(|f| !f.is_empty()) {
        None => None,
        Some(f) => Some(
            crate::domain::FailureType::parse(&f.to_ascii_uppercase())
                .ok_or_else(|| ApiError::BadRequest(format!("unknown `failure_type` {f}")))?,
        ),
    };
    let filter = crate::store::summary::SummaryFilter {
        since,
        until,
        agent: q.agent.filter(|a| !a.is_empty()),
        channel: q.channel.filter(|c| !c.is_empty()),
        failure_type,
    };
    let rows = svc.store.summary_counts(&filter, bucket_ms).await?;
    let mut latencies = svc.store.reply_latencies(&filter, LATENCY_SAMPLE).await?;
    latencies.sort_unstable();
    let errors = svc.store.top_errors(&filter).await?;

    #[derive(Default)]
    struct Tally {
        by_status: BTreeMap<&'static str, i64>,
        by_failure_type: BTreeMap<&'static str, i64>,
    }
    impl Tally {
        fn add(&mut self, row: &crate::store::summary::SummaryRow) {
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
        "since": since,
        "until": until,
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

#[derive(Debug, Deserialize)]
struct JobRunsQuery {
    job: Option<String>,
    limit: Option<String>,
}

async fn job_runs(
    _auth: AdminAuth,
    State(svc): State<Arc<Services>>,
    Query(q): Query<JobRunsQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = match q.limit.as_deref() {
        None | Some("") => 50,
        Some(l) => l
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=LIMIT_MAX).contains(n))
            .ok_or_else(|| ApiError::BadRequest(format!("limit must be 1 to {LIMIT_MAX}")))?,
    };
    let job = q.job.as_deref().filter(|j| !j.is_empty());
    let runs = svc.store.job_runs(job, limit).await?;
    Ok(Json(json!({
        "job_runs": runs.iter().map(|r| json!({
            "id": r.id,
            "job": r.job,
            "instance": r.instance,
            "started_at": r.started_at,
            "finished_at": r.finished_at,
            "status": r.status,
            "scanned": r.scanned,
            "affected": r.affected,
            "error": r.error,
        })).collect::<Vec<_>>(),
    })))
}
