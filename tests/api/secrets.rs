//! Issue 32, part 3: no secret leaves through an error, a page or a span. A distinct secret
//! is planted in each configured URL, header, environment value and argument, each endpoint
//! is made to fail, and the log, the task API, the admin pages, the model's requests and the
//! chat replies are searched for every one of them. Errors are built without secrets where
//! they are built (`redaction::outbound_error`, `redaction::endpoint`, the MCP server's
//! scrubber), so no sink has to clean them. The platform tokens have their own test
//! (`platforms::secrets`).

use serde_json::{Value, json};

use crate::helpers::*;
use crate::mcp::McpServer;

/// Everything a person or a model could read about the app's tasks: the task API and admin
/// task page of each task, the model's request bodies, the chat replies, and the log.
async fn everything_shown(app: &TestApp) -> String {
    let listed = app.admin_json("/api/tasks?limit=50").await;
    let http = crate::admin_pages::browser();
    let cookie = crate::admin_pages::sign_in(app, &http).await;
    let mut shown = String::new();
    for task in listed["tasks"].as_array().unwrap() {
        let id = task["id"].as_i64().unwrap();
        shown.push_str(&app.get_task(id).await.to_string());
        let page = format!("/admin/tasks/{id}");
        shown.push_str(&crate::admin_pages::page_of(app, &http, &cookie, &page).await);
    }
    for body in model_bodies(&app.model).await {
        shown.push_str(&body.to_string());
    }
    for (_, reply) in app.replies().await {
        shown.push_str(&reply.to_string());
    }
    shown.push_str(&captured_log());
    shown
}

fn assert_hidden(shown: &str, secrets: &[&str]) {
    for secret in secrets {
        if let Some(at) = shown.find(secret) {
            let from = shown[..at]
                .char_indices()
                .rev()
                .nth(300)
                .map_or(0, |(i, _)| i);
            let to = (at + 100).min(shown.len());
            panic!("a secret is shown: {secret} in …{}…", &shown[from..to]);
        }
    }
}

/// Calls `tool` until a tool answer is in the chat, then answers with what it got.
fn echo_tool(
    tool: &'static str,
    args: Value,
) -> impl Fn(&Value) -> ModelReply + Send + Sync + 'static {
    move |body: &Value| {
        let messages = body["messages"].as_array().unwrap();
        match messages.iter().find(|m| m["role"] == "tool") {
            Some(t) => ModelReply::text(format!("got: {}", t["content"].as_str().unwrap())),
            None => ModelReply::calls(&[(tool, args.clone())]),
        }
    }
}

/// An HTTP tool whose URL query and header hold secrets, at a closed port: its error reaches
/// the model and the chat without either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_tool_names_no_secret_of_its_url_or_headers() {
    let _ = captured_log();
    const QUERY: &str = "TOOLQUERYsecret4711";
    const HEADER: &str = "TOOLHEADERsecret4712";
    const USERINFO: &str = "TOOLPASSsecret4713";
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["lookup_a"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        echo_tool("lookup_a", json!({"q": "x"})),
        |c| {
            let tool = c.tools.get_mut("lookup_a").unwrap();
            tool.url = format!("http://tooluser:{USERINFO}@127.0.0.1:9/tools/a?token={QUERY}");
            tool.headers.insert("X-Api-Key".into(), HEADER.into());
        },
    )
    .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("leak-tool", 1, "look")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(reply.contains("tool call failed"), "{reply}");
    assert_hidden(&everything_shown(app).await, &[QUERY, HEADER, USERINFO]);
    flow.app.stop().await;
}

