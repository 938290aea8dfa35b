//! Feedback while a task runs (issue 20, item 1, part): the platform's typing indicator,
//! against doubles that refuse what the real APIs refuse.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path_regex};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use super::*;

/// Telegram `sendChatAction` as the Bot API documents it: `chat_id` (integer or string)
/// and `action` (one of the listed kinds) are required; the answer is `{"ok": true,
/// "result": true}`, or 400 with a description.
pub(crate) struct TelegramChatAction;

const ACTIONS: [&str; 11] = [
    "typing",
    "upload_photo",
    "record_video",
    "upload_video",
    "record_voice",
    "upload_voice",
    "upload_document",
    "choose_sticker",
    "find_location",
    "record_video_note",
    "upload_video_note",
];

impl Respond for TelegramChatAction {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let chat_ok =
            body["chat_id"].is_i64() || body["chat_id"].as_str().is_some_and(|c| !c.is_empty());
        let action_ok = body["action"]
            .as_str()
            .is_some_and(|a| ACTIONS.contains(&a));
        if chat_ok && action_ok {
            ResponseTemplate::new(200).set_body_json(json!({"ok": true, "result": true}))
        } else {
            ResponseTemplate::new(400).set_body_json(json!({
                "ok": false, "error_code": 400,
                "description": "Bad Request: chat_id and a valid action are required"
            }))
        }
    }
}

/// Matrix `PUT /rooms/{roomId}/typing/{userId}` as the client-server API documents it:
/// only the authenticated user's own typing state (else 403 M_FORBIDDEN), `typing` a
/// boolean, `timeout` an integer when given.
struct MatrixTyping;

impl Respond for MatrixTyping {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let authorised = request
            .headers
            .get("authorization")
            .is_some_and(|v| v.to_str().unwrap_or("") == "Bearer as-token");
        if !authorised {
            return ResponseTemplate::new(401)
                .set_body_json(json!({"errcode": "M_UNKNOWN_TOKEN", "error": "unknown token"}));
        }
        if !request.url.path().ends_with("/typing/%40assistd%3Ahs") {
            return ResponseTemplate::new(403).set_body_json(
                json!({"errcode": "M_FORBIDDEN", "error": "Cannot set another user's typing state"}),
            );
        }
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let timeout_ok = body.get("timeout").is_none_or(Value::is_u64);
        if !body["typing"].is_boolean() || !timeout_ok {
            return ResponseTemplate::new(400).set_body_json(
                json!({"errcode": "M_BAD_JSON", "error": "typing must be a boolean"}),
            );
        }
        ResponseTemplate::new(200).set_body_json(json!({}))
    }
}

/// A model that takes `delay` to answer.
async fn slow_model(delay: Duration) -> MockServer {
    let model = MockServer::start().await;
    model_mock(move |_: &Value| ModelReply::text("slow answer").delayed(delay))
        .mount(&model)
        .await;
    model
}

/// The paths the platform API was called on, in order.
async fn calls(api: &MockServer) -> Vec<String> {
    api.received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.url.path().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_shows_typing_while_the_answer_is_prepared_then_answers_once() {
    let api = platform_api().await;
    let uri = api.uri();
    let app = TestApp::spawn_with(
        slow_model(Duration::from_millis(4500)).await,
        accepting_receiver().await,
        move |c| enable_platforms(c, &uri, "default"),
    )
    .await;
    let id = task_id_of(
        app.telegram(
            &tg_update(1, -100, 5, 42, "@helper_bot slow question"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    // Feedback within a second, long before the answer.
    let typing = wait_sends(&api, &format!("/bot{TG_TOKEN}/sendChatAction"), 1).await;
    assert_eq!(typing[0], json!({"chat_id": "-100", "action": "typing"}));
    assert!(
        sends(&api, &format!("/bot{TG_TOKEN}/sendMessage"))
            .await
            .is_empty()
    );
    app.wait_replied(id, WAIT).await;
    let order = calls(&api).await;
    let first_send = order
        .iter()
        .position(|p| p.ends_with("/sendMessage"))
        .unwrap();
    let typings: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, p)| p.ends_with("/sendChatAction"))
        .map(|(i, _)| i)
        .collect();
    // Renewed every 4 s while the 4.5 s call ran (it fades after 5 s), all before the answer.
    assert!(typings.len() >= 2, "{order:?}");
    assert!(typings.iter().all(|&i| i < first_send), "{order:?}");
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert_eq!(
        sends(&api, &format!("/bot{TG_TOKEN}/sendChatAction"))
            .await
            .len(),
        typings.len(),
        "no typing once the run is over"
    );
    assert_eq!(
        sends(&api, &format!("/bot{TG_TOKEN}/sendMessage"))
            .await
            .len(),
        1
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typing_indicator_can_be_switched_off() {
    let api = platform_api().await;
    let uri = api.uri();
    let app = TestApp::spawn_with(
        slow_model(Duration::from_millis(500)).await,
        accepting_receiver().await,
        move |c| {
            enable_platforms(c, &uri, "default");
            c.replies.typing_indicator = false;
        },
    )
    .await;
    let id = task_id_of(
        app.telegram(
            &tg_update(2, -101, 6, 42, "@helper_bot question"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    app.wait_replied(id, WAIT).await;
    assert!(
        sends(&api, &format!("/bot{TG_TOKEN}/sendChatAction"))
            .await
            .is_empty()
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_shows_the_bot_typing_and_clears_it_when_the_run_ends() {
    let hs = matrix_homeserver().await;
    Mock::given(method("PUT"))
        .and(path_regex(r"^/_matrix/client/v3/rooms/.*/typing/.*$"))
        .respond_with(MatrixTyping)
        .mount(&hs)
        .await;
    let uri = hs.uri();
    let app = TestApp::spawn_with(
        slow_model(Duration::from_millis(800)).await,
        accepting_receiver().await,
        move |c| enable_matrix(c, &uri),
    )
    .await;
    let resp = app
        .matrix_txn(
            "typing-1",
            json!([{"type": "m.room.message", "room_id": "!r:hs", "sender": "@ada:hs",
                    "event_id": "$q-typing", "origin_server_ts": 1,
                    "content": {"msgtype": "m.text", "body": "@assistd:hs: slow question"}}]),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let deadline = std::time::Instant::now() + WAIT;
    let typing = loop {
        let typing: Vec<(String, Value)> = hs
            .received_requests()
            .await
            .unwrap()
            .iter()
            .filter(|r| r.url.path().contains("/typing/"))
            .map(|r| {
                (
                    r.url.path().to_string(),
                    serde_json::from_slice(&r.body).unwrap_or(Value::Null),
                )
            })
            .collect();
        if typing.len() >= 2 {
            break typing;
        }
        assert!(std::time::Instant::now() < deadline, "{typing:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        typing[0].0,
        "/_matrix/client/v3/rooms/%21r%3Ahs/typing/%40assistd%3Ahs"
    );
    assert_eq!(typing[0].1, json!({"typing": true, "timeout": 30000}));
    assert_eq!(typing[1].1, json!({"typing": false}));
    // The run ends (typing cleared) before the outbox delivers the answer: wait for it.
    let room_sends = || async {
        hs.received_requests()
            .await
            .unwrap()
            .iter()
            .filter(|r| r.url.path().contains("/send/m.room.message/"))
            .map(|r| r.url.path().to_string())
            .collect::<Vec<String>>()
    };
    while room_sends().await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "no answer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sends = room_sends().await;
    assert_eq!(sends.len(), 1, "{sends:?}");
    app.stop().await;
}
