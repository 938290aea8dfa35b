//! The real `assistd` binary, as a newcomer runs it.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helpers::*;

/// A running `assistd serve` child process; killed when dropped, so a failing test leaves
/// no server behind.
pub struct RealServer {
    pub child: Child,
    pub addr: String,
}

impl Drop for RealServer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl RealServer {
    /// Starts the binary on a free port. A port found free can be taken by another test's
    /// server before this one binds it: then it starts again on another (at most 5 times).
    pub async fn start(envs: &[(String, String)], workdir: &std::path::Path) -> RealServer {
        for _ in 0..5 {
            match Self::try_start_on(free_port(), envs, workdir).await {
                Ok(server) => return server,
                Err(log) if log.contains("Address already in use") => continue,
                Err(log) => panic!("assistd did not become ready: {log}"),
            }
        }
        panic!("assistd found no free port in 5 tries")
    }

    pub async fn start_on(
        port: u16,
        envs: &[(String, String)],
        workdir: &std::path::Path,
    ) -> RealServer {
        Self::try_start_on(port, envs, workdir)
            .await
            .unwrap_or_else(|log| panic!("assistd did not become ready: {log}"))
    }

    /// The server on `port` once `/readyz` answers 200, or its log when it exited first or
    /// was not ready in 30 s.
    async fn try_start_on(
        port: u16,
        envs: &[(String, String)],
        workdir: &std::path::Path,
    ) -> Result<RealServer, String> {
        let log = std::fs::File::create(workdir.join("assistd.log")).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_assistd"))
            .current_dir(workdir)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("ASSISTD_SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("ASSISTD_LOG__LEVEL", "warn")
            .envs(envs.iter().cloned())
            // The log and standard error, for tests that read them: `<workdir>/assistd.log`.
            .stdout(Stdio::from(log.try_clone().expect("log file")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start assistd");
        let addr = format!("http://127.0.0.1:{port}");
        let mut server = RealServer { child, addr };
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let log = || std::fs::read_to_string(workdir.join("assistd.log")).unwrap_or_default();
        loop {
            if let Ok(r) = http.get(format!("{}/readyz", server.addr)).send().await
                && r.status() == 200
            {
                return Ok(server);
            }
            if matches!(server.child.try_wait(), Ok(Some(_))) || Instant::now() >= deadline {
                return Err(log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: the process dies mid-whatever, as in an OOM kill or machine loss.
    pub fn kill(self) {
        // Drop sends SIGKILL and reaps the process.
        drop(self);
    }

    /// Sends SIGTERM and waits for the exit code.
    pub fn terminate(mut self) -> Option<i32> {
        // `self` is dropped at the end; the process has exited by then.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("assistd did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl RealServer {
    /// POSTs `message` to the server's generic webhook, signed with the test secret.
    /// GET `path` with the admin token; asserts 200 and returns the JSON body.
    pub async fn admin_json(&self, path: &str) -> Value {
        let resp = reqwest::Client::new()
            .get(format!("{}{path}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "GET {path}");
        resp.json().await.unwrap()
    }

    pub async fn post_message(&self, message: &Value) -> reqwest::Response {
        self.post_message_with(message, &[]).await
    }

    /// [`Self::post_message`] with more request headers.
    pub async fn post_message_with(
        &self,
        message: &Value,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let body = serde_json::to_vec(message).unwrap();
        let ts = assistd::domain::now_ms() / 1000;
        let mut request = reqwest::Client::new().post(format!("{}/webhooks/generic", self.addr));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request
            .header("X-Assistd-Timestamp", ts.to_string())
            .header(
                "X-Assistd-Signature",
                assistd::channels::generic::sign(SECRET, ts, &body),
            )
            .body(body)
            .send()
            .await
            .unwrap()
    }
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The environment of a server on `db` answering the generic channel with `model` (its
/// base URL) and replying to `receiver` (its base URL), plus `extra`.
pub fn server_envs(
    db: &TestDb,
    model: &str,
    receiver: &str,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let mut envs = vec![
        ("ASSISTD_DATABASE__URL".to_string(), db.url.clone()),
        ("ASSISTD_LLM__BASE_URL".to_string(), format!("{model}/v1")),
        (
            "ASSISTD_CHANNELS__GENERIC__SECRET".to_string(),
            SECRET.to_string(),
        ),
        (
            "ASSISTD_CHANNELS__GENERIC__REPLY_URL".to_string(),
            format!("{receiver}/reply"),
        ),
        ("ASSISTD_ADMIN__TOKEN".to_string(), ADMIN_TOKEN.to_string()),
    ];
    envs.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    envs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_answers_a_signed_message_and_stops_cleanly_on_sigterm() {
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let workdir = tempfile::tempdir().unwrap();
    let envs = server_envs(&db, &model.uri(), &receiver.uri(), &[]);
    let server = RealServer::start(&envs, workdir.path()).await;

    let resp = server
        .post_message(&message("bin", 1, "hello binary"))
        .await;
    assert_eq!(resp.status(), 200);
    let id = resp.json::<Value>().await.unwrap()["task_id"]
        .as_i64()
        .unwrap();

    let deadline = Instant::now() + WAIT;
    loop {
        let replies = received_replies(&receiver).await;
        if !replies.is_empty() {
            assert_eq!(replies.len(), 1);
            assert_eq!(replies[0].0, format!("agent-task-{id}"));
            assert_eq!(replies[0].1["text"], "answer to: hello binary");
            break;
        }
        assert!(Instant::now() < deadline, "no reply from the binary");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Traces are off by default: nothing names a span to the model.
    let calls = model.received_requests().await.unwrap();
    assert!(!calls.is_empty());
    assert!(calls.iter().all(|r| !r.headers.contains_key("traceparent")));
    assert_eq!(server.terminate(), Some(0));
    db.drop_db().await;
}

#[test]
fn invalid_configuration_stops_start_up_naming_the_key() {
    for (var, value, key) in [
        ("ASSISTD_WORKER__CONCURRENCY", "0", "worker.concurrency"),
        (
            "ASSISTD_CONTEXT__SUMMARY_MAX_TOKENS",
            "0",
            "context.summary_max_tokens",
        ),
        (
            "ASSISTD_CONTEXT__RECENT_AFTER_SUMMARY_PERCENT",
            "101",
            "context.recent_after_summary_percent",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_assistd"))
            .env_clear()
            .env(var, value)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{var}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(key), "{stderr}");
    }

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[llm]\ntimeout_secs = \"soon\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_assistd"))
        .env_clear()
        .arg("--config")
        .arg(&file)
        .arg("migrate")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("llm.timeout_secs"), "{stderr}");
}

/// Issue 23: a cron expression the scheduler would refuse, and a log level that names no
/// level, stop start-up naming the key (before, `… funday` was accepted and the job never
/// ran; `verbose` was taken as a target and silenced every log).
#[test]
fn a_bad_cron_expression_or_log_level_stops_start_up_naming_the_key() {
    for (var, value, key) in [
        (
            "ASSISTD_SCHEDULER__JOBS__RETENTION__CRON",
            "0 0 3 * * funday",
            "scheduler.jobs.retention.cron",
        ),
        (
            "ASSISTD_SCHEDULER__JOBS__CONFIRM_TIMEOUT__CRON",
            "0 61 * * * *",
            "scheduler.jobs.confirm_timeout.cron",
        ),
        ("ASSISTD_LOG__LEVEL", "verbose", "log.level"),
        ("ASSISTD_LOG__LEVEL", "info,assistd", "log.level"),
        ("ASSISTD_LOG__LEVEL", "assistd=loud", "log.level"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_assistd"))
            .env_clear()
            .env(var, value)
            .env(
                "ASSISTD_DATABASE__URL",
                format!("sqlite://{}/a.db", dir.path().display()),
            )
            .arg("migrate")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {stderr}");
        assert!(stderr.contains(key), "{value}: {stderr}");
        assert!(stderr.contains(value), "{value}: {stderr}");
    }
    // Directives with levels are fine (checked without starting: `migrate` on a temp file).
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_assistd"))
        .env_clear()
        .env("ASSISTD_LOG__LEVEL", "warn,assistd=debug")
        .env(
            "ASSISTD_DATABASE__URL",
            format!("sqlite://{}/a.db", dir.path().display()),
        )
        .arg("migrate")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Issue 23: a PostgreSQL server that cannot be reached is reported within a few seconds,
/// naming its address and the cause, not as the pool's "timed out": refused, an unknown
/// host, and a server that accepts and never answers (reported after
/// `database.acquire_timeout_secs`, here 2).
#[test]
fn an_unreachable_database_is_reported_with_its_address_and_cause() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let closed = free_port();
    for (url, cause) in [
        (
            format!("postgres://u:secret-pw@127.0.0.1:{closed}/db"),
            "refused",
        ),
        (
            "postgres://u:secret-pw@no-such-host.invalid:5432/db".to_string(),
            "no-such-host.invalid",
        ),
        (
            format!("postgres://u:secret-pw@127.0.0.1:{silent_port}/db"),
            "no answer within 2 s",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_assistd"))
            .env_clear()
            .env("ASSISTD_DATABASE__URL", &url)
            .env("ASSISTD_DATABASE__ACQUIRE_TIMEOUT_SECS", "2")
            .arg("migrate")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{url}");
        assert!(
            stderr.contains("cannot connect to PostgreSQL at"),
            "{stderr}"
        );
        assert!(stderr.contains(cause), "{url}: {stderr}");
        assert!(
            !stderr.contains("secret-pw"),
            "the password is not shown: {stderr}"
        );
        assert!(!stderr.contains("pool timed out"), "{stderr}");
    }
    drop(silent);
}

#[cfg_attr(
    not(assistd_has_prometheus),
    ignore = "needs Python's prometheus-client (pip install 'prometheus-client>=0.20,<1'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reports_recovery_time_and_tokens_per_agent_and_model() {
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    // A task an instance claimed and then died with: its lease ran out a second ago.
    let now = assistd::domain::now_ms();
    let id = {
        let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
        let store = assistd::store::Store::connect(&cfg.database).await.unwrap();
        store.migrate().await.unwrap();
        publish_agents(&store, &cfg).await.unwrap();
        let msg = assistd::domain::NewMessage {
            reply_context: None,
            channel: "generic".into(),
            event_id: "e-dead".into(),
            message_id: "m-dead".into(),
            conversation_id: "c-dead".into(),
            sender_id: "u".into(),
            sender_name: None,
            text: "left behind".into(),
            trace_context: None,
        };
        let id = store
            .ingest_message(&msg, "default", now - 5_000)
            .await
            .unwrap()
            .task_id;
        let claimed = store
            .claim_tasks("dead-instance", 1, now - 1_000, now - 4_000)
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1);
        store.close().await;
        id
    };
    let workdir = tempfile::tempdir().unwrap();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[("ASSISTD_LLM__MODEL", "tiny-model")],
    );
    let server = RealServer::start(&envs, workdir.path()).await;
    let deadline = Instant::now() + WAIT;
    while received_replies(&receiver).await.is_empty() {
        assert!(Instant::now() < deadline, "the task was not taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        received_replies(&receiver).await[0].0,
        format!("agent-task-{id}")
    );
    let m = crate::metrics::scrape(&server.addr).await;
    assert_eq!(
        m.sample("assistd_recovery_seconds_count", &[]),
        Some(1.0),
        "{m:?}"
    );
    let recovery = m.sample("assistd_recovery_seconds_sum", &[]).unwrap();
    assert!(recovery > 0.0 && recovery < 30.0, "{recovery}");
    // The model double reports 7 completion tokens per call and the prompt's size.
    let tokens = |m: &crate::metrics::Exposition, kind| {
        let labels = [
            ("agent", "default"),
            ("model", "tiny-model"),
            ("kind", kind),
        ];
        m.sample("assistd_model_tokens_total", &labels)
    };
    assert_eq!(tokens(&m, "completion"), Some(7.0), "{m:?}");
    assert!(tokens(&m, "prompt").unwrap() > 0.0);

    // A message claimed the ordinary way is no takeover.
    let resp = server.post_message(&message("fresh", 1, "new one")).await;
    assert_eq!(resp.status(), 200);
    while received_replies(&receiver).await.len() < 2 {
        assert!(Instant::now() < deadline, "no second reply");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = crate::metrics::scrape(&server.addr).await;
    assert_eq!(m.sample("assistd_recovery_seconds_count", &[]), Some(1.0));
    assert_eq!(tokens(&m, "completion"), Some(14.0));
    assert_eq!(server.terminate(), Some(0));
    db.drop_db().await;
}
