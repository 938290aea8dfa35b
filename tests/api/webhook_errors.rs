//! Bad input is refused with the documented status and writes nothing.

use serde_json::{Value, json};

use crate::helpers::*;

async fn assert_nothing_written(app: &TestApp) {
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_signature_stale_timestamp_and_missing_headers_get_401() {
    let app = TestApp::spawn().await;
    let raw = serde_json::to_vec(&message("c", 1, "hi")).unwrap();
    let now = assistd::domain::now_ms() / 1000;

    let wrong = assistd::channels::generic::sign("not-the-secret", now, &raw);
    let resp = app
        .post_raw(raw.clone(), Some(now.to_string()), Some(wrong))
        .await;
    assert_eq!(resp.status(), 401);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("signature"),
        "{body}"
    );

    // Well outside the 300 s window, so a second ticking over mid-test changes nothing.
    let stale_ts = now - 310;
    let stale = assistd::channels::generic::sign(SECRET, stale_ts, &raw);
    let resp = app
        .post_raw(raw.clone(), Some(stale_ts.to_string()), Some(stale))
        .await;
    assert_eq!(resp.status(), 401);

    let future_ts = now + 310;
    let future = assistd::channels::generic::sign(SECRET, future_ts, &raw);
    let resp = app
        .post_raw(raw.clone(), Some(future_ts.to_string()), Some(future))
        .await;
    assert_eq!(resp.status(), 401);

    let resp = app.post_raw(raw.clone(), None, None).await;
    assert_eq!(resp.status(), 401);

    // A valid signature over different bytes does not cover this body.
    let other = assistd::channels::generic::sign(SECRET, now, b"{}");
    let resp = app
        .post_raw(raw.clone(), Some(now.to_string()), Some(other))
        .await;
    assert_eq!(resp.status(), 401);

    assert_nothing_written(&app).await;
    assert!(app.replies().await.is_empty());
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_and_missing_fields_get_400_naming_the_field() {
    let app = TestApp::spawn().await;
    let now = assistd::domain::now_ms() / 1000;
    let signed = |raw: &[u8]| assistd::channels::generic::sign(SECRET, now, raw);

    let raw = b"{not json".to_vec();
    let resp = app
        .post_raw(raw.clone(), Some(now.to_string()), Some(signed(&raw)))
        .await;
    assert_eq!(resp.status(), 400);

    for field in [
        "event_id",
        "message_id",
        "conversation_id",
        "sender_id",
        "text",
    ] {
        let mut body = message("c", 1, "hi");
        body.as_object_mut().unwrap().remove(field);
        let resp = app.post_message(&body).await;
        assert_eq!(resp.status(), 400, "missing {field}");
        let err: Value = resp.json().await.unwrap();
        assert!(
            err["error"]
                .as_str()
                .unwrap()
                .contains(&format!("`{field}`")),
            "error names {field}: {err}"
        );
    }
    let resp = app.post_message(&json!({"event_id": 1})).await;
    assert_eq!(resp.status(), 400);
    assert_nothing_written(&app).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_gets_413() {
    let model = wiremock::MockServer::start().await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.server.body_limit_bytes = 4096;
    })
    .await;
    let big = message("c", 1, &"x".repeat(5000));
    let resp = app.post_message(&big).await;
    assert_eq!(resp.status(), 413);

    // Chunked, without Content-Length: the limit still holds.
    let raw = serde_json::to_vec(&big).unwrap();
    let now = assistd::domain::now_ms() / 1000;
    let sig = assistd::channels::generic::sign(SECRET, now, &raw);
    let stream = futures::stream::iter(
        raw.chunks(1000)
            .map(|c| Ok::<_, std::io::Error>(c.to_vec()))
            .collect::<Vec<_>>(),
    );
    let resp = app
        .http
        .post(format!("{}/webhooks/generic", app.addr))
        .header("X-Assistd-Timestamp", now.to_string())
        .header("X-Assistd-Signature", sig)
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert_nothing_written(&app).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_api_requires_the_admin_token() {
    let app = TestApp::spawn().await;
    let id = task_id_of(app.post_message(&message("c-auth", 1, "hi")).await).await;
    let url = format!("{}/api/tasks/{id}", app.addr);
    assert_eq!(app.http.get(&url).send().await.unwrap().status(), 401);
    assert_eq!(
        app.http
            .get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let missing = format!("{}/api/tasks/999999", app.addr);
    assert_eq!(
        app.http
            .get(&missing)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    let health = app
        .http
        .get(format!("{}/healthz", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfigured_generic_channel_answers_404() {
    let model = wiremock::MockServer::start().await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.channels.generic.secret = String::new();
    })
    .await;
    let resp = app.post_message(&message("c", 1, "hi")).await;
    assert_eq!(resp.status(), 404);
    assert_nothing_written(&app).await;
    app.stop().await;
}
