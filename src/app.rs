//! Assembly: `App::build` connects, migrates, publishes agents and binds the listener;
//! `App::run_until_stopped` serves HTTP and runs the workers and the outbox until the
//! shutdown token fires. `main` and the tests start exactly the same thing.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::channels::Channels;
use crate::config::Config;
use crate::control::TaskControl;
use crate::engine::{RunningTasks, Worker};
use crate::http::ApiContext;
use crate::intake::{Intake, IntakeQueue};
use crate::llm::ModelClients;
use crate::outbox::Sender;
use crate::scheduler::Jobs;
use crate::store::Store;
use crate::store::journal::Journal;
use crate::store::worker_lease::WorkerLease;
use crate::wake::Wake;

/// The assembled instance: each part gets its own context, holding only what it uses.
pub struct App {
    config: Arc<Config>,
    store: Store,
    api: Arc<ApiContext>,
    worker: Arc<Worker>,
    sender: Arc<Sender>,
    jobs: Arc<Jobs>,
    ingester: Arc<crate::knowledge::ingest::Ingester>,
    wake: Arc<Wake>,
    listener: TcpListener,
}

impl App {
    pub async fn build(config: Config) -> anyhow::Result<App> {
        // Validated with the config, so this cannot fail here.
        if let Ok(redactor) = crate::redaction::Redactor::new(&config.redaction.extra_patterns) {
            crate::redaction::install(redactor);
        }
        let store = Store::connect(&config.database).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot open database.url {}: {e}",
                redact_url(&config.database.url)
            )
        })?;
        store.migrate().await?;
        let mut tools = crate::tools::ToolRegistry::new(&config.tools, &config.tooling)?;
        if !config.mcp_servers.is_empty() {
            tools.check_mcp_urls(&config.mcp_servers).await?;
            let mcp = crate::tools::mcp::McpTools::connect(
                &config.mcp_servers,
                &config.tooling.allowed_private_hosts,
            )
            .await?;
            tools = tools.with_mcp(mcp)?;
        }
        let tools = Arc::new(tools);
        let llm = Arc::new(ModelClients::new(&config.llm)?);
        // Collections first: agents that answer from them are checked against them.
        crate::knowledge::create_configured_collections(&store, &config.knowledge).await?;
        crate::agents::publish_configured_agents(&store, &config, &tools, &llm).await?;
        crate::agents::watch_mcp(store.clone(), &tools, llm.clone());
        // A restart under the same instance id: whatever that id still holds was running in
        // the previous process, which is gone, so take it back at once.
        let instance_id = config.instance_id();
        let (tasks, replies) = if config.server.role.runs_workers() {
            store
                .release_leases_of(&instance_id, crate::domain::now_ms())
                .await?
        } else {
            (0, 0)
        };
        if config.server.role.runs_workers() {
            store.release_ingests_of(&instance_id).await?;
        }
        if tasks + replies > 0 {
            tracing::info!(
                instance = %instance_id,
                tasks,
                replies,
                "resuming work left running by a previous run of this instance"
            );
        }
        let admin_token = admin_token(&config)?;
        let generic = &config.channels.generic;
        if generic.enabled && generic.secret.is_empty() {
            tracing::warn!(
                "channels.generic.secret is not set: POST /webhooks/generic answers 404 \
                 (set ASSISTD_CHANNELS__GENERIC__SECRET)"
            );
        }
        let listener =
            listen(&config.server.listen, config.server.listen_backlog).map_err(|e| {
                anyhow::anyhow!(
                    "cannot listen on server.listen {}: {e}",
                    config.server.listen
                )
            })?;
        App::assemble(
            Arc::new(config),
            store,
            llm,
            tools,
            instance_id,
            admin_token,
            listener,
        )
    }

    /// Builds each part's context from the shared pieces.
    fn assemble(
        config: Arc<Config>,
        store: Store,
        llm: Arc<ModelClients>,
        tools: Arc<crate::tools::ToolRegistry>,
        instance_id: String,
        admin_token: String,
        listener: TcpListener,
    ) -> anyhow::Result<App> {
        let wake = Arc::new(Wake::default());
        let knowledge = Arc::new(crate::knowledge::Knowledge::new(
            store.clone(),
            config.clone(),
            llm.clone(),
        ));
        let running = Arc::new(RunningTasks::default());
        let channels = channels_of(&config)?;
        let journal = Arc::new(
            Journal::start(store.clone(), &config.worker)
                .with_inline_max(config.journal.inline_max_bytes)
                .with_handoff(wake.clone(), config.outbox.lease_secs),
        );
        let jobs = Arc::new(Jobs {
            config: config.clone(),
            store: store.clone(),
            instance_id: instance_id.clone(),
            wake: wake.clone(),
        });
        // A webhook waits for its commit no longer than for a connection, and a 503 says
        // to come back after that long.
        let acquire = std::time::Duration::from_secs(config.database.acquire_timeout_secs.max(1));
        crate::http::error::set_retry_after(acquire.as_secs());
        let api = Arc::new(ApiContext {
            config: config.clone(),
            store: store.clone(),
            intake: Intake {
                store: store.clone(),
                queue: IntakeQueue::start(store.clone(), &config.intake, acquire, wake.clone()),
                wake: wake.clone(),
            },
            control: TaskControl {
                config: config.clone(),
                store: store.clone(),
                running: running.clone(),
                wake: wake.clone(),
            },
            channels: channels.clone(),
            llm: llm.clone(),
            tools: tools.clone(),
            admin_token,
            jobs: jobs.clone(),
            wake: wake.clone(),
            knowledge: knowledge.clone(),
        });
        let ingester = Arc::new(crate::knowledge::ingest::Ingester {
            config: config.clone(),
            store: store.clone(),
            knowledge: knowledge.clone(),
            instance_id: instance_id.clone(),
            wake: wake.clone(),
        });
        let worker = Arc::new(Worker {
            config: config.clone(),
            store: store.clone(),
            journal: journal.clone(),
            llm,
            tools,
            instance_id: instance_id.clone(),
            wake: wake.clone(),
            running,
            slot_free: Notify::new(),
            channels: channels.clone(),
            knowledge,
        });
        let sender = Arc::new(Sender {
            config: config.clone(),
            store: store.clone(),
            journal,
            channels,
            instance_id: instance_id.clone(),
            wake: wake.clone(),
        });
        Ok(App {
            config,
            store,
            api,
            worker,
            sender,
            jobs,
            ingester,
            wake,
            listener,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        // A bound TcpListener always has a local address.
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    pub fn config(&self) -> Arc<Config> {
        self.config.clone()
    }

    pub fn store(&self) -> Store {
        self.store.clone()
    }

    /// The engine's context (the bench rebuilds resume state with it).
    pub fn worker(&self) -> Arc<Worker> {
        self.worker.clone()
    }

    /// The scheduled jobs' context (tests run a job's tick directly).
    pub fn jobs(&self) -> Arc<Jobs> {
        self.jobs.clone()
    }

    /// Serves until `shutdown` is cancelled, then stops accepting, lets work in flight finish
    /// within the grace period, and returns.
    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let App {
            config,
            store,
            api,
            worker,
            sender,
            jobs,
            ingester,
            wake,
            listener,
        } = self;
        tracing::info!(
            addr = %listener.local_addr()?,
            role = ?config.server.role,
            instance = %worker.instance_id,
            database = ?store.dialect(),
            model_endpoint = %worker.llm.default_provider().endpoint(),
            "assistd listening"
        );
        let role = config.server.role;
        let work = Work {
            config: config.clone(),
            store: store.clone(),
            worker,
            sender,
            jobs,
            ingester,
            wake,
        };
        // `worker.exclusive` takes effect on PostgreSQL only (SQLite has no advisory locks).
        let exclusive = matches!(store, Store::Postgres(_)) && config.worker.exclusive;
        let background = match (&store, role.runs_workers()) {
            (_, false) => None,
            (Store::Postgres(pool), true) if exclusive => Some(tokio::spawn(
                work.clone().run_exclusive(pool.clone(), shutdown.clone()),
            )),
            (_, true) => Some(tokio::spawn(work.clone().run(shutdown.clone()))),
        };
        let router = if role == crate::config::Role::Worker {
            crate::http::health_router(api)
        } else {
            crate::http::router(api)
        };
        crate::http::serve(listener, router, &config.server, shutdown.clone()).await;
        if let Some(background) = background {
            let _ = background.await;
            // Whatever is left unfinished is handed over now, not after its lease runs out
            // (`run_exclusive` did so itself, before it gave the workers' lease up).
            if !exclusive {
                work.release().await;
            }
        }
        store.close().await;
        tracing::info!("assistd stopped");
        Ok(())
    }
}

/// The parts that claim and deliver (roles all and worker): workers, outbox, knowledge
/// ingester, scheduler and, on PostgreSQL, the `LISTEN` that wakes them.
#[derive(Clone)]
struct Work {
    config: Arc<Config>,
    store: Store,
    worker: Arc<Worker>,
    sender: Arc<Sender>,
    jobs: Arc<Jobs>,
    ingester: Arc<crate::knowledge::ingest::Ingester>,
    wake: Arc<Wake>,
}

impl Work {
    /// Runs the parts until `stop` fires and each has stopped (in-flight tasks get the
    /// shutdown grace period).
    async fn run(self, stop: CancellationToken) {
        let mut parts = tokio::task::JoinSet::new();
        parts.spawn(crate::engine::run_workers(
            self.worker.clone(),
            stop.clone(),
        ));
        parts.spawn(crate::outbox::run_outbox(self.sender.clone(), stop.clone()));
        parts.spawn(crate::knowledge::ingest::run_ingester(
            self.ingester.clone(),
            stop.clone(),
        ));
        if self.config.scheduler.enabled {
            parts.spawn(crate::scheduler::run_scheduler(
                self.jobs.clone(),
                stop.clone(),
            ));
        }
        if let Store::Postgres(pool) = &self.store {
            parts.spawn(crate::store::notify::listen_for_tasks(
                pool.clone(),
                self.wake.clone(),
                stop.clone(),
            ));
        }
        while parts.join_next().await.is_some() {}
    }

    /// Hands this instance's unfinished tasks and replies back to the queue at once.
    async fn release(&self) {
        let instance = &self.worker.instance_id;
        match self
            .store
            .release_leases_of(instance, crate::domain::now_ms())
            .await
        {
            Ok((0, 0)) => {}
            Ok((tasks, replies)) => {
                tracing::info!(tasks, replies, "released leases of unfinished work")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not release leases; they expire on their own")
            }
        }
    }

    /// `worker.exclusive` on PostgreSQL: stands by until this instance holds the workers'
    /// lease, runs the parts while it holds it, and stops them (handing their work back) when
    /// it is lost, to stand by again; until `shutdown`.
    async fn run_exclusive(self, pool: sqlx::PgPool, shutdown: CancellationToken) {
        let instance = self.worker.instance_id.clone();
        let poll = Duration::from_millis(self.config.worker.standby_poll_ms);
        let timeout = Duration::from_secs(self.config.database.acquire_timeout_secs.max(1));
        let mut lease = WorkerLease::new(pool, timeout);
        let mut failing = false;
        crate::metrics::set_worker_lease(&instance, false);
        tracing::info!(instance = %instance, "standing by for the workers' lease (worker.exclusive)");
        loop {
            match lease.try_take().await {
                Ok(true) => {}
                Ok(false) => failing = false,
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "trying the workers' lease failed; will retry");
                }
                Err(_) => {}
            }
            if !lease.held() {
                tokio::select! {
                    _ = tokio::time::sleep(poll) => continue,
                    _ = shutdown.cancelled() => return,
                }
            }
            failing = false;
            crate::metrics::set_worker_lease(&instance, true);
            tracing::info!(instance = %instance, "took the workers' lease; running the workers");
            let stop = shutdown.child_token();
            let running = tokio::spawn(self.clone().run(stop.clone()));
            while !stop.is_cancelled() {
                tokio::select! {
                    _ = tokio::time::sleep(poll) => {}
                    _ = stop.cancelled() => break,
                }
                let lost = match lease.check().await {
                    Ok(true) => continue,
                    Ok(false) => "the workers' lease is gone".to_string(),
                    Err(e) => format!("the workers' lease cannot be checked: {e}"),
                };
                tracing::warn!(cause = %lost, "stopping the workers; standing by again");
                crate::metrics::set_worker_lease(&instance, false);
                stop.cancel();
            }
            let _ = running.await;
            crate::metrics::set_worker_lease(&instance, false);
            // Tasks first, then the lock: the next holder finds them claimable.
            self.release().await;
            if shutdown.is_cancelled() {
                lease.release().await;
                return;
            }
        }
    }
}

