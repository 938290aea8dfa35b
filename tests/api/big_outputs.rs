//! Large step outputs (issue 19, item 2): kept whole up to the hard cap, by reference in
//! `step_blob` over `journal.inline_max_bytes`, read through by replay and the task API, a
//! bounded view for the model, removed by retention; over the cap the call fails.

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::helpers::*;
use crate::workflows::{spawn_flow_on, spawn_flow_scripted};

/// `{"items": ["item-00000", …]}`: about 13 bytes an item.
fn big_body(items: usize) -> Value {
    json!({ "items": (0..items).map(|i| format!("item-{i:05}")).collect::<Vec<_>>() })
}

async fn serve_big(tools: &MockServer, items: usize) {
    Mock::given(method("GET"))
        .and(path("/tools/a"))
        .respond_with(ResponseTemplate::new(200).set_body_json(big_body(items)))
        .with_priority(1)
        .mount(tools)
        .await;
}

const LOOK_THEN_CONFIRM: &str = r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "lookup_a", "args": {"q": "all"}, "next": "ok"},
  {"id": "ok", "type": "human_confirm", "message": "Go on?", "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.look['items'] | length }} items, last {{ steps.look['items'][-1] }}"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_output_is_kept_by_reference_read_through_on_replay_and_purged_by_retention() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("unused"))
        .mount(&model)
        .await;
    let flow = spawn_flow_on(LOOK_THEN_CONFIRM, model, |c| {
        c.scheduler.enabled = false;
        c.journal.inline_max_bytes = 4096;
    })
    .await;
    serve_big(&flow.tools, 1000).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-big", 1, "list all")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(
        app.store().blob_count(id).await.unwrap(),
        1,
        "kept by reference"
    );
    // The task API reads through the reference.
    let shown = task["steps"][0]["output"].as_str().unwrap();
    assert!(
        shown.starts_with("{\"items\":[\"item-00000\""),
        "{shown:.200}"
    );
    // The approval resumes the task in a new run, which replays the step from the blob.
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task}");
    let replies = app.replies().await;
    assert_eq!(
        replies.last().unwrap().1["text"],
        "1000 items, last item-00999"
    );
    assert_eq!(
        crate::workflows::calls_to(&flow.tools, "GET", "/tools/a").await,
        1,
        "replayed, not called again"
    );
    // Retention removes blobs with the task's other bodies.
    let finished = task["finished_at"].as_i64().unwrap();
    let ttl = app.config.scheduler.jobs.retention.ttl_days as i64 * 86_400_000;
    assistd::scheduler::retention(&app.jobs, 500, finished + ttl + 1)
        .await
        .unwrap();
    assert_eq!(app.store().blob_count(id).await.unwrap(), 0);
    flow.app.stop().await;
}

/// Calls `lookup_a`, then answers with what it was shown of the result.
struct ShownModel;

impl ModelScript for ShownModel {
    fn reply(&self, _request: &Request, body: &Value) -> ModelReply {
        let messages = body["messages"].as_array().unwrap();
        match messages.iter().find(|m| m["role"] == "tool") {
            None => ModelReply::calls(&[("lookup_a", json!({ "q": "all" }))]),
            Some(tool) => {
                let content = tool["content"].as_str().unwrap();
                ModelReply::text(format!(
                    "shown={} note={}",
                    content.len(),
                    content.contains("shortened for the model: this tool output is")
                ))
            }
        }
    }
}

const LOOP: &str = r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["lookup_a"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_is_shown_a_bounded_view_of_a_large_tool_output_with_a_note() {
    let flow = spawn_flow_scripted(LOOP, ShownModel, |c| {
        c.journal.model_view_bytes = 2000;
    })
    .await;
    serve_big(&flow.tools, 1000).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-view", 1, "look")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    let text = app.replies().await[0].1["text"]
        .as_str()
        .unwrap()
        .to_string();
    let shown: usize = text
        .strip_prefix("shown=")
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(shown <= 2200, "{text}");
    assert!(text.ends_with("note=true"), "{text}");
    // The journal keeps the whole output.
    let whole = big_body(1000).to_string();
    let tool_step = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["tool"] == "lookup_a")
        .cloned()
        .unwrap();
    assert_eq!(tool_step["status"], "SUCCEEDED");
    assert!(whole.len() > 10_000);
    assert!(
        whole.starts_with(tool_step["output"].as_str().unwrap().trim_end_matches('…')),
        "the journal keeps the output itself, not the model's view"
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_the_hard_cap_fails_its_step_naming_the_key_instead_of_being_cut() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("unused"))
        .mount(&model)
        .await;
    let flow = spawn_flow_on(LOOK_THEN_CONFIRM, model, |c| {
        c.tooling.max_response_bytes = 10_000;
    })
    .await;
    serve_big(&flow.tools, 1000).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-cap", 1, "list all")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED");
    assert_eq!(task["failure_type"], "TOOL_FAILED");
    let error = task["steps"][0]["error"].as_str().unwrap();
    assert!(error.contains("tooling.max_response_bytes"), "{error}");
    assert_eq!(app.store().blob_count(id).await.unwrap(), 0);
    flow.app.stop().await;
}

/// Issue 35 (migration 0039): on PostgreSQL long texts are compressed with LZ4, not pglz,
/// every text column set so: a long question, the model call's journalled request and its
/// answer, the task's result and the reply, written through a webhook, are each stored
/// compressed with LZ4, and the chat gets the whole answer back.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_texts_are_stored_compressed_with_lz4_on_postgres() {
    let app = TestApp::spawn_on(
        TestDb::postgres().await,
        echo_model().await,
        accepting_receiver().await,
        |_| {},
    )
    .await;
    let question = "报销需要哪些材料？请按步骤说明。".repeat(300);
    let id = task_id_of(app.post_message(&message("lz4", 1, &question)).await).await;
    app.wait_replied(id, std::time::Duration::from_secs(20))
        .await;
    let replies = app.replies().await;
    let answer = format!("answer to: {question}");
    assert!(
        replies
            .iter()
            .any(|(_, body)| body["text"] == answer.as_str()),
        "{} replies",
        replies.len()
    );
    let assistd::store::Store::Postgres(pool) = app.store() else {
        panic!("a PostgreSQL store");
    };
    let stored: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT 'message', pg_column_compression(text) FROM im_message WHERE task_id = $1 \
         UNION ALL SELECT 'request', pg_column_compression(input) FROM agent_step \
             WHERE task_id = $1 AND step_type = 'llm' \
         UNION ALL SELECT 'answer', pg_column_compression(output) FROM agent_step \
             WHERE task_id = $1 AND step_type = 'llm' \
         UNION ALL SELECT 'result', pg_column_compression(result) FROM agent_task WHERE id = $1 \
         UNION ALL SELECT 'reply', pg_column_compression(content) FROM outbound_reply \
             WHERE task_id = $1 ORDER BY 1",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap();
    let expected = ["answer", "message", "reply", "request", "result"]
        .map(|what| (what.to_string(), Some("lz4".to_string())));
    assert_eq!(stored, expected);
    // Every text and JSON column is set so (migration tables aside).
    let others: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname || '.' || a.attname FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = current_schema() AND c.relkind = 'r' AND a.attnum > 0 \
         AND NOT a.attisdropped AND a.atttypid IN ('text'::regtype, 'json'::regtype, 'jsonb'::regtype) \
         AND c.relname NOT LIKE '\\_sqlx%' AND a.attcompression <> 'l' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(others.is_empty(), "{others:?}");
    app.stop().await;
}
