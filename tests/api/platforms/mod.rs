//! The chat platforms against mock platform APIs speaking their wire formats, one file per
//! platform (plus pacing and secrets across them); this file holds their shared setup.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::helpers::*;

mod chat_doubles;
mod dingtalk;
pub(crate) mod groups;
mod lark;
mod long_answers;
mod markdown;
pub(crate) mod matrix;
mod pacing;
mod placeholders;
mod scopes;
mod sdk_inputs;
mod secrets;
mod slack;
mod streamed;
mod synapse;
mod telegram;
mod typing;
mod wecom;

pub(crate) use dingtalk::*;
pub(crate) use lark::*;
pub(crate) use matrix::*;
pub(crate) use wecom::*;

pub(crate) const TG_TOKEN: &str = "123:ABC";
pub(crate) const TG_SECRET: &str = "tg-secret";
pub(crate) const SLACK_SECRET: &str = "slack-signing-secret";

pub(crate) async fn platform_api() -> MockServer {
    let api = MockServer::start().await;
    let telegram = chat_doubles::TelegramMessages::default();
    for call in ["sendMessage", "editMessageText"] {
        Mock::given(method("POST"))
            .and(path(format!("/bot{TG_TOKEN}/{call}")))
            .respond_with(telegram.clone())
            .with_priority(5)
            .mount(&api)
            .await;
    }
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/sendChatAction")))
        .respond_with(typing::TelegramChatAction)
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/answerCallbackQuery")))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"ok": true, "result": true})))
        .mount(&api)
        .await;
    let slack = chat_doubles::SlackMessages::default();
    for call in ["/chat.postMessage", "/chat.update"] {
        Mock::given(method("POST"))
            .and(path(call))
            .respond_with(slack.clone())
            .with_priority(5)
            .mount(&api)
            .await;
    }
    for call in ["/conversations.replies", "/conversations.history"] {
        Mock::given(method("GET"))
            .and(path(call))
            .respond_with(slack.clone())
            .with_priority(5)
            .mount(&api)
            .await;
    }
    api
}

pub(crate) fn enable_platforms(c: &mut assistd::Config, api: &str, agent: &str) {
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

/// The JSON bodies `api` received at paths matching `pattern` (a regex), in order.
pub(crate) async fn requests_to(api: &MockServer, pattern: &str) -> Vec<Value> {
    let re = regex::Regex::new(pattern).unwrap();
    api.received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| re.is_match(r.url.path()))
        .map(|r| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
        .collect()
}

pub(crate) fn tg_update(
    update_id: i64,
    chat: i64,
    message_id: i64,
    from: i64,
    text: &str,
) -> Value {
    json!({"update_id": update_id, "message": {
        "message_id": message_id, "date": 1,
        "from": {"id": from, "is_bot": false, "first_name": "Ada", "username": "ada"},
        // As on Telegram: a private chat's id is the user's (positive), a group's negative.
        "chat": {"id": chat, "type": if chat > 0 { "private" } else { "group" }}, "text": text}})
}

impl TestApp {
    pub(crate) async fn telegram(&self, body: &Value, secret: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}/webhooks/telegram", self.addr))
            .json(body);
        if let Some(s) = secret {
            req = req.header("X-Telegram-Bot-Api-Secret-Token", s);
        }
        req.send().await.unwrap()
    }

    pub(crate) async fn slack(
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

pub(crate) fn now() -> i64 {
    assistd::domain::now_ms() / 1000
}

pub(crate) async fn sends(api: &MockServer, p: &str) -> Vec<Value> {
    api.received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path() == p)
        .map(|r: &Request| serde_json::from_slice(&r.body).unwrap_or(Value::Null))
        .collect()
}

pub(crate) async fn wait_sends(api: &MockServer, p: &str, n: usize) -> Vec<Value> {
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
