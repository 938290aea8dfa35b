//! Workflows under SIGKILL of the real binary: finished steps are never run again, and a
//! non-idempotent step caught mid-call becomes UNKNOWN and waits for a human.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::binary::{RealServer, free_port};
use crate::helpers::*;
use crate::workflows::{AGENT_LOOP, TRANSFER, ToolScriptModel, calls_to, overlay, tool_server};

/// A script that also records the step key and body of every call.
struct KeyedModel(
    Arc<Mutex<Vec<String>>>,
    Box<dyn ModelScript>,
    Arc<Mutex<Vec<Value>>>,
);

impl ModelScript for KeyedModel {
    fn reply(&self, request: &Request, body: &Value) -> ModelReply {
        let key = request
            .headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        self.0.lock().unwrap().push(key);
        self.2.lock().unwrap().push(body.clone());
        self.1.reply(request, body)
    }
}

struct BinaryFlow {
    db: TestDb,
    receiver: MockServer,
    tools: MockServer,
    _model: MockServer,
    model_keys: Arc<Mutex<Vec<String>>>,
    model_bodies: Arc<Mutex<Vec<Value>>>,
    dir: tempfile::TempDir,
    port: u16,
}

impl BinaryFlow {
    async fn new(workflow: &str, slow_path: &str, slow: Duration) -> BinaryFlow {
        Self::with_script(workflow, slow_path, 0, slow, ToolScriptModel::default()).await
    }

    /// `slow_path` answers `fast_first` calls at once, then hangs on one for `slow`.
    async fn with_script(
        workflow: &str,
        slow_path: &str,
        fast_first: u64,
        slow: Duration,
        script: impl ModelScript,
    ) -> BinaryFlow {
        let model_keys = Arc::new(Mutex::new(Vec::new()));
        let model_bodies = Arc::new(Mutex::new(Vec::new()));
        let model = MockServer::start().await;
        model_mock(KeyedModel(
            model_keys.clone(),
            Box::new(script),
            model_bodies.clone(),
        ))
        .mount(&model)
        .await;
        let tools = tool_server().await;
        // The first call to `slow_path` hangs long enough to be killed in flight.
        let slow_method = if slow_path.starts_with("/tools/transfer") {
            "POST"
        } else {
            "GET"
        };
        if fast_first > 0 {
            Mock::given(method(slow_method))
                .and(path(slow_path))
                .respond_with(
                    ResponseTemplate::new(200)
                        .set_body_json(json!({"value": "alpha", "status": "done"})),
                )
                .up_to_n_times(fast_first)
                .with_priority(1)
                .mount(&tools)
                .await;
        }
        Mock::given(method(slow_method))
            .and(path(slow_path))
            .respond_with(
                ResponseTemplate::new(200)
                    .set_body_json(json!({"value": "slow", "status": "done"}))
                    .set_delay(slow),
            )
            .up_to_n_times(1)
            .with_priority(2)
            .mount(&tools)
            .await;
        let later = if fast_first > 0 { "alpha" } else { "beta" };
        Mock::given(method(slow_method))
            .and(path(slow_path))
            .respond_with(
                ResponseTemplate::new(200).set_body_json(json!({"value": later, "status": "done"})),
            )
            .with_priority(3)
            .mount(&tools)
            .await;
        let dir = tempfile::tempdir().unwrap();
        let wf = dir.path().join("flow.json");
        std::fs::write(&wf, workflow).unwrap();
        std::fs::write(dir.path().join("overlay.toml"), overlay(&tools.uri(), &wf)).unwrap();
        BinaryFlow {
            db: TestDb::new().await,
            receiver: accepting_receiver().await,
            tools,
            _model: model,
            model_keys,
            model_bodies,
            dir,
            port: free_port(),
        }
    }

