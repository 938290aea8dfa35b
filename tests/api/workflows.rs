//! Workflow agents: tool loops, compensation, approvals, snapshots, validation.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path, path_regex};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::helpers::*;

/// A model that asks for its tools in turn, then answers with what the tools said. It
/// reads only the messages it is given, like a real model at temperature 0: what it has
/// "seen" is the tool results in its context plus the `seen:` line of a rolling summary, and
/// asked to summarise it writes that line. So a replayed context gives the same answers.
pub struct ToolScriptModel(pub Vec<&'static str>);

impl Default for ToolScriptModel {
    fn default() -> Self {
        ToolScriptModel(vec!["lookup_a", "lookup_b", "lookup_c"])
    }
}

fn tool_value(content: &str) -> String {
    serde_json::from_str::<Value>(content)
        .ok()
        .and_then(|v| v["value"].as_str().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// The values listed on a `seen:` line.
fn seen_line(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("seen:"))
        .flat_map(|rest| {
            rest.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .collect()
}

impl ModelScript for ToolScriptModel {
    fn reply(&self, _request: &Request, body: &Value) -> ModelReply {
        let messages = body["messages"].as_array().unwrap();
        let text = |m: &Value| m["content"].as_str().unwrap_or("").to_string();
        if text(&messages[0]).starts_with("Summarise the work so far") {
            let input = text(&messages[1]);
            let mut seen = seen_line(&input);
            for line in input.lines() {
                if let Some(content) = line.strip_prefix("tool: ") {
                    seen.push(tool_value(content));
                }
            }
            return ModelReply::text(format!("seen: {}", seen.join(",")));
        }
        let mut seen: Vec<String> = messages
            .iter()
            .filter(|m| m["role"] == "user")
            .flat_map(|m| seen_line(&text(m)))
            .collect();
        seen.extend(
            messages
                .iter()
                .filter(|m| m["role"] == "tool")
                .map(|m| tool_value(&text(m))),
        );
        let n = seen.len();
        // Like a real model, it answers when it may not call (the last turn of a loop).
        if n < self.0.len() && body["tool_choice"] != "none" {
            return ModelReply::calls(&[(self.0[n], json!({ "q": format!("item{n}") }))]);
        }
        ModelReply::text(format!("found {}", seen.join(", ")))
    }
}

pub const TOOLS_TOML: &str = r#"
[tooling]
allowed_private_hosts = ["127.0.0.1"]

[tools.lookup_a]
kind = "read_only"
description = "Look up A"
method = "GET"
url = "TOOLS/tools/a?q={{ args.q }}"
args_schema = { type = "object", required = ["q"], properties = { q = { type = "string" } } }

[tools.lookup_b]
kind = "read_only"
method = "GET"
url = "TOOLS/tools/b?q={{ args.q }}"

[tools.lookup_c]
kind = "read_only"
method = "GET"
url = "TOOLS/tools/c?q={{ args.q }}"

[tools.reserve]
kind = "compensable"
method = "POST"
url = "TOOLS/tools/reserve"
undo = { method = "DELETE", url = "TOOLS/tools/reserve/{{ result.id }}" }

[tools.charge]
kind = "compensable"
method = "POST"
url = "TOOLS/tools/charge"
undo = { method = "POST", url = "TOOLS/tools/refund" }

[tools.transfer]
kind = "compensable"
method = "POST"
url = "TOOLS/tools/transfer"
undo = { method = "POST", url = "TOOLS/tools/transfer/undo" }

[tools.send_notice]
kind = "irreversible"
description = "Send the legal notice"
method = "POST"
url = "TOOLS/tools/notice"
"#;

pub const AGENT_LOOP: &str = r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["lookup_a", "lookup_b", "lookup_c"], "max_steps": 6, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#;

pub const SAGA: &str = r#"{"start": "reserve", "nodes": [
  {"id": "reserve", "type": "tool", "tool": "reserve", "args": {"item": "{{ message.text }}"}, "next": "charge"},
  {"id": "charge", "type": "tool", "tool": "charge", "args": {"amount": 5}, "next": "done"},
  {"id": "done", "type": "reply", "text": "reserved {{ steps.reserve.id }}"}]}"#;

pub const NOTICE: &str = r#"{"start": "notice", "nodes": [
  {"id": "notice", "type": "tool", "tool": "send_notice", "args": {"text": "{{ message.text }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "notice {{ steps.notice.status }}"}]}"#;

pub const TRANSFER: &str = r#"{"start": "move", "nodes": [
  {"id": "move", "type": "tool", "tool": "transfer", "args": {"amount": 10}, "next": "done"},
  {"id": "done", "type": "reply", "text": "transfer {{ steps.move.status }}"}]}"#;

/// The overlay TOML for a workflow agent `flow` answering the generic channel.
pub fn overlay(tools_uri: &str, workflow_path: &std::path::Path) -> String {
    format!(
        "{}\n[agents.flow]\nmode = \"workflow\"\nsystem_prompt = \"You help.\"\nworkflow_file = \"{}\"\napprovers = [\"alice\"]\n\n[channels.generic]\nagent = \"flow\"\n",
        TOOLS_TOML.replace("TOOLS", tools_uri),
        workflow_path.display()
    )
}

/// Mock tool endpoints.
pub async fn tool_server() -> MockServer {
    let tools = MockServer::start().await;
    for (p, v) in [
        ("/tools/a", "alpha"),
        ("/tools/b", "beta"),
        ("/tools/c", "gamma"),
    ] {
        Mock::given(method("GET"))
            .and(path(p))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!({"value": v})))
            .mount(&tools)
            .await;
    }
    Mock::given(method("POST"))
        .and(path("/tools/reserve"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"id": "R1"})))
        .mount(&tools)
        .await;
    Mock::given(method("DELETE"))
        .and(path_regex("^/tools/reserve/.*$"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"undone": true})))
        .mount(&tools)
        .await;
    Mock::given(method("POST"))
        .and(path("/tools/charge"))
        .respond_with(ResponseTemplate::new(500).set_body_json(json!({"error": "card declined"})))
        .mount(&tools)
        .await;
    Mock::given(method("POST"))
        .and(path("/tools/notice"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"status": "sent"})))
        .mount(&tools)
        .await;
    tools
}

