//! Benchmarks: the real server in-process, driven over HTTP with signed webhooks, a built-in
//! mock model with configurable latency and a mock reply receiver. Prints one line of
//! figures per scenario; asserts nothing about speed.
//!
//! ```text
//! cargo run --release --bin assistd-bench -- <ingest|end-to-end|in-flight|all> \
//!     [--db sqlite|postgres] [--n N] [--concurrency C] [--model-latency-ms MS]
//! ```
//! PostgreSQL runs create a fresh database from ASSISTD_BENCH_POSTGRES_URL (or
//! ASSISTD_TEST_POSTGRES_URL).
// long file: one harness, one function per scenario; they share the server, mocks and load generator.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::Router;
use axum::routing::post;
use clap::{Parser, ValueEnum};
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use assistd::config::{Config, Role};

const SECRET: &str = "bench-secret";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Ingest,
    EndToEnd,
    InFlight,
    /// Tasks in flight in a child `assistd`, killed (SIGKILL, then SIGTERM) and restarted.
    Recovery,
    /// A workflow of 20 instant tool steps per task: journalled steps per second.
    Steps,
    /// Resume of a 150-step task: time to rebuild its context from the journal.
    Context,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Db {
    Sqlite,
    Postgres,
}

#[derive(Parser, Debug)]
#[command(name = "assistd-bench", about = "Measure assistd on this machine")]
struct Args {
    scenario: Scenario,
    #[arg(long, value_enum, default_value = "sqlite")]
    db: Db,
    /// Messages per scenario (in-flight: conversations in flight at once).
    #[arg(long, default_value_t = 2000)]
    n: usize,
    /// Concurrent HTTP clients sending webhooks.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Latency of the mock model for the in-flight scenario, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    model_latency_ms: u64,
}

/// A fresh database for one scenario; dropped (PostgreSQL) at the end.
struct BenchDb {
    url: String,
    _dir: Option<tempfile::TempDir>,
    admin: Option<(String, String)>,
}

impl BenchDb {
    async fn new(db: Db) -> anyhow::Result<BenchDb> {
        match db {
            Db::Sqlite => {
                let dir = tempfile::tempdir()?;
                Ok(BenchDb {
                    url: format!("sqlite://{}/bench.db", dir.path().display()),
                    _dir: Some(dir),
                    admin: None,
                })
            }
            Db::Postgres => {
                use sqlx::Connection;
                let admin = std::env::var("ASSISTD_BENCH_POSTGRES_URL")
                    .or_else(|_| std::env::var("ASSISTD_TEST_POSTGRES_URL"))
                    .context("set ASSISTD_BENCH_POSTGRES_URL for --db postgres")?;
                let name = format!("assistd_bench_{}", uuid::Uuid::new_v4().simple());
                let mut conn = sqlx::PgConnection::connect(&admin).await?;
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut conn)
                    .await?;
                let mut url = reqwest::Url::parse(&admin)?;
                url.set_path(&format!("/{name}"));
                Ok(BenchDb {
                    url: url.to_string(),
                    _dir: None,
                    admin: Some((admin, name)),
                })
            }
        }
    }

    async fn drop_db(&self) {
        if let Some((admin, name)) = &self.admin {
            use sqlx::Connection;
            if let Ok(mut conn) = sqlx::PgConnection::connect(admin).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut conn)
                    .await;
            }
        }
    }
}

