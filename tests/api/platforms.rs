//! Slack and Telegram: verification, dedupe, replies in the thread, cards and approvals,
//! against mock platform APIs speaking their wire formats.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::helpers::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

const TG_TOKEN: &str = "123:ABC";
const TG_SECRET: &str = "tg-secret";
const SLACK_SECRET: &str = "slack-signing-secret";

pub(crate) async fn platform_api() -> MockServer {
    let api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/sendMessage")))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"ok": true, "result": {"message_id": 99}})),
        )
        .with_priority(5)
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/answerCallbackQuery")))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"ok": true, "result": true})))
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path("/chat.postMessage"))
        .respond_with(
            ResponseTemplate::new(200).set_body_json(json!({"ok": true, "ts": "1700.9999"})),
        )
        .with_priority(5)
        .mount(&api)
        .await;
    Mock::given(method("GET"))
        .and(path("/conversations.replies"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"ok": true, "messages": []})))
        .with_priority(5)
        .mount(&api)
        .await;
    api
}

fn enable_platforms(c: &mut assistd::Config, api: &str, agent: &str) {
    c.channels.telegram.enabled = true;
    c.channels.telegram.bot_token = TG_TOKEN.into();
    c.channels.telegram.secret_token = TG_SECRET.into();
    c.channels.telegram.api_base_url = api.into();
    c.channels.telegram.bot_username = "helper_bot".into();
    c.channels.telegram.agent = agent.into();
    c.channels.slack.enabled = true;
    c.channels.slack.signing_secret = SLACK_SECRET.into();
    c.channels.slack.bot_token = "xoxb-test".into();
    c.channels.slack.api_base_url = api.into();
    c.channels.slack.bot_user_id = "UBOT".into();
    c.channels.slack.agent = agent.into();
}

pub(crate) async fn spawn_platforms(
    api: &MockServer,
    tweak: impl FnOnce(&mut assistd::Config),
) -> TestApp {
    let model = echo_model().await;
    let uri = api.uri();
    TestApp::spawn_with(model, accepting_receiver().await, move |c| {
        enable_platforms(c, &uri, "default");
        tweak(c);
    })
    .await
}

fn tg_update(update_id: i64, chat: i64, message_id: i64, from: i64, text: &str) -> Value {
    json!({"update_id": update_id, "message": {
        "message_id": message_id, "date": 1,
        "from": {"id": from, "is_bot": false, "first_name": "Ada", "username": "ada"},
        "chat": {"id": chat, "type": "group"}, "text": text}})
}

impl TestApp {
    async fn telegram(&self, body: &Value, secret: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}/webhooks/telegram", self.addr))
            .json(body);
        if let Some(s) = secret {
            req = req.header("X-Telegram-Bot-Api-Secret-Token", s);
        }
        req.send().await.unwrap()
    }

    async fn slack(
        &self,
        route: &str,
        body: Vec<u8>,
        content_type: &str,
        secret: &str,
        ts: i64,
    ) -> reqwest::Response {
        let ts = ts.to_string();
        let sig = assistd::channels::slack::sign(secret, &ts, &body);
        self.http
            .post(format!("{}{route}", self.addr))
            .header("content-type", content_type)
            .header("X-Slack-Request-Timestamp", ts)
            .header("X-Slack-Signature", sig)
            .body(body)
            .send()
            .await
            .unwrap()
    }

    pub(crate) async fn slack_event(&self, body: &Value) -> reqwest::Response {
        self.slack(
            "/webhooks/slack",
            serde_json::to_vec(body).unwrap(),
            "application/json",
            SLACK_SECRET,
            now(),
        )
        .await
    }
}

fn now() -> i64 {
    assistd::domain::now_ms() / 1000
}

async fn sends(api: &MockServer, p: &str) -> Vec<Value> {
    api.received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path() == p)
        .map(|r: &Request| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
        .collect()
}