pub async fn calls_to(server: &MockServer, method_name: &str, prefix: &str) -> usize {
    server
        .received_requests()
        .await
        .unwrap_or_default()
        .iter()
        .filter(|r| r.method.as_str() == method_name && r.url.path().starts_with(prefix))
        .count()
}

pub struct Flow {
    pub app: TestApp,
    pub tools: MockServer,
    pub _dir: tempfile::TempDir,
}

pub async fn spawn_flow(workflow: &str) -> Flow {
    spawn_flow_with(workflow, |_| {}).await
}

pub async fn spawn_flow_with(workflow: &str, tweak: impl FnOnce(&mut assistd::Config)) -> Flow {
    spawn_flow_scripted(workflow, ToolScriptModel::default(), tweak).await
}

/// A flow whose model (the strict double) follows `script`.
pub async fn spawn_flow_scripted(
    workflow: &str,
    script: impl ModelScript,
    tweak: impl FnOnce(&mut assistd::Config),
) -> Flow {
    let model = MockServer::start().await;
    model_mock(script).mount(&model).await;
    spawn_flow_on(workflow, model, tweak).await
}

/// A flow whose model is `model` (a mock already mounted).
pub async fn spawn_flow_on(
    workflow: &str,
    model: MockServer,
    tweak: impl FnOnce(&mut assistd::Config),
) -> Flow {
    let tools = tool_server().await;
    let receiver = accepting_receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let wf = dir.path().join("flow.json");
    std::fs::write(&wf, workflow).unwrap();
    let db = TestDb::new().await;
    let config = config_with_overlay(
        &db.url,
        &model.uri(),
        &format!("{}/reply", receiver.uri()),
        dir.path(),
        &overlay(&tools.uri(), &wf),
    );
    let mut config = config;
    tweak(&mut config);
    let app = TestApp::spawn_config(db, model, receiver, config).await;
    Flow {
        app,
        tools,
        _dir: dir,
    }
}

