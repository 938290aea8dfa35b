//! Issue 32, part 1: a poison task ends instead of looping forever. Text that PostgreSQL
//! refuses (U+0000) from every outside source is stored; a run that aborts for a cause
//! that is not an outage is counted and, past `engine.max_run_aborts`, ends FAILED with
//! INTERNAL and its notice, freeing its conversation; an outage is waited out without
//! counting; a reply the platform refuses for good ends FAILED instead of being retried
//! forever.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::helpers::*;

/// Runs `sql` on the test database `url` (SQLite or PostgreSQL).
pub async fn exec_sql(url: &str, sql: &str) {
    if url.starts_with("sqlite:") {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        sqlx::query(sql).execute(&pool).await.unwrap();
        pool.close().await;
    } else {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::query(sql).execute(&pool).await.unwrap();
        pool.close().await;
    }
}

/// Before: on PostgreSQL the answer's write was refused ("unsupported Unicode escape
/// sequence"), the run aborted, and the task was claimed, paid for and aborted again
/// forever.
/// Slack against the platform doubles at `api`, with an answer streamed into a placeholder
/// sent at once and no pacing between edits.
fn streaming_on_slack(c: &mut assistd::Config, api: &str) {
    crate::platforms::enable_platforms(c, api, "default");
    c.replies.placeholder_after_ms = 0;
    c.replies.stream_edit_ms = 50;
    c.channels.slack.per_chat_interval_ms = 0;
}

/// Mentions the bot on Slack with `text` (event `event_id`, message `ts`) and waits for the
/// answer; the task as the API shows it.
async fn ask_on_slack(app: &TestApp, event_id: &str, text: &str, ts: &str) -> Value {
    let mention = crate::platforms::slack_event(
        event_id,
        json!({"type": "app_mention", "user": "U1", "text": text, "ts": ts, "channel": "C9"}),
    );
    let id = task_id_of(app.slack_event(&mention).await).await;
    app.wait_replied(id, WAIT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_the_model_answer_is_stored_and_answered() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("before\0after"))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("nul-1", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], "before\u{FFFD}after");
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].1["text"], "before\u{FFFD}after");
    assert_eq!(
        model_bodies(&app.model).await.len(),
        1,
        "the model was called again"
    );
    app.stop().await;
}

/// A NUL in a platform message's text (the generic webhook refuses it with a clear 400,
/// as before; a platform that cannot be told is the Slack case) is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_streamed_chunk_and_a_slack_message_is_stored_and_answered() {
    let api = crate::platforms::platform_api().await;
    let model =
        SlowStreamingModel::start("part one\0 part two\0 end", 6, Duration::from_millis(50)).await;
    let (uri, model_uri) = (api.uri(), model.uri.clone());
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            streaming_on_slack(c, &uri);
            c.llm.base_url = format!("{model_uri}/v1");
        },
    )
    .await;
    let task = ask_on_slack(&app, "EvNul1", "<@UBOT> tell\u{0} me", "1990.1").await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(
        task["result"], "part one\u{FFFD} part two\u{FFFD} end",
        "{task:#}"
    );
    assert!(
        task["message"]["text"]
            .as_str()
            .unwrap()
            .contains("tell\u{FFFD} me"),
        "{task:#}"
    );
    assert_eq!(model.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    app.stop().await;
}

/// A tool's result with a NUL in it is journalled and used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_tool_result_is_stored_and_answered() {
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "lookup_a", "args": {"q": "x"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "found {{ steps.look.value }}"}]}"#,
        |_: &Value| ModelReply::text("unused"),
        |_| {},
    )
    .await;
    Mock::given(method("GET"))
        .and(path("/tools/a"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"value": "al\u{0}pha"})))
        .with_priority(1)
        .mount(&flow.tools)
        .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("nul-tool", 1, "go")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["reply"]["content"]["text"], "found al\u{FFFD}pha");
    let output = task["steps"][0]["output"].to_string();
    assert!(output.contains("al\u{FFFD}pha"), "{output}");
    flow.app.stop().await;
}

