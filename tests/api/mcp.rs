//! Issue 21 (first part): tools from an MCP server, over streamable HTTP, against a server
//! built with the reference Python SDK (PyPI `mcp` 1.x, `FastMCP`). `.ci/run` installs it
//! and sets `ASSISTD_TEST_MCP=require`; elsewhere these tests skip with a printed reason when
//! it is not installed.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::binary::free_port;
use crate::helpers::*;
use crate::strict_model::ModelReply;

const SERVER: &str = r#"
import sys
from mcp.server.fastmcp import FastMCP, Context
from mcp.types import ToolAnnotations

port, log = int(sys.argv[1]), sys.argv[2]
mcp = FastMCP("desk", host="127.0.0.1", port=port)

def record(ctx, line):
    meta = ctx.request_context.meta
    key = (meta.model_extra or {}).get("io.assistd/idempotency-key") if meta else None
    with open(log, "a") as f:
        f.write(f"{line} key={key}\n")

@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup(ticket: str, ctx: Context) -> str:
    """Looks a ticket up."""
    record(ctx, f"lookup {ticket}")
    return f"{ticket} is open"

@mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
def send(to: str, text: str, ctx: Context) -> str:
    """Sends a message to someone."""
    record(ctx, f"send {to} {text}")
    return "sent"

@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def broken(ticket: str, ctx: Context) -> str:
    """Always fails."""
    record(ctx, f"broken {ticket}")
    raise ValueError(f"no such ticket {ticket}")

mcp.run(transport="streamable-http")
"#;

/// A FastMCP server on 127.0.0.1, stopped on drop; its calls are logged to `log`.
struct McpServer {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl McpServer {
    async fn start() -> Option<McpServer> {
        let python = crate::real_model::python();
        let required = std::env::var("ASSISTD_TEST_MCP").is_ok_and(|m| m == "require");
        let available = Command::new(&python)
            .args(["-c", "import mcp.server.fastmcp"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !available {
            assert!(
                !required,
                "ASSISTD_TEST_MCP=require, but `mcp` is not importable"
            );
            eprintln!("skipping the MCP test: the Python package `mcp` is not installed");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("desk.py");
        std::fs::write(&script, SERVER).unwrap();
        let log = dir.path().join("calls.log");
        let port = free_port();
        let child = Command::new(&python)
            .arg(&script)
            .arg(port.to_string())
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the MCP server");
        let server = McpServer {
            child,
            port,
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the MCP server did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(server)
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn configure(&self, c: &mut assistd::Config) {
        c.mcp_servers.insert(
            "desk".into(),
            assistd::config::McpServerConfig {
                url: format!("http://127.0.0.1:{}/mcp", self.port),
                timeout_secs: 20,
                ..Default::default()
            },
        );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_mcp_tool_is_offered_called_once_and_its_answer_reaches_the_reply() {
    let Some(server) = McpServer::start().await else {
        return;
    };
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["desk.lookup"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        lookup_script,
        |c| server.configure(c),
    )
    .await;
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
    let listed: Value = app
        .http
        .get(&url)
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destructive_mcp_tool_runs_once_and_only_after_approval() {
    let Some(server) = McpServer::start().await else {
        return;
    };
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_error_result_reaches_the_model_and_is_not_retried() {
    let Some(server) = McpServer::start().await else {
        return;
    };
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
