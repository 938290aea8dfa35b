//! In-process metrics for `GET /metrics` (Prometheus text format). Latency histograms and
//! webhook counters live here; task, reply and job counts are read from the database at
//! scrape time, so every instance reports the shared truth for those.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::domain::{FailureType, JobRunStatus, ReplyStatus, TaskStatus};

/// Upper bounds of the latency buckets, in seconds.
const BOUNDS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

pub struct Histogram {
    buckets: [AtomicU64; BOUNDS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    const fn new() -> Self {
        Histogram {
            buckets: [const { AtomicU64::new(0) }; BOUNDS.len()],
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        for (i, bound) in BOUNDS.iter().enumerate() {
            if secs <= *bound {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, bound) in BOUNDS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                self.buckets[i].load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// Model calls, each try.
pub static MODEL_CALL_SECONDS: Histogram = Histogram::new();
/// Journalled steps, from start to recorded end (including retries).
pub static STEP_SECONDS: Histogram = Histogram::new();
/// Group-commit transactions and the operations they carried, by queue (intake, journal).
static GROUP_COMMITS: Mutex<BTreeMap<&'static str, (u64, u64)>> = Mutex::new(BTreeMap::new());

pub fn count_group_commit(queue: &'static str, operations: usize) {
    let mut map = GROUP_COMMITS.lock().unwrap_or_else(|p| p.into_inner());
    let entry = map.entry(queue).or_default();
    entry.0 += 1;
    entry.1 += operations as u64;
}

/// Time from the claim that took a task over (its last owner's lease ran out, or the
/// orphan reclaim put it back) to the first step that claim begins: how long a crash
/// stalls a task once another instance has it.
pub static RECOVERY_SECONDS: Histogram = Histogram::new();

/// Model tokens by (agent, model): (prompt, completion). Agents and models are the
/// configured ones, so the label sets stay few.
static TOKENS: Mutex<BTreeMap<(String, String), (u64, u64)>> = Mutex::new(BTreeMap::new());

/// Counts the tokens of one recorded model call.
pub fn count_tokens(agent: &str, model: &str, prompt: i64, completion: i64) {
    let mut map = TOKENS.lock().unwrap_or_else(|p| p.into_inner());
    let entry = map
        .entry((agent.to_string(), model.to_string()))
        .or_default();
    entry.0 += prompt.max(0) as u64;
    entry.1 += completion.max(0) as u64;
}

/// Webhook requests by (channel, status code); the channel is one of a fixed set.
static WEBHOOKS: Mutex<BTreeMap<(&'static str, u16), u64>> = Mutex::new(BTreeMap::new());

pub fn count_webhook(channel: &'static str, status: u16) {
    let mut map = WEBHOOKS.lock().unwrap_or_else(|p| p.into_inner());
    *map.entry((channel, status)).or_default() += 1;
}

/// A label value as the exposition format wants it: `\`, `"` and newlines escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Counts for the metrics endpoint.
#[derive(Debug, Clone, Default)]
pub struct MetricCounts {
    pub tasks_by_status: Vec<(TaskStatus, i64)>,
    pub failures_by_type: Vec<(FailureType, i64)>,
    pub replies_by_status: Vec<(ReplyStatus, i64)>,
    pub job_runs: Vec<(String, JobRunStatus, i64)>,
    pub lease_takeovers: i64,
}

/// The whole exposition: database counts plus this instance's histograms and counters.
pub fn render(counts: &MetricCounts, llm: &crate::config::LlmConfig) -> String {
    let mut out = String::new();
    family(&mut out, "assistd_tasks", "gauge", "Tasks by status.");
    for (status, n) in &counts.tasks_by_status {
        let _ = writeln!(out, "assistd_tasks{{status=\"{status}\"}} {n}");
    }
    family(
        &mut out,
        "assistd_task_failures",
        "gauge",
        "Tasks by failure type.",
    );
    for (failure, n) in &counts.failures_by_type {
        let _ = writeln!(
            out,
            "assistd_task_failures{{failure_type=\"{failure}\"}} {n}"
        );
    }
    family(
        &mut out,
        "assistd_replies",
        "gauge",
        "Outbox replies by status (PENDING = backlog).",
    );
    for (status, n) in &counts.replies_by_status {
        let _ = writeln!(out, "assistd_replies{{status=\"{status}\"}} {n}");
    }
    family(
        &mut out,
        "assistd_lease_takeovers",
        "gauge",
        "Claims of a task beyond its first.",
    );
    let _ = writeln!(out, "assistd_lease_takeovers {}", counts.lease_takeovers);
    family(
        &mut out,
        "assistd_job_runs",
        "gauge",
        "Scheduled job runs by job and status.",
    );
    for (job, status, n) in &counts.job_runs {
        let _ = writeln!(
            out,
            "assistd_job_runs{{job=\"{}\",status=\"{status}\"}} {n}",
            label(job)
        );
    }
    render_local(&mut out, llm);
    out
}

/// This instance's counters and histograms.
fn render_local(out: &mut String, llm: &crate::config::LlmConfig) {
    family(
        out,
        "assistd_webhook_requests_total",
        "counter",
        "Webhook requests by channel and HTTP status (this instance).",
    );
    for ((channel, status), n) in WEBHOOKS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(
            out,
            "assistd_webhook_requests_total{{channel=\"{channel}\",status=\"{status}\"}} {n}"
        );
    }
    let groups = GROUP_COMMITS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    family(
        out,
        "assistd_group_commits_total",
        "counter",
        "Group-commit transactions by queue (this instance).",
    );
    for (queue, (batches, _)) in &groups {
        let _ = writeln!(
            out,
            "assistd_group_commits_total{{queue=\"{queue}\"}} {batches}"
        );
    }
    family(
        out,
        "assistd_group_commit_operations_total",
        "counter",
        "Operations carried by those transactions (operations / transactions = mean batch).",
    );
    for (queue, (_, ops)) in &groups {
        let _ = writeln!(
            out,
            "assistd_group_commit_operations_total{{queue=\"{queue}\"}} {ops}"
        );
    }
    family(
        out,
        "assistd_model_tokens_total",
        "counter",
        "Model tokens of recorded calls by agent, model and kind (prompt, completion; this instance).",
    );
    let tokens = TOKENS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for ((agent, model), (prompt, completion)) in &tokens {
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            let _ = writeln!(
                out,
                "assistd_model_tokens_total{{agent=\"{}\",model=\"{}\",kind=\"{kind}\"}} {n}",
                label(agent),
                label(model)
            );
        }
    }
    family(
        out,
        "assistd_model_estimated_cost_total",
        "counter",
        "Estimated cost of those tokens at llm.prices, by agent, model and currency (models with a price; this instance).",
    );
    for ((agent, model), (prompt, completion)) in &tokens {
        if let Some(price) = llm.prices.get(model) {
            let _ = writeln!(
                out,
                "assistd_model_estimated_cost_total{{agent=\"{}\",model=\"{}\",currency=\"{}\"}} {}",
                label(agent),
                label(model),
                label(&llm.price_currency),
                price.cost(*prompt as i64, *completion as i64)
            );
        }
    }
    RECOVERY_SECONDS.render(
        out,
        "assistd_recovery_seconds",
        "From the claim that took a task over after a lost lease to its next step (this instance).",
    );
    MODEL_CALL_SECONDS.render(
        out,
        "assistd_model_call_seconds",
        "Model call latency (this instance).",
    );
    STEP_SECONDS.render(
        out,
        "assistd_step_seconds",
        "Step latency including retries (this instance).",
    );
}
