//! In-process metrics for `GET /metrics`, exposed in the OpenMetrics text format by
//! `prometheus-client`. Latency histograms and webhook, group-commit and token counters live
//! in this process; task, reply and job counts are read from the database at scrape time, so
//! every instance reports the shared truth for those; the `process_*` families are this
//! process's CPU, memory, threads and file descriptors (`metrics-process`'s collector).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::domain::{FailureType, JobRunStatus, ReplyStatus, TaskStatus};

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the latency buckets, in seconds.
const BOUNDS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A latency histogram with [`BOUNDS`].
pub struct Latency(LazyLock<Histogram>);

impl Latency {
    const fn new() -> Self {
        Latency(LazyLock::new(|| Histogram::new(BOUNDS)))
    }

    pub fn observe(&self, elapsed: Duration) {
        self.0.observe(elapsed.as_secs_f64());
    }
}

/// Model calls, each try.
pub static MODEL_CALL_SECONDS: Latency = Latency::new();
/// Journalled steps, from start to recorded end (including retries).
pub static STEP_SECONDS: Latency = Latency::new();
/// Time from the claim that took a task over (its last owner's lease ran out, or the
/// orphan reclaim put it back) to the first step that claim begins: how long a crash
/// stalls a task once another instance has it.
pub static RECOVERY_SECONDS: Latency = Latency::new();

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    /// `worker.instance_id`: one per process in production, two in a test with two apps.
    instance: String,
    /// `claimed` when the claim took at least one task, `empty` when it found none.
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeliveryLabels {
    instance: String,
    /// `handed` when the reply came leased from this instance's finishing task, `claimed`
    /// when the outbox claimed it.
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceLabels {
    instance: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabels {
    channel: &'static str,
    status: u16,
}

/// This instance's counters. Agents and models are the configured ones and channels a fixed
/// set, so the label sets stay few.
#[derive(Default)]
struct Counters {
    /// Group-commit transactions, by queue (intake, journal).
    group_commits: Family<QueueLabels, Counter>,
    /// The operations those transactions carried.
    group_commit_operations: Family<QueueLabels, Counter>,
    /// Webhook requests by channel and status code.
    webhooks: Family<WebhookLabels, Counter>,
    /// Claims of the task queue by instance and whether they found tasks.
    claims: Family<ClaimLabels, Counter>,
    /// `worker.exclusive` on PostgreSQL: 1 while the instance holds the workers' lease, 0
    /// while it stands by.
    worker_lease: Family<InstanceLabels, Gauge>,
    /// Reply deliveries the outbox started, by instance and where the reply came from.
    deliveries: Family<DeliveryLabels, Counter>,
    /// Claims of due replies by instance's outbox and whether they found replies.
    reply_claims: Family<ClaimLabels, Counter>,
    /// Times the instance took the workers' lease.
    worker_lease_taken: Family<InstanceLabels, Counter>,
    /// Tokens of recorded model calls by (agent, model): (prompt, completion). Kept as plain
    /// sums because the estimated cost is priced at scrape time, with the serving app's prices.
    tokens: Mutex<BTreeMap<(String, String), (u64, u64)>>,
}

static COUNTERS: LazyLock<Counters> = LazyLock::new(Counters::default);

pub fn count_group_commit(queue: &'static str, operations: usize) {
    let labels = QueueLabels { queue };
    COUNTERS.group_commits.get_or_create(&labels).inc();
    COUNTERS
        .group_commit_operations
        .get_or_create(&labels)
        .inc_by(operations as u64);
}

/// Counts the tokens of one recorded model call.
pub fn count_tokens(agent: &str, model: &str, prompt: i64, completion: i64) {
    let mut tokens = COUNTERS.tokens.lock().unwrap_or_else(|p| p.into_inner());
    let entry = tokens
        .entry((agent.to_string(), model.to_string()))
        .or_default();
    entry.0 += prompt.max(0) as u64;
    entry.1 += completion.max(0) as u64;
}

/// Counts one claim of the task queue by `instance` that took `tasks` tasks.
pub fn count_claim(instance: &str, tasks: usize) {
    count_claim_in(&COUNTERS.claims, instance, tasks);
}

/// Counts one claim of due replies by `instance`'s outbox that took `replies` replies.
pub fn count_reply_claim(instance: &str, replies: usize) {
    count_claim_in(&COUNTERS.reply_claims, instance, replies);
}

fn count_claim_in(family: &Family<ClaimLabels, Counter>, instance: &str, took: usize) {
    let result = if took == 0 { "empty" } else { "claimed" };
    family
        .get_or_create(&ClaimLabels {
            instance: instance.to_string(),
            result,
        })
        .inc();
}

/// Counts `n` reply deliveries `instance`'s outbox started with replies from `source`
/// (`handed` or `claimed`).
pub fn count_deliveries(instance: &str, source: &'static str, n: usize) {
    if n == 0 {
        return;
    }
    COUNTERS
        .deliveries
        .get_or_create(&DeliveryLabels {
            instance: instance.to_string(),
            source,
        })
        .inc_by(n as u64);
}

/// Records whether `instance` holds the workers' lease now; `taken` counts a new holding.
pub fn set_worker_lease(instance: &str, held: bool) {
    let labels = InstanceLabels {
        instance: instance.to_string(),
    };
    let gauge = COUNTERS.worker_lease.get_or_create(&labels);
    if held && gauge.set(1) != 1 {
        COUNTERS.worker_lease_taken.get_or_create(&labels).inc();
    } else if !held {
        gauge.set(0);
    }
}

pub fn count_webhook(channel: &'static str, status: u16) {
    COUNTERS
        .webhooks
        .get_or_create(&WebhookLabels { channel, status })
        .inc();
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

type Labels = Vec<(&'static str, String)>;

/// A gauge family filled from database counts: each row's labels and count.
fn counted(
    registry: &mut Registry,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, i64)>,
) {
    let family = Family::<Labels, Gauge>::default();
    for (labels, n) in rows {
        family.get_or_create(&labels).set(n);
    }
    registry.register(name, help, family);
}

/// Rows of `(value, count)` labelled `label = value`.
fn by<T: ToString>(label: &'static str, rows: &[(T, i64)]) -> impl Iterator<Item = (Labels, i64)> {
    rows.iter()
        .map(move |(value, n)| (vec![(label, value.to_string())], *n))
}

/// The whole exposition: database counts plus this instance's histograms and counters and
/// its process metrics. A registry is built per scrape: the database gauges and the estimated
/// cost (which depends on the serving app's prices) are computed now; the instance metrics
/// are handles onto the shared counters.
pub fn render(counts: &MetricCounts, llm: &crate::config::LlmConfig) -> String {
    let mut registry = Registry::default();
    counted(
        &mut registry,
        "assistd_tasks",
        "Tasks by status",
        by("status", &counts.tasks_by_status),
    );
    counted(
        &mut registry,
        "assistd_task_failures",
        "Tasks by failure type",
        by("failure_type", &counts.failures_by_type),
    );
    counted(
        &mut registry,
        "assistd_replies",
        "Outbox replies by status (PENDING = backlog)",
        by("status", &counts.replies_by_status),
    );
    registry.register(
        "assistd_lease_takeovers",
        "Claims of a task beyond its first",
        ConstGauge::new(counts.lease_takeovers),
    );
    counted(
        &mut registry,
        "assistd_job_runs",
        "Scheduled job runs by job and status",
        counts.job_runs.iter().map(|(job, status, n)| {
            (
                vec![("job", job.clone()), ("status", status.to_string())],
                *n,
            )
        }),
    );
    register_local(&mut registry, llm);
    register_process(&mut registry);
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// This instance's counters and histograms.
fn register_local(registry: &mut Registry, llm: &crate::config::LlmConfig) {
    let c = &*COUNTERS;
    registry.register(
        "assistd_webhook_requests",
        "Webhook requests by channel and HTTP status (this instance)",
        c.webhooks.clone(),
    );
    registry.register(
        "assistd_task_claims",
        "Claims of the task queue by instance, and whether they found tasks (empty claims are \
         wake-ups that came to nothing)",
        c.claims.clone(),
    );
    registry.register(
        "assistd_reply_deliveries",
        "Reply deliveries started by instance, by where the reply came from: handed (leased \
         by the instance's own finishing task, PostgreSQL) or claimed from the outbox",
        c.deliveries.clone(),
    );
    registry.register(
        "assistd_reply_claims",
        "Claims of due replies by instance's outbox, and whether they found replies (an empty \
         one is a wake-up, a poll or a finished delivery that came to nothing)",
        c.reply_claims.clone(),
    );
    registry.register(
        "assistd_worker_lease",
        "1 while the instance holds the workers' lease, 0 while it stands by (worker.exclusive, PostgreSQL)",
        c.worker_lease.clone(),
    );
    registry.register(
        "assistd_worker_lease_taken",
        "Times the instance took the workers' lease (worker.exclusive, PostgreSQL)",
        c.worker_lease_taken.clone(),
    );
    registry.register(
        "assistd_group_commits",
        "Group-commit transactions by queue (this instance)",
        c.group_commits.clone(),
    );
    registry.register(
        "assistd_group_commit_operations",
        "Operations carried by those transactions (operations / transactions = mean batch)",
        c.group_commit_operations.clone(),
    );
    register_tokens(registry, llm);
    for (name, help, latency) in [
        (
            "assistd_recovery",
            "From the claim that took a task over after a lost lease to its next step (this instance)",
            &RECOVERY_SECONDS,
        ),
        (
            "assistd_model_call",
            "Model call latency (this instance)",
            &MODEL_CALL_SECONDS,
        ),
        (
            "assistd_step",
            "Step latency including retries (this instance)",
            &STEP_SECONDS,
        ),
    ] {
        registry.register_with_unit(name, help, Unit::Seconds, (*latency.0).clone());
    }
}

type Labelled<N = u64> = Family<Labels, Counter<N, AtomicU64>>;

/// The tokens counted so far, and their cost at `llm.prices` (models without a price are
/// left out of the cost).
fn register_tokens(registry: &mut Registry, llm: &crate::config::LlmConfig) {
    let counted = COUNTERS
        .tokens
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let tokens = Labelled::<u64>::default();
    let cost = Labelled::<f64>::default();
    for ((agent, model), (prompt, completion)) in counted {
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            tokens
                .get_or_create(&vec![
                    ("agent", agent.clone()),
                    ("model", model.clone()),
                    ("kind", kind.to_string()),
                ])
                .inc_by(n);
        }
        if let Some(price) = llm.prices.get(&model) {
            cost.get_or_create(&vec![
                ("agent", agent),
                ("model", model),
                ("currency", llm.price_currency.clone()),
            ])
            .inc_by(price.cost(prompt as i64, completion as i64));
        }
    }
    registry.register(
        "assistd_model_tokens",
        "Model tokens of recorded calls by agent, model and kind (prompt, completion; this instance)",
        tokens,
    );
    registry.register(
        "assistd_model_estimated_cost",
        "Estimated cost of those tokens at llm.prices, by agent, model and currency (models with a price; this instance)",
        cost,
    );
}

/// The standard `process_*` families, read now (Linux: `/proc/self`).
fn register_process(registry: &mut Registry) {
    let m = metrics_process::collector::collect();
    if let Some(cpu) = m.cpu_seconds_total {
        registry.register_with_unit(
            "process_cpu",
            "Total user and system CPU time spent in seconds",
            Unit::Seconds,
            ConstCounter::new(cpu),
        );
    }
    let gauges = [
        (
            "process_open_fds",
            "Number of open file descriptors",
            m.open_fds,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors",
            m.max_fds,
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            m.virtual_memory_bytes,
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            m.resident_memory_bytes,
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch in seconds",
            m.start_time_seconds,
        ),
        (
            "process_threads",
            "Number of OS threads in the process",
            m.threads,
        ),
    ];
    for (name, help, value) in gauges {
        if let Some(value) = value {
            registry.register(name, help, ConstGauge::new(value as i64));
        }
    }
}
