//! DingTalk: signed messages answered by session webhook or robot API, the replay guard, action-card approvals.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use super::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

pub(crate) const DT_SECRET: &str = "dt-app-secret";

pub(crate) fn dingtalk_message(
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

/// Enables DingTalk against `api` (its API and session webhooks) with the test app's keys.
pub(crate) fn enable_dingtalk(c: &mut assistd::Config, api: &str) {
    c.channels.dingtalk.enabled = true;
    c.channels.dingtalk.app_key = "dt-key".into();
    c.channels.dingtalk.app_secret = DT_SECRET.into();
    c.channels.dingtalk.robot_code = "ding-robot".into();
    c.channels.dingtalk.session_webhook_origins = vec![api.to_string()];
    c.channels.dingtalk.api_base_url = api.to_string();
}

/// The session webhook double (`chat_doubles::TextLengthLimit::dingtalk_session`) on `api`.
pub(crate) async fn mount_dingtalk_session(api: &MockServer) {
    Mock::given(method("POST"))
        .and(path("/robot/sendBySession"))
        .respond_with(super::chat_doubles::TextLengthLimit::dingtalk_session())
        .mount(api)
        .await;
}

impl TestApp {
    pub(crate) async fn dingtalk(
        &self,
        body: &Value,
        secret: &str,
        ts_ms: i64,
    ) -> reqwest::Response {
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
    mount_dingtalk_session(&api).await;
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
        enable_dingtalk(c, &uri);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dingtalk_approvals_use_action_cards_answered_by_command() {
    let api = MockServer::start().await;
    mount_dingtalk_session(&api).await;
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