async fn wait_sends(api: &MockServer, p: &str, n: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let s = sends(api, p).await;
        if s.len() >= n {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{p}: {} of {n} sends",
            s.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn slack_event(event_id: &str, event: Value) -> Value {
    json!({"token": "x", "team_id": "T1", "api_app_id": "A1", "type": "event_callback",
           "event_id": event_id, "event_time": 1, "event": event})
}

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
async fn slow_telegram_api(delay: Duration) -> MockServer {
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
async fn assert_unknown_and_sent_once(api: &MockServer, task: &Value) {
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
            &tg_update(1, -7, 3, 99, "end the contract"),
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
    assert!(approve.starts_with(&format!("approve:{id}:")), "{approve}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platforms_not_enabled_are_not_routed() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.telegram(&tg_update(1, 1, 1, 1, "x"), Some(TG_SECRET))
            .await
            .status(),
        404
    );
    let resp = app
        .http
        .post(format!("{}/webhooks/slack", app.addr))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    app.stop().await;
}

pub(crate) const HS_TOKEN: &str = "hs-token";

/// Enables the Matrix channel against `homeserver` with the test tokens.
pub(crate) fn enable_matrix(c: &mut assistd::Config, homeserver: &str) {
    c.channels.matrix.enabled = true;
    c.channels.matrix.homeserver_url = homeserver.into();
    c.channels.matrix.as_token = "as-token".into();
    c.channels.matrix.hs_token = HS_TOKEN.into();
    c.channels.matrix.bot_user_id = "@assistd:hs".into();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_transactions_are_authorised_answered_and_idempotent() {
    use wiremock::matchers::path_regex;
    let hs = MockServer::start().await;
    Mock::given(method("PUT"))
        .and(path_regex(
            r"^/_matrix/client/v3/rooms/.*/send/m\.room\.message/.*$",
        ))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"event_id": "$reply"})))
        .mount(&hs)
        .await;
    Mock::given(method("POST"))
        .and(path_regex(r"^/_matrix/client/v3/rooms/.*/join$"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"room_id": "!new:hs"})))
        .mount(&hs)
        .await;
    let uri = hs.uri();
    let app = spawn_platforms(&hs, move |c| {
        enable_matrix(c, &uri);
    })
    .await;
    let txn = json!({"events": [
        {"type": "m.room.message", "room_id": "!r:hs", "sender": "@ada:hs", "event_id": "$q1",
         "origin_server_ts": 1, "content": {"msgtype": "m.text", "body": "@assistd:hs: where is the office?"}},
        {"type": "m.room.message", "room_id": "!r:hs", "sender": "@assistd:hs", "event_id": "$own",
         "origin_server_ts": 2, "content": {"msgtype": "m.text", "body": "my own words"}},
        {"type": "m.room.member", "room_id": "!new:hs", "sender": "@ada:hs", "state_key": "@assistd:hs",
         "event_id": "$inv", "content": {"membership": "invite"}}
    ]});
    let put = |token: Option<&str>| {
        let mut req = app
            .http
            .put(format!(
                "{}/webhooks/matrix/_matrix/app/v1/transactions/t1",
                app.addr
            ))
            .json(&txn);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    let resp = put(None).await.unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["errcode"],
        "M_UNAUTHORIZED"
    );
    let resp = put(Some("wrong")).await.unwrap();
    assert_eq!(resp.status(), 403);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["errcode"],
        "M_FORBIDDEN"
    );
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    assert_eq!(put(Some(HS_TOKEN)).await.unwrap().status(), 200);
    assert_eq!(
        put(Some(HS_TOKEN)).await.unwrap().status(),
        200,
        "a repeated transaction"
    );
    assert_eq!(
        app.store().intake_row_counts().await.unwrap().1,
        1,
        "one task; the bot's own message ignored"
    );
    let tasks: Value = app.list("conversation=!r:hs").await.json().await.unwrap();
    let id = tasks["tasks"][0]["id"].as_i64().unwrap();
    app.wait_replied(id, WAIT).await;
    let sent: Vec<Request> = hs
        .received_requests()
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.method.as_str() == "PUT")
        .collect();
    assert_eq!(sent.len(), 1);
    assert!(
        sent[0]
            .url
            .path()
            .ends_with(&format!("/send/m.room.message/agent-task-{id}")),
        "{}",
        sent[0].url
    );
    assert_eq!(
        sent[0].headers.get("authorization").unwrap(),
        "Bearer as-token"
    );
    let body: Value = serde_json::from_slice(&sent[0].body).unwrap();
    assert_eq!(body["body"], "answer to: where is the office?");
    assert_eq!(body["m.relates_to"]["m.in_reply_to"]["event_id"], "$q1");
    let joins = hs
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path().ends_with("/join"))
        .count();
    assert_eq!(
        joins, 1,
        "the invited room is joined; the repeated transaction did nothing"
    );
    app.stop().await;
}

const LARK_KEY: &str = "lark-encrypt-key";
const LARK_TOKEN: &str = "lark-verification-token";

fn lark_encrypt(plain: &Value) -> Value {
    use aes::cipher::{BlockEncryptMut, KeyIvInit, block_padding::Pkcs7};
    use base64::Engine;
    use sha2::Digest;
    let key = sha2::Sha256::digest(LARK_KEY.as_bytes());
    let iv: [u8; 16] = std::array::from_fn(|i| i as u8 * 7);
    let ct = cbc::Encryptor::<aes::Aes256>::new(key.as_slice().into(), &iv.into())
        .encrypt_padded_vec_mut::<Pkcs7>(plain.to_string().as_bytes());
    let mut data = iv.to_vec();
    data.extend(ct);
    json!({ "encrypt": base64::engine::general_purpose::STANDARD.encode(data) })
}

fn lark_message(event_id: &str, message_id: &str, sender_type: &str, text: &str) -> Value {
    json!({"schema": "2.0", "header": {"event_id": event_id, "event_type": "im.message.receive_v1",
        "create_time": "1", "token": LARK_TOKEN, "app_id": "cli_x", "tenant_key": "t"},
        "event": {"sender": {"sender_id": {"open_id": "ou_user"}, "sender_type": sender_type},
            "message": {"message_id": message_id, "chat_id": "oc_chat", "chat_type": "group", "message_type": "text",
                "content": json!({"text": text}).to_string(),
                "mentions": [{"key": "@_user_1", "name": "bot"}]}}})
}

impl TestApp {
    async fn lark(
        &self,
        route: &str,
        plain: &Value,
        signed_with: &str,
        ts: i64,
    ) -> reqwest::Response {
        let body = serde_json::to_vec(&lark_encrypt(plain)).unwrap();
        let ts = ts.to_string();
        let sig = assistd::channels::lark::signature(&ts, "nonce-1", signed_with, &body);
        self.http
            .post(format!("{}{route}", self.addr))
            .header("content-type", "application/json")
            .header("X-Lark-Request-Timestamp", ts)
            .header("X-Lark-Request-Nonce", "nonce-1")
            .header("X-Lark-Signature", sig)
            .body(body)
            .send()
            .await
            .unwrap()
    }
}

async fn lark_api() -> MockServer {
    use wiremock::matchers::path_regex;
    let api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/open-apis/auth/v3/tenant_access_token/internal"))
        .respond_with(ResponseTemplate::new(200).set_body_json(
            json!({"code": 0, "msg": "ok", "tenant_access_token": "t-abc", "expire": 7200}),
        ))
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path_regex(r"^/open-apis/im/v1/messages/.*/reply$"))
        .respond_with(ResponseTemplate::new(200).set_body_json(
            json!({"code": 0, "msg": "success", "data": {"message_id": "om_reply"}}),
        ))
        .mount(&api)
        .await;
    api
}

