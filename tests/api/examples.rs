//! Every shipped example (`config/examples/*.toml`) runs end to end as shipped: only its tool
//! URLs are pointed at a local tool server (scheme and host replaced, path kept), and the
//! model is the strict double. Each example has a scenario here; a new example without one
//! fails `every_shipped_example_runs_end_to_end` until it gets one.

use std::path::Path;

use serde_json::{Value, json};
use wiremock::matchers::{method, path, query_param};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::helpers::*;
use crate::workflows::calls_to;

/// The example's config with its tools on `tools_uri` and the test settings.
fn example_config(
    example: &Path,
    db: &TestDb,
    model: &str,
    receiver: &str,
    tools_uri: &str,
) -> assistd::Config {
    let mut c = assistd::Config::load_with_env(Some(example), Vec::new())
        .unwrap_or_else(|e| panic!("{}: {e}", example.display()));
    let local = |url: &str| -> String {
        let parsed = url::Url::parse(url).unwrap_or_else(|e| panic!("tool url {url}: {e}"));
        let path_and_query = &url[parsed.origin().ascii_serialization().len()..];
        format!("{tools_uri}{path_and_query}")
    };
    for tool in c.tools.values_mut() {
        tool.url = local(&tool.url);
        if let Some(undo) = tool.undo.as_mut() {
            undo.url = local(&undo.url);
        }
    }
    c.tooling.allowed_private_hosts = vec!["127.0.0.1".into()];
    with_test_settings(&mut c, &db.url, model, &format!("{receiver}/reply"));
    c
}

async fn spawn_example(example: &Path, model: MockServer, tools: &MockServer) -> TestApp {
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let config = example_config(example, &db, &model.uri(), &receiver.uri(), &tools.uri());
    TestApp::spawn_config(db, model, receiver, config).await
}

fn tool_messages(body: &Value) -> Vec<Value> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| serde_json::from_str(m["content"].as_str().unwrap()).unwrap_or(Value::Null))
        .collect()
}

/// helpdesk: the agent node offers its tools; the model looks the ticket up (once), then
/// answers with what the tool said.
async fn helpdesk(example: &Path) {
    let tools = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/api/tickets/T-42"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"id": "T-42", "status": "waiting for parts"})),
        )
        .mount(&tools)
        .await;
    Mock::given(method("GET"))
        .and(path("/api/search"))
        .and(query_param("q", "laptop repair & returns"))
        .and(wiremock::matchers::query_param_is_missing("returns"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"hits": ["KB-9: repairs take a week"]})),
        )
        .mount(&tools)
        .await;
    let model = MockServer::start().await;
    // Both tools in one answer, then an answer from what they said.
    model_mock(|body: &Value| {
        let results = tool_messages(body);
        match results.as_slice() {
            [] => ModelReply::calls(&[
                ("ticket_lookup", json!({"ticket_id": "T-42"})),
                ("kb_search", json!({"query": "laptop repair & returns"})),
            ]),
            [ticket, kb, ..] => ModelReply::text(format!(
                "Ticket {} is {}. {}",
                ticket["id"].as_str().unwrap_or("?"),
                ticket["status"].as_str().unwrap_or("?"),
                kb["hits"][0].as_str().unwrap_or("?")
            )),
            _ => panic!("one result of two calls: {body}"),
        }
    })
    .mount(&model)
    .await;
    let app = spawn_example(example, model, &tools).await;
    let id = task_id_of(
        app.post_message(&message("ex-help", 1, "Where is my laptop? Ticket T-42"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(calls_to(&tools, "GET", "/api/tickets/T-42").await, 1);
    assert_eq!(calls_to(&tools, "GET", "/api/search").await, 1);
    let first = &app.model.received_requests().await.unwrap()[0];
    let body: Value = serde_json::from_slice(&first.body).unwrap();
    let offered: Vec<&str> = body["tools"]
        .as_array()
        .expect("the agent node offers its tools")
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(offered, ["ticket_lookup", "kb_search"]);
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0, format!("agent-task-{id}"));
    assert_eq!(
        replies[0].1["text"],
        "Ticket T-42 is waiting for parts. KB-9: repairs take a week"
    );
    app.stop().await;
}

/// contract review: fetch → llm review → condition (`startswith`) → irreversible notice
/// behind an approval → card reply. The notice goes out exactly once, after the approval.
async fn contract_review(example: &Path) {
    let tools = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/api/contracts/C-7"))
        .respond_with(
            ResponseTemplate::new(200).set_body_json(
                json!({"id": "C-7", "clause": "either party may terminate on breach"}),
            ),
        )
        .mount(&tools)
        .await;
    Mock::given(method("POST"))
        .and(path("/api/contracts/C-7/notices"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"status": "sent"})))
        .mount(&tools)
        .await;
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        let prompt = body["messages"][1]["content"].as_str().unwrap_or("");
        assert!(
            prompt.contains("either party may terminate"),
            "the review sees the contract: {prompt}"
        );
        ModelReply::text("TERMINATE\nThe counterparty breached clause 4.")
    })
    .mount(&model)
    .await;
    let app = spawn_example(example, model, &tools).await;
    let id = task_id_of(app.post_message(&message("ex-contract", 1, " C-7 ")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(
        calls_to(&tools, "POST", "/api/contracts/C-7/notices").await,
        0,
        "not before the approval"
    );
    assert_eq!(
        task["pending_actions"][0]["approvers"],
        json!(["legal-lead"])
    );
    let approved = app
        .http
        .post(format!("{}/api/tasks/{id}/confirm", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"decision": "approve", "approver": "legal-lead"}))
        .send()
        .await
        .unwrap();
    assert_eq!(approved.status(), 200);
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let notices: Vec<Value> = tools
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path() == "/api/contracts/C-7/notices")
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    assert_eq!(
        notices.len(),
        1,
        "the irreversible notice is sent exactly once"
    );
    assert_eq!(notices[0]["type"], "termination");
    assert!(
        notices[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("TERMINATE")
    );
    let replies = app.replies().await;
    let answer = replies
        .iter()
        .find(|(k, _)| *k == format!("agent-task-{id}"))
        .expect("the task's reply");
    assert_eq!(
        answer.1["card"]["card_type"], "agent_result",
        "{:#}",
        answer.1
    );
    assert_eq!(answer.1["card"]["contract"], "C-7");
    assert!(
        replies
            .iter()
            .any(|(k, r)| k.contains("-confirm-") && r["card"]["card_type"] == "approval_request"),
        "the approval request went to the chat first: {replies:?}"
    );
    app.stop().await;
}