fn statuses(task: &Value) -> Vec<(String, String)> {
    task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["tool"].as_str().unwrap().to_string(),
                s["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

impl TestApp {
    /// Posts a card action as the in-house IM does: the button's value (`task_id`,
    /// `step_no`, `request`) with the decision and the approver.
    pub async fn post_action(
        &self,
        task_id: i64,
        request: &str,
        decision: &str,
        approver: &str,
    ) -> reqwest::Response {
        let step_no: i64 = request.split('.').nth(1).unwrap().parse().unwrap();
        let raw = serde_json::to_vec(&json!({
            "task_id": task_id, "step_no": step_no, "request": request,
            "decision": decision, "approver": approver
        }))
        .unwrap();
        let ts = assistd::domain::now_ms() / 1000;
        let sig = assistd::channels::generic::sign(SECRET, ts, &raw);
        self.http
            .post(format!("{}/webhooks/generic/actions", self.addr))
            .header("X-Assistd-Timestamp", ts.to_string())
            .header("X-Assistd-Signature", sig)
            .body(raw)
            .send()
            .await
            .unwrap()
    }

    pub async fn confirm(&self, task_id: i64, decision: &str, approver: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/api/tasks/{task_id}/confirm", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .json(&json!({"decision": decision, "approver": approver}))
            .send()
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_tool_agent_loop_completes_and_replies_once() {
    let flow = spawn_flow(AGENT_LOOP).await;
    let app = &flow.app;
    let id = task_id_of(
        app.post_message(&message("wf-loop", 1, "find things"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], "found alpha, beta, gamma");
    let steps = statuses(&task);
    let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
    // Every 4 steps the loop folds older rounds into a rolling summary step.
    assert_eq!(
        names,
        [
            "llm", "lookup_a", "llm", "lookup_b", "summary", "llm", "lookup_c", "summary", "llm"
        ]
    );
    assert!(steps.iter().all(|(_, s)| s == "SUCCEEDED"));
    assert_eq!(
        task["steps"][1]["idempotency_key"],
        format!("{id}:2:lookup_a")
    );
    assert!(task["trace"]["nodes"].as_array().unwrap().len() >= 2);
    for p in ["/tools/a", "/tools/b", "/tools/c"] {
        assert_eq!(calls_to(&flow.tools, "GET", p).await, 1, "{p}");
    }
    // Every tool call carried its step's idempotency key.
    let req = &flow.tools.received_requests().await.unwrap()[0];
    assert_eq!(
        req.headers.get("idempotency-key").unwrap(),
        &format!("{id}:2:lookup_a")
    );
    // The model was offered the node's tools, as OpenAI function declarations.
    let sent = model_bodies(&app.model).await;
    let first = &sent[0];
    let offered: Vec<&str> = first["tools"]
        .as_array()
        .expect("tools sent")
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(offered, ["lookup_a", "lookup_b", "lookup_c"]);
    assert_eq!(first["tools"][0]["function"]["description"], "Look up A");
    assert_eq!(
        first["tools"][0]["function"]["parameters"]["required"],
        json!(["q"])
    );
    // The assistant turn that asked for a tool goes back with content "" and its call.
    let asked = &sent[1]["messages"][2];
    assert_eq!(asked["role"], "assistant");
    assert_eq!(asked["content"], "");
    assert_eq!(
        sent[1]["messages"][3]["tool_call_id"],
        asked["tool_calls"][0]["id"]
    );
    // The journal's input of the first model step is the body the model received.
    let journalled: Value =
        serde_json::from_str(task["steps"][0]["input"].as_str().unwrap()).unwrap();
    assert_eq!(&journalled, first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].1["text"], "found alpha, beta, gamma");
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_undoes_the_compensable_ones_and_tells_the_user_once() {
    let flow = spawn_flow(SAGA).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("wf-saga", 1, "book it")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED");
    assert_eq!(task["failure_type"], "TOOL_FAILED");
    assert!(task["error"].as_str().unwrap().contains("500"));
    assert_eq!(
        statuses(&task),
        [
            ("reserve".to_string(), "COMPENSATED".to_string()),
            ("charge".to_string(), "FAILED".to_string()),
            ("undo:reserve".to_string(), "SUCCEEDED".to_string()),
        ]
    );
    assert_eq!(
        calls_to(&flow.tools, "DELETE", "/tools/reserve/R1").await,
        1,
        "undo called once"
    );
    assert_eq!(
        calls_to(&flow.tools, "POST", "/tools/charge").await,
        1,
        "a compensable call is not retried"
    );
    assert_eq!(
        calls_to(&flow.tools, "POST", "/tools/refund").await,
        0,
        "the failed step is not undone"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert!(
        replies[0].1["text"]
            .as_str()
            .unwrap()
            .contains("TOOL_FAILED")
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_irreversible_tool_waits_for_approval_from_an_allowed_approver() {
    let flow = spawn_flow(NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(
        app.post_message(&message("wf-approve", 1, "terminate contract 7"))
            .await,
    )
    .await;
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "WAITING_HUMAN_CONFIRM" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert!(task["confirm_deadline"].as_i64().unwrap() > assistd::domain::now_ms());
    assert_eq!(task["pending_actions"][0]["kind"], "tool");
    assert_eq!(task["pending_actions"][0]["tool"], "confirm:send_notice");
    assert_eq!(
        calls_to(&flow.tools, "POST", "/tools/notice").await,
        0,
        "never run automatically"
    );
    let cards = app.replies().await;
    assert_eq!(cards.len(), 1);
    let card = &cards[0].1;
    assert_eq!(card["type"], "card");
    assert_eq!(card["card"]["card_type"], "approval_request");
    assert_eq!(card["card"]["args"]["text"], "terminate contract 7");
    let actions = card["card"]["actions"].as_array().unwrap();
    assert_eq!(actions[0]["callback"], "/webhooks/generic/actions");
    let request = actions[0]["value"]["request"].as_str().unwrap().to_string();

    // Not an approver: 403, audited, nothing changes.
    assert_eq!(
        app.post_action(id, &request, "approve", "mallory")
            .await
            .status(),
        403
    );
    let task = app.get_task(id).await;
    assert_eq!(task["status"], "WAITING_HUMAN_CONFIRM");
    let denied = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "CONFIRM_DENIED")
        .unwrap();
    assert_eq!(denied["risk_flag"], true);
    // Unsigned actions are refused.
    let unsigned = app
        .http
        .post(format!("{}/webhooks/generic/actions", app.addr))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), 401);

    let resp = app.post_action(id, &request, "approve", "alice").await;
    assert_eq!(resp.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["result"], "notice sent");
    assert_eq!(
        app.post_action(id, &request, "approve", "alice")
            .await
            .status(),
        409,
        "second decision"
    );
    assert_eq!(app.confirm(id, "reject", "alice").await.status(), 409);
    assert_eq!(
        calls_to(&flow.tools, "POST", "/tools/notice").await,
        1,
        "runs once, after approval"
    );
    let events = audit_events(&task);
    assert!(
        events.contains(&"TASK_WAITING_CONFIRM") && events.contains(&"TASK_CONFIRMED"),
        "{events:?}"
    );
    let keys: Vec<String> = app.replies().await.into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        [
            format!("agent-task-{id}-confirm-{}", actions[0]["value"]["step_no"]),
            format!("agent-task-{id}")
        ]
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_action_cancels_the_task_and_tells_the_requester() {
    let flow = spawn_flow(NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("wf-reject", 1, "send it")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(app.confirm(id, "maybe", "alice").await.status(), 400);
    assert_eq!(app.confirm(id, "reject", "bob").await.status(), 403);
    let resp = app.confirm(id, "reject", "alice").await;
    assert_eq!(resp.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "CANCELLED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["pending_actions"][0]["decision"], "REJECTED");
    assert_eq!(task["pending_actions"][0]["decided_by"], "alice");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 2, "the card, then the rejection notice");
    assert!(
        replies[1].1["text"]
            .as_str()
            .unwrap()
            .contains("alice rejected")
    );
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_task_keeps_its_version_when_a_new_one_is_published() {
    let flow = spawn_flow(NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("wf-snap", 1, "v1 please")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let v2_workflow: Value = serde_json::from_str(&NOTICE.replace(
        "notice {{ steps.notice.status }}",
        "v2 says {{ steps.notice.status }}",
    ))
    .unwrap();
    let resp = app
        .http
        .post(format!("{}/api/agents/flow/versions", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"mode": "workflow", "system_prompt": "You help.", "approvers": ["alice"], "workflow": v2_workflow}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let published: Value = resp.json().await.unwrap();
    assert_eq!(published["version"], 2);
    assert_eq!(published["created"], true);
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(
        task["result"], "notice sent",
        "the waiting task ran version 1"
    );
    assert_eq!(task["agent"]["version"], 1);
    // New messages use version 2.
    let id2 = task_id_of(app.post_message(&message("wf-snap", 2, "v2 please")).await).await;
    app.wait_task(id2, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(app.confirm(id2, "approve", "alice").await.status(), 200);
    let task2 = app
        .wait_task(id2, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(task2["result"], "v2 says sent");
    assert_eq!(task2["agent"]["version"], 2);
    let agents: Value = app
        .http
        .get(format!("{}/api/agents", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let flow_agent = agents["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "flow")
        .unwrap();
    assert_eq!(flow_agent["current_version"], 2);
    let v1: Value = app
        .http
        .get(format!("{}/api/agents/flow/versions/1", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        v1["definition"]["workflow"]
            .to_string()
            .contains("notice {{ steps.notice.status }}")
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_workflows_are_refused_naming_the_node() {
    let flow = spawn_flow(AGENT_LOOP).await;
    let app = &flow.app;
    let post_version = |definition: Value| {
        let app = &flow.app;
        async move {
            let resp = app
                .http
                .post(format!("{}/api/agents/flow/versions", app.addr))
                .bearer_auth(ADMIN_TOKEN)
                .json(&definition)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap();
            (status, body)
        }
    };
    let publish = |workflow: Value| {
        let posted = post_version(json!({"mode": "workflow", "system_prompt": "s",
            "approvers": ["alice"], "workflow": workflow}));
        async {
            let (status, body) = posted.await;
            (status, body["error"].as_str().unwrap_or("").to_string())
        }
    };
    let cases = [
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "llm", "prompt": "p", "next": "ghost"}]}),
            "node `a`",
            "ghost",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "tool", "tool": "nope", "next": "b"}, {"id": "b", "type": "reply", "text": "t"}]}),
            "node `a`",
            "nope",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "llm", "prompt": "p", "next": "b"}, {"id": "b", "type": "llm", "prompt": "p", "next": "a"}]}),
            "node `b`",
            "cycle",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "llm", "next": "b"}, {"id": "b", "type": "reply", "text": "t"}]}),
            "node `a`",
            "prompt",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "teleport", "next": "b"}]}),
            "node `a`",
            "teleport",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "reply"}]}),
            "node `a`",
            "text",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "reply", "text": "{{ broken"}]}),
            "node `a`",
            "text",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "reply", "text": "t"}, {"id": "z", "type": "reply", "text": "t"}]}),
            "node `z`",
            "reachable",
        ),
        // Expressions are dry-run: a method, filter or function that does not exist is
        // refused at publish, not found by a task at run time.
        (
            json!({"start": "r", "nodes": [
                {"id": "r", "type": "llm", "prompt": "p", "next": "c"},
                {"id": "c", "type": "condition", "branches": [{"when": "steps.r.text.beginswith('X')", "next": "d"}], "default": "d"},
                {"id": "d", "type": "reply", "text": "t"}]}),
            "node `c`",
            "branches[0].when",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "reply", "text": "{{ message.text | shout }}"}]}),
            "node `a`",
            "shout",
        ),
        (
            json!({"start": "a", "nodes": [{"id": "a", "type": "agent", "prompt": "p", "tools": ["lookup_a"], "tool_choice": "lookup_z", "next": "b"}, {"id": "b", "type": "reply", "text": "t"}]}),
            "node `a`",
            "tool_choice",
        ),
    ];
    for (workflow, node, word) in cases {
        let (status, error) = publish(workflow.clone()).await;
        assert_eq!(status, 400, "{workflow}");
        assert!(
            error.contains(node) && error.contains(word),
            "`{error}` should name {node} and {word}"
        );
    }
    let agents: Value = app
        .http
        .get(format!("{}/api/agents", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let flow_agent = agents["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "flow")
        .unwrap();
    assert_eq!(flow_agent["versions"], 1, "nothing was published");
    // Each task reads its conversation's earlier messages before its model call: bounded.
    let single_turn = |history: u32| {
        post_version(json!({"mode": "single_turn", "system_prompt": "s",
            "history_messages": history}))
    };
    let (status, body) = single_turn(1001).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"], "history_messages must be at most 1000");
    let (status, body) = single_turn(1000).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["version"], 2);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_example_agents_are_valid() {
    for example in [
        "config/examples/helpdesk.toml",
        "config/examples/contract-review.toml",
    ] {
        let config =
            assistd::Config::load_with_env(Some(std::path::Path::new(example)), Vec::new())
                .unwrap_or_else(|e| panic!("{example}: {e}"));
        let db = TestDb::new().await;
        let mut db_config = config.database.clone();
        db_config.url = db.url.clone();
        let store = assistd::store::Store::connect(&db_config).await.unwrap();
        store.migrate().await.unwrap();
        publish_agents(&store, &config)
            .await
            .unwrap_or_else(|e| panic!("{example}: {e}"));
        let agent = &config.channels.generic.agent;
        let version = store.current_agent_version(agent).await.unwrap().unwrap();
        assert_eq!(version.mode, "workflow", "{example}");
        store.close().await;
        db.drop_db().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_waiting_task_cannot_be_approved_afterwards() {
    let flow = spawn_flow(NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("wf-cancel", 1, "send it")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(app.control(id, "cancel").await.status(), 200);
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 409);
    let task = app.get_task(id).await;
    assert_eq!(task["status"], "CANCELLED");
    assert_eq!(task["pending_actions"][0]["decision"], "EXPIRED");
    let events = audit_events(&task);
    assert!(!events.contains(&"TASK_CONFIRMED"), "{events:?}");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    flow.app.stop().await;
}
