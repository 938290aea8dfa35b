//! Matrix: authorised, idempotent transactions; approvals by reaction and by command.

use serde_json::{Value, json};
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use super::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

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
    mount_room_sends(&hs).await;
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
        .filter(|r| r.method.as_str() == "PUT" && r.url.path().contains("/send/"))
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
    mount_room_sends(&hs).await;
    hs
}

/// The room-send double (`chat_doubles::MatrixRoomSends`) and the room-state double
/// (`chat_doubles::MatrixRooms`) on `hs`, below any more specific mock (priorities 5, 6).
/// The rooms the tests write in (`!r:hs`, `!room:hs`, `!s:hs`, `!nul:hs`, `!batch:hs`) are
/// direct chats with @ada:hs; returns the room state, for tests that make other rooms.
pub(crate) async fn mount_room_sends(hs: &MockServer) -> super::chat_doubles::MatrixRooms {
    use wiremock::matchers::path_regex;
    let sends = super::chat_doubles::MatrixRoomSends::default();
    let rooms = super::chat_doubles::MatrixRooms::new(&sends);
    for room in ["!r:hs", "!room:hs", "!s:hs", "!nul:hs", "!batch:hs"] {
        rooms.room(room, &["@ada:hs"], Some("@ada:hs"));
    }
    Mock::given(method("PUT"))
        .and(path_regex(
            r"^/_matrix/client/v3/rooms/.*/send/m\.room\.message/.*$",
        ))
        .respond_with(sends)
        .with_priority(5)
        .mount(hs)
        .await;
    Mock::given(path_regex(
        r"^/_matrix/client/v3/(rooms/[^/]+/(joined_members|join|event/[^/]+)|user/[^/]+/account_data/m\.direct)$",
    ))
    .respond_with(rooms.clone())
    .with_priority(6)
    .mount(hs)
    .await;
    rooms
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

pub(crate) fn matrix_reaction(event_id: &str, sender: &str, target: &str, key: &str) -> Value {
    json!({"type": "m.reaction", "room_id": "!r:hs", "sender": sender, "event_id": event_id,
           "content": {"m.relates_to": {"rel_type": "m.annotation", "event_id": target, "key": key}}})
}

/// A workflow agent answering Matrix whose approver is @boss:hs, asked to send a notice:
/// returns the homeserver, the flow, the task (waiting for approval, request sent) and the
/// approval request's event content.
pub(crate) async fn matrix_waiting_for_approval() -> (MockServer, crate::workflows::Flow, i64, Value)
{
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
    let request = body["org.assistd.approval"]["request"].as_str().unwrap();
    assert!(request.starts_with(&format!("{id}.")), "{request}");
    let reject = json!([{"type": "m.room.message", "room_id": "!r:hs", "sender": "@boss:hs",
        "event_id": "$cmd", "content": {"msgtype": "m.text", "body": format!("reject {request}")}}]);
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
