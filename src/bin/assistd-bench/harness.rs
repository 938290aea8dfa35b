//! The bench harness: databases, the mock model and receiver, the server in-process or as a
//! child, the load generator, and the waits and measurements the scenarios share.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::Router;
use axum::response::IntoResponse;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use assistd::config::{Config, Role};

use crate::model::{MODEL_WINDOW, answer_chars, chat_completion, over_window};
use crate::*;

/// A fresh database for one scenario; dropped (PostgreSQL) at the end.
pub(crate) struct BenchDb {
    pub(crate) url: String,
    pub(crate) _dir: Option<tempfile::TempDir>,
    pub(crate) admin: Option<(String, String)>,
}

impl BenchDb {
    pub(crate) async fn new(db: Db) -> anyhow::Result<BenchDb> {
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

    /// Drops the bench's PostgreSQL database, unless `ASSISTD_BENCH_KEEP_DB` is set (then it
    /// prints its name, for reading the run's WAL by relation: `scripts/wal-by-relation.sh`).
    ///
    /// First it merges the pending lists of the GIN indexes (the messages' trigram index):
    /// a message's entries are written to the list at once, and moved into the index only
    /// when the list outgrows `gin_pending_list_limit` or vacuum runs, which a short run
    /// never reaches. Merged here, the WAL a run is measured by (`compare-builds.sh`,
    /// `compare-peers.sh`, `wal-by-relation.sh`) includes that deferred work: ~64 bytes
    /// per message at N = 5,000 (issue 35 part 2).
    pub(crate) async fn drop_db(&self) {
        if let Some((admin, name)) = &self.admin {
            use sqlx::Connection;
            if let Ok(mut conn) = sqlx::PgConnection::connect(&self.url).await {
                let merged = sqlx::query(
                    "SELECT gin_clean_pending_list(c.oid) FROM pg_class c \
                     JOIN pg_am am ON am.oid = c.relam \
                     WHERE am.amname = 'gin' AND c.relnamespace = 'public'::regnamespace",
                )
                .fetch_all(&mut conn)
                .await;
                if let Err(e) = merged {
                    eprintln!("merging the GIN pending lists failed: {e}");
                }
                let _ = conn.close().await;
            }
            if std::env::var_os("ASSISTD_BENCH_KEEP_DB").is_some() {
                println!("kept_database={name}");
                return;
            }
            if let Ok(mut conn) = sqlx::PgConnection::connect(admin).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut conn)
                    .await;
            }
        }
    }
}

/// The mock model and reply receiver, in one small server.
pub(crate) struct Mocks {
    pub(crate) addr: SocketAddr,
    pub(crate) model_calls: Arc<AtomicUsize>,
    /// Model calls refused as over the model's context window ([`MODEL_WINDOW`]).
    pub(crate) model_refusals: Arc<AtomicUsize>,
    /// Most model calls open at the same time.
    pub(crate) max_in_flight: Arc<AtomicUsize>,
    pub(crate) replies: Arc<AtomicUsize>,
    /// The distinct reply keys (`Idempotency-Key`) received, and how many deliveries
    /// repeated a key already received.
    pub(crate) reply_keys: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    pub(crate) repeated_replies: Arc<AtomicUsize>,
    /// Replies that were failure notices (`FAILURE_NOTICE`), not answers: a bench measures
    /// answered messages, so `wait_replies` fails on any (a mock the client no longer
    /// reads, a broken path).
    pub(crate) notices: Arc<AtomicUsize>,
    /// The shortest reply body received, in bytes (`usize::MAX` before the first).
    pub(crate) shortest_reply: Arc<AtomicUsize>,
    pub(crate) replied: Arc<Notify>,
    /// When the mocks started; the marks below are milliseconds since then.
    pub(crate) epoch: Instant,
    /// Latest arrival of a model call.
    pub(crate) last_call_ms: Arc<AtomicU64>,
    /// First arrival of a reply.
    pub(crate) first_reply_ms: Arc<AtomicU64>,
    pub(crate) stop: CancellationToken,
}

impl Mocks {
    /// A mark as seconds after `since` (which must be after `epoch`).
    pub(crate) fn mark_after(&self, mark: &AtomicU64, since: Instant) -> f64 {
        let at = self.epoch + Duration::from_millis(mark.load(Ordering::Relaxed));
        at.saturating_duration_since(since).as_secs_f64()
    }
}

