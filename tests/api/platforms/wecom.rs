//! WeCom: callbacks verified and decrypted, answered by the app API; template-card approvals; XML fields.

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use super::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

pub(crate) mod wecom_sample {
    pub const TOKEN: &str = "QDG6eK";
    pub const CORP: &str = "wx5823bf96d3bd56c7";
    pub const AES_KEY: &str = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C";
}

impl TestApp {
    pub(crate) async fn wecom_post(&self, xml_message: &str, token: &str) -> reqwest::Response {
        self.wecom_post_at(xml_message, token, now()).await
    }

    pub(crate) async fn wecom_post_at(
        &self,
        xml_message: &str,
        token: &str,
        ts: i64,
    ) -> reqwest::Response {
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
pub(crate) async fn wecom_api() -> MockServer {
    let api = MockServer::start().await;
    mount_wecom(&api).await;
    api
}

/// The WeCom API doubles (gettoken, and message/send held to its 2,048-byte text) on `api`.
pub(crate) async fn mount_wecom(api: &MockServer) {
    Mock::given(method("GET"))
        .and(path("/cgi-bin/gettoken"))
        .respond_with(ResponseTemplate::new(200).set_body_json(
            json!({"errcode": 0, "errmsg": "ok", "access_token": "wc-token", "expires_in": 7200}),
        ))
        .mount(api)
        .await;
    Mock::given(method("POST"))
        .and(path("/cgi-bin/message/send"))
        .respond_with(super::chat_doubles::TextLengthLimit::wecom())
        .mount(api)
        .await;
}

pub(crate) fn enable_wecom(c: &mut assistd::Config, api: &str, agent: &str) {
    c.channels.wecom.enabled = true;
    c.channels.wecom.corp_id = wecom_sample::CORP.into();
    c.channels.wecom.agent_id = "1000002".into();
    c.channels.wecom.secret = "app-secret".into();
    c.channels.wecom.token = wecom_sample::TOKEN.into();
    c.channels.wecom.encoding_aes_key = wecom_sample::AES_KEY.into();
    c.channels.wecom.api_base_url = api.into();
    c.channels.wecom.agent = agent.into();
}

pub(crate) fn wecom_text(msg_id: &str, text: &str) -> String {
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

pub(crate) fn wecom_card_event(from: &str, key: &str) -> String {
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
    assert!(key.starts_with(&format!("approve:{id}.")), "{key}");
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