fn enable_lark(c: &mut assistd::Config, api: &str, agent: &str) {
    c.channels.lark.enabled = true;
    c.channels.lark.app_id = "cli_x".into();
    c.channels.lark.app_secret = "secret".into();
    c.channels.lark.verification_token = LARK_TOKEN.into();
    c.channels.lark.encrypt_key = LARK_KEY.into();
    c.channels.lark.api_base_url = api.into();
    c.channels.lark.agent = agent.into();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_encrypted_events_are_verified_answered_and_deduplicated() {
    let api = lark_api().await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| enable_lark(c, &uri, "default")).await;
    let challenge =
        json!({"challenge": "ajls384kdjx98XX", "token": LARK_TOKEN, "type": "url_verification"});
    let resp = app
        .lark("/webhooks/lark", &challenge, LARK_KEY, now())
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["challenge"],
        "ajls384kdjx98XX"
    );
    let mut wrong = challenge.clone();
    wrong["token"] = json!("nope");
    assert_eq!(
        app.lark("/webhooks/lark", &wrong, LARK_KEY, now())
            .await
            .status(),
        401
    );

    let msg = lark_message("ev-1", "om_1", "user", "@_user_1 where is the printer?");
    assert_eq!(
        app.lark("/webhooks/lark", &msg, "wrong-key", now())
            .await
            .status(),
        401,
        "bad signature"
    );
    assert_eq!(
        app.lark("/webhooks/lark", &msg, LARK_KEY, now() - 600)
            .await
            .status(),
        401,
        "stale"
    );
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    let id = task_id_of(app.lark("/webhooks/lark", &msg, LARK_KEY, now()).await).await;
    let dup: Value = app
        .lark("/webhooks/lark", &msg, LARK_KEY, now())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(dup["duplicate"], true);
    let from_app = lark_message("ev-2", "om_2", "app", "loop");
    let ignored: Value = app
        .lark("/webhooks/lark", &from_app, LARK_KEY, now())
        .await
        .json()
        .await
        .unwrap();
    assert!(ignored["ignored"].is_string());
    let id2 = task_id_of(
        app.lark(
            "/webhooks/lark",
            &lark_message("ev-3", "om_3", "user", "second"),
            LARK_KEY,
            now(),
        )
        .await,
    )
    .await;
    app.wait_replied(id, WAIT).await;
    app.wait_replied(id2, WAIT).await;
    let replies: Vec<Request> = api
        .received_requests()
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.url.path().ends_with("/reply"))
        .collect();
    assert_eq!(replies.len(), 2);
    let first = replies
        .iter()
        .find(|r| r.url.path() == "/open-apis/im/v1/messages/om_1/reply")
        .unwrap();
    assert_eq!(first.headers.get("authorization").unwrap(), "Bearer t-abc");
    let body: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(body["uuid"], format!("agent-task-{id}"));
    assert_eq!(body["msg_type"], "text");
    let content: Value = serde_json::from_str(body["content"].as_str().unwrap()).unwrap();
    assert_eq!(content["text"], "answer to: where is the printer?");
    let token_calls = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path().contains("tenant_access_token"))
        .count();
    assert_eq!(token_calls, 1, "the tenant token is cached");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_approvals_use_interactive_cards() {
    let api = lark_api().await;
    let uri = api.uri();
    let flow = spawn_flow_with(NOTICE, move |c| {
        enable_lark(c, &uri, "flow");
        c.agents.get_mut("flow").unwrap().approvers = vec!["ou_boss".into()];
    })
    .await;
    let app = &flow.app;
    let id = task_id_of(
        app.lark(
            "/webhooks/lark",
            &lark_message("ev-9", "om_9", "user", "send the notice"),
            LARK_KEY,
            now(),
        )
        .await,
    )
    .await;
    app.wait_task(id, WAIT, |t| {
        t["status"] == "WAITING_HUMAN_CONFIRM" && t["reply"]["status"] == "SENT"
    })
    .await;
    let req = api
        .received_requests()
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.url.path().ends_with("/reply"))
        .unwrap();
    let body: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(body["msg_type"], "interactive");
    let card: Value = serde_json::from_str(body["content"].as_str().unwrap()).unwrap();
    let value = card["elements"][1]["actions"][0]["value"].clone();
    assert_eq!(value["decision"], "approve");
    let action = |who: &str| {
        json!({"schema": "2.0", "header": {"event_id": format!("ca-{who}"), "event_type": "card.action.trigger", "token": LARK_TOKEN},
        "event": {"operator": {"open_id": who}, "action": {"value": value, "tag": "button"}}})
    };
    let denied: Value = app
        .lark("/webhooks/lark/card", &action("ou_intern"), LARK_KEY, now())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(denied["result"], "you may not decide this request");
    let ok: Value = app
        .lark("/webhooks/lark/card", &action("ou_boss"), LARK_KEY, now())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(ok["result"], "approved");
    app.wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    flow.app.stop().await;
}

const DT_SECRET: &str = "dt-app-secret";

fn dingtalk_message(
    msg_id: &str,
    conversation_type: &str,
    session: &str,
    expires: i64,
    text: &str,
) -> Value {
    json!({"msgtype": "text", "text": {"content": text}, "msgId": msg_id, "createAt": 1,
        "conversationType": conversation_type, "conversationId": "cid-group", "senderId": "$:LWCP:$user",
        "senderNick": "Ada", "senderStaffId": "staff-1", "chatbotUserId": "$:LWCP:$bot",
        "sessionWebhook": session, "sessionWebhookExpiredTime": expires, "robotCode": "ding-robot", "isInAtList": true})
}