pub(crate) async fn start_mocks(model_latency: Duration) -> anyhow::Result<Mocks> {
    let replies = Arc::new(AtomicUsize::new(0));
    let replied = Arc::new(Notify::new());
    let model_calls = Arc::new(AtomicUsize::new(0));
    let model_refusals = Arc::new(AtomicUsize::new(0));
    let refused = model_refusals.clone();
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (r, n, calls) = (replies.clone(), replied.clone(), model_calls.clone());
    let reply_keys = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let repeated_replies = Arc::new(AtomicUsize::new(0));
    let (keys, repeated) = (reply_keys.clone(), repeated_replies.clone());
    let notices = Arc::new(AtomicUsize::new(0));
    let notices_seen = notices.clone();
    let shortest_reply = Arc::new(AtomicUsize::new(usize::MAX));
    let shortest = shortest_reply.clone();
    let peak = max_in_flight.clone();
    let answer_chars = answer_chars();
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
                match over_window(&body) {
                    Some(refusal) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        let status = axum::http::StatusCode::BAD_REQUEST;
                        (status, axum::Json(refusal)).into_response()
                    }
                    None => axum::Json(chat_completion(&body, answer_chars)).into_response(),
                }
            }),
        )
        .route(
            "/tool",
            axum::routing::get(|| async { axum::Json(json!({"ok": true})) }),
        )
        .route(
            "/reply",
            post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| async move {
                    shortest.fetch_min(body.len(), Ordering::Relaxed);
                    if String::from_utf8_lossy(&body).contains(FAILURE_NOTICE_MARK) {
                        notices_seen.fetch_add(1, Ordering::Relaxed);
                    }
                    let key = headers.get("idempotency-key").and_then(|k| k.to_str().ok());
                    if !keys.lock().unwrap().insert(key.unwrap_or("").to_string()) {
                        repeated.fetch_add(1, Ordering::Relaxed);
                    }
                    r.fetch_add(1, Ordering::Relaxed);
                    first_reply.fetch_min(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                    n.notify_waiters();
                    "ok"
                },
            ),
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
        model_refusals,
        max_in_flight,
        replies,
        reply_keys,
        repeated_replies,
        notices,
        shortest_reply,
        replied,
        epoch,
        last_call_ms,
        first_reply_ms,
        stop,
    })
}

pub(crate) fn bench_config(
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
    // 16 unless ASSISTD_BENCH_DB_CONNECTIONS says otherwise (for pool-size experiments).
    c.database.max_connections = std::env::var("ASSISTD_BENCH_DB_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    c.llm.base_url = format!("http://{}/v1", mocks.addr);
    c.llm.timeout_secs = 120;
    c.llm.context_window = MODEL_WINDOW as u32;
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
    c.replies.failure_notice = FAILURE_NOTICE.into();
    // Room for the long answers asked for: the mock model holds each answer to the request's
    // max_tokens, as a model does.
    let chars = u32::try_from(answer_chars()).unwrap_or(u32::MAX);
    for agent in c.agents.values_mut() {
        agent.max_tokens = agent.max_tokens.max(chars / 3 + 64);
    }
    Ok(c)
}

pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    pub(crate) worker: Arc<assistd::engine::Worker>,
    pub(crate) stop: CancellationToken,
    pub(crate) handle: tokio::task::JoinHandle<anyhow::Result<()>>,
}

pub(crate) async fn start_server(config: Config) -> anyhow::Result<Server> {
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
    pub(crate) async fn stop(self) {
        self.stop.cancel();
        let _ = self.handle.await;
    }
}

/// Sends `n` signed messages (each its own conversation, or round
/// `ASSISTD_BENCH_CONVERSATIONS` of them) from `concurrency` clients;
/// returns the acknowledgement latencies.
pub(crate) async fn send_messages(
    addr: SocketAddr,
    n: usize,
    concurrency: usize,
    tag: &str,
) -> anyhow::Result<Vec<Duration>> {
    send_messages_to(&[addr], n, concurrency, tag).await
}

/// As `send_messages`, message `i` going to `addrs[i % addrs.len()]` (instances sharing
/// one database).
pub(crate) async fn send_messages_to(
    addrs: &[SocketAddr],
    n: usize,
    concurrency: usize,
    tag: &str,
) -> anyhow::Result<Vec<Duration>> {
    let next = Arc::new(AtomicUsize::new(0));
    // ASSISTD_BENCH_CONVERSATIONS: the messages go round that many conversations, so each
    // question after a conversation's first carries its history (with
    // ASSISTD_BENCH_ANSWER_CHARS, long answers) into the prompt; unset: one each.
    let conversations: usize = std::env::var("ASSISTD_BENCH_CONVERSATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(n.max(1));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let next = next.clone();
        let tag = tag.to_string();
        let addrs = addrs.to_vec();
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
                    "conversation_id": format!("{tag}-c{}", i % conversations), "sender_id": "bench", "text": format!("question {i}"),
                }))?;
                let ts = assistd::domain::now_ms() / 1000;
                let sig = assistd::channels::generic::sign(SECRET, ts, &body);
                let started = Instant::now();
                let addr = addrs[i % addrs.len()];
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

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1000.0
}