/// Attack: chat text that tries to leave the contract's URL path (issue 17, item 6). The tool
/// host must see no request at all; the task fails with one notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_text_cannot_steer_the_contract_tool_to_another_path() {
    let tools = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"id": "x"})))
        .mount(&tools)
        .await;
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("KEEP"))
        .mount(&model)
        .await;
    let app = spawn_example(
        Path::new("config/examples/contract-review.toml"),
        model,
        &tools,
    )
    .await;
    for (n, attack) in [
        "../../../internal/admin?delete=all#",
        "C-7/../../internal/admin",
        "C-7?delete=all",
    ]
    .iter()
    .enumerate()
    {
        let id = task_id_of(
            app.post_message(&message("ex-attack", n as u32 + 1, attack))
                .await,
        )
        .await;
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(task["status"], "FAILED", "{attack}: {task:#}");
        assert_eq!(task["failure_type"], "TOOL_FAILED", "{attack}");
    }
    let seen: Vec<String> = tools
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.url.to_string())
        .collect();
    assert!(seen.is_empty(), "the tool host was reached: {seen:?}");
    app.stop().await;
}

/// Attack: the same escape through a tool whose schema does not constrain the argument; the
/// URL template itself refuses it (the encoding is the last line, not the schema).
#[test]
fn a_tool_url_refuses_a_path_escape_without_a_schema_pattern() {
    let ctx = json!({"args": {"contract_id": "../../../internal/admin?delete=all#"}});
    let err = assistd::templating::render_url(
        "https://contracts.example.com/api/contracts/{{ args.contract_id }}",
        &ctx,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("may not be placed in a URL path"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shipped_example_runs_end_to_end() {
    let mut examples: Vec<_> = std::fs::read_dir("config/examples")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    examples.sort();
    assert!(examples.len() >= 2, "{examples:?}");
    for example in &examples {
        match example.file_stem().and_then(|s| s.to_str()) {
            Some("helpdesk") => helpdesk(example).await,
            Some("contract-review") => contract_review(example).await,
            other => panic!(
                "{}: no scenario for example {other:?}; add one here",
                example.display()
            ),
        }
    }
}

/// The TOML snippets of docs/providers.md load as configuration files, as a user who copies
/// one would load it.
#[test]
fn the_provider_snippets_in_the_docs_are_valid_configuration() {
    let doc = std::fs::read_to_string("docs/providers.md").unwrap();
    let snippets: Vec<&str> = doc
        .split("```toml\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap())
        .collect();
    assert!(snippets.len() >= 4, "{} snippets", snippets.len());
    let dir = tempfile::tempdir().unwrap();
    for (i, snippet) in snippets.iter().enumerate() {
        let path = dir.path().join(format!("snippet{i}.toml"));
        std::fs::write(&path, snippet).unwrap();
        assistd::Config::load_with_env(Some(&path), Vec::new())
            .unwrap_or_else(|e| panic!("docs/providers.md snippet {i}: {e}\n{snippet}"));
    }
}