/// A model endpoint with `user:password@` and a provider whose base URL carries a key in its
/// query, both unreachable: the failure, the console page and `/console/status` name neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_model_and_the_console_name_no_secret_of_its_url() {
    let _ = captured_log();
    const PASS: &str = "MODELPASSsecret4721";
    const KEY: &str = "MODELKEYsecret4722";
    const BACKUP_QUERY: &str = "BACKUPQUERYsecret4723";
    const BACKUP_HEADER: &str = "BACKUPHEADERsecret4724";
    const BACKUP_PASS: &str = "BACKUPPASSsecret4725";
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.llm.base_url = format!("http://modeluser:{PASS}@127.0.0.1:9/v1");
        c.llm.api_key = KEY.into();
        c.llm.retry.provider_error.max_attempts = 1;
        c.channels.console.enabled = true;
        // A named provider too, answering the console's agent.
        let mut backup = c.llm.default_provider();
        backup.base_url = format!("http://backup:{BACKUP_PASS}@127.0.0.1:9/v1");
        backup.query.insert("key".into(), BACKUP_QUERY.into());
        backup
            .headers
            .insert("X-Backup-Key".into(), BACKUP_HEADER.into());
        c.llm.providers.insert("backup".into(), backup);
        let mut agent = c.agents["default"].clone();
        agent.provider = "backup".into();
        c.agents.insert("viabackup".into(), agent);
        c.channels.console.agent = "viabackup".into();
    })
    .await;
    let id = task_id_of(app.post_message(&message("leak-model", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED", "{task:#}");
    assert!(
        task["error"].as_str().unwrap().contains("127.0.0.1:9"),
        "the endpoint is named: {task:#}"
    );
    let resp = app
        .http
        .post(format!("{}/console/messages", app.addr))
        .json(&json!({"conversation_id": "leak-backup", "text": "hi"}))
        .send()
        .await
        .unwrap();
    let backup_id = resp.json::<Value>().await.unwrap()["task_id"]
        .as_i64()
        .unwrap();
    let task = app.wait_replied(backup_id, WAIT).await;
    assert_eq!(task["status"], "FAILED", "{task:#}");
    let mut shown = everything_shown(&app).await;
    for path in ["/", "/console/status"] {
        let resp = app
            .http
            .get(format!("{}{path}", app.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        let text = resp.text().await.unwrap();
        assert!(text.contains("127.0.0.1:9"), "{path}: {text}");
        shown.push_str(&text);
    }
    assert_hidden(
        &shown,
        &[PASS, KEY, BACKUP_QUERY, BACKUP_HEADER, BACKUP_PASS],
    );
    app.stop().await;
}

/// The orphan-reclaim alert URL with credentials and a key in its query, at a closed port:
/// the failing alert's error, the task pages and the log name neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_alert_names_no_secret_of_its_url() {
    let _ = captured_log();
    const PASS: &str = "ALERTPASSsecret4761";
    const QUERY: &str = "ALERTQUERYsecret4762";
    let db = TestDb::new().await;
    let now = assistd::domain::now_ms();
    let id = crate::jobs::orphaned_task(&db, now).await;
    let (model, receiver) = (echo_model().await, accepting_receiver().await);
    let mut config = test_config(&db.url, &model.uri(), &format!("{}/reply", receiver.uri()));
    config.scheduler.enabled = false;
    config.scheduler.jobs.orphan_reclaim.alert_url =
        format!("http://alerts:{PASS}@127.0.0.1:9/alerts?token={QUERY}");
    let app = TestApp::spawn_config(db, model, receiver, config).await;
    let run = assistd::scheduler::orphan_reclaim(&app.jobs, 500, now + 3_700_000)
        .await
        .unwrap();
    assert_eq!(run.affected, 1);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["replies"].as_array().unwrap().iter().any(|r| {
                r["idempotency_key"]
                    .as_str()
                    .is_some_and(|k| k.contains("-reclaimed-"))
                    && r["last_error"].is_string()
            })
        })
        .await;
    let shown = format!("{task}\n{}", everything_shown(&app).await);
    assert_hidden(&shown, &[PASS, QUERY]);
    app.stop().await;
}

/// A stdio MCP server started with a `--token=` argument and a token in its environment,
/// which prints both to its standard error and exits: the start-up error and the log name
/// neither (before, the whole command line and the child's stderr were logged verbatim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdio_mcp_server_that_fails_names_no_argument_or_environment_secret() {
    let _ = captured_log();
    const ARG: &str = "MCPARGsecret4731";
    const ENV: &str = "MCPENVsecret4732";
    let db = TestDb::new().await;
    let mut config = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    config.mcp_servers.insert(
        "desk".into(),
        assistd::config::McpServerConfig {
            command: vec![
                "sh".into(),
                "-c".into(),
                "echo \"starting with $API_TOKEN and $1 at https://u:$API_TOKEN@h/x\" >&2; exit 3"
                    .into(),
                "desk".into(),
                format!("--token={ARG}"),
            ],
            env: [("API_TOKEN".to_string(), ENV.to_string())].into(),
            timeout_secs: 5,
            ..Default::default()
        },
    );
    let error = match assistd::App::build(config).await {
        Ok(_) => panic!("a server that exits cannot be connected"),
        Err(e) => format!("{e:#}"),
    };
    assert!(error.contains("mcp_servers.desk"), "{error}");
    // The child's line was logged, scrubbed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !captured_log().contains("starting with") && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let log = captured_log();
    assert_hidden(&format!("{error}\n{log}"), &[ARG, ENV]);
    db.drop_db().await;
}

/// An MCP server over HTTP whose URL holds a key in its query, with a bearer token and a
/// header, goes away: its error reaches the model and the chat without any of them. Before,
/// the key reached the log (rmcp's lines too), the step's input and output, the model's tool
/// message and the chat reply.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_that_goes_away_names_no_secret_of_its_url() {
    let _ = captured_log();
    const QUERY: &str = "MCPQUERYsecret4741";
    const BEARER: &str = "MCPBEARERsecret4742";
    const HEADER: &str = "MCPHEADERsecret4743";
    let mut server = McpServer::start().await;
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["desk.lookup"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        echo_tool("desk__lookup", json!({"ticket": "T-42"})),
        |c| {
            let mut desk = server.server_config();
            desk.url = format!("{}?api_key={QUERY}", desk.url);
            desk.bearer_token = BEARER.into();
            desk.headers.insert("X-Desk-Key".into(), HEADER.into());
            c.mcp_servers.insert("desk".into(), desk);
        },
    )
    .await;
    server.stop();
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("leak-mcp", 1, "T-42?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(reply.contains("MCP server `desk`"), "{reply}");
    assert_hidden(&everything_shown(app).await, &[QUERY, BEARER, HEADER]);
    flow.app.stop().await;
}
