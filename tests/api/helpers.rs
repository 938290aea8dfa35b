//! Test harness: the real app on a random 127.0.0.1 port, a fresh database (SQLite file, or
//! a new PostgreSQL database when ASSISTD_TEST_POSTGRES_URL is set), a mock OpenAI-compatible
//! model and a mock reply receiver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use assistd::channels::generic;
use assistd::config::Config;
use assistd::store::Store;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

pub use crate::strict_model::*;

pub const SECRET: &str = "test-secret";
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// A fresh, empty database for one test.
pub struct TestDb {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg_admin: Option<(String, String)>,
    /// The private cluster the database is in (`TestDb::postgres` without
    /// `ASSISTD_TEST_POSTGRES_URL`); stopped when the last handle goes.
    _cluster: Option<Arc<crate::private_pg::PrivateCluster>>,
}

impl TestDb {
    pub async fn new() -> TestDb {
        match std::env::var("ASSISTD_TEST_POSTGRES_URL") {
            Ok(admin_url) if !admin_url.is_empty() => Self::created_in(admin_url).await,
            _ => Self::sqlite(),
        }
    }

    /// A fresh SQLite database, whatever database the run is for (SQLite-only tests).
    pub fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}/assistd.db", dir.path().display());
        TestDb {
            url,
            _dir: Some(dir),
            pg_admin: None,
            _cluster: None,
        }
    }

    /// A fresh PostgreSQL database for a PostgreSQL-only test: in the server of
    /// `ASSISTD_TEST_POSTGRES_URL` when it is set, else in a private cluster started for
    /// the test. Such a test is compiled as ignored where no PostgreSQL server can be
    /// started (`#[cfg_attr(not(assistd_has_postgres_server), ignore = ...)]`), so it never
    /// counts as passed without having run.
    pub async fn postgres() -> TestDb {
        match std::env::var("ASSISTD_TEST_POSTGRES_URL") {
            Ok(admin_url) if !admin_url.is_empty() => Self::created_in(admin_url).await,
            _ => {
                let cluster = tokio::task::spawn_blocking(crate::private_pg::PrivateCluster::start)
                    .await
                    .expect("start a private PostgreSQL cluster");
                let mut db = Self::created_in(cluster.url()).await;
                db._cluster = Some(Arc::new(cluster));
                db
            }
        }
    }

    /// A new database in the server of `admin_url`, dropped by `drop_db`.
    async fn created_in(admin_url: String) -> TestDb {
        use sqlx::Connection;
        let name = format!("assistd_t_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&admin_url)
            .await
            .expect("connect to the PostgreSQL server for tests");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .expect("create test database");
        conn.close().await.ok();
        let mut url = reqwest::Url::parse(&admin_url).expect("postgres url");
        url.set_path(&format!("/{name}"));
        TestDb {
            url: url.to_string(),
            _dir: None,
            pg_admin: Some((admin_url, name)),
            _cluster: None,
        }
    }

    /// A database the test made itself (a private cluster's), not created or dropped here.
    pub fn external(url: String) -> TestDb {
        TestDb {
            url,
            _dir: None,
            pg_admin: None,
            _cluster: None,
        }
    }

    /// PostgreSQL: closes the database to connections and ends the ones it has (`true`), or
    /// opens it again (`false`), as an outage of the server would look to the app.
    pub async fn refuse_connections(&self, refuse: bool) {
        use sqlx::Connection;
        let (admin, name) = self.pg_admin.as_ref().expect("a PostgreSQL test database");
        let mut conn = sqlx::PgConnection::connect(admin).await.unwrap();
        let allow = !refuse;
        sqlx::query(&format!(
            "ALTER DATABASE {name} WITH ALLOW_CONNECTIONS {allow}"
        ))
        .execute(&mut conn)
        .await
        .unwrap();
        if refuse {
            sqlx::query(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = '{name}' AND pid <> pg_backend_pid()"
            ))
            .execute(&mut conn)
            .await
            .unwrap();
        }
        conn.close().await.ok();
    }

    /// Another handle on the same database that does not own (or drop) it.
    pub fn share(&self) -> TestDb {
        TestDb {
            url: self.url.clone(),
            _dir: None,
            pg_admin: None,
            _cluster: self._cluster.clone(),
        }
    }

    pub fn is_postgres(&self) -> bool {
        self.pg_admin.is_some()
    }

    /// Drops a PostgreSQL test database (SQLite files go with the temp dir).
    pub async fn drop_db(&self) {
        if let Some((admin, name)) = &self.pg_admin {
            use sqlx::Connection;
            if let Ok(mut conn) = sqlx::PgConnection::connect(admin).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut conn)
                    .await;
                conn.close().await.ok();
            }
        }
    }
}

