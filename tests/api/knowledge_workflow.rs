//! Workflow agents and knowledge (issue 34): a `retrieve` node whose passages a prompt uses,
//! and the `knowledge.search` tool an agent node's model calls, both journalled as tool
//! steps; a workflow naming either without `knowledge = [...]` is refused.

use serde_json::{Value, json};

use crate::helpers::*;
use crate::strict_model::{ModelReply, model_mock};
use crate::workflows::spawn_flow_on;

const HANDBOOK: [(&str, &str); 2] = [
    (
        "travel",
        "# Travel policy\n\n## Flights\n\nEconomy class for flights under six hours; business class above.",
    ),
    (
        "expenses",
        "# 报销制度\n\n请在出差结束后十五天内通过财务系统提交报销单，并附上发票。",
    ),
];

const FLOW: &str = r#"{"start": "find", "nodes": [
  {"id": "find", "type": "retrieve", "query": "{{ message.text }}", "k": 2, "next": "answer"},
  {"id": "answer", "type": "agent", "tools": ["knowledge.search"], "max_steps": 3,
   "prompt": "Passages:{{ steps.find.text }}\nQuestion: {{ message.text }}", "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.answer.text }} ({{ steps.find.found }} found first)"}
]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_retrieves_passages_and_its_agent_searches_with_the_tool() {
    let model = wiremock::MockServer::start().await;
    model_mock(|body: &Value| {
        let messages = body["messages"].as_array().unwrap();
        let tool_result = messages.iter().rev().find(|m| m["role"] == "tool");
        match tool_result {
            // First turn: the prompt carries the retrieve node's passages; search again.
            None => {
                let prompt = last_content(body);
                assert!(prompt.contains("[1] 报销制度"), "{prompt}");
                ModelReply::calls(&[(
                    "knowledge__search",
                    json!({"query": "发票 报销", "collection": "handbook", "k": 1}),
                )])
            }
            Some(result) => {
                let found: Value =
                    serde_json::from_str(result["content"].as_str().unwrap()).unwrap();
                let doc = found["passages"][0]["document_id"]
                    .as_str()
                    .unwrap()
                    .to_string();
                ModelReply::text(format!("附上发票 (from {doc} [1])"))
            }
        }
    })
    .mount(&model)
    .await;
    let flow = spawn_flow_on(FLOW, model, |c| {
        c.knowledge
            .collections
            .insert("handbook".into(), Default::default());
        c.agents.get_mut("flow").unwrap().knowledge = vec!["handbook".into()];
    })
    .await;
    let app = &flow.app;
    for (id, text) in HANDBOOK {
        let (status, body) = app
            .admin_call(
                reqwest::Method::POST,
                "/api/admin/knowledge/handbook/documents",
                Some(json!({"id": id, "content_type": "text/markdown", "text": text})),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let id = task_id_of(
        app.post_message(&message("kb-wf", 1, "怎么申请报销？"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(
        task["result"],
        "附上发票 (from expenses [1]) (1 found first)"
    );
    let tools: Vec<&str> = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["tool"].as_str().unwrap())
        .collect();
    assert_eq!(
        tools,
        ["knowledge.search", "llm", "knowledge.search", "llm"],
        "{task:#}"
    );
    // The retrieve node is a journalled tool step with its query and passages.
    let first = &task["steps"][0];
    assert_eq!(first["idempotency_key"], format!("{id}:1:knowledge.search"));
    assert!(
        first["input"].as_str().unwrap().contains("怎么申请报销"),
        "{first}"
    );
    assert!(
        first["output"]
            .as_str()
            .unwrap()
            .contains("\"document_id\":\"expenses\"")
    );
    // The model was offered the tool with the agent's collections as its choices.
    let offered = &model_bodies(&app.model).await[0]["tools"][0]["function"];
    assert_eq!(offered["name"], "knowledge__search");
    assert_eq!(
        offered["parameters"]["properties"]["collection"]["enum"],
        json!(["handbook"])
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_without_knowledge_cannot_retrieve_or_search() {
    let app = TestApp::spawn().await;
    for (workflow, says) in [
        (
            json!({"start": "r", "nodes": [
                {"id": "r", "type": "retrieve", "query": "{{ message.text }}", "next": "d"},
                {"id": "d", "type": "reply", "text": "x"}]}),
            "a retrieve node needs the agent's `knowledge = [...]`",
        ),
        (
            json!({"start": "a", "nodes": [
                {"id": "a", "type": "agent", "prompt": "p", "tools": ["knowledge.search"], "next": "d"},
                {"id": "d", "type": "reply", "text": "x"}]}),
            "unknown tool `knowledge.search`",
        ),
    ] {
        let (status, body) = app
            .admin_call(
                reqwest::Method::POST,
                "/api/agents/flow/versions",
                Some(json!({"mode": "workflow", "system_prompt": "s", "workflow": workflow})),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert!(body.to_string().contains(says), "{says}: {body}");
    }
    app.stop().await;
}
