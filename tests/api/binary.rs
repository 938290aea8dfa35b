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
    pub async fn start(envs: &[(String, String)], workdir: &std::path::Path) -> RealServer {
        Self::start_on(free_port(), envs, workdir).await
    }

    pub async fn start_on(
        port: u16,
        envs: &[(String, String)],
        workdir: &std::path::Path,
    ) -> RealServer {
        let child = Command::new(env!("CARGO_BIN_EXE_assistd"))
            .current_dir(workdir)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("ASSISTD_SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("ASSISTD_LOG__LEVEL", "warn")
            .envs(envs.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start assistd");
        let addr = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http.get(format!("{addr}/readyz")).send().await
                && r.status() == 200
            {
                break;
            }
            assert!(Instant::now() < deadline, "assistd did not become ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        RealServer { child, addr }
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

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_answers_a_signed_message_and_stops_cleanly_on_sigterm() {
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let workdir = tempfile::tempdir().unwrap();
    let envs = vec![
        ("ASSISTD_DATABASE__URL".to_string(), db.url.clone()),
        (
            "ASSISTD_LLM__BASE_URL".to_string(),
            format!("{}/v1", model.uri()),
        ),
        (
            "ASSISTD_CHANNELS__GENERIC__SECRET".to_string(),
            SECRET.to_string(),
        ),
        (
            "ASSISTD_CHANNELS__GENERIC__REPLY_URL".to_string(),
            format!("{}/reply", receiver.uri()),
        ),
        ("ASSISTD_ADMIN__TOKEN".to_string(), ADMIN_TOKEN.to_string()),
    ];
    let server = RealServer::start(&envs, workdir.path()).await;

    let body = serde_json::to_vec(&message("bin", 1, "hello binary")).unwrap();
    let ts = assistd::domain::now_ms() / 1000;
    let sig = assistd::channels::generic::sign(SECRET, ts, &body);
    let http = reqwest::Client::new();
    let resp = http
        .post(format!("{}/webhooks/generic", server.addr))
        .header("X-Assistd-Timestamp", ts.to_string())
        .header("X-Assistd-Signature", sig)
        .body(body)
        .send()
        .await
        .unwrap();
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
    assert_eq!(server.terminate(), Some(0));
    db.drop_db().await;
}

#[test]
fn invalid_configuration_stops_start_up_naming_the_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_assistd"))
        .env_clear()
        .env("ASSISTD_WORKER__CONCURRENCY", "0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("worker.concurrency"), "{stderr}");

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