/// Test configuration: defaults, fast polling and backoff, mocks wired in.
pub fn test_config(db_url: &str, model_url: &str, reply_url: &str) -> Config {
    let mut c = Config::load_with_env(None, Vec::new()).expect("default config loads");
    c.server.listen = "127.0.0.1:0".into();
    c.database.url = db_url.into();
    c.database.max_connections = 8;
    c.llm.base_url = format!("{model_url}/v1");
    c.llm.model = "test-model".into();
    c.llm.timeout_secs = 5;
    for policy in [
        &mut c.llm.retry.timeout,
        &mut c.llm.retry.rate_limited,
        &mut c.llm.retry.provider_error,
    ] {
        policy.backoff_base_ms = 50;
        policy.backoff_max_ms = 200;
    }
    c.worker.instance_id = "test-instance".into();
    c.worker.poll_interval_ms = 100;
    c.worker.shutdown_grace_secs = 2;
    c.outbox.backoff_base_ms = 50;
    c.outbox.backoff_max_ms = 300;
    c.outbox.poll_interval_ms = 100;
    c.admin.token = ADMIN_TOKEN.into();
    c.channels.generic.secret = SECRET.into();
    c.channels.generic.reply_url = reply_url.into();
    c
}

pub struct TestApp {
    pub addr: String,
    pub db: TestDb,
    pub model: MockServer,
    pub receiver: MockServer,
    pub config: Arc<Config>,
    /// The scheduled jobs' context, for running a job's tick directly.
    pub jobs: Arc<assistd::scheduler::Jobs>,
    store: Store,
    pub http: reqwest::Client,
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Answers every chat completion with `answer to: <last message's content>`.
pub fn echo(body: &Value) -> ModelReply {
    ModelReply::text(format!("answer to: {}", last_content(body)))
}

pub fn chat_path() -> wiremock::matchers::PathExactMatcher {
    path("/v1/chat/completions")
}

/// A mock receiver that accepts every reply.
pub async fn accepting_receiver() -> MockServer {
    receiver_answering(ResponseTemplate::new(200)).await
}

/// The in-house IM's check of a signed reply, written from the generic channel's documented
/// contract (README, "The generic webhook"), not from assistd's code: `X-Assistd-Timestamp`
/// within 300 s of now, and `X-Assistd-Signature: v1=<hex HMAC-SHA256(SECRET,
/// "<timestamp>.<raw body>")>`.
pub struct SignedWithTestSecret;

impl wiremock::Match for SignedWithTestSecret {
    fn matches(&self, request: &wiremock::Request) -> bool {
        use hmac::Mac;
        let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok());
        let (Some(ts), Some(signature)) =
            (header("x-assistd-timestamp"), header("x-assistd-signature"))
        else {
            return false;
        };
        let Ok(ts_secs) = ts.parse::<i64>() else {
            return false;
        };
        if (assistd::domain::now_ms() / 1000 - ts_secs).abs() > 300 {
            return false;
        }
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
        mac.update(format!("{ts}.").as_bytes());
        mac.update(&request.body);
        let want = format!("v1={}", hex::encode(mac.finalize().into_bytes()));
        signature == want
    }
}

/// A receiver as [`accepting_receiver`] that first refuses `n` signed replies with `status`.
pub async fn receiver_refusing_first(n: u64, status: u16) -> MockServer {
    let receiver = accepting_receiver().await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(ResponseTemplate::new(status))
        .up_to_n_times(n)
        .with_priority(1)
        .mount(&receiver)
        .await;
    receiver
}

/// The receiver is back: from now on it accepts every signed reply, whatever it answered
/// before.
pub async fn receiver_accepts_again(receiver: &MockServer) {
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(ResponseTemplate::new(200))
        .with_priority(1)
        .mount(receiver)
        .await;
}

/// A mock receiver that answers every signed reply with `answer`, and refuses one that is
/// not signed with the test secret (401), as the IM would.
pub async fn receiver_answering(answer: ResponseTemplate) -> MockServer {
    let receiver = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(answer)
        .with_priority(5)
        .mount(&receiver)
        .await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .respond_with(ResponseTemplate::new(401).set_body_string("bad signature"))
        .with_priority(10)
        .mount(&receiver)
        .await;
    receiver
}

/// A mock model (the strict double) that answers every chat call with `answer to: <last
/// user message>`.
pub async fn echo_model() -> MockServer {
    let model = MockServer::start().await;
    model_mock(echo).mount(&model).await;
    model
}

/// The strict model double refusing the first `failures` chat calls as a provider refuses a
/// bad key (401 with `body`), then echoing like [`echo_model`].
pub async fn model_failing_first(failures: u64, body: &'static str) -> MockServer {
    let model = MockServer::start().await;
    model_mock(move |_: &Value| ModelReply::error(401, body))
        .up_to_n_times(failures)
        .with_priority(1)
        .mount(&model)
        .await;
    model_mock(echo).with_priority(2).mount(&model).await;
    model
}