impl TestApp {
    async fn dingtalk(&self, body: &Value, secret: &str, ts_ms: i64) -> reqwest::Response {
        let ts = ts_ms.to_string();
        self.http
            .post(format!("{}/webhooks/dingtalk", self.addr))
            .header("timestamp", &ts)
            .header("sign", assistd::channels::dingtalk::sign(secret, &ts))
            .json(body)
            .send()
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dingtalk_messages_are_verified_and_answered_by_session_webhook_or_robot_api() {
    let api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/robot/sendBySession"))
        .respond_with(
            ResponseTemplate::new(200).set_body_json(json!({"errcode": 0, "errmsg": "ok"})),
        )
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1.0/oauth2/accessToken"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"accessToken": "dt-token", "expireIn": 7200})),
        )
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path("/v1.0/robot/groupMessages/send"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"processQueryKey": "pqk-1"})))
        .mount(&api)
        .await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| {
        c.channels.dingtalk.enabled = true;
        c.channels.dingtalk.app_key = "dt-key".into();
        c.channels.dingtalk.app_secret = DT_SECRET.into();
        c.channels.dingtalk.robot_code = "ding-robot".into();
        c.channels.dingtalk.session_webhook_origins = vec![uri.clone()];
        c.channels.dingtalk.api_base_url = uri;
    })
    .await;
    let now_ms = assistd::domain::now_ms();
    let session = format!("{}/robot/sendBySession?session=s1", api.uri());
    let live = dingtalk_message("msg-1", "2", &session, now_ms + 3_600_000, " hello robot");
    assert_eq!(app.dingtalk(&live, "wrong", now_ms).await.status(), 401);
    assert_eq!(
        app.dingtalk(&live, DT_SECRET, now_ms - 3_601_000)
            .await
            .status(),
        401,
        "older than an hour"
    );
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    let id = task_id_of(app.dingtalk(&live, DT_SECRET, now_ms).await).await;
    let dup: Value = app
        .dingtalk(&live, DT_SECRET, now_ms)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(dup["duplicate"], true);
    app.wait_replied(id, WAIT).await;
    let session_sends = sends(&api, "/robot/sendBySession").await;
    assert_eq!(session_sends.len(), 1);
    assert_eq!(
        session_sends[0]["text"]["content"],
        "answer to: hello robot"
    );

    // An expired session webhook: the robot API answers instead.
    let expired = dingtalk_message("msg-2", "2", &session, now_ms - 1_000, "second question");
    let id2 = task_id_of(app.dingtalk(&expired, DT_SECRET, now_ms + 1).await).await;
    app.wait_replied(id2, WAIT).await;
    let robot: Vec<Request> = api
        .received_requests()
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.url.path() == "/v1.0/robot/groupMessages/send")
        .collect();
    assert_eq!(robot.len(), 1);
    assert_eq!(
        robot[0].headers.get("x-acs-dingtalk-access-token").unwrap(),
        "dt-token"
    );
    let body: Value = serde_json::from_slice(&robot[0].body).unwrap();
    assert_eq!(body["openConversationId"], "cid-group");
    assert_eq!(body["robotCode"], "ding-robot");
    let param: Value = serde_json::from_str(body["msgParam"].as_str().unwrap()).unwrap();
    assert_eq!(param["content"], "answer to: second question");

    // Attack (issue 17, item 2): DingTalk's sign covers only the timestamp, so a captured
    // header pair is replayed with a forged body whose sessionWebhook is the attacker's.
    let attacker = MockServer::start().await;
    let counts = app.store().intake_row_counts().await.unwrap();
    let forged = dingtalk_message(
        "msg-evil",
        "2",
        &format!("{}/steal", attacker.uri()),
        now_ms + 3_600_000,
        "forged question",
    );
    let replayed = app.dingtalk(&forged, DT_SECRET, now_ms).await;
    assert_eq!(replayed.status(), 401, "a used pair with another body");
    // The same forgery under a fresh pair fails on the session webhook's origin instead.
    let fresh = app.dingtalk(&forged, DT_SECRET, now_ms + 5).await;
    assert_eq!(fresh.status(), 400);
    let https_elsewhere = dingtalk_message(
        "msg-evil-2",
        "2",
        "https://evil.example/robot/sendBySession?session=x",
        now_ms + 3_600_000,
        "forged question",
    );
    assert_eq!(
        app.dingtalk(&https_elsewhere, DT_SECRET, now_ms + 6)
            .await
            .status(),
        400
    );
    assert_eq!(
        app.store().intake_row_counts().await.unwrap(),
        counts,
        "nothing written"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        attacker.received_requests().await.unwrap().is_empty(),
        "no reply to the attacker"
    );
    app.stop().await;
}

mod wecom_sample {
    pub const TOKEN: &str = "QDG6eK";
    pub const CORP: &str = "wx5823bf96d3bd56c7";
    pub const AES_KEY: &str = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C";
}

impl TestApp {
    async fn wecom_post(&self, xml_message: &str, token: &str) -> reqwest::Response {
        self.wecom_post_at(xml_message, token, now()).await
    }

    async fn wecom_post_at(&self, xml_message: &str, token: &str, ts: i64) -> reqwest::Response {
        use assistd::channels::wecom;
        let encrypted = wecom::encrypt(
            wecom_sample::AES_KEY,
            wecom_sample::CORP,
            xml_message,
            [3; 16],
        )
        .unwrap();
        let ts = ts.to_string();
        let sig = wecom::signature(token, &ts, "nonce9", &encrypted);
        let body = format!(
            "<xml><ToUserName><![CDATA[{}]]></ToUserName><Encrypt><![CDATA[{encrypted}]]></Encrypt><AgentID><![CDATA[1000002]]></AgentID></xml>",
            wecom_sample::CORP
        );
        self.http
            .post(format!(
                "{}/webhooks/wecom?msg_signature={sig}&timestamp={ts}&nonce=nonce9",
                self.addr
            ))
            .body(body)
            .send()
            .await
            .unwrap()
    }
}

/// A mock WeCom API: gettoken and message/send.
async fn wecom_api() -> MockServer {
    let api = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/cgi-bin/gettoken"))
        .respond_with(ResponseTemplate::new(200).set_body_json(
            json!({"errcode": 0, "errmsg": "ok", "access_token": "wc-token", "expires_in": 7200}),
        ))
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path("/cgi-bin/message/send"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"errcode": 0, "errmsg": "ok", "msgid": "m-1"})),
        )
        .mount(&api)
        .await;
    api
}

fn enable_wecom(c: &mut assistd::Config, api: &str, agent: &str) {
    c.channels.wecom.enabled = true;
    c.channels.wecom.corp_id = wecom_sample::CORP.into();
    c.channels.wecom.agent_id = "1000002".into();
    c.channels.wecom.secret = "app-secret".into();
    c.channels.wecom.token = wecom_sample::TOKEN.into();
    c.channels.wecom.encoding_aes_key = wecom_sample::AES_KEY.into();
    c.channels.wecom.api_base_url = api.into();
    c.channels.wecom.agent = agent.into();
}

