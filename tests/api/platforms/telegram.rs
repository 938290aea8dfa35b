//! Telegram: verification, dedupe, replies in reply to the question, 429 handling, unknown outcomes, inline-keyboard approvals.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use super::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_messages_are_answered_in_reply_to_the_question() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let resp = app
        .telegram(
            &tg_update(1, -100, 5, 42, "@helper_bot what is up"),
            Some(TG_SECRET),
        )
        .await;
    let id = task_id_of(resp).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["channel"], "telegram");
    let sent = wait_sends(&api, &format!("/bot{TG_TOKEN}/sendMessage"), 1).await;
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["chat_id"], "-100");
    assert_eq!(sent[0]["reply_parameters"]["message_id"], 5);
    assert_eq!(sent[0]["text"], "answer to: what is up", "mention stripped");
    assert_eq!(task["reply"]["status"], "SENT");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_requests_are_verified_and_deduplicated() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let update = tg_update(7, 55, 9, 42, "hello");
    assert_eq!(app.telegram(&update, None).await.status(), 401);
    assert_eq!(app.telegram(&update, Some("wrong")).await.status(), 401);
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    let responses =
        futures::future::join_all((0..4).map(|_| app.telegram(&update, Some(TG_SECRET)))).await;
    let mut ids = Vec::new();
    for r in responses {
        ids.push(task_id_of(r).await);
    }
    assert!(ids.iter().all(|i| *i == ids[0]), "one task: {ids:?}");
    // The same message under a new update id (a re-delivery) is still one message.
    let again: Value = app
        .telegram(&tg_update(8, 55, 9, 42, "hello"), Some(TG_SECRET))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["duplicate"], true);
    let mut bot = tg_update(9, 55, 10, 1, "from a bot");
    bot["message"]["from"]["is_bot"] = json!(true);
    let ignored: Value = app
        .telegram(&bot, Some(TG_SECRET))
        .await
        .json()
        .await
        .unwrap();
    assert!(ignored["ignored"].is_string());
    app.wait_replied(ids[0], WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sends(&api, &format!("/bot{TG_TOKEN}/sendMessage"))
            .await
            .len(),
        1
    );
    assert_eq!(app.store().intake_row_counts().await.unwrap().1, 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_honours_429_retry_after() {
    let api = platform_api().await;
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/sendMessage")))
        .respond_with(ResponseTemplate::new(429).set_body_json(json!({
            "ok": false, "error_code": 429, "description": "Too Many Requests: retry after 1",
            "parameters": {"retry_after": 1}})))
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&api)
        .await;
    let app = spawn_platforms(&api, |c| c.outbox.backoff_base_ms = 30_000).await;
    let id = task_id_of(
        app.telegram(&tg_update(1, 3, 4, 42, "hi"), Some(TG_SECRET))
            .await,
    )
    .await;
    let task = app.wait_replied(id, Duration::from_secs(10)).await;
    assert_eq!(task["reply"]["attempts"], 2);
    app.stop().await;
}

/// The platform stand-in with Telegram's sendMessage answering only after `delay`.
pub(crate) async fn slow_telegram_api(delay: Duration) -> MockServer {
    let api = platform_api().await;
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/sendMessage")))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"ok": true, "result": {"message_id": 1}}))
                .set_delay(delay),
        )
        .with_priority(1)
        .mount(&api)
        .await;
    api
}

/// The task's REPLY_FAILED audit entry is risk-flagged, and the reply went out only once.
pub(crate) async fn assert_unknown_and_sent_once(api: &MockServer, task: &Value) {
    let failed = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "REPLY_FAILED")
        .unwrap();
    assert_eq!(failed["risk_flag"], true);
    assert_eq!(
        sends(api, &format!("/bot{TG_TOKEN}/sendMessage"))
            .await
            .len(),
        1,
        "not blindly re-sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_telegram_send_with_unknown_outcome_is_not_repeated() {
    let api = slow_telegram_api(Duration::from_secs(3)).await;
    let app = spawn_platforms(&api, |c| {
        c.outbox.timeout_secs = 1;
        c.outbox.lease_secs = 5;
    })
    .await;
    let id = task_id_of(
        app.telegram(&tg_update(1, 3, 4, 42, "hi"), Some(TG_SECRET))
            .await,
    )
    .await;
    let task = app
        .wait_task(id, WAIT, |t| t["reply"]["status"] == "UNKNOWN")
        .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_unknown_and_sent_once(&api, &task).await;
    app.stop().await;
}