pub(crate) async fn wait_replies(mocks: &Mocks, n: usize, timeout: Duration) -> anyhow::Result<()> {
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
    let notices = mocks.notices.load(Ordering::Relaxed);
    if notices > 0 {
        bail!("{notices} of {n} replies were failure notices, not answers");
    }
    Ok(())
}

/// What the bench's servers say when a run fails (`replies.failure_notice`, set by
/// `bench_config` and `spawn_child`), so the reply receiver can tell notices from answers
/// whatever the default template says.
const FAILURE_NOTICE_MARK: &str = "BENCH-FAILURE-NOTICE";
const FAILURE_NOTICE: &str = "BENCH-FAILURE-NOTICE {failure_type} (task {task_id})";

/// Resident set size of this process, in KiB.
/// Resident memory of process `pid` (`VmRSS`, or `VmHWM` = its peak), in KiB.
pub(crate) fn rss_kib(pid: u32, field: &str) -> u64 {
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

/// Starts `assistd serve` (the binary next to this one) as a child on `port`, on SQLite or
/// PostgreSQL. Its log (warnings and errors; it logs to stdout) goes to `log` when given
/// (appended), else nowhere; `extra`: more `ASSISTD_*` settings.
#[allow(clippy::too_many_arguments)] // the child's settings, each its own
pub(crate) fn spawn_child(
    db_url: &str,
    mocks: &Mocks,
    port: u16,
    grace_secs: u64,
    concurrency: usize,
    log: Option<&std::path::Path>,
    instance: &str,
    extra: &[(&str, String)],
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
        // The bench's own ASSISTD_* variables apply to the children too (for experiments,
        // e.g. ASSISTD_WORKER__EXCLUSIVE=true), except the keys set below, which win.
        .envs(
            std::env::vars()
                .filter(|(k, _)| k.starts_with("ASSISTD_") && !k.starts_with("ASSISTD_BENCH_")),
        )
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
        .env("ASSISTD_WORKER__INSTANCE_ID", instance)
        .env("ASSISTD_WORKER__CONCURRENCY", concurrency.to_string())
        .env("ASSISTD_WORKER__CLAIM_BATCH", "256")
        .env(
            "ASSISTD_WORKER__SHUTDOWN_GRACE_SECS",
            grace_secs.to_string(),
        )
        .env("ASSISTD_LOG__LEVEL", "warn")
        .env("ASSISTD_REPLIES__FAILURE_NOTICE", FAILURE_NOTICE)
        .envs(extra.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(stdout)
        .stderr(stderr)
        .spawn()?)
}

pub(crate) async fn wait_ready(port: u16) -> anyhow::Result<()> {
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

pub(crate) async fn wait_calls(mocks: &Mocks, n: usize, timeout: Duration) -> anyhow::Result<()> {
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

/// Steps per task in the `steps` scenario.
pub(crate) const WORKFLOW_STEPS: usize = 20;

/// A server whose agent `steps` runs a workflow of `n_steps` instant read-only tool calls
/// (answered by the mock) and then replies; the temp dir holds its files.
pub(crate) async fn tool_chain_server(
    db: &BenchDb,
    mocks: &Mocks,
    n_steps: usize,
) -> anyhow::Result<(Server, tempfile::TempDir)> {
    tool_chain_server_with(db, mocks, n_steps, "ping", "").await
}

/// `tool_chain_server` calling `tool`, with `extra` TOML (e.g. the MCP server of `tool`).
pub(crate) async fn tool_chain_server_with(
    db: &BenchDb,
    mocks: &Mocks,
    n_steps: usize,
    tool: &str,
    extra: &str,
) -> anyhow::Result<(Server, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let mut nodes: Vec<Value> = (0..n_steps)
        .map(|i| {
            let next = if i + 1 == n_steps {
                "done".to_string()
            } else {
                format!("s{}", i + 1)
            };
            json!({"id": format!("s{i}"), "type": "tool", "tool": tool, "args": {}, "next": next})
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
            "[tooling]\nallowed_private_hosts = [\"127.0.0.1\"]\n\n[tools.ping]\nkind = \"read_only\"\nmethod = \"GET\"\nurl = \"http://{}/tool\"\n\n[agents.steps]\nmode = \"workflow\"\nsystem_prompt = \"bench\"\nworkflow_file = \"{}\"\n{extra}",
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