    async fn start(&self) -> RealServer {
        let env: Vec<(String, String)> = [
            (
                "ASSISTD_CONFIG",
                self.dir.path().join("overlay.toml").display().to_string(),
            ),
            ("ASSISTD_DATABASE__URL", self.db.url.clone()),
            ("ASSISTD_LLM__BASE_URL", format!("{}/v1", self._model.uri())),
            ("ASSISTD_CHANNELS__GENERIC__SECRET", SECRET.to_string()),
            (
                "ASSISTD_CHANNELS__GENERIC__REPLY_URL",
                format!("{}/reply", self.receiver.uri()),
            ),
            ("ASSISTD_ADMIN__TOKEN", ADMIN_TOKEN.to_string()),
            ("ASSISTD_WORKER__INSTANCE_ID", "wf-crash".to_string()),
            ("ASSISTD_WORKER__POLL_INTERVAL_MS", "100".to_string()),
            ("ASSISTD_OUTBOX__POLL_INTERVAL_MS", "100".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        RealServer::start_on(self.port, &env, self.dir.path()).await
    }

    async fn post(&self, body: &Value) -> i64 {
        let raw = serde_json::to_vec(body).unwrap();
        let ts = assistd::domain::now_ms() / 1000;
        let sig = assistd::channels::generic::sign(SECRET, ts, &raw);
        let resp = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/webhooks/generic", self.port))
            .header("X-Assistd-Timestamp", ts.to_string())
            .header("X-Assistd-Signature", sig)
            .body(raw)
            .send()
            .await
            .unwrap();
        task_id_of(resp).await
    }

    async fn task(&self, id: i64) -> Value {
        reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}/api/tasks/{id}", self.port))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn wait(&self, id: i64, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let t = self.task(id).await;
            if pred(&t) {
                return t;
            }
            assert!(Instant::now() < deadline, "task {id} stuck: {t:#}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Posts `body`, kills the server while `/tools/b` hangs, restarts it and waits for the
    /// task to finish and reply; checks that only the interrupted lookup ran twice.
    async fn kill_in_b_and_resume(&self, body: &Value) -> (i64, Value, RealServer) {
        let server = self.start().await;
        let id = self.post(body).await;
        self.wait_calls("GET", "/tools/b", 1).await;
        server.kill();
        let server = self.start().await;
        let task = self
            .wait(id, |t| {
                t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
            })
            .await;
        assert_eq!(task["claim_count"], 2);
        assert_eq!(
            calls_to(&self.tools, "GET", "/tools/a").await,
            1,
            "finished tool not re-run"
        );
        assert_eq!(
            calls_to(&self.tools, "GET", "/tools/b").await,
            2,
            "the interrupted read-only call ran again"
        );
        assert_eq!(calls_to(&self.tools, "GET", "/tools/c").await, 1);
        (id, task, server)
    }

    /// Adds `toml` to the overlay the binary reads.
    fn extend_overlay(&self, toml: &str) {
        let path = self.dir.path().join("overlay.toml");
        let mut overlay = std::fs::read_to_string(&path).unwrap();
        overlay.push('\n');
        overlay.push_str(toml);
        std::fs::write(path, overlay).unwrap();
    }

    async fn wait_calls(&self, method_name: &str, prefix: &str, n: usize) {
        let deadline = Instant::now() + WAIT;
        while calls_to(&self.tools, method_name, prefix).await < n {
            assert!(Instant::now() < deadline, "{prefix} never called");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_tool_calls_resumes_without_rerunning_finished_steps() {
    let flow = BinaryFlow::new(AGENT_LOOP, "/tools/b", Duration::from_secs(5)).await;
    let (id, task, server) = flow
        .kill_in_b_and_resume(&message("wfc", 1, "find things"))
        .await;
    // Model calls of finished steps were not repeated either: steps 1 and 3 once each.
    let keys = flow.model_keys.lock().unwrap().clone();
    for (step, name) in [
        (1, "llm"),
        (3, "llm"),
        (5, "summary"),
        (6, "llm"),
        (8, "summary"),
        (9, "llm"),
    ] {
        let key = format!("{id}:{step}:{name}");
        assert_eq!(
            keys.iter().filter(|k| **k == key).count(),
            1,
            "{key} in {keys:?}"
        );
    }
    assert_eq!(
        task["result"], "found alpha, beta, gamma",
        "same context after resume"
    );
    let replies = received_replies(&flow.receiver).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(server.terminate(), Some(0));
    flow.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_calls_of_one_answer_resumes_without_rerunning_the_finished_one() {
    // One model answer asks for lookup_a, lookup_b and lookup_c; the process dies while
    // lookup_b hangs.
    let flow = BinaryFlow::with_script(
        AGENT_LOOP,
        "/tools/b",
        0,
        Duration::from_secs(5),
        crate::model_contract::ParallelCalls,
    )
    .await;
    let (id, task, server) = flow
        .kill_in_b_and_resume(&message("wfp", 1, "all at once"))
        .await;
    let keys = flow.model_keys.lock().unwrap().clone();
    let first = format!("{id}:1:llm");
    assert_eq!(keys.iter().filter(|k| **k == first).count(), 1, "{keys:?}");
    assert_eq!(task["result"], "got 3");
    let steps: Vec<&str> = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["idempotency_key"].as_str().unwrap())
        .collect();
    let want: Vec<String> = ["1:llm", "2:lookup_a", "3:lookup_b", "4:lookup_c", "5:llm"]
        .iter()
        .map(|k| format!("{id}:{k}"))
        .collect();
    assert_eq!(steps, want);
    assert_eq!(received_replies(&flow.receiver).await.len(), 1);
    assert_eq!(server.terminate(), Some(0));
    flow.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_non_idempotent_step_becomes_unknown_and_is_not_repeated() {
    let flow = BinaryFlow::new(TRANSFER, "/tools/transfer", Duration::from_secs(5)).await;
    let server = flow.start().await;
    let id = flow.post(&message("wfu", 1, "move money")).await;
    flow.wait_calls("POST", "/tools/transfer", 1).await;
    server.kill();
    let server = flow.start().await;
    let task = flow
        .wait(id, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(task["steps"][0]["status"], "UNKNOWN");
    assert_eq!(task["pending_actions"][0]["kind"], "unknown_step");
    let unknown = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "STEP_UNKNOWN")
        .unwrap();
    assert_eq!(unknown["risk_flag"], true);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        calls_to(&flow.tools, "POST", "/tools/transfer").await,
        1,
        "not guessed at"
    );
    // A human checks and decides to run it again.
    let resp = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/api/tasks/{id}/confirm",
            flow.port
        ))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"decision": "approve", "approver": "alice"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let task = flow
        .wait(id, |t| {
            t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["result"], "transfer done");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/transfer").await, 2);
    assert_eq!(server.terminate(), Some(0));
    flow.db.drop_db().await;
}

const LONG_LOOP: &str = r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["lookup_a"], "max_steps": 30, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_loop_resumes_from_its_summary_and_last_steps() {
    const CALLS: usize = 20;
    let script = ToolScriptModel(vec!["lookup_a"; CALLS]);
    let flow =
        BinaryFlow::with_script(LONG_LOOP, "/tools/a", 10, Duration::from_secs(5), script).await;
    let server = flow.start().await;
    let id = flow.post(&message("wfl", 1, "gather twenty facts")).await;
    flow.wait_calls("GET", "/tools/a", 11).await;
    server.kill();
    let before_restart = flow.model_bodies.lock().unwrap().len();
    let server = flow.start().await;
    let task = flow
        .wait(id, |t| {
            t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
        })
        .await;
    let expected = format!("found {}", vec!["alpha"; CALLS].join(", "));
    assert_eq!(task["result"], expected);
    let steps = task["steps"].as_array().unwrap();
    let tool_steps = steps.iter().filter(|s| s["tool"] == "lookup_a").count();
    assert_eq!(tool_steps, CALLS);
    assert!(steps.len() >= 2 * CALLS, "a loop of {} steps", steps.len());
    assert!(
        task["context_summary"]
            .as_str()
            .unwrap()
            .starts_with("seen:")
    );
    assert_eq!(
        calls_to(&flow.tools, "GET", "/tools/a").await,
        CALLS + 1,
        "only the interrupted call ran twice"
    );

    // What the model was given first after the restart: the system prompt, the request, the
    // rolling summary, and the last steps in full — not the whole loop.
    let bodies = flow.model_bodies.lock().unwrap().clone();
    let first = bodies[before_restart..]
        .iter()
        .find(|b| {
            !b["messages"][0]["content"]
                .as_str()
                .unwrap()
                .starts_with("Summarise")
        })
        .expect("a model call after the restart");
    let messages = first["messages"].as_array().unwrap();
    assert!(
        messages.len() <= 2 + 1 + 4,
        "context of {} messages: {first:#}",
        messages.len()
    );
    let summary = messages[2]["content"].as_str().unwrap();
    assert!(
        summary.starts_with("Summary of the work so far"),
        "{summary}"
    );
    let seen = summary.matches("alpha").count();
    assert!(
        seen >= 6,
        "the summary carries the earlier results: {summary}"
    );
    // No finished model step was called twice.
    let keys = flow.model_keys.lock().unwrap().clone();
    let mut distinct = keys.clone();
    distinct.sort();
    distinct.dedup();
    assert!(keys.len() <= distinct.len() + 1, "{keys:?}");
    assert_eq!(server.terminate(), Some(0));
    flow.db.drop_db().await;
}

/// A FastMCP server over HTTP, and a binary flow running `workflow` with it configured.
async fn mcp_flow(workflow: &str) -> (crate::mcp::McpServer, BinaryFlow) {
    let mcp = crate::mcp::McpServer::start().await;
    let flow = BinaryFlow::new(workflow, "/unused", Duration::from_secs(1)).await;
    flow.extend_overlay(&mcp.toml());
    (mcp, flow)
}

/// Waits until the MCP server logged a call.
async fn wait_mcp_call(mcp: &crate::mcp::McpServer) {
    let deadline = Instant::now() + WAIT;
    while mcp.calls().is_empty() {
        assert!(Instant::now() < deadline, "the MCP tool was never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 21: an MCP tool the server marks destructive, killed mid-call after its approval,
/// is UNKNOWN after the restart and not called again (the journal and its key, as for HTTP
/// tools); the server is a FastMCP one from the reference SDK.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_destructive_mcp_call_leaves_it_unknown_and_not_repeated() {
    let (mcp, flow) = mcp_flow(
        r#"{"start": "send", "nodes": [
  {"id": "send", "type": "tool", "tool": "desk.slow_send", "args": {"to": "{{ message.text }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "sent: {{ steps.send.result }}"}]}"#,
    )
    .await;
    let server = flow.start().await;
    let id = flow.post(&message("wf-mcp", 1, "ops")).await;
    flow.wait(id, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let approve = |port: u16| async move {
        let resp = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/api/tasks/{id}/confirm"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"decision": "approve", "approver": "alice"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    };
    approve(flow.port).await;
    wait_mcp_call(&mcp).await;
    server.kill();
    let server = flow.start().await;
    let send = |t: &Value| {
        t["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["tool"] == "desk.slow_send")
            .cloned()
            .unwrap_or(Value::Null)
    };
    let task = flow
        .wait(id, |t| {
            t["status"] == "WAITING_HUMAN_CONFIRM" && send(t)["status"] == "UNKNOWN"
        })
        .await;
    let pending = task["pending_actions"].as_array().unwrap();
    assert!(
        pending
            .iter()
            .any(|p| p["kind"] == "unknown_step" && p["decision"] == "PENDING"),
        "{task:#}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calls = mcp.calls();
    assert_eq!(calls.len(), 1, "not guessed at: {calls:?}");
    assert_eq!(
        calls[0],
        format!(
            "slow_send ops key={}",
            send(&task)["idempotency_key"].as_str().unwrap()
        ),
        "the step's key went in _meta"
    );
    assert_eq!(server.terminate(), Some(0));
    flow.db.drop_db().await;
}

/// Issue 21: a read-only MCP call interrupted by SIGKILL is made again after the restart,
/// under the same key, and the task answers with its result.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_read_only_mcp_call_replays_it_after_the_restart() {
    let (mcp, flow) = mcp_flow(
        r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "desk.slow_lookup", "args": {"ticket": "{{ message.text }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.look.result }}"}]}"#,
    )
    .await;
    let server = flow.start().await;
    let id = flow.post(&message("wf-mcp-ro", 1, "T-3")).await;
    wait_mcp_call(&mcp).await;
    server.kill();
    let server = flow.start().await;
    let task = flow
        .wait(id, |t| {
            t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["result"], "T-3 is open");
    let calls = mcp.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0], calls[1], "the same call under the same key");
    assert_eq!(server.terminate(), Some(0));
    flow.db.drop_db().await;
}