/// A run that aborts the same way every time (here: its agent snapshot cannot be read)
/// ends FAILED with INTERNAL after `engine.max_run_aborts` runs, with one failure notice
/// and a risk-flagged audit row per abort naming the error; the conversation's next
/// message is answered. Before: "task run aborted; it resumes when its lease expires",
/// forever, and the next message waited behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_always_aborts_ends_failed_internal_and_the_conversation_moves_on() {
    let intake = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.server.role = assistd::config::Role::Api;
    })
    .await;
    let first = task_id_of(intake.post_message(&message("poison", 1, "first")).await).await;
    let second = task_id_of(intake.post_message(&message("poison", 2, "second")).await).await;
    exec_sql(
        &intake.db.url,
        &format!("UPDATE agent_task SET workflow_snapshot = '{{not json' WHERE id = {first}"),
    )
    .await;
    let (db, model, receiver) = intake.stop_keeping_db().await;
    let mut config = test_config(&db.url, &model.uri(), &format!("{}/reply", receiver.uri()));
    config.engine.abort_retry_ms = 100;
    let app = TestApp::spawn_config(db, model, receiver, config).await;

    let task = app.wait_replied(first, WAIT).await;
    assert_eq!(task["status"], "FAILED", "{task:#}");
    assert_eq!(task["failure_type"], "INTERNAL", "{task:#}");
    assert_eq!(task["run_aborts"], 3, "{task:#}");
    let error = task["error"].as_str().unwrap();
    assert!(error.contains("agent snapshot unreadable"), "{error}");
    let aborted = audit_of(&task, "TASK_ABORTED");
    assert_eq!(aborted.len(), 3, "{task:#}");
    assert!(
        aborted.iter().all(|a| a["risk_flag"] == true),
        "{aborted:?}"
    );
    assert!(
        aborted.iter().all(|a| a["summary"]
            .as_str()
            .unwrap()
            .contains("agent snapshot unreadable")),
        "{aborted:?}"
    );
    let notice = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(notice.contains("INTERNAL"), "{notice}");

    let next = app.wait_replied(second, WAIT).await;
    assert_eq!(next["status"], "SUCCEEDED", "{next:#}");
    let replies = app.replies().await;
    let keys: Vec<&str> = replies.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            format!("agent-task-{first}"),
            format!("agent-task-{second}")
        ],
        "one notice, then the next answer"
    );
    // The model was never called for the poison task: only the second message's answer.
    assert_eq!(model_bodies(&app.model).await.len(), 1);

    // An admin can still resume it, and it counts afresh.
    let resumed = app
        .http
        .post(format!("{}/api/tasks/{first}/resume", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    // Still poison: it counts three aborts afresh and fails again, under its resumed key.
    let again = app
        .wait_task(first, WAIT, |t| {
            t["status"] == "FAILED"
                && t["reply"]["idempotency_key"] == format!("agent-task-{first}-r1")
                && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(again["run_aborts"], 3, "{again:#}");
    assert_eq!(audit_of(&again, "TASK_ABORTED").len(), 6, "{again:#}");
    app.stop().await;
}

/// On PostgreSQL, a database outage while a run is in flight is waited out: the run goes
/// on as soon as the database answers again (not when the 60 s lease lapses, which is
/// past this test's wait), and is not counted as an abort.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_waited_out_and_not_counted() {
    // SQLite has no server to lose (the outage test of `outage.rs` stops a private
    // PostgreSQL cluster; this one closes the test database to connections).
    let db = TestDb::postgres().await;
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("still here").delayed(Duration::from_millis(1500)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_on(db, model, accepting_receiver().await, |c| {
        c.database.acquire_timeout_secs = 1;
        c.worker.lease_secs = 60;
    })
    .await;
    let id = task_id_of(app.post_message(&message("outage", 1, "q")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "RUNNING").await;
    app.db.refuse_connections(true).await;
    // Out for longer than the model takes: the run's write of the answer meets the outage.
    tokio::time::sleep(Duration::from_secs(4)).await;
    app.db.refuse_connections(false).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["run_aborts"], 0, "{task:#}");
    assert!(audit_of(&task, "TASK_ABORTED").is_empty(), "{task:#}");
    assert_eq!(app.replies().await.len(), 1);
    app.stop().await;
}

/// A reply the receiver refuses for good (413: too large for it) ends FAILED with the
/// reason after one try, audited; a 503 keeps its backoff. Before: retried forever
/// (`outbox.max_attempts = 0`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_refused_for_good_ends_failed_and_a_transient_refusal_is_retried() {
    let receiver =
        receiver_answering(ResponseTemplate::new(413).set_body_string("too large")).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |_| {}).await;
    let id = task_id_of(app.post_message(&message("refused", 1, "hi")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["reply"]["status"] == "FAILED")
        .await;
    assert_eq!(task["reply"]["attempts"], 1, "{task:#}");
    let error = task["reply"]["last_error"].as_str().unwrap();
    assert!(error.contains("413"), "{error}");
    assert_eq!(audit_of(&task, "REPLY_FAILED").len(), 1, "{task:#}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        app.replies().await.len(),
        1,
        "a refused reply was tried again"
    );
    app.stop().await;

    let receiver = receiver_refusing_first(2, 503).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |_| {}).await;
    let id = task_id_of(app.post_message(&message("busy", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["reply"]["attempts"], 3, "{task:#}");
    app.stop().await;
}

/// Issue 32, part 6: a gateway that ignores `stream` and answers a streaming request with
/// one ordinary completion (the Content-Type says so) is answered, not failed as
/// PROVIDER_ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_answering_a_streaming_request_is_accepted() {
    let api = crate::platforms::platform_api().await;
    let model = MockServer::start().await;
    strict_mock(
        StrictModel::new(|_: &Value| {
            ModelReply::text("whole answer").delayed(Duration::from_millis(300))
        })
        .ignoring_stream(),
    )
    .mount(&model)
    .await;
    let uri = api.uri();
    let app = TestApp::spawn_with(model, accepting_receiver().await, move |c| {
        streaming_on_slack(c, &uri);
    })
    .await;
    let task = ask_on_slack(&app, "EvGw1", "<@UBOT> hello", "1991.1").await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], "whole answer");
    let bodies = model_bodies(&app.model).await;
    assert_eq!(bodies.len(), 1);
    assert_eq!(
        bodies[0]["stream"], true,
        "the request did ask for a stream"
    );
    app.stop().await;
}