/// The crash window: an instance took the reply and died mid-send (here: its send hangs past
/// the lease), so another instance finds the reply taken before with no result recorded.
/// Telegram has no idempotency key, so the second instance marks it UNKNOWN and sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_telegram_reply_left_mid_send_by_another_instance_is_not_resent() {
    let api = slow_telegram_api(Duration::from_secs(4)).await;
    let tweak = |c: &mut assistd::Config| {
        c.outbox.timeout_secs = 10;
        c.outbox.lease_secs = 1;
    };
    let app = spawn_platforms(&api, tweak).await;
    let id = task_id_of(
        app.telegram(&tg_update(1, 3, 4, 42, "hi"), Some(TG_SECRET))
            .await,
    )
    .await;
    wait_sends(&api, &format!("/bot{TG_TOKEN}/sendMessage"), 1).await;

    let mut peer_cfg = app.config.as_ref().clone();
    peer_cfg.worker.instance_id = "peer".into();
    let peer = assistd::App::build(peer_cfg).await.unwrap();
    let stop_peer = tokio_util::sync::CancellationToken::new();
    let peer_handle = tokio::spawn(peer.run_until_stopped(stop_peer.clone()));

    let task = app
        .wait_task(id, WAIT, |t| t["reply"]["status"] == "UNKNOWN")
        .await;
    assert_eq!(task["reply"]["attempts"], 2, "{task}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_unknown_and_sent_once(&api, &task).await;
    assert_eq!(
        app.get_task(id).await["reply"]["status"],
        "UNKNOWN",
        "the late answer of the first send does not overwrite the verdict"
    );
    stop_peer.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), peer_handle).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_approvals_use_inline_keyboards() {
    let api = platform_api().await;
    let uri = api.uri();
    let flow = spawn_flow_with(NOTICE, move |c| {
        enable_platforms(c, &uri, "flow");
        c.agents.get_mut("flow").unwrap().approvers = vec!["42".into()];
    })
    .await;
    let app = &flow.app;
    let id = task_id_of(
        app.telegram(
            &tg_update(1, -7, 3, 99, "@helper_bot end the contract"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let card = wait_sends(&api, &format!("/bot{TG_TOKEN}/sendMessage"), 1)
        .await
        .remove(0);
    let buttons = card["reply_markup"]["inline_keyboard"][0]
        .as_array()
        .unwrap()
        .clone();
    assert!(card["text"].as_str().unwrap().contains("Approval needed"));
    let approve = buttons[0]["callback_data"].as_str().unwrap().to_string();
    assert!(approve.starts_with(&format!("approve:{id}.")), "{approve}");
    assert!(
        approve.len() <= 64,
        "Telegram allows 64 bytes of callback data: {approve}"
    );
    let callback = |from: i64, data: &str| {
        json!({"update_id": 50 + from, "callback_query": {
        "id": format!("cq-{from}"), "from": {"id": from, "is_bot": false, "first_name": "X"},
        "chat_instance": "1", "data": data}})
    };
    let denied: Value = app
        .telegram(&callback(7, &approve), Some(TG_SECRET))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(denied["result"], "you may not decide this request");
    let parked = app.get_task(id).await;
    assert_eq!(parked["status"], "WAITING_HUMAN_CONFIRM");
    // The step it waits at is its current step: the gate, journalled PENDING.
    let gate = parked["steps"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(gate["status"], "PENDING");
    assert_eq!(gate["tool"], "confirm:send_notice");
    assert_eq!(parked["current_step"], gate["step_no"]);
    let ok: Value = app
        .telegram(&callback(42, &approve), Some(TG_SECRET))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(ok["result"], "approved");
    app.wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    let answers = sends(&api, &format!("/bot{TG_TOKEN}/answerCallbackQuery")).await;
    assert_eq!(answers.len(), 2, "every callback query is answered");
    assert_eq!(answers[1]["callback_query_id"], "cq-42");
    flow.app.stop().await;
}