impl TestApp {
    /// Starts the app with an echoing model and an accepting receiver.
    pub async fn spawn() -> TestApp {
        Self::spawn_with(echo_model().await, accepting_receiver().await, |_| {}).await
    }

    /// Starts the app against the given mocks; `tweak` adjusts the config first.
    pub async fn spawn_with(
        model: MockServer,
        receiver: MockServer,
        tweak: impl FnOnce(&mut Config),
    ) -> TestApp {
        Self::spawn_on(TestDb::new().await, model, receiver, tweak).await
    }

    /// [`TestApp::spawn_with`] on a given database (`TestDb::postgres`, say).
    pub async fn spawn_on(
        db: TestDb,
        model: MockServer,
        receiver: MockServer,
        tweak: impl FnOnce(&mut Config),
    ) -> TestApp {
        let reply_url = format!("{}/reply", receiver.uri());
        let mut config = test_config(&db.url, &model.uri(), &reply_url);
        tweak(&mut config);
        Self::spawn_config(db, model, receiver, config).await
    }

    pub async fn spawn_config(
        db: TestDb,
        model: MockServer,
        receiver: MockServer,
        config: Config,
    ) -> TestApp {
        let app = assistd::App::build(config).await.expect("app builds");
        let addr = format!("http://{}", app.local_addr());
        let (config, jobs, store) = (app.config(), app.jobs(), app.store());
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(app.run_until_stopped(shutdown.clone()));
        TestApp {
            addr,
            db,
            model,
            receiver,
            config,
            jobs,
            store,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
            shutdown,
            handle,
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Stops the app and drops its database.
    pub async fn stop(self) {
        let (db, _, _) = self.stop_keeping_db().await;
        db.drop_db().await;
    }

    /// Stops the app (graceful shutdown, as on SIGTERM) and hands back its database and
    /// mocks, for an instance started again on them.
    pub async fn stop_keeping_db(self) -> (TestDb, MockServer, MockServer) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.handle).await;
        (self.db, self.model, self.receiver)
    }

    /// Posts `body` to the generic webhook, signed with the test secret, timestamp now.
    pub async fn post_message(&self, body: &Value) -> reqwest::Response {
        let raw = serde_json::to_vec(body).unwrap();
        let ts = assistd::domain::now_ms() / 1000;
        let sig = generic::sign(SECRET, ts, &raw);
        self.post_raw(raw, Some(ts.to_string()), Some(sig)).await
    }

