//! Benchmarks: the real server in-process, driven over HTTP with signed webhooks, a built-in
//! mock model with configurable latency and a mock reply receiver. Prints one line of
//! figures per scenario; asserts nothing about speed.
//!
//! ```text
//! cargo run --release --bin assistd-bench -- <ingest|end-to-end|in-flight|steps|context|feedback|mcp-steps|instances|connections|history|provider-limit|knowledge|recovery|all> \
//!     [--db sqlite|postgres] [--n N] [--concurrency C] [--model-latency-ms MS] [--stream-ms MS]
//! ```
//! PostgreSQL runs create a fresh database from ASSISTD_BENCH_POSTGRES_URL (or
//! ASSISTD_TEST_POSTGRES_URL).

use clap::{Parser, ValueEnum};

mod connections;
mod feedback;
mod harness;
mod history;
mod instances;
mod knowledge;
mod mcp;
mod model;
mod scenarios;

use scenarios::*;

pub(crate) const SECRET: &str = "bench-secret";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Scenario {
    Ingest,
    EndToEnd,
    InFlight,
    /// Tasks in flight in a child `assistd`, killed (SIGKILL, then SIGTERM) and restarted.
    Recovery,
    /// A workflow of 20 instant tool steps per task: journalled steps per second.
    Steps,
    /// Resume of a 150-step task: time to rebuild its context from the journal.
    Context,
    /// Streamed answers on Telegram and Slack: time to the first feedback in the chat and
    /// platform calls per answer.
    Feedback,
    /// Journalled MCP read-only tool steps per second against a local streamable-HTTP MCP
    /// server, next to the same number of HTTP tool steps.
    McpSteps,
    /// End-to-end with one `assistd` child and with two on the same database (webhooks
    /// split between them), alternating, three pairs: rates, unanswered messages and
    /// repeated deliveries.
    Instances,
    /// Resident memory per model request held open by a reqwest client alone (a child
    /// process), to set against in-flight's memory per task.
    Connections,
    /// The admin read paths (failure summary, /metrics) over N finished tasks seeded
    /// straight into the database.
    History,
    /// N tasks queued behind a provider limited to 64 calls at once: drain time against the
    /// ideal, and resident memory.
    ProviderLimit,
    /// A knowledge base of N chunks added through the background ingest API, then searched:
    /// chunks per second, search p50 and p99.
    Knowledge,
    /// The child of `connections` (not a scenario of its own).
    #[value(hide = true)]
    ConnectionsChild,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Db {
    Sqlite,
    Postgres,
}

#[derive(Parser, Debug)]
#[command(name = "assistd-bench", about = "Measure assistd on this machine")]
pub(crate) struct Args {
    pub(crate) scenario: Scenario,
    #[arg(long, value_enum, default_value = "sqlite")]
    pub(crate) db: Db,
    /// Messages per scenario (in-flight: conversations in flight at once).
    #[arg(long, default_value_t = 2000)]
    pub(crate) n: usize,
    /// Concurrent HTTP clients sending webhooks.
    #[arg(long, default_value_t = 64)]
    pub(crate) concurrency: usize,
    /// Latency of the mock model for the in-flight scenario, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub(crate) model_latency_ms: u64,
    /// How long the model streams its 50 tokens in the feedback scenario, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) stream_ms: u64,
}

pub(crate) fn db_name(db: Db) -> &'static str {
    match db {
        Db::Sqlite => "sqlite",
        Db::Postgres => "postgres",
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Logs only when asked for (RUST_LOG=…), to stderr: e.g. RUST_LOG=sqlx::query=debug
    // shows every statement a scenario runs.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        match args.scenario {
            Scenario::Ingest => ingest(&args).await,
            Scenario::EndToEnd => end_to_end(&args).await,
            Scenario::InFlight => in_flight(&args).await,
            Scenario::Recovery => recovery(&args).await,
            Scenario::Steps => steps(&args).await,
            Scenario::Context => context(&args).await,
            Scenario::Feedback => feedback::feedback(&args).await,
            Scenario::McpSteps => mcp::mcp_steps(&args).await,
            Scenario::Instances => instances::instances(&args).await,
            Scenario::Connections => connections::connections(&args).await,
            Scenario::History => history::history(&args).await,
            Scenario::ProviderLimit => provider_limit(&args).await,
            Scenario::Knowledge => knowledge::knowledge(&args).await,
            Scenario::ConnectionsChild => connections::child(&args).await,
            Scenario::All => {
                ingest(&args).await?;
                end_to_end(&args).await?;
                in_flight(&args).await?;
                steps(&args).await?;
                context(&args).await?;
                feedback::feedback(&args).await?;
                mcp::mcp_steps(&args).await?;
                instances::instances(&args).await?;
                connections::connections(&args).await?;
                history::history(&args).await?;
                provider_limit(&args).await?;
                knowledge::knowledge(&args).await?;
                recovery(&args).await
            }
        }
    })
}
