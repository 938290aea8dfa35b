//! Slack: signed events and URL verification, answers in the thread once, reconciled sends, Block Kit approvals.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use super::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_requests_are_verified_and_url_verification_answered() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let challenge = json!({"token": "t", "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P", "type": "url_verification"});
    let resp = app.slack_event(&challenge).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["challenge"], challenge["challenge"]);
    let event = slack_event(
        "Ev1",
        json!({"type": "app_mention", "user": "U1", "text": "hi", "ts": "1.1", "channel": "C1"}),
    );
    let raw = serde_json::to_vec(&event).unwrap();
    assert_eq!(
        app.slack(
            "/webhooks/slack",
            raw.clone(),
            "application/json",
            "wrong-secret",
            now()
        )
        .await
        .status(),
        401
    );
    assert_eq!(
        app.slack(
            "/webhooks/slack",
            raw.clone(),
            "application/json",
            SLACK_SECRET,
            now() - 301
        )
        .await
        .status(),
        401
    );
    let unsigned = app
        .http
        .post(format!("{}/webhooks/slack", app.addr))
        .body(raw)
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), 401);
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_mentions_are_answered_in_the_thread_once() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let mention = slack_event(
        "Ev10",
        json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> what is the wifi password?", "ts": "1700.0001", "channel": "C9"}),
    );
    let id = task_id_of(app.slack_event(&mention).await).await;
    // The same message as a `message` event (another event id) and a Slack retry.
    let as_message = slack_event(
        "Ev11",
        json!({"type": "message", "user": "U1", "text": "<@UBOT> what is the wifi password?", "ts": "1700.0001", "channel": "C9"}),
    );
    let dup: Value = app.slack_event(&as_message).await.json().await.unwrap();
    assert_eq!(
        (dup["task_id"].as_i64(), dup["duplicate"].as_bool()),
        (Some(id), Some(true))
    );
    let retry: Value = app.slack_event(&mention).await.json().await.unwrap();
    assert_eq!(retry["duplicate"], true);
    let own = slack_event(
        "Ev12",
        json!({"type": "message", "user": "UBOT", "bot_id": "B1", "text": "answer", "ts": "1700.0002", "channel": "C9"}),
    );
    let ignored: Value = app.slack_event(&own).await.json().await.unwrap();
    assert!(ignored["ignored"].is_string());
    app.wait_replied(id, WAIT).await;
    let posts = wait_sends(&api, "/chat.postMessage", 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sends(&api, "/chat.postMessage").await.len(), 1);
    assert_eq!(posts[0]["channel"], "C9");
    assert_eq!(posts[0]["thread_ts"], "1700.0001");
    assert_eq!(posts[0]["text"], "answer to: what is the wifi password?");
    assert_eq!(
        posts[0]["metadata"]["event_payload"]["key"],
        format!("agent-task-{id}")
    );
    let task = app.get_task(id).await;
    assert_eq!(task["conversation_id"], "C9:1700.0001");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slack_send_is_reconciled_not_reposted() {
    let api = MockServer::start().await;
    // The first post is accepted by Slack but its answer never arrives in time.
    Mock::given(method("POST"))
        .and(path("/chat.postMessage"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"ok": true, "ts": "1700.5"}))
                .set_delay(Duration::from_secs(3)),
        )
        .mount(&api)
        .await;
    let app = spawn_platforms(&api, |c| {
        c.outbox.timeout_secs = 1;
        c.outbox.lease_secs = 5;
    })
    .await;
    let ev = slack_event(
        "Ev20",
        json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> ping", "ts": "1700.4", "channel": "C2"}),
    );
    let id = task_id_of(app.slack_event(&ev).await).await;
    Mock::given(method("GET"))
        .and(path("/conversations.replies"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"ok": true, "messages": [
            {"ts": "1700.4", "text": "<@UBOT> ping"},
            {"ts": "1700.5", "text": "answer to: ping", "metadata": {"event_type": "assistd_reply", "event_payload": {"key": format!("agent-task-{id}")}}}
        ]})))
        .mount(&api)
        .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["reply"]["attempts"], 2);
    assert_eq!(
        sends(&api, "/chat.postMessage").await.len(),
        1,
        "found by its key, not posted twice"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_approvals_use_block_kit_buttons() {
    let api = platform_api().await;
    let uri = api.uri();
    let flow = spawn_flow_with(NOTICE, move |c| {
        enable_platforms(c, &uri, "flow");
        c.agents.get_mut("flow").unwrap().approvers = vec!["U42".into()];
    })
    .await;
    let app = &flow.app;
    let ev = slack_event(
        "Ev30",
        json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> send the notice", "ts": "1800.1", "channel": "C3"}),
    );
    let id = task_id_of(app.slack_event(&ev).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let card = wait_sends(&api, "/chat.postMessage", 1).await.remove(0);
    assert_eq!(card["thread_ts"], "1800.1");
    let buttons = card["blocks"][1]["elements"].as_array().unwrap().clone();
    assert_eq!(buttons[0]["text"]["text"], "Approve");
    let value = buttons[0]["value"].as_str().unwrap().to_string();
    let payload = |user: &str| {
        let p = json!({"type": "block_actions", "user": {"id": user}, "actions": [{"action_id": "assistd_approve", "value": value}]});
        format!(
            "payload={}",
            url::form_urlencoded::byte_serialize(p.to_string().as_bytes()).collect::<String>()
        )
        .into_bytes()
    };
    let form = "application/x-www-form-urlencoded";
    let denied: Value = app
        .slack(
            "/webhooks/slack/actions",
            payload("U7"),
            form,
            SLACK_SECRET,
            now(),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(denied["result"], "you may not decide this request");
    assert_eq!(
        app.slack(
            "/webhooks/slack/actions",
            payload("U42"),
            form,
            "bad",
            now()
        )
        .await
        .status(),
        401
    );
    let ok: Value = app
        .slack(
            "/webhooks/slack/actions",
            payload("U42"),
            form,
            SLACK_SECRET,
            now(),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(ok["result"], "approved");
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["result"], "notice sent");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    flow.app.stop().await;
}