/// An MCP tool's result with a NUL in it (the reference SDK's server echoes the ticket it was
/// asked about) is journalled and reaches the chat.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_an_mcp_result_is_stored_and_answered() {
    let server = crate::mcp::McpServer::start().await;
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["desk.lookup"], "max_steps": 3, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#,
        |body: &Value| {
            let messages = body["messages"].as_array().unwrap();
            match messages.iter().find(|m| m["role"] == "tool") {
                Some(t) => ModelReply::text(format!("found: {}", t["content"].as_str().unwrap())),
                None => ModelReply::calls(&[("desk__lookup", json!({"ticket": "T\u{0}-42"}))]),
            }
        },
        |c| server.configure(c),
    )
    .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("nul-mcp", 1, "how is it?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    // The model was handed the result as JSON text (the NUL as its escape) and quoted it.
    let reply = task["reply"]["content"]["text"].as_str().unwrap();
    assert!(reply.contains("-42 is open"), "{reply}");
    let step = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["tool"] == "desk.lookup")
        .expect("the MCP step");
    let output = step["output"].to_string();
    assert!(output.contains("T\u{FFFD}-42 is open"), "{output}");
    assert_eq!(server.calls().len(), 1, "{:?}", server.calls());
    flow.app.stop().await;
}

/// With the real binary (issue 32, "done means"): a model answer with a NUL is answered, and
/// a task whose runs abort the same way every time ends FAILED INTERNAL after
/// `engine.max_run_aborts` with one notice while its conversation's next message is
/// answered, on the test database's dialect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_ends_a_poison_task_and_answers_a_nul() {
    use crate::binary::{RealServer, server_envs};
    let model = MockServer::start().await;
    model_mock(|body: &Value| ModelReply::text(format!("nul\0answer to: {}", last_content(body))))
        .mount(&model)
        .await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let workdir = tempfile::tempdir().unwrap();
    // First an instance that only takes messages: the poison is laid before any worker runs.
    let api_only = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[("ASSISTD_SERVER__ROLE", "api")],
    );
    let intake = RealServer::start(&api_only, workdir.path()).await;
    let first = task_id_of(
        intake
            .post_message(&message("bin-poison", 1, "first"))
            .await,
    )
    .await;
    let second = task_id_of(
        intake
            .post_message(&message("bin-poison", 2, "second"))
            .await,
    )
    .await;
    assert_eq!(intake.terminate(), Some(0));
    exec_sql(
        &db.url,
        &format!("UPDATE agent_task SET workflow_snapshot = '{{not json' WHERE id = {first}"),
    )
    .await;
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[("ASSISTD_ENGINE__ABORT_RETRY_MS", "100")],
    );
    let server = RealServer::start(&envs, workdir.path()).await;
    let deadline = std::time::Instant::now() + WAIT;
    let replies = loop {
        let replies = received_replies(&receiver).await;
        if replies.len() >= 2 {
            break replies;
        }
        assert!(std::time::Instant::now() < deadline, "{replies:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let keys: Vec<&str> = replies.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            format!("agent-task-{first}"),
            format!("agent-task-{second}")
        ],
        "one notice, then the next answer"
    );
    assert!(
        replies[0].1["text"].as_str().unwrap().contains("INTERNAL"),
        "{replies:?}"
    );
    assert_eq!(replies[1].1["text"], "nul\u{FFFD}answer to: second");
    let task = server.admin_json(&format!("/api/tasks/{first}")).await;
    assert_eq!(task["failure_type"], "INTERNAL", "{task:#}");
    assert_eq!(task["run_aborts"], 3, "{task:#}");
    assert_eq!(server.terminate(), Some(0));
    db.drop_db().await;
}
