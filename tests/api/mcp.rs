//! Issue 21 (first part): tools from an MCP server, over streamable HTTP, against a server
//! built with the reference Python SDK (PyPI `mcp` 1.x, `FastMCP`). `.ci/run` installs it;
//! where build.rs does not find it these tests are compiled as ignored, with the reason.

use std::process::{Child, Command, Stdio};

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::binary::free_port;
use crate::helpers::*;
use crate::strict_model::ModelReply;

/// The server the tests run: a few tools of each kind (see the script).
pub const DESK: &str = include_str!("mcp_desk.py");

/// A FastMCP server, stopped on drop: over streamable HTTP on 127.0.0.1 (started here), or
/// over stdio (started by assistd from `configure`). Its calls are logged to `log`.
pub struct McpServer {
    child: Option<Child>,
    pub port: u16,
    pub log: std::path::PathBuf,
    script: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for McpServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Fails the test unless the Python of the tests imports `mcp`. The tests using it are
/// compiled only where build.rs found the package (else ignored, `assistd_has_mcp`), so a
/// missing one was removed after the probe (`ASSISTD_TEST_PROBE=$(date +%s) cargo test`
/// probes again).
fn require_mcp() {
    let python = crate::real_model::python();
    let available = Command::new(&python)
        .args(["-c", "import mcp.server.fastmcp"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        available,
        "the Python package `mcp` is not importable by {python}, though build.rs found it: \
         install it again, or probe again (ASSISTD_TEST_PROBE=$(date +%s) cargo test)"
    );
}

impl McpServer {
    /// Over streamable HTTP, started now.
    pub async fn start() -> McpServer {
        let mut server = Self::stdio();
        // A free port can be taken by another test's server while Python starts: then the
        // MCP server cannot bind and exits, and it starts again on another port.
        for _ in 0..5 {
            server.port = free_port();
            if server.try_start().await {
                return server;
            }
        }
        panic!("the MCP server could not bind a port");
    }

    /// Over stdio: nothing runs until assistd starts it.
    pub fn stdio() -> McpServer {
        require_mcp();
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("desk.py");
        std::fs::write(&script, DESK).unwrap();
        McpServer {
            child: None,
            port: 0,
            log: dir.path().join("calls.log"),
            script,
            _dir: dir,
        }
    }

    /// Stops the HTTP server (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the HTTP server (again) on its port.
    pub async fn restart(&mut self) {
        assert!(
            self.try_start().await,
            "the MCP server could not bind its port"
        );
    }

    /// Starts the HTTP server on `self.port`; `false` when it exited (the port was taken).
    /// It is up once `/mcp` answers as an MCP endpoint (not another server's 404).
    async fn try_start(&mut self) -> bool {
        self.stop();
        let child = Command::new(crate::real_model::python())
            .arg(&self.script)
            .args([
                "http",
                &self.log.display().to_string(),
                &self.port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the MCP server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        let url = format!("http://127.0.0.1:{}/mcp", self.port);
        loop {
            if let Some(child) = self.child.as_mut()
                && child.try_wait().ok().flatten().is_some()
            {
                self.child = None;
                return false;
            }
            let answered = reqwest::get(&url).await.map(|r| r.status().as_u16());
            if matches!(answered, Ok(status) if status != 404) {
                return true;
            }
            assert!(Instant::now() < deadline, "the MCP server did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The logged calls, without the pid.
    pub fn calls(&self) -> Vec<String> {
        self.calls_with_pid()
            .into_iter()
            .map(|(line, _)| line)
            .collect()
    }

    /// The logged calls and the pid of the server process that took each.
    pub fn calls_with_pid(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (line, pid) = l.rsplit_once(" pid=").unwrap();
                (line.to_string(), pid.to_string())
            })
            .collect()
    }

    /// The server's config: the HTTP URL, or the command that starts it over stdio.
    pub fn server_config(&self) -> assistd::config::McpServerConfig {
        let mut config = assistd::config::McpServerConfig {
            timeout_secs: 20,
            undo: [("create_ticket".to_string(), "delete_ticket".to_string())].into(),
            ..Default::default()
        };
        if self.child.is_some() || self.port != 0 {
            config.url = format!("http://127.0.0.1:{}/mcp", self.port);
        } else {
            // The interpreter itself: a pyenv shim would add its own variables.
            let out = Command::new(crate::real_model::python())
                .args(["-c", "import sys; print(sys.executable)"])
                .output()
                .unwrap();
            config.command = vec![
                String::from_utf8(out.stdout).unwrap().trim().to_string(),
                self.script.display().to_string(),
                "stdio".into(),
                self.log.display().to_string(),
            ];
        }
        config
    }

    pub fn configure(&self, c: &mut assistd::Config) {
        c.mcp_servers.insert("desk".into(), self.server_config());
    }

    /// The TOML a user writes for this server, for the real binary.
    pub fn toml(&self) -> String {
        let c = self.server_config();
        format!(
            "[mcp_servers.desk]\nurl = \"{}\"\ntimeout_secs = 20\n\n[mcp_servers.desk.undo]\ncreate_ticket = \"delete_ticket\"\n",
            c.url
        )
    }
}

/// Calls `desk__lookup` until a tool answer is in the chat, then answers with it.
fn lookup_script(body: &Value) -> ModelReply {
    let messages = body["messages"].as_array().unwrap();
    match messages.iter().find(|m| m["role"] == "tool") {
        Some(tool) => ModelReply::text(format!("found: {}", tool["content"].as_str().unwrap())),
        None => ModelReply::calls(&[("desk__lookup", json!({"ticket": "T-42"}))]),
    }
}

/// A flow whose agent node may call `desk.lookup`, its model following `lookup_script`.
async fn lookup_flow(server: &McpServer) -> crate::workflows::Flow {
    crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["desk.lookup"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        lookup_script,
        |c| server.configure(c),
    )
    .await
}

#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_mcp_tool_is_offered_called_once_and_its_answer_reaches_the_reply() {
    let server = McpServer::start().await;
    let flow = lookup_flow(&server).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("mcp-1", 1, "how is T-42?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let reply = &task["reply"]["content"]["text"];
    assert!(reply.as_str().unwrap().contains("T-42 is open"), "{reply}");
    // Called once, with the step's key in `_meta`.
    let calls = server.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let step = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["tool"] == "desk.lookup")
        .expect("a journalled MCP step");
    assert_eq!(
        calls[0],
        format!(
            "lookup T-42 key={}",
            step["idempotency_key"].as_str().unwrap()
        )
    );
    // The admin API lists the server, its state and its tools with their kinds.
    let url = format!("{}/api/admin/mcp", app.addr);
    assert_eq!(app.http.get(&url).send().await.unwrap().status(), 401);
    let listed = app.admin_json("/api/admin/mcp").await;
    let desk = &listed["servers"][0];
    assert_eq!(desk["name"], "desk");
    assert_eq!(desk["connected"], true);
    let kinds: std::collections::BTreeMap<String, String> = desk["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(kinds["desk.lookup"], "read_only");
    assert_eq!(kinds["desk.send"], "irreversible");
    // Idempotent and not destructive, with an undo configured: compensable.
    assert_eq!(kinds["desk.create_ticket"], "compensable");
    assert_eq!(kinds["desk.delete_ticket"], "irreversible");
    flow.app.stop().await;
}

#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destructive_mcp_tool_runs_once_and_only_after_approval() {
    let server = McpServer::start().await;
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "send", "nodes": [
  {"id": "send", "type": "tool", "tool": "desk.send", "args": {"to": "ops", "text": "{{ message.text }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "done: {{ steps.send.result }}"}]}"#,
        |_: &Value| ModelReply::text("unused"),
        |c| server.configure(c),
    )
    .await;
    let app = &flow.app;
    let id = task_id_of(
        app.post_message(&message("mcp-2", 1, "restart the router"))
            .await,
    )
    .await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(server.calls().is_empty(), "called before approval");
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["reply"]["content"]["text"], "done: sent");
    let calls = server.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(calls[0].starts_with("send ops restart the router key="));
    flow.app.stop().await;
}

/// A tool result with `isError` goes back to the model as the call's error, once (it is not
/// a transport failure to retry).
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_error_result_reaches_the_model_and_is_not_retried() {
    let server = McpServer::start().await;
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["desk.broken"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        |body: &Value| {
            let messages = body["messages"].as_array().unwrap();
            match messages.iter().find(|m| m["role"] == "tool") {
                Some(tool) => ModelReply::text(format!("tool said: {}", tool["content"].as_str().unwrap())),
                None => ModelReply::calls(&[("desk__broken", json!({"ticket": "T-9"}))]),
            }
        },
        |c| server.configure(c),
    )
    .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("mcp-3", 1, "how is T-9?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(reply.contains("no such ticket T-9"), "{reply}");
    assert_eq!(server.calls().len(), 1, "not retried");
    flow.app.stop().await;
}

/// The SSRF guard: an MCP server on an internal address is refused at start-up and never
/// contacted, unless its host is on `tooling.allowed_private_hosts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_on_an_internal_address_is_refused_at_start_up() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let db = TestDb::new().await;
    let mut config = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    config.tooling.allowed_private_hosts.clear();
    config.mcp_servers.insert(
        "inside".into(),
        assistd::config::McpServerConfig {
            url: format!("http://127.0.0.1:{port}/mcp"),
            timeout_secs: 2,
            ..Default::default()
        },
    );
    let refused = assistd::App::build(config.clone())
        .await
        .err()
        .expect("refused");
    assert!(
        refused
            .to_string()
            .contains("mcp_servers.inside: refusing internal address 127.0.0.1"),
        "{refused}"
    );
    assert!(listener.accept().is_err(), "the server was contacted");
    // Allowed: the guard lets it through (and the connection itself is then tried).
    config.tooling.allowed_private_hosts = vec!["127.0.0.1".into()];
    let tried = assistd::App::build(config)
        .await
        .err()
        .expect("nothing speaks MCP there");
    assert!(!tried.to_string().contains("refusing"), "{tried}");
    db.drop_db().await;
}

/// Issue 21: a stdio server runs as a child process with the documented environment only
/// (assistd's own, secrets included, is not passed on), and is started again when it dies.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdio_server_gets_only_its_environment_and_is_restarted_when_it_dies() {
    let server = McpServer::stdio();
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "keys", "nodes": [
  {"id": "keys", "type": "tool", "tool": "desk.env_keys", "args": {}, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.keys.result }}"}]}"#,
        |_: &Value| ModelReply::text("unused"),
        |c| {
            let mut config = server.server_config();
            config.env.insert("DESK_TOKEN".into(), "t0k".into());
            c.mcp_servers.insert("desk".into(), config);
        },
    )
    .await;
    let app = &flow.app;
    let listed = app.admin_json("/api/admin/mcp").await;
    assert_eq!(listed["servers"][0]["transport"], "stdio");
    assert_eq!(listed["servers"][0]["connected"], true);
    let id = task_id_of(app.post_message(&message("mcp-env", 1, "env?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let keys: Vec<String> = task["reply"]["content"]["text"]
        .as_str()
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    assert!(keys.contains(&"DESK_TOKEN".to_string()), "{keys:?}");
    // The test process has CARGO_* and ASSISTD_TEST_* variables; none reach the server.
    // (Python itself may set LC_CTYPE when the locale is C.)
    for key in &keys {
        assert!(
            assistd::tools::mcp::STDIO_ENV.contains(&key.as_str())
                || key == "DESK_TOKEN"
                || key == "LC_CTYPE",
            "{key} was passed on: {keys:?}"
        );
    }
    // The server dies; the next call starts it again.
    let pid = server.calls_with_pid()[0].1.clone();
    assert!(
        Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .unwrap()
            .success()
    );
    // Started again by the watcher, before any call needs it.
    let starts = server.log.with_extension("log.starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&starts)
        .unwrap_or_default()
        .lines()
        .count()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "the stdio server was not started again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let id = task_id_of(app.post_message(&message("mcp-env", 2, "again?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let calls = server.calls_with_pid();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_ne!(calls[1].1, pid, "a new server process took the call");
    flow.app.stop().await;
}

/// Issue 21: an idempotent, non-destructive tool with an undo tool configured is
/// compensable: it runs without approval, and a later failure calls the undo tool with the
/// original arguments and the result's fields (here the ticket id), once.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_tool_with_an_undo_is_undone_when_a_later_step_fails() {
    let server = McpServer::start().await;
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "open", "nodes": [
  {"id": "open", "type": "tool", "tool": "desk.create_ticket", "args": {"title": "{{ message.text }}"}, "next": "check"},
  {"id": "check", "type": "tool", "tool": "desk.broken", "args": {"ticket": "{{ steps.open.id }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "opened {{ steps.open.id }}"}]}"#,
        |_: &Value| ModelReply::text("unused"),
        |c| server.configure(c),
    )
    .await;
    let app = &flow.app;
    let id = task_id_of(
        app.post_message(&message("mcp-saga", 1, "printer jam"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED", "{task:#}");
    assert_eq!(task["failure_type"], "TOOL_FAILED");
    let steps: Vec<(String, String)> = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["tool"].as_str().unwrap_or("").to_string(),
                s["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        steps,
        [
            ("desk.create_ticket".to_string(), "COMPENSATED".to_string()),
            ("desk.broken".to_string(), "FAILED".to_string()),
            (
                "undo:desk.create_ticket".to_string(),
                "SUCCEEDED".to_string()
            ),
        ],
        "{task:#}"
    );
    let calls = server.calls();
    let names: Vec<&str> = calls
        .iter()
        .map(|c| c.split(" key=").next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "create_ticket printer jam",
            "broken T-7",
            "delete_ticket T-7"
        ]
    );
    flow.app.stop().await;
}

/// What the model of the list-changed test saw offered, per message.
type Offered = std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<String>)>>>;

/// Issue 21: `notifications/tools/list_changed` makes assistd list the tools again and
/// publish the agent anew: a new task is offered the new list; the running task keeps the
/// list it started with, and its call of a tool the server took away fails with a clear
/// error (which the model sees).
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_tool_list_reaches_new_tasks_and_not_running_ones() {
    let server = McpServer::start().await;
    let offered: Offered = Default::default();
    let seen = offered.clone();
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["desk.*"], "max_steps": 4, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        move |body: &Value| {
            let messages = body["messages"].as_array().unwrap();
            let grow = messages
                .iter()
                .any(|m| m["role"] == "user" && m["content"] == "grow");
            let text = if grow { "grow" } else { "list" }.to_string();
            let tools: Vec<String> = body["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| t["function"]["name"].as_str().unwrap().to_string())
                .collect();
            if tools.is_empty() {
                // A summary of the loop's rounds, asked without tools.
                return ModelReply::text("summary");
            }
            seen.lock().unwrap().push((text.clone(), tools.clone()));
            let results: Vec<&str> = messages
                .iter()
                .filter(|m| m["role"] == "tool")
                .map(|m| m["content"].as_str().unwrap())
                .collect();
            match (text.as_str(), results.len()) {
                ("grow", 0) => ModelReply::calls(&[("desk__grow", json!({}))]),
                ("grow", 1) => {
                    // Time for the notification to be handled before the next call.
                    std::thread::sleep(Duration::from_millis(1500));
                    ModelReply::calls(&[("desk__gone", json!({}))])
                }
                ("grow", _) => ModelReply::text(format!("gone said: {}", results[1])),
                _ => ModelReply::text(format!("offered: {}", tools.join(","))),
            }
        },
        |c| {
            server.configure(c);
            c.context.summary_every_steps = 100;
        },
    )
    .await;
    let app = &flow.app;
    let first = task_id_of(app.post_message(&message("mcp-grow", 1, "grow")).await).await;
    let task = app.wait_replied(first, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(
        reply.contains("gone said:") && reply.contains("no longer offered by server `desk`"),
        "{reply}"
    );
    // The running task was offered the list it started with, on every turn.
    for (text, tools) in offered.lock().unwrap().iter() {
        assert_eq!(text, "grow");
        assert!(tools.contains(&"desk__gone".to_string()), "{tools:?}");
        assert!(!tools.contains(&"desk__extra".to_string()), "{tools:?}");
    }
    let second = task_id_of(app.post_message(&message("mcp-grow-2", 1, "list")).await).await;
    let task = app.wait_replied(second, WAIT).await;
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(reply.contains("desk__extra"), "{reply}");
    assert!(!reply.contains("desk__gone"), "{reply}");
    let calls = server.calls();
    assert!(!calls.iter().any(|c| c.starts_with("gone")), "{calls:?}");
    flow.app.stop().await;
}

/// Issue 21: a server that restarts while a task waits between two of its calls is
/// reached again for the second; each call runs once.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restarted_mid_task_is_reconnected() {
    let mut server = McpServer::start().await;
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "desk.lookup", "args": {"ticket": "T-1"}, "next": "send"},
  {"id": "send", "type": "tool", "tool": "desk.send", "args": {"to": "ops", "text": "{{ steps.look.result }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "done: {{ steps.send.result }}"}]}"#,
        |_: &Value| ModelReply::text("unused"),
        |c| server.configure(c),
    )
    .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("mcp-restart", 1, "go")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    server.restart().await;
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["reply"]["content"]["text"], "done: sent");
    let calls = server.calls_with_pid();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[1].0.starts_with("send ops T-1 is open"), "{calls:?}");
    assert_ne!(calls[0].1, calls[1].1, "the restarted server took the send");
    flow.app.stop().await;
}

/// The README's MCP snippet loads as configuration and each server in it passes the
/// start-up checks (one transport, undo tools where compensable).
#[test]
fn the_readme_mcp_snippet_is_valid_configuration() {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let snippet = readme
        .split("```toml\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap())
        .find(|s| s.contains("[mcp_servers."))
        .expect("an MCP snippet in the README");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mcp.toml");
    std::fs::write(&path, snippet).unwrap();
    let config = assistd::Config::load_with_env(Some(&path), Vec::new())
        .unwrap_or_else(|e| panic!("README MCP snippet: {e}\n{snippet}"));
    assert_eq!(config.mcp_servers.len(), 2);
    for (name, server) in &config.mcp_servers {
        assistd::tools::mcp::check_config(name, server).unwrap();
    }
    assert_eq!(config.mcp_servers["files"].command[0], "python3");
    assert_eq!(
        config.mcp_servers["desk"].undo["create_ticket"],
        "delete_ticket"
    );
}

/// A version published before MCP tools were pinned into versions (issue 21's first part)
/// still runs: its tasks see the servers' tools as they are now.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_without_pinned_mcp_tools_runs_on_the_live_list() {
    let server = McpServer::start().await;
    let flow = lookup_flow(&server).await;
    let app = &flow.app;
    let current = app
        .store()
        .current_agent_version("flow")
        .await
        .unwrap()
        .unwrap();
    let mut definition: Value = serde_json::from_str(&current.definition).unwrap();
    assert!(definition["mcp_tools"]["desk.lookup"].is_object(), "pinned");
    definition.as_object_mut().unwrap().remove("mcp_tools");
    let older = app
        .store()
        .publish_agent_version("flow", "workflow", &definition.to_string(), 1)
        .await
        .unwrap();
    assert!(older.created);
    let id = task_id_of(
        app.post_message(&message("mcp-old", 1, "how is T-42?"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["agent"]["version"], older.version_no);
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(reply.contains("T-42 is open"), "{reply}");
    flow.app.stop().await;
}
