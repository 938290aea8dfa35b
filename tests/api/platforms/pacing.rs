//! Per-chat pacing of replies: one chat is paced, others are not held up, a paced reply keeps its time.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use super::*;

/// Records when each request arrived.
#[derive(Clone, Default)]
pub(crate) struct Arrivals(std::sync::Arc<std::sync::Mutex<Vec<(std::time::Instant, Value)>>>);

impl wiremock::Respond for Arrivals {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        self.0
            .lock()
            .unwrap()
            .push((std::time::Instant::now(), body));
        ResponseTemplate::new(200).set_body_json(json!({"ok": true, "result": {"message_id": 99}}))
    }
}

impl Arrivals {
    /// When the sends into chat `chat_id` arrived, in order.
    fn sent_to_chat(&self, chat_id: &str) -> Vec<std::time::Instant> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, b)| b["chat_id"] == chat_id)
            .map(|(t, _)| *t)
            .collect()
    }
}

/// The platforms app with its Telegram sends recorded in `Arrivals`.
pub(crate) async fn telegram_with_arrivals(
    tweak: impl FnOnce(&mut assistd::Config),
) -> (MockServer, Arrivals, TestApp) {
    let api = MockServer::start().await;
    let arrivals = Arrivals::default();
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/sendMessage")))
        .respond_with(arrivals.clone())
        .mount(&api)
        .await;
    let app = spawn_platforms(&api, tweak).await;
    (api, arrivals, app)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_into_one_chat_are_paced_and_other_chats_are_not_held_up() {
    let (_api, arrivals, app) =
        telegram_with_arrivals(|c| c.channels.telegram.per_chat_interval_ms = 400).await;
    // Four questions in one busy chat, then one in a quiet chat.
    let mut ids = Vec::new();
    for i in 0..4 {
        let resp = app
            .telegram(
                &tg_update(100 + i, -7, 10 + i, 42, &format!("@helper_bot q{i}")),
                Some(TG_SECRET),
            )
            .await;
        ids.push(task_id_of(resp).await);
    }
    let quiet = task_id_of(
        app.telegram(
            &tg_update(200, -8, 1, 43, "@helper_bot quiet chat"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    for id in ids.iter().chain([&quiet]) {
        app.wait_replied(*id, WAIT).await;
    }
    let busy = arrivals.sent_to_chat("-7");
    assert_eq!(busy.len(), 4, "every reply sent once");
    for pair in busy.windows(2) {
        let gap = pair[1] - pair[0];
        // The pacer's clock is in whole milliseconds.
        assert!(
            gap >= Duration::from_millis(395),
            "sends into one chat {gap:?} apart"
        );
    }
    let quiet_at = arrivals.sent_to_chat("-8")[0];
    assert!(
        quiet_at < *busy.last().unwrap(),
        "the quiet chat's reply did not wait behind the busy chat"
    );
    // Paced replies were deferred, not tried and failed.
    for id in &ids {
        let task = app.get_task(*id).await;
        assert_eq!(task["reply"]["attempts"], 1, "{task}");
    }
    app.stop().await;
}

/// A reply held back by its chat's pace goes when its time comes, even if the outbox claimed
/// other replies in between (it must not fall back to the poll interval).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_reply_keeps_its_time_across_other_claims() {
    let (_api, arrivals, app) = telegram_with_arrivals(|c| {
        c.channels.telegram.per_chat_interval_ms = 300;
        c.outbox.poll_interval_ms = 15_000;
    })
    .await;
    let mut busy = Vec::new();
    for i in 0..2 {
        let resp = app
            .telegram(
                &tg_update(300 + i, -7, 30 + i, 42, &format!("@helper_bot q{i}")),
                Some(TG_SECRET),
            )
            .await;
        busy.push(task_id_of(resp).await);
    }
    // The first reply went; the second is deferred by the pace. Now another chat's reply
    // makes the outbox claim again before the deferred one is due.
    let deadline = std::time::Instant::now() + WAIT;
    while arrivals.0.lock().unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "no reply left");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let quiet = task_id_of(
        app.telegram(
            &tg_update(400, -8, 1, 43, "@helper_bot quiet chat"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    for id in busy.iter().chain([&quiet]) {
        app.wait_replied(*id, WAIT).await;
    }
    let sent = arrivals.sent_to_chat("-7");
    assert_eq!(sent.len(), 2);
    let gap = sent[1] - sent[0];
    assert!(
        gap < Duration::from_secs(5),
        "the paced reply went {gap:?} after the first (poll interval 15 s)"
    );
    app.stop().await;
}
