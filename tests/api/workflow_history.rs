//! Workflow agents see the conversation's recent messages: `history` in templates and the
//! turns before the prompt in `llm` and `agent` model calls (issue 19, item 4).

use serde_json::{Value, json};
use wiremock::MockServer;

use crate::helpers::*;
use crate::workflows::spawn_flow_on;

const ASK: &str = r#"{"start": "ask", "nodes": [
  {"id": "ask", "type": "llm", "prompt": "Now: {{ message.text }}", "next": "loop"},
  {"id": "loop", "type": "agent", "prompt": "Loop: {{ message.text }}", "tools": ["lookup_a"], "max_steps": 1, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.ask.text }}|{% for h in history %}{{ h.role }}={{ h.text }};{% endfor %}"}]}"#;

/// What each model call was given, as (role, content) pairs after the system prompt.
fn turns(body: &Value) -> Vec<(String, String)> {
    body["messages"].as_array().unwrap()[1..]
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_string(),
                m["content"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflow_model_calls_and_templates_see_the_conversations_earlier_exchanges() {
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        let last = body["messages"].as_array().unwrap().last().unwrap()["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        ModelReply::text(format!("re {last}"))
    })
    .mount(&model)
    .await;
    let flow = spawn_flow_on(ASK, model, |_| {}).await;
    let app = &flow.app;
    let first = task_id_of(
        app.post_message(&message("c-hist", 1, "my name is Ada"))
            .await,
    )
    .await;
    app.wait_replied(first, WAIT).await;
    let second = task_id_of(
        app.post_message(&message("c-hist", 2, "what is my name?"))
            .await,
    )
    .await;
    app.wait_replied(second, WAIT).await;

    let replies = app.replies().await;
    assert_eq!(replies.len(), 2);
    // The first message had no history; the second sees the first exchange.
    assert_eq!(replies[0].1["text"], "re Now: my name is Ada|");
    assert_eq!(
        replies[1].1["text"],
        json!(format!(
            "re Now: what is my name?|user=my name is Ada;assistant={};",
            replies[0].1["text"].as_str().unwrap()
        ))
    );
    let calls: Vec<Value> = app
        .model
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    assert_eq!(calls.len(), 4, "an llm and an agent call per message");
    assert_eq!(
        turns(&calls[0]),
        vec![("user".into(), "Now: my name is Ada".into())]
    );
    assert_eq!(
        turns(&calls[1]),
        vec![("user".into(), "Loop: my name is Ada".into())]
    );
    let earlier = vec![
        ("user".to_string(), "my name is Ada".to_string()),
        (
            "assistant".to_string(),
            replies[0].1["text"].as_str().unwrap().to_string(),
        ),
    ];
    let mut llm = earlier.clone();
    llm.push(("user".into(), "Now: what is my name?".into()));
    assert_eq!(turns(&calls[2]), llm);
    let mut agent = earlier;
    agent.push(("user".into(), "Loop: what is my name?".into()));
    assert_eq!(turns(&calls[3]), agent);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflow_history_keeps_only_the_newest_exchanges_that_fit_the_budget() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("ok"))
        .mount(&model)
        .await;
    // Room for about one exchange: each message below is ~100 tokens by the estimate.
    let plain = ASK.replace(
        "{{ steps.ask.text }}|{% for h in history %}{{ h.role }}={{ h.text }};{% endfor %}",
        "{{ steps.ask.text }}",
    );
    let flow = spawn_flow_on(&plain, model, |c| c.context.history_token_budget = 150).await;
    let app = &flow.app;
    let long = |n: u32| format!("{n}{}", "x".repeat(300));
    for n in 1..=3 {
        let id = task_id_of(app.post_message(&message("c-budget", n, &long(n))).await).await;
        app.wait_replied(id, WAIT).await;
    }
    let calls = app.model.received_requests().await.unwrap();
    let last: Value = serde_json::from_slice(&calls[calls.len() - 2].body).unwrap();
    let given = turns(&last);
    // Message 3's llm call: only the newest earlier exchange that fits (message 2's answer
    // "ok" and, budget allowing, message 2), never message 1.
    assert!(given.iter().all(|(_, c)| !c.starts_with('1')), "{given:?}");
    assert_eq!(given.last().unwrap().1, format!("Now: {}", long(3)));
    assert_eq!(
        given.len(),
        3,
        "message 2, its answer, the prompt: {given:?}"
    );
    assert_eq!(given[0].0, "user", "whole exchanges only");
    flow.app.stop().await;
}