/// The mock model and reply receiver, in one small server.
struct Mocks {
    addr: SocketAddr,
    model_calls: Arc<AtomicUsize>,
    /// Most model calls open at the same time.
    max_in_flight: Arc<AtomicUsize>,
    replies: Arc<AtomicUsize>,
    replied: Arc<Notify>,
    /// When the mocks started; the marks below are milliseconds since then.
    epoch: Instant,
    /// Latest arrival of a model call.
    last_call_ms: Arc<AtomicU64>,
    /// First arrival of a reply.
    first_reply_ms: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Mocks {
    /// A mark as seconds after `since` (which must be after `epoch`).
    fn mark_after(&self, mark: &AtomicU64, since: Instant) -> f64 {
        let at = self.epoch + Duration::from_millis(mark.load(Ordering::Relaxed));
        at.saturating_duration_since(since).as_secs_f64()
    }
}

async fn start_mocks(model_latency: Duration) -> anyhow::Result<Mocks> {
    let replies = Arc::new(AtomicUsize::new(0));
    let replied = Arc::new(Notify::new());
    let model_calls = Arc::new(AtomicUsize::new(0));
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (r, n, calls) = (replies.clone(), replied.clone(), model_calls.clone());
    let peak = max_in_flight.clone();
    let epoch = Instant::now();
    let last_call_ms = Arc::new(AtomicU64::new(0));
    let first_reply_ms = Arc::new(AtomicU64::new(u64::MAX));
    let (last_call, first_reply) = (last_call_ms.clone(), first_reply_ms.clone());
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(move |body: axum::Json<Value>| async move {
                calls.fetch_add(1, Ordering::Relaxed);
                last_call.fetch_max(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                let now_open = open.fetch_add(1, Ordering::Relaxed) + 1;
                peak.fetch_max(now_open, Ordering::Relaxed);
                if !model_latency.is_zero() {
                    tokio::time::sleep(model_latency).await;
                }
                open.fetch_sub(1, Ordering::Relaxed);
                let last = body["messages"]
                    .as_array()
                    .and_then(|m| m.last())
                    .and_then(|m| m["content"].as_str())
                    .unwrap_or("")
                    .to_string();
                axum::Json(json!({"choices": [{"message": {"role": "assistant", "content": format!("answer to: {last}")},
                    "finish_reason": "stop"}], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}))
            }),
        )
        .route("/tool", axum::routing::get(|| async { axum::Json(json!({"ok": true})) }))
        .route(
            "/reply",
            post(move || async move {
                r.fetch_add(1, Ordering::Relaxed);
                first_reply.fetch_min(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                n.notify_waiters();
                "ok"
            }),
        );
    // A burst of model calls (all of `recovery`'s tasks resuming at once, `in-flight`'s
    // 10,000) must not overflow the accept queue: dropped SYNs are retried a second later,
    // which the figures would count as the server's delay.
    let listener = assistd::app::listen("127.0.0.1:0", 4096)?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { s.cancelled().await })
            .await;
    });
    Ok(Mocks {
        addr,
        model_calls,
        max_in_flight,
        replies,
        replied,
        epoch,
        last_call_ms,
        first_reply_ms,
        stop,
    })
}

fn bench_config(
    db_url: &str,
    mocks: &Mocks,
    role: Role,
    concurrency: usize,
) -> anyhow::Result<Config> {
    // ASSISTD_* variables apply (for experiments, e.g. ASSISTD_INTAKE__WRITERS=1), except
    // for the keys set below.
    let mut c = Config::load_with_env(None, std::env::vars())?;
    c.server.listen = "127.0.0.1:0".into();
    c.server.role = role;
    c.database.url = db_url.into();
    c.database.max_connections = 16;
    c.llm.base_url = format!("http://{}/v1", mocks.addr);
    c.llm.timeout_secs = 120;
    c.worker.instance_id = "bench".into();
    c.worker.concurrency = concurrency;
    c.worker.claim_batch = 256;
    c.worker.poll_interval_ms = 50;
    c.outbox.batch = 256;
    c.outbox.poll_interval_ms = 50;
    c.admin.token = "bench-admin".into();
    c.channels.generic.secret = SECRET.into();
    c.channels.generic.reply_url = format!("http://{}/reply", mocks.addr);
    c.channels.console.enabled = false;
    c.scheduler.enabled = false;
    Ok(c)
}

struct Server {
    addr: SocketAddr,
    worker: Arc<assistd::engine::Worker>,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn start_server(config: Config) -> anyhow::Result<Server> {
    let app = assistd::App::build(config).await?;
    let addr = app.local_addr();
    let worker = app.worker();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(app.run_until_stopped(stop.clone()));
    Ok(Server {
        addr,
        worker,
        stop,
        handle,
    })
}

impl Server {
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.handle.await;
    }
}

/// Sends `n` signed messages (each its own conversation) from `concurrency` clients;
/// returns the acknowledgement latencies.
async fn send_messages(
    addr: SocketAddr,
    n: usize,
    concurrency: usize,
    tag: &str,
) -> anyhow::Result<Vec<Duration>> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let next = next.clone();
        let tag = tag.to_string();
        clients.spawn(async move {
            let http = reqwest::Client::new();
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                let body = serde_json::to_vec(&json!({
                    "event_id": format!("{tag}-e{i}"), "message_id": format!("{tag}-m{i}"),
                    "conversation_id": format!("{tag}-c{i}"), "sender_id": "bench", "text": format!("question {i}"),
                }))?;
                let ts = assistd::domain::now_ms() / 1000;
                let sig = assistd::channels::generic::sign(SECRET, ts, &body);
                let started = Instant::now();
                let resp = http
                    .post(format!("http://{addr}/webhooks/generic"))
                    .header("X-Assistd-Timestamp", ts.to_string())
                    .header("X-Assistd-Signature", sig)
                    .body(body)
                    .send()
                    .await?;
                if !resp.status().is_success() {
                    bail!("webhook answered {}", resp.status());
                }
                latencies.push(started.elapsed());
            }
        });
    }
    let mut all = Vec::with_capacity(n);
    while let Some(r) = clients.join_next().await {
        all.extend(r??);
    }
    Ok(all)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