fn wecom_text(msg_id: &str, text: &str) -> String {
    format!(
        "<xml><ToUserName><![CDATA[{}]]></ToUserName><FromUserName><![CDATA[zhangsan]]></FromUserName><CreateTime>1348831860</CreateTime><MsgType><![CDATA[text]]></MsgType><Content><![CDATA[{text}]]></Content><MsgId>{msg_id}</MsgId><AgentID>1000002</AgentID></xml>",
        wecom_sample::CORP
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wecom_callbacks_are_verified_decrypted_and_answered() {
    let api = wecom_api().await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| {
        enable_wecom(c, &uri, "default");
        // The documentation's known-answer request is from 2014.
        c.channels.wecom.timestamp_tolerance_secs = 20 * 365 * 86_400;
    })
    .await;
    // URL verification with the sample request of WeCom's documentation.
    let verify = app
        .http
        .get(format!(
            "{}/webhooks/wecom?msg_signature=5c45ff5e21c57e6ad56bac8758b79b1d9ac89fd3&timestamp=1409659589&nonce=263014780&echostr={}",
            app.addr,
            url::form_urlencoded::byte_serialize(b"P9nAzCzyDtyTWESHep1vC5X9xho/qYX3Zpb4yKa9SKld1DsH3Iyt3tP3zNdtp+4RPcs8TgAE7OaBO+FZXvnaqQ==").collect::<String>()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(verify.status(), 200);
    assert_eq!(verify.text().await.unwrap(), "1616140317555161061");

    assert_eq!(
        app.wecom_post(&wecom_text("1001", "hello"), "wrong-token")
            .await
            .status(),
        401
    );
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    let resp = app
        .wecom_post(
            &wecom_text("1001", "where is the canteen?"),
            wecom_sample::TOKEN,
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.text().await.unwrap(),
        "",
        "an empty answer, not a passive reply"
    );
    assert_eq!(
        app.wecom_post(
            &wecom_text("1001", "where is the canteen?"),
            wecom_sample::TOKEN
        )
        .await
        .status(),
        200
    );
    assert_eq!(
        app.store().intake_row_counts().await.unwrap().1,
        1,
        "deduplicated on MsgId"
    );
    let tasks: Value = app
        .list("conversation=zhangsan")
        .await
        .json()
        .await
        .unwrap();
    let id = tasks["tasks"][0]["id"].as_i64().unwrap();
    app.wait_replied(id, WAIT).await;
    let sent: Vec<Request> = api
        .received_requests()
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.url.path() == "/cgi-bin/message/send")
        .collect();
    assert_eq!(sent.len(), 1);
    assert!(
        sent[0]
            .url
            .query()
            .unwrap()
            .contains("access_token=wc-token")
    );
    let body: Value = serde_json::from_slice(&sent[0].body).unwrap();
    assert_eq!(body["touser"], "zhangsan");
    assert_eq!(body["agentid"], 1000002);
    assert_eq!(body["text"]["content"], "answer to: where is the canteen?");
    app.stop().await;
}

fn wecom_card_event(from: &str, key: &str) -> String {
    format!(
        "<xml><ToUserName><![CDATA[{}]]></ToUserName><FromUserName><![CDATA[{from}]]></FromUserName><CreateTime>1</CreateTime><MsgType><![CDATA[event]]></MsgType><Event><![CDATA[template_card_event]]></Event><EventKey><![CDATA[{key}]]></EventKey><TaskId><![CDATA[t1]]></TaskId><CardType><![CDATA[button_interaction]]></CardType><AgentID>1000002</AgentID></xml>",
        wecom_sample::CORP
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wecom_approvals_use_template_card_buttons() {
    let api = wecom_api().await;
    let uri = api.uri();
    let flow = spawn_flow_with(NOTICE, move |c| {
        enable_wecom(c, &uri, "flow");
        c.agents.get_mut("flow").unwrap().approvers = vec!["zhangsan".into()];
    })
    .await;
    let app = &flow.app;
    assert_eq!(
        app.wecom_post(&wecom_text("2001", "send the notice"), wecom_sample::TOKEN)
            .await
            .status(),
        200
    );
    let tasks: Value = app
        .list("conversation=zhangsan")
        .await
        .json()
        .await
        .unwrap();
    let id = tasks["tasks"][0]["id"].as_i64().unwrap();
    app.wait_task(id, WAIT, |t| {
        t["status"] == "WAITING_HUMAN_CONFIRM" && t["reply"]["status"] == "SENT"
    })
    .await;
    let sent: Value = serde_json::from_slice(
        &api.received_requests()
            .await
            .unwrap()
            .into_iter()
            .find(|r| r.url.path() == "/cgi-bin/message/send")
            .unwrap()
            .body,
    )
    .unwrap();
    assert_eq!(sent["msgtype"], "template_card");
    let key = sent["template_card"]["button_list"][0]["key"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(key.starts_with(&format!("approve:{id}:")), "{key}");
    assert_eq!(
        app.wecom_post(&wecom_card_event("wangwu", &key), wecom_sample::TOKEN)
            .await
            .status(),
        200
    );
    assert_eq!(
        app.get_task(id).await["status"],
        "WAITING_HUMAN_CONFIRM",
        "not an approver"
    );
    assert_eq!(
        app.wecom_post(&wecom_card_event("zhangsan", &key), wecom_sample::TOKEN)
            .await
            .status(),
        200
    );
    app.wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    flow.app.stop().await;
}

/// A Matrix homeserver stand-in: room sends answer with `event_id` (the approval request
/// gets `$approval`), joins succeed.
pub(crate) async fn matrix_homeserver() -> MockServer {
    use wiremock::matchers::path_regex;
    let hs = MockServer::start().await;
    Mock::given(method("PUT"))
        .and(path_regex(
            r"^/_matrix/client/v3/rooms/.*/send/m\.room\.message/.*-confirm-.*$",
        ))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"event_id": "$approval"})))
        .with_priority(1)
        .mount(&hs)
        .await;
    Mock::given(method("PUT"))
        .and(path_regex(
            r"^/_matrix/client/v3/rooms/.*/send/m\.room\.message/.*$",
        ))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"event_id": "$reply"})))
        .with_priority(5)
        .mount(&hs)
        .await;
    hs
}