/// The platforms' senders, with the two internal channels (approval callbacks, orphan alerts).
fn channels_of(config: &Config) -> anyhow::Result<Arc<Channels>> {
    let jobs = &config.scheduler.jobs;
    Ok(Arc::new(Channels::new(
        &config.channels,
        std::time::Duration::from_secs(config.outbox.timeout_secs),
        [
            (
                crate::domain::CALLBACK_CHANNEL,
                &jobs.confirm_timeout.approval_callback_url,
            ),
            (
                crate::domain::ORPHAN_ALERT_CHANNEL,
                &jobs.orphan_reclaim.alert_url,
            ),
        ],
    )?))
}

/// The configured admin token, or one generated for this run and written to
/// `admin.token_file` (never to the log).
fn admin_token(config: &Config) -> anyhow::Result<String> {
    Ok(if config.admin.token.is_empty() {
        let token = uuid::Uuid::new_v4().simple().to_string();
        write_token_file(&config.admin.token_file, &token).map_err(|e| {
            anyhow::anyhow!(
                "admin.token is not set and admin.token_file {} cannot be written: {e}",
                config.admin.token_file
            )
        })?;
        tracing::warn!(
            file = %config.admin.token_file,
            "admin.token is not set; generated one for this run and wrote it to admin.token_file (set ASSISTD_ADMIN__TOKEN to keep one)"
        );
        token
    } else {
        config.admin.token.clone()
    })
}

