//! Lark/Feishu: encrypted, signed events; interactive-card approvals; unsigned and stale requests refused.

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use super::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

pub(crate) const LARK_KEY: &str = "lark-encrypt-key";
pub(crate) const LARK_TOKEN: &str = "lark-verification-token";

pub(crate) fn lark_encrypt(plain: &Value) -> Value {
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

pub(crate) fn lark_message(
    event_id: &str,
    message_id: &str,
    sender_type: &str,
    text: &str,
) -> Value {
    json!({"schema": "2.0", "header": {"event_id": event_id, "event_type": "im.message.receive_v1",
        "create_time": "1", "token": LARK_TOKEN, "app_id": "cli_x", "tenant_key": "t"},
        "event": {"sender": {"sender_id": {"open_id": "ou_user"}, "sender_type": sender_type},
            "message": {"message_id": message_id, "chat_id": "oc_chat", "chat_type": "group", "message_type": "text",
                "content": json!({"text": text}).to_string(),
                "mentions": [{"key": "@_user_1", "name": "bot"}]}}})
}

impl TestApp {
    pub(crate) async fn lark(
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

pub(crate) async fn lark_api() -> MockServer {
    let api = MockServer::start().await;
    mount_lark(&api).await;
    api
}

/// The Lark Open API doubles (token, replies, card updates) on `api`.
pub(crate) async fn mount_lark(api: &MockServer) {
    use wiremock::matchers::path_regex;
    Mock::given(method("POST"))
        .and(path("/open-apis/auth/v3/tenant_access_token/internal"))
        .respond_with(ResponseTemplate::new(200).set_body_json(
            json!({"code": 0, "msg": "ok", "tenant_access_token": "t-abc", "expire": 7200}),
        ))
        .mount(api)
        .await;
    let messages = super::chat_doubles::LarkMessages::default();
    Mock::given(method("POST"))
        .and(path_regex(r"^/open-apis/im/v1/messages/[^/]+/reply$"))
        .respond_with(messages.clone())
        .mount(api)
        .await;
    Mock::given(method("PATCH"))
        .and(path_regex(r"^/open-apis/im/v1/messages/[^/]+$"))
        .respond_with(messages.clone())
        .mount(api)
        .await;
    Mock::given(method("GET"))
        .and(path_regex(r"^/open-apis/im/v1/messages/[^/]+$"))
        .respond_with(messages)
        .mount(api)
        .await;
}

pub(crate) fn enable_lark(c: &mut assistd::Config, api: &str, agent: &str) {
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