async fn wait_replies(mocks: &Mocks, n: usize, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while mocks.replies.load(Ordering::Relaxed) < n {
        if Instant::now() > deadline {
            bail!(
                "only {} of {n} replies after {timeout:?}",
                mocks.replies.load(Ordering::Relaxed)
            );
        }
        tokio::select! {
            _ = mocks.replied.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    Ok(())
}

/// Resident set size of this process, in KiB.
/// Resident memory of process `pid` (`VmRSS`, or `VmHWM` = its peak), in KiB.
fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn db_name(db: Db) -> &'static str {
    match db {
        Db::Sqlite => "sqlite",
        Db::Postgres => "postgres",
    }
}

async fn ingest(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    // Intake only: no workers competing for the database.
    let server = start_server(bench_config(&db.url, &mocks, Role::Api, 256)?).await?;
    let started = Instant::now();
    let mut latencies = send_messages(server.addr, args.n, args.concurrency, "ingest").await?;
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    println!(
        "scenario=ingest db={} n={} concurrency={} rate={:.0}/s p50={:.2}ms p99={:.2}ms",
        db_name(args.db),
        args.n,
        args.concurrency,
        args.n as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99)
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

async fn end_to_end(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let server = start_server(bench_config(&db.url, &mocks, Role::All, 256)?).await?;
    let started = Instant::now();
    send_messages(server.addr, args.n, args.concurrency, "e2e").await?;
    wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed();
    println!(
        "scenario=end-to-end db={} n={} concurrency={} rate={:.0}/s wall={:.2}s",
        db_name(args.db),
        args.n,
        args.concurrency,
        args.n as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

/// The server runs as a child `assistd` so its memory is measured alone (the mock model,
/// which holds a connection per call, and the load generator stay in this process).
async fn in_flight(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let latency = Duration::from_millis(args.model_latency_ms);
    let mocks = start_mocks(latency).await?;
    let port = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()?
        .port();
    let mut child = spawn_child(&db.url, &mocks, port, 0, args.n.max(1), None)?;
    wait_ready(port).await?;
    let pid = child.id();
    let baseline = rss_kib(pid, "VmRSS:");
    let started = Instant::now();
    let mut acks = send_messages(
        format!("127.0.0.1:{port}").parse()?,
        args.n,
        args.concurrency,
        "inflight",
    )
    .await?;
    let ingest_time = started.elapsed();
    acks.sort_unstable();
    wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
    let wall = started.elapsed();
    let peak = rss_kib(pid, "VmHWM:");
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "scenario=in-flight db={} n={} model_latency={}ms wall={:.2}s ingest={:.2}s ack_p50={:.2}ms ack_p99={:.2}ms last_call={:.2}s first_reply={:.2}s max_in_flight={} baseline_rss={:.1}MiB peak_rss={:.1}MiB rss_per_task={:.1}KiB",
        db_name(args.db),
        args.n,
        args.model_latency_ms,
        wall.as_secs_f64(),
        ingest_time.as_secs_f64(),
        percentile(&acks, 0.50),
        percentile(&acks, 0.99),
        mocks.mark_after(&mocks.last_call_ms, started),
        mocks.mark_after(&mocks.first_reply_ms, started),
        mocks.max_in_flight.load(Ordering::Relaxed),
        baseline as f64 / 1024.0,
        peak as f64 / 1024.0,
        // Per task actually in flight at the peak, not per message sent.
        peak.saturating_sub(baseline) as f64
            / mocks.max_in_flight.load(Ordering::Relaxed).max(1) as f64
    );
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

/// Starts `assistd serve` (the binary next to this one) as a child on `port`, on SQLite or
/// PostgreSQL. Its log (warnings and errors; it logs to stdout) goes to `log` when given
/// (appended), else nowhere.
fn spawn_child(
    db_url: &str,
    mocks: &Mocks,
    port: u16,
    grace_secs: u64,
    concurrency: usize,
    log: Option<&std::path::Path>,
) -> anyhow::Result<std::process::Child> {
    let (stdout, stderr) = match log {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            (
                std::process::Stdio::from(file.try_clone()?),
                std::process::Stdio::from(file),
            )
        }
        None => (std::process::Stdio::null(), std::process::Stdio::null()),
    };
    let exe = std::env::current_exe()?.with_file_name("assistd");
    Ok(std::process::Command::new(exe)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ASSISTD_SERVER__LISTEN", format!("127.0.0.1:{port}"))
        .env("ASSISTD_DATABASE__URL", db_url)
        .env("ASSISTD_LLM__BASE_URL", format!("http://{}/v1", mocks.addr))
        .env("ASSISTD_LLM__TIMEOUT_SECS", "120")
        .env("ASSISTD_CHANNELS__GENERIC__SECRET", SECRET)
        .env(
            "ASSISTD_CHANNELS__GENERIC__REPLY_URL",
            format!("http://{}/reply", mocks.addr),
        )
        .env("ASSISTD_ADMIN__TOKEN", "bench-admin")
        .env("ASSISTD_WORKER__INSTANCE_ID", "bench-child")
        .env("ASSISTD_WORKER__CONCURRENCY", concurrency.to_string())
        .env("ASSISTD_WORKER__CLAIM_BATCH", "256")
        .env(
            "ASSISTD_WORKER__SHUTDOWN_GRACE_SECS",
            grace_secs.to_string(),
        )
        .env("ASSISTD_LOG__LEVEL", "warn")
        .stdout(stdout)
        .stderr(stderr)
        .spawn()?)
}

async fn wait_ready(port: u16) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = http
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("child did not become ready");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_calls(mocks: &Mocks, n: usize, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while mocks.model_calls.load(Ordering::Relaxed) < n {
        if Instant::now() > deadline {
            bail!(
                "only {} of {n} model calls",
                mocks.model_calls.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

async fn recovery(args: &Args) -> anyhow::Result<()> {
    for (signal, grace) in [("KILL", 0u64), ("TERM", 0u64)] {
        let db = BenchDb::new(args.db).await?;
        // The model answers slowly enough that every task is in flight when the process dies.
        let mocks = start_mocks(Duration::from_millis(args.model_latency_ms.max(5_000))).await?;
        let port = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await?
            .local_addr()?
            .port();
        let mut child = spawn_child(&db.url, &mocks, port, grace, 4096, None)?;
        wait_ready(port).await?;
        send_messages(
            format!("127.0.0.1:{port}").parse()?,
            args.n,
            args.concurrency,
            "rec",
        )
        .await?;
        wait_calls(&mocks, args.n, Duration::from_secs(300)).await?;
        let _ = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status();
        let _ = child.wait();
        let calls_before = mocks.model_calls.load(Ordering::Relaxed);
        let logs = tempfile::tempdir()?;
        let log = logs.path().join("restarted.log");
        let restarted = Instant::now();
        let mut child = spawn_child(&db.url, &mocks, port, grace, 4096, Some(&log))?;
        wait_ready(port).await?;
        let ready = restarted.elapsed();
        // When 90 % of the tasks were running again: a late tail points at the claim loop's
        // fallback poll, a late start at the restart itself.
        let most = calls_before + args.n * 9 / 10;
        wait_calls(&mocks, most, Duration::from_secs(300)).await?;
        let most_resumed = restarted.elapsed();
        wait_calls(&mocks, calls_before + args.n, Duration::from_secs(300)).await?;
        let resumed = restarted.elapsed();
        wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
        let done = restarted.elapsed();
        println!(
            "scenario=recovery db={} signal=SIG{signal} n={} ready={:.3}s all_resumed={:.3}s all_done={:.3}s",
            db_name(args.db),
            args.n,
            ready.as_secs_f64(),
            resumed.as_secs_f64(),
            done.as_secs_f64()
        );
        if resumed > Duration::from_secs(1) {
            let warnings = std::fs::read_to_string(&log).unwrap_or_default();
            eprintln!(
                "recovery: resuming took over 1 s; 90 % were running again after {:.3}s; the \
                 restarted child logged {} warning or error line(s):",
                most_resumed.as_secs_f64(),
                warnings.lines().count()
            );
            for line in warnings.lines().take(20) {
                eprintln!("  {line}");
            }
        }
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let _ = child.wait();
        mocks.stop.cancel();
        db.drop_db().await;
    }
    Ok(())
}

/// Steps per task in the `steps` scenario.
const WORKFLOW_STEPS: usize = 20;

/// A server whose agent `steps` runs a workflow of `n_steps` instant read-only tool calls
/// (answered by the mock) and then replies; the temp dir holds its files.
async fn tool_chain_server(
    db: &BenchDb,
    mocks: &Mocks,
    n_steps: usize,
) -> anyhow::Result<(Server, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let mut nodes: Vec<Value> = (0..n_steps)
        .map(|i| {
            let next = if i + 1 == n_steps {
                "done".to_string()
            } else {
                format!("s{}", i + 1)
            };
            json!({"id": format!("s{i}"), "type": "tool", "tool": "ping", "args": {}, "next": next})
        })
        .collect();
    nodes.push(json!({"id": "done", "type": "reply", "text": "done"}));
    let workflow = dir.path().join("steps.json");
    std::fs::write(
        &workflow,
        json!({"start": "s0", "nodes": nodes}).to_string(),
    )?;
    let overlay = dir.path().join("steps.toml");
    std::fs::write(
        &overlay,
        format!(
            "[tooling]\nallowed_private_hosts = [\"127.0.0.1\"]\n\n[tools.ping]\nkind = \"read_only\"\nmethod = \"GET\"\nurl = \"http://{}/tool\"\n\n[agents.steps]\nmode = \"workflow\"\nsystem_prompt = \"bench\"\nworkflow_file = \"{}\"\n",
            mocks.addr,
            workflow.display()
        ),
    )?;
    let mut config = Config::load_with_env(Some(&overlay), std::env::vars())?;
    let base = bench_config(&db.url, mocks, Role::All, 256)?;
    config.server = base.server;
    config.database = base.database;
    config.llm = base.llm;
    config.worker = base.worker;
    config.outbox = base.outbox;
    config.admin = base.admin;
    config.channels = base.channels;
    config.channels.generic.agent = "steps".into();
    config.scheduler.enabled = false;
    Ok((start_server(config).await?, dir))
}

async fn steps(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let (server, _dir) = tool_chain_server(&db, &mocks, WORKFLOW_STEPS).await?;
    let started = Instant::now();
    send_messages(server.addr, args.n, args.concurrency, "steps").await?;
    wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed();
    let journalled = args.n * WORKFLOW_STEPS;
    // The same steps over the journal's own window: first step begun to last step finished
    // (without the ingest before and the replies after).
    let (finished, span_ms) = server.worker.store.finished_steps_span().await?;
    println!(
        "scenario=steps db={} n={} steps_per_task={WORKFLOW_STEPS} rate={:.0} steps/s tasks={:.0}/s wall={:.2}s journal_window={:.2}s journal_rate={:.0} steps/s",
        db_name(args.db),
        args.n,
        journalled as f64 / elapsed.as_secs_f64(),
        args.n as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        span_ms as f64 / 1000.0,
        finished as f64 * 1000.0 / span_ms.max(1) as f64,
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

/// Steps journalled by the task whose resume the context scenario measures.
const CONTEXT_STEPS: usize = 150;

/// Runs one task of 150 tool steps to the end, then rebuilds its resume state from the
/// database `n` times (capped at 1,000): load task, message, agent snapshot and journal,
/// parse the workflow and replay every journalled step, as a resume does before executing.
async fn context(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let (server, _dir) = tool_chain_server(&db, &mocks, CONTEXT_STEPS).await?;
    send_messages(server.addr, 1, 1, "context").await?;
    wait_replies(&mocks, 1, Duration::from_secs(120)).await?;
    let svc = server.worker.clone();
    let tasks = svc.store.list_tasks(None, None, 1).await?;
    let task_id = tasks
        .first()
        .map(|t| t.id)
        .context("the task was not found")?;
    let rounds = args.n.clamp(1, 1000);
    let mut times = Vec::with_capacity(rounds);
    let mut replayed = 0;
    for _ in 0..rounds {
        let started = Instant::now();
        replayed = assistd::engine::workflow::runner::replay(&svc, task_id).await?;
        times.push(started.elapsed());
    }
    anyhow::ensure!(
        replayed == CONTEXT_STEPS as i64,
        "replayed {replayed} of {CONTEXT_STEPS} steps"
    );
    times.sort();
    println!(
        "scenario=context db={} steps={replayed} rounds={rounds} p50={:.2}ms p99={:.2}ms max={:.2}ms",
        db_name(args.db),
        percentile(&times, 0.50),
        percentile(&times, 0.99),
        times.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
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
            Scenario::All => {
                ingest(&args).await?;
                end_to_end(&args).await?;
                in_flight(&args).await?;
                steps(&args).await?;
                context(&args).await?;
                recovery(&args).await
            }
        }
    })
}