    pub async fn post_raw(
        &self,
        raw: Vec<u8>,
        timestamp: Option<String>,
        signature: Option<String>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}/webhooks/generic", self.addr))
            .header("content-type", "application/json")
            .body(raw);
        if let Some(ts) = timestamp {
            req = req.header("X-Assistd-Timestamp", ts);
        }
        if let Some(sig) = signature {
            req = req.header("X-Assistd-Signature", sig);
        }
        req.send().await.expect("webhook request")
    }

    pub async fn get_task(&self, id: i64) -> Value {
        self.admin_json(&format!("/api/tasks/{id}")).await
    }

    /// GET `path` with the admin token; asserts 200 and returns the JSON body.
    pub async fn admin_json(&self, path: &str) -> Value {
        let resp = self
            .http
            .get(format!("{}{path}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("admin API request");
        assert_eq!(resp.status(), 200, "GET {path}");
        resp.json().await.unwrap()
    }

    /// Polls the task API until `pred` holds, or panics after `timeout`.
    pub async fn wait_task(
        &self,
        id: i64,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let task = self.get_task(id).await;
            if pred(&task) {
                return task;
            }
            if Instant::now() > deadline {
                panic!("task {id} did not reach the expected state in {timeout:?}: {task:#}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the task is terminal and its reply SENT.
    pub async fn wait_replied(&self, id: i64, timeout: Duration) -> Value {
        self.wait_task(id, timeout, |t| {
            t["reply"]["status"] == "SENT"
                && matches!(
                    t["status"].as_str(),
                    Some("SUCCEEDED" | "FAILED" | "CANCELLED")
                )
        })
        .await
    }

    /// The replies the receiver got, as JSON bodies with their idempotency keys.
    pub async fn replies(&self) -> Vec<(String, Value)> {
        received_replies(&self.receiver).await
    }
}

pub async fn received_replies(receiver: &MockServer) -> Vec<(String, Value)> {
    receiver
        .received_requests()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.url.path() == "/reply")
        .map(|r| {
            let key = r
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            (key, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
        })
        .collect()
}

/// A webhook body for message `n` of `conversation`.
pub fn message(conversation: &str, n: u32, text: &str) -> Value {
    json!({
        "event_id": format!("evt-{conversation}-{n}"),
        "message_id": format!("msg-{conversation}-{n}"),
        "conversation_id": conversation,
        "sender_id": "user-1",
        "sender_name": "Ada",
        "text": text,
    })
}

pub async fn task_id_of(resp: reqwest::Response) -> i64 {
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    body["task_id"].as_i64().expect("task_id")
}

pub const WAIT: Duration = Duration::from_secs(20);

/// Loads the test configuration with a TOML overlay (tools, agents) laid over the defaults,
/// then the usual test settings. The overlay file lives in `dir`.
pub fn config_with_overlay(
    db_url: &str,
    model_url: &str,
    reply_url: &str,
    dir: &std::path::Path,
    overlay: &str,
) -> Config {
    let path = dir.join("overlay.toml");
    std::fs::write(&path, overlay).unwrap();
    let mut c = Config::load_with_env(Some(&path), Vec::new()).expect("overlay config loads");
    with_test_settings(&mut c, db_url, model_url, reply_url);
    c
}

/// Lays the test settings (server, database, model, worker, outbox, admin, generic channel
/// secret and reply URL, fast tool retries) over a loaded configuration.
pub fn with_test_settings(c: &mut Config, db_url: &str, model_url: &str, reply_url: &str) {
    let base = test_config(db_url, model_url, reply_url);
    c.server = base.server;
    c.database = base.database;
    c.llm = base.llm;
    c.worker = base.worker;
    c.outbox = base.outbox;
    c.admin = base.admin;
    c.channels.generic.secret = base.channels.generic.secret;
    c.channels.generic.reply_url = base.channels.generic.reply_url;
    c.tooling.retry_backoff_base_ms = 20;
    c.tooling.retry_backoff_max_ms = 50;
}

/// Publishes the agents `cfg` declares, as `App::build` does.
pub async fn publish_agents(store: &Store, cfg: &Config) -> anyhow::Result<()> {
    let tools = std::sync::Arc::new(assistd::tools::ToolRegistry::new(&cfg.tools, &cfg.tooling)?);
    let models = assistd::llm::ModelClients::new(&cfg.llm)?;
    assistd::agents::publish_configured_agents(store, cfg, &tools, &models).await
}

/// The request bodies a mock model received, in order.
pub async fn model_bodies(model: &MockServer) -> Vec<Value> {
    model
        .received_requests()
        .await
        .unwrap_or_default()
        .iter()
        .map(|r| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
        .collect()
}

/// What the app logged at WARN and above, in this test process, as text. The first call
/// installs a global subscriber writing into a buffer (tests install no other), so call it
/// before the app whose log a test reads starts.
pub fn captured_log() -> String {
    use std::sync::{Mutex, OnceLock};
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    #[derive(Clone)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let log = LOG.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink(buffer.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            // The binary's own log writer (`telemetry::init`), around the buffer.
            .with_writer(assistd::telemetry::ScrubForeign(move || sink.clone()))
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        buffer
    });
    String::from_utf8_lossy(&log.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
}

/// The audit events of a task as the task API shows it, in order.
pub fn audit_events(task: &Value) -> Vec<&str> {
    task["audit"]
        .as_array()
        .expect("the task shows its audit")
        .iter()
        .map(|a| a["event"].as_str().unwrap())
        .collect()
}

/// The audit rows of a task for `event`.
pub fn audit_of<'a>(task: &'a Value, event: &str) -> Vec<&'a Value> {
    task["audit"]
        .as_array()
        .expect("the task shows its audit")
        .iter()
        .filter(|a| a["event"] == event)
        .collect()
}

/// Runs the Python `script` (with `ASSISTD_TEST_PYTHON`, else python3) on `input` as its
/// standard input: its standard output as JSON, or (`Err`) its standard error when it
/// exits with a failure. A missing Python package is a broken set-up, not an answer: it
/// panics (build.rs makes such a test ignored, or `.ci/run` installs the package).
pub fn python_json(script: &str, input: &str) -> Result<Value, String> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(crate::real_model::python())
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (with the packages .ci/run installs)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("ModuleNotFoundError"), "{stderr}");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(stderr.into_owned())
    }
}

/// The `/metrics` text of the server at `addr` (`http://host:port`).
pub async fn metrics_text(addr: &str) -> reqwest::Result<String> {
    reqwest::get(format!("{addr}/metrics")).await?.text().await
}

/// The sum of the samples in `/metrics` `text` whose line starts with `prefix` (a family's
/// sample name and the start of its labels); `None` when there is none.
pub fn metric_sum(text: &str, prefix: &str) -> Option<i64> {
    let values: Vec<i64> = text
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}
