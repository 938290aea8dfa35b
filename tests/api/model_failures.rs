//! Model failures are classified, transient ones retried, and the chat always hears back once.

use std::time::Duration;

use wiremock::MockServer;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limited_then_ok_succeeds_after_honouring_retry_after() {
    rate_limited_then_ok("1".into()).await;
}

/// `Retry-After` in its other form, an HTTP-date (RFC 9110), read with `httpdate` (issue 23).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_as_an_http_date_is_honoured() {
    let at = std::time::SystemTime::now() + Duration::from_secs(2);
    rate_limited_then_ok(httpdate::fmt_http_date(at)).await;
}

async fn rate_limited_then_ok(retry_after: String) {
    let model = MockServer::start().await;
    model_mock(move |_: &serde_json::Value| {
        ModelReply::error(429, r#"{"error":{"message":"slow down"}}"#)
            .header("retry-after", retry_after.as_str())
    })
    .up_to_n_times(1)
    .with_priority(1)
    .mount(&model)
    .await;
    model_mock(echo).with_priority(2).mount(&model).await;
    // Backoff alone would wait a minute; only honouring Retry-After (1–2 s) finishes in time.
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.llm.retry.rate_limited.backoff_base_ms = 60_000;
        c.llm.retry.rate_limited.backoff_max_ms = 60_000;
    })
    .await;
    let id = task_id_of(app.post_message(&message("c-429", 1, "hi")).await).await;
    let task = app.wait_replied(id, Duration::from_secs(15)).await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(task["retry_count"], 1);
    assert_eq!(task["steps"][0]["attempts"], 2);
    assert_eq!(app.model.received_requests().await.unwrap().len(), 2);
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].1["text"], "answer to: hi");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_failure_fails_at_once_with_one_notice() {
    let model = MockServer::start().await;
    model_mock(|_: &serde_json::Value| ModelReply::error(401, r#"{"error":"bad key"}"#))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-401", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED");
    assert_eq!(task["failure_type"], "AUTH_FAILED");
    assert!(task["error"].as_str().unwrap().contains("401"));
    assert_eq!(task["steps"][0]["status"], "FAILED");
    let events = audit_events(&task);
    assert!(events.contains(&"TASK_FAILED"), "{events:?}");
    // Not transient: one call only.
    assert_eq!(app.model.received_requests().await.unwrap().len(), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1, "exactly one failure notice");
    assert_eq!(replies[0].0, format!("agent-task-{id}"));
    let text = replies[0].1["text"].as_str().unwrap();
    assert!(
        text.contains("AUTH_FAILED") && text.contains(&id.to_string()),
        "{text}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_timeout_is_retried_then_fails_as_timeout() {
    let model = MockServer::start().await;
    model_mock(|_: &serde_json::Value| ModelReply::text("late").delayed(Duration::from_secs(3)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.llm.timeout_secs = 1;
        c.llm.retry.timeout.max_attempts = 2;
    })
    .await;
    let id = task_id_of(app.post_message(&message("c-timeout", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED");
    assert_eq!(task["failure_type"], "TIMEOUT");
    assert_eq!(task["steps"][0]["attempts"], 2);
    assert_eq!(task["retry_count"], 1);
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert!(replies[0].1["text"].as_str().unwrap().contains("TIMEOUT"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_errors_are_retried_up_to_the_limit() {
    let model = MockServer::start().await;
    model_mock(|_: &serde_json::Value| ModelReply::error(503, ""))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.llm.retry.provider_error.max_attempts = 3;
    })
    .await;
    let id = task_id_of(app.post_message(&message("c-503", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["failure_type"], "PROVIDER_ERROR");
    assert_eq!(app.model.received_requests().await.unwrap().len(), 3);
    app.stop().await;
}