impl TestApp {
    pub(crate) async fn matrix_txn(&self, txn: &str, events: Value) -> reqwest::Response {
        self.http
            .put(format!(
                "{}/webhooks/matrix/_matrix/app/v1/transactions/{txn}",
                self.addr
            ))
            .bearer_auth(HS_TOKEN)
            .json(&json!({ "events": events }))
            .send()
            .await
            .unwrap()
    }
}

fn matrix_reaction(event_id: &str, sender: &str, target: &str, key: &str) -> Value {
    json!({"type": "m.reaction", "room_id": "!r:hs", "sender": sender, "event_id": event_id,
           "content": {"m.relates_to": {"rel_type": "m.annotation", "event_id": target, "key": key}}})
}

/// A workflow agent answering Matrix whose approver is @boss:hs, asked to send a notice:
/// returns the homeserver, the flow, the task (waiting for approval, request sent) and the
/// approval request's event content.
async fn matrix_waiting_for_approval() -> (MockServer, crate::workflows::Flow, i64, Value) {
    let hs = matrix_homeserver().await;
    let uri = hs.uri();
    let flow = spawn_flow_with(NOTICE, move |c| {
        enable_matrix(c, &uri);
        c.channels.matrix.agent = "flow".into();
        c.agents.get_mut("flow").unwrap().approvers = vec!["@boss:hs".into()];
    })
    .await;
    let app = &flow.app;
    let question = json!([{"type": "m.room.message", "room_id": "!r:hs", "sender": "@ada:hs",
        "event_id": "$q", "content": {"msgtype": "m.text", "body": "send the notice"}}]);
    assert_eq!(app.matrix_txn("t1", question).await.status(), 200);
    let tasks: Value = app.list("conversation=!r:hs").await.json().await.unwrap();
    let id = tasks["tasks"][0]["id"].as_i64().unwrap();
    app.wait_task(id, WAIT, |t| {
        t["status"] == "WAITING_HUMAN_CONFIRM" && t["reply"]["status"] == "SENT"
    })
    .await;
    let request = hs
        .received_requests()
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.url.path().contains("-confirm-"))
        .expect("the approval request was sent");
    let body: Value = serde_json::from_slice(&request.body).unwrap();
    (hs, flow, id, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_approvals_are_decided_by_reactions_of_approvers() {
    let (_hs, flow, id, body) = matrix_waiting_for_approval().await;
    let app = &flow.app;
    assert_eq!(body["format"], "org.matrix.custom.html");
    assert!(
        body["body"].as_str().unwrap().contains("React with ✅"),
        "{body}"
    );
    assert_eq!(body["org.assistd.approval"]["task_id"], id);
    assert_eq!(body["m.relates_to"]["m.in_reply_to"]["event_id"], "$q");

    // Reactions by someone who may not approve, or to another event, decide nothing.
    let not_approver = json!([matrix_reaction("$x1", "@intern:hs", "$approval", "✅")]);
    assert_eq!(app.matrix_txn("t2", not_approver).await.status(), 200);
    let elsewhere = json!([matrix_reaction("$x2", "@boss:hs", "$q", "✅")]);
    assert_eq!(app.matrix_txn("t3", elsewhere).await.status(), 200);
    assert_eq!(app.get_task(id).await["status"], "WAITING_HUMAN_CONFIRM");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);

    // The approver's ✅ (with the variation selector some clients add) approves.
    let approve = json!([matrix_reaction(
        "$x3",
        "@boss:hs",
        "$approval",
        "\u{2705}\u{fe0f}"
    )]);
    assert_eq!(app.matrix_txn("t4", approve).await.status(), 200);
    app.wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_approvals_can_be_rejected_by_command() {
    let (_hs, flow, id, body) = matrix_waiting_for_approval().await;
    let app = &flow.app;
    let step = body["org.assistd.approval"]["step_no"].as_i64().unwrap();
    let reject = json!([{"type": "m.room.message", "room_id": "!r:hs", "sender": "@boss:hs",
        "event_id": "$cmd", "content": {"msgtype": "m.text", "body": format!("reject {id}.{step}")}}]);
    assert_eq!(app.matrix_txn("t2", reject).await.status(), 200);
    app.wait_task(id, WAIT, |t| t["status"] == "CANCELLED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    assert_eq!(
        app.store().intake_row_counts().await.unwrap().1,
        1,
        "the command is a decision, not a new question"
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dingtalk_approvals_use_action_cards_answered_by_command() {
    let api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/robot/sendBySession"))
        .respond_with(
            ResponseTemplate::new(200).set_body_json(json!({"errcode": 0, "errmsg": "ok"})),
        )
        .mount(&api)
        .await;
    let uri = api.uri();
    let flow = spawn_flow_with(NOTICE, move |c| {
        c.channels.dingtalk.enabled = true;
        c.channels.dingtalk.app_secret = DT_SECRET.into();
        c.channels.dingtalk.session_webhook_origins = vec![uri.clone()];
        c.channels.dingtalk.api_base_url = uri;
        c.channels.dingtalk.agent = "flow".into();
        c.agents.get_mut("flow").unwrap().approvers = vec!["staff-boss".into()];
    })
    .await;
    let app = &flow.app;
    let now_ms = assistd::domain::now_ms();
    let session = format!("{}/robot/sendBySession?session=s1", api.uri());
    let ask = dingtalk_message(
        "msg-1",
        "2",
        &session,
        now_ms + 3_600_000,
        "send the notice",
    );
    let id = task_id_of(app.dingtalk(&ask, DT_SECRET, now_ms).await).await;
    app.wait_task(id, WAIT, |t| {
        t["status"] == "WAITING_HUMAN_CONFIRM" && t["reply"]["status"] == "SENT"
    })
    .await;
    let sent = sends(&api, "/robot/sendBySession").await;
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["msgtype"], "actionCard");
    let approve_url = sent[0]["actionCard"]["btns"][0]["actionURL"]
        .as_str()
        .unwrap()
        .to_string();
    let prefix = format!("dtmd://dingtalkclient/sendMessage?content=approve%20{id}.");
    assert!(approve_url.starts_with(&prefix), "{approve_url}");
    let step = approve_url.strip_prefix(&prefix).unwrap();
    let text = sent[0]["actionCard"]["text"].as_str().unwrap();
    assert!(
        text.contains(&format!("[Approve]({approve_url})")),
        "{text}"
    );
    let command = format!("approve {id}.{step}");

    // The command from someone who may not approve is refused; from the approver it approves.
    let by = |msg: &str, staff: &str| {
        let mut m = dingtalk_message(msg, "2", &session, now_ms + 3_600_000, &command);
        m["senderStaffId"] = json!(staff);
        m
    };
    let denied: Value = app
        .dingtalk(&by("msg-2", "staff-intern"), DT_SECRET, now_ms + 1)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(denied["result"], "you may not decide this request");
    // Attack: the approver's earlier header pair (the request that asked) replayed with a
    // forged decision is refused, and decides nothing.
    let replayed = app
        .dingtalk(&by("msg-forged", "staff-boss"), DT_SECRET, now_ms)
        .await;
    assert_eq!(replayed.status(), 401);
    assert_eq!(app.get_task(id).await["status"], "WAITING_HUMAN_CONFIRM");
    let ok: Value = app
        .dingtalk(&by("msg-3", "staff-boss"), DT_SECRET, now_ms + 2)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(ok["result"], "approved");
    app.wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    assert_eq!(app.store().intake_row_counts().await.unwrap().1, 1);
    flow.app.stop().await;
}

/// Records when each request arrived.
#[derive(Clone, Default)]
struct Arrivals(std::sync::Arc<std::sync::Mutex<Vec<(std::time::Instant, Value)>>>);

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
async fn telegram_with_arrivals(
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
                &tg_update(100 + i, -7, 10 + i, 42, &format!("q{i}")),
                Some(TG_SECRET),
            )
            .await;
        ids.push(task_id_of(resp).await);
    }
    let quiet = task_id_of(
        app.telegram(&tg_update(200, -8, 1, 43, "quiet chat"), Some(TG_SECRET))
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
                &tg_update(300 + i, -7, 30 + i, 42, &format!("q{i}")),
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
        app.telegram(&tg_update(400, -8, 1, 43, "quiet chat"), Some(TG_SECRET))
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

/// Attack (issue 17, item 1): every platform's send fails (its API is a closed port), and
/// the configured secrets must appear nowhere an operator or an attacker with API access
/// looks: the task API, the admin task page, and the log. Before, reqwest's error text
/// carried the request URL, so the Telegram bot token (in the Bot API path) and WeCom's
/// corp secret (in gettoken's query) were shown, stored and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_sends_on_every_platform_show_and_log_no_secret() {
    let _ = captured_log();
    const DEAD: &str = "http://127.0.0.1:9";
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        enable_platforms(c, DEAD, "default");
        enable_lark(c, DEAD, "default");
        enable_wecom(c, DEAD, "default");
        c.channels.telegram.bot_token = "7000123456:AAsecretTelegramBotTokenValue_0123456".into();
        c.channels.slack.bot_token = "xoxb-secret-slack-bot-token-value".into();
        c.channels.lark.app_secret = "lark-app-secret-value-0123".into();
        c.channels.wecom.secret = "wecom-corp-secret-value-0123".into();
        c.channels.dingtalk.enabled = true;
        c.channels.dingtalk.app_key = "dt-key".into();
        c.channels.dingtalk.app_secret = DT_SECRET.into();
        c.channels.dingtalk.robot_code = "ding-robot".into();
        c.channels.dingtalk.session_webhook_origins = vec![DEAD.to_string()];
        c.channels.dingtalk.api_base_url = DEAD.into();
        enable_matrix(c, DEAD);
        c.channels.matrix.as_token = "matrix-as-token-secret-value".into();
        c.outbox.max_attempts = 0;
    })
    .await;
    let cfg = app.config.clone();
    let ch = &cfg.channels;
    let secrets = [
        ch.telegram.bot_token.as_str(),
        ch.telegram.secret_token.as_str(),
        ch.slack.bot_token.as_str(),
        ch.slack.signing_secret.as_str(),
        ch.lark.app_secret.as_str(),
        ch.lark.encrypt_key.as_str(),
        ch.lark.verification_token.as_str(),
        ch.wecom.secret.as_str(),
        ch.wecom.encoding_aes_key.as_str(),
        ch.dingtalk.app_secret.as_str(),
        ch.matrix.as_token.as_str(),
        ch.matrix.hs_token.as_str(),
        // The telegram token's secret half, in case only the id is cut.
        "AAsecretTelegramBotTokenValue_0123456",
    ];
    // One message from each platform.
    assert_eq!(
        app.telegram(
            &tg_update(1, -100, 1, 42, "@helper_bot hi"),
            Some(TG_SECRET)
        )
        .await
        .status(),
        200
    );
    let mention = json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> hi", "ts": "1700.0001", "channel": "C1"});
    assert_eq!(
        app.slack_event(&slack_event("Ev1", mention)).await.status(),
        200
    );
    assert_eq!(
        app.lark(
            "/webhooks/lark",
            &lark_message("ev-l1", "om_1", "user", "@_user_1 hi"),
            LARK_KEY,
            now()
        )
        .await
        .status(),
        200
    );
    assert_eq!(
        app.wecom_post(&wecom_text("9001", "hi"), wecom_sample::TOKEN)
            .await
            .status(),
        200
    );
    let session = format!("{DEAD}/robot/sendBySession?session=dt-session-secret");
    let now_ms = assistd::domain::now_ms();
    let dt = dingtalk_message("dt-1", "2", &session, now_ms + 3_600_000, " hi");
    assert_eq!(app.dingtalk(&dt, DT_SECRET, now_ms).await.status(), 200);
    let mx = json!([{"type": "m.room.message", "room_id": "!s:hs", "sender": "@ada:hs", "event_id": "$s1",
        "origin_server_ts": 1, "content": {"msgtype": "m.text", "body": "@assistd:hs: hi"}}]);
    assert_eq!(app.matrix_txn("t-secrets", mx).await.status(), 200);

    // Every platform's reply fails at least once, with an error recorded.
    let listed: Value = app.list("limit=50").await.json().await.unwrap();
    let ids: Vec<i64> = listed["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids.len(), 6, "{listed:#}");
    let http = crate::admin_pages::browser();
    let cookie = crate::admin_pages::sign_in(&app, &http).await;
    let mut channels = Vec::new();
    for id in ids {
        let task = app
            .wait_task(id, WAIT, |t| t["reply"]["last_error"].is_string())
            .await;
        channels.push(task["channel"].as_str().unwrap_or("?").to_string());
        let page = http
            .get(format!("{}/admin/tasks/{id}", app.addr))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let shown = format!("{task}\n{page}");
        for secret in secrets {
            assert!(
                !shown.contains(secret),
                "task {id} shows a secret ({secret}): {task:#}"
            );
        }
        assert!(
            !shown.contains("127.0.0.1:9/"),
            "a request URL is shown: {task:#}"
        );
    }
    channels.sort();
    assert_eq!(
        channels,
        ["dingtalk", "lark", "matrix", "slack", "telegram", "wecom"]
    );
    let log = captured_log();
    assert!(
        log.contains("reply delivery failed"),
        "the failures were logged"
    );
    for secret in secrets {
        assert!(!log.contains(secret), "the log holds a secret ({secret})");
    }
    app.stop().await;
}

/// Attack (issue 17, item 5): Lark used to decrypt before it verified, answering 400 or 401
/// by the ciphertext's padding (an oracle), and card callbacks had no timestamp window. Now
/// every unsigned request gets one identical 401, a bad signature is refused before any
/// decryption, and a stale card callback is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_refuses_unsigned_and_stale_requests_alike() {
    use base64::Engine;
    let api = lark_api().await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| enable_lark(c, &uri, "default")).await;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    // Bad padding, good padding around non-JSON, and a well-formed event: all unsigned.
    let bad_padding = json!({ "encrypt": b64(&[7u8; 48]) });
    let plain_text = {
        use aes::cipher::{BlockEncryptMut, KeyIvInit, block_padding::Pkcs7};
        use sha2::Digest;
        let key = sha2::Sha256::digest(LARK_KEY.as_bytes());
        let iv = [1u8; 16];
        let ct = cbc::Encryptor::<aes::Aes256>::new(key.as_slice().into(), &iv.into())
            .encrypt_padded_vec_mut::<Pkcs7>(b"definitely { not json");
        let mut data = iv.to_vec();
        data.extend(ct);
        json!({ "encrypt": b64(&data) })
    };
    let event = lark_encrypt(&lark_message("ev-u", "om_u", "user", "@_user_1 hi"));
    let mut answers = Vec::new();
    for (route, body) in [
        ("/webhooks/lark", &bad_padding),
        ("/webhooks/lark", &plain_text),
        ("/webhooks/lark", &event),
        ("/webhooks/lark/card", &bad_padding),
        ("/webhooks/lark/card", &plain_text),
    ] {
        let resp = app
            .http
            .post(format!("{}{route}", app.addr))
            .json(body)
            .send()
            .await
            .unwrap();
        answers.push((resp.status().as_u16(), resp.text().await.unwrap()));
    }
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:#?}");
    assert_eq!(answers[0].0, 401);
    // Signed with the wrong key around bad padding: refused on the signature, not decrypted.
    let resp = app
        .lark("/webhooks/lark", &json!({}), "wrong-key", now())
        .await;
    assert_eq!(resp.status(), 401);
    let body = serde_json::to_vec(&bad_padding).unwrap();
    let ts = now().to_string();
    let sig = assistd::channels::lark::signature(&ts, "n", "wrong-key", &body);
    let resp = app
        .http
        .post(format!("{}/webhooks/lark", app.addr))
        .header("content-type", "application/json")
        .header("X-Lark-Request-Timestamp", ts)
        .header("X-Lark-Request-Nonce", "n")
        .header("X-Lark-Signature", sig)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert!(resp.text().await.unwrap().contains("signature"));
    // A card callback signed correctly but an hour old.
    let action = json!({"schema": "2.0", "header": {"event_id": "ev-c", "event_type": "card.action.trigger", "token": LARK_TOKEN},
        "event": {"operator": {"open_id": "ou_boss"}, "action": {"value": {"task_id": 1, "step_no": 1, "decision": "approve"}}}});
    let stale = app
        .lark("/webhooks/lark/card", &action, LARK_KEY, now() - 3_600)
        .await;
    assert_eq!(stale.status(), 401);
    assert_eq!(app.store().intake_row_counts().await.unwrap(), (0, 0, 0));
    app.stop().await;
}