/// A TCP listener on `addr` (an `ip:port`) whose accept queue holds `backlog` connections.
/// `TcpListener::bind` asks for 128: a burst of new connections beyond that (webhooks after
/// an outage, or a restarted worker's model calls arriving at a local mock) has its SYNs
/// dropped and each client retries a second or more later.
pub fn listen(addr: &str, backlog: u32) -> std::io::Result<TcpListener> {
    let addr: SocketAddr = addr.parse().map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("`{addr}` is not an ip:port: {e}"),
        )
    })?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restart need not wait for the old connections' TIME_WAIT.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Writes a generated admin token where only its owner can read it (the log must not hold it).
fn write_token_file(path: &str, token: &str) -> std::io::Result<()> {
    use std::io::Write;
    let path = std::path::Path::new(path);
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(token.as_bytes())?;
    file.write_all(b"\n")
}

/// The URL without its password, for messages.
pub fn redact_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::listen;
    use std::time::Duration;

    /// How many of `n` connections to a listener that accepts none are established within a
    /// second: the kernel completes a handshake only while the accept queue has room.
    async fn established(backlog: u32, n: usize) -> usize {
        let listener = listen("127.0.0.1:0", backlog).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut connects = tokio::task::JoinSet::new();
        for _ in 0..n {
            connects.spawn(async move {
                tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr))
                    .await
                    .ok()
                    .and_then(Result::ok)
            });
        }
        let mut open = Vec::new();
        while let Some(conn) = connects.join_next().await {
            open.extend(conn.unwrap());
        }
        drop(listener);
        open.len()
    }

    #[tokio::test]
    async fn the_listener_queues_as_many_connections_as_its_backlog() {
        // Linux caps the backlog at net.core.somaxconn (4096 on current kernels).
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(4096);
        let n = 400.min(cap);
        assert_eq!(established(n as u32, n).await, n, "backlog {n}");
        // The same burst against a small queue: most handshakes wait for a SYN retry, which
        // is what the default backlog of 128 did to bursts above it.
        let small = established(16, n).await;
        assert!(
            small < n / 2,
            "{small} of {n} established with a backlog of 16"
        );
    }
}