/// Attack (issue 17, item 9): WeCom XML was read by string search, so a `<MsgId>` inside the
/// message text chose the dedupe key (a later, different message was dropped as its
/// duplicate), and the callback timestamp was not checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wecom_fields_come_from_the_xml_structure_and_stale_callbacks_are_refused() {
    let api = wecom_api().await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| enable_wecom(c, &uri, "default")).await;
    let posing = |msg_id: &str| {
        format!(
            "<xml><ToUserName><![CDATA[{}]]></ToUserName><FromUserName><![CDATA[zhangsan]]></FromUserName><CreateTime>1348831860</CreateTime><MsgType><![CDATA[text]]></MsgType><Content><![CDATA[look <MsgId>1</MsgId>]]></Content><MsgId>{msg_id}</MsgId><AgentID>1000002</AgentID></xml>",
            wecom_sample::CORP
        )
    };
    let mut ids = Vec::new();
    for msg_id in ["7001", "7002"] {
        let resp = app.wecom_post(&posing(msg_id), wecom_sample::TOKEN).await;
        assert_eq!(resp.status(), 200);
        ids.push(
            app.list("conversation=zhangsan")
                .await
                .json::<Value>()
                .await
                .unwrap()["tasks"]
                .as_array()
                .unwrap()
                .len(),
        );
    }
    assert_eq!(ids, [1, 2], "two messages, two tasks");
    let stale = app
        .wecom_post_at(
            &wecom_text("7003", "old"),
            wecom_sample::TOKEN,
            now() - 3_600,
        )
        .await;
    assert_eq!(stale.status(), 401);
    app.stop().await;
}
