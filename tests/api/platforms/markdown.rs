//! Issue 33, part 4: the model's Markdown in each platform's dialect — Telegram's HTML parse
//! mode (checked by the double as Telegram parses it), Slack mrkdwn with its escaping,
//! Matrix `formatted_body` beside the plain `body`, a Lark `post` with an `md` element, a
//! DingTalk `markdown` message, a WeCom `markdown` message when switched on, and the generic
//! channel's `html` beside the raw `text`; a message refused for its formatting is sent once
//! more as plain text.

use serde_json::{Value, json};
use wiremock::matchers::{body_partial_json, method, path, path_regex};
use wiremock::{Mock, MockServer, ResponseTemplate};

use super::chat_doubles::telegram_html_entities;
use super::*;
use crate::strict_model::{ModelReply, model_mock};

const ANSWER: &str = "## 报销 & travel\n\nBook **economy**, keep *receipts* (see [the policy](https://intra.example/p?a=1&b=2)).\n\n- flights < 6 h\n- hotels ~~4~~ 3 stars\n\n`a<b>` and <script>x</script>";

async fn markdown_model() -> MockServer {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text(ANSWER))
        .mount(&model)
        .await;
    model
}

/// What a Slack client shows of a mrkdwn text: links as their labels, entities decoded.
fn slack_visible(mrkdwn: &str) -> String {
    let links = regex::Regex::new(r"<([^|>]+)\|([^>]+)>").unwrap();
    links
        .replace_all(mrkdwn, "$2")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markdown_reaches_every_platform_in_its_own_dialect() {
    let api = platform_api().await;
    mount_lark(&api).await;
    mount_dingtalk_session(&api).await;
    mount_wecom(&api).await;
    let rooms = mount_room_sends(&api).await;
    rooms.room("!md:hs", &["@ada:hs"], Some("@ada:hs"));
    let uri = api.uri();
    let app = TestApp::spawn_with(
        markdown_model().await,
        accepting_receiver().await,
        move |c| {
            enable_platforms(c, &uri, "default");
            enable_lark(c, &uri, "default");
            enable_matrix(c, &uri);
            enable_dingtalk(c, &uri);
            enable_wecom(c, &uri, "default");
            c.channels.wecom.markdown = true;
            c.replies.placeholder = String::new();
        },
    )
    .await;
    let mut ids = vec![
        task_id_of(
            app.telegram(&tg_update(1, 42, 1, 42, "travel?"), Some(TG_SECRET))
                .await,
        )
        .await,
        task_id_of(
            app.slack_event(&slack_event(
                "E1",
                json!({"type": "message", "channel_type": "im", "user": "U1", "text": "travel?",
                       "ts": "1800.0001", "channel": "D1"}),
            ))
            .await,
        )
        .await,
        task_id_of(app.post_message(&message("md-1", 1, "travel?")).await).await,
    ];
    let mut p2p = lark_message("ev-md", "om_md", "user", "travel?");
    p2p["event"]["message"]["chat_type"] = json!("p2p");
    ids.push(task_id_of(app.lark("/webhooks/lark", &p2p, LARK_KEY, now()).await).await);
    let now_ms = assistd::domain::now_ms();
    let session = format!("{}/robot/sendBySession?session=s1", api.uri());
    let dt = dingtalk_message("dt-md", "1", &session, now_ms + 3_600_000, "travel?");
    ids.push(task_id_of(app.dingtalk(&dt, DT_SECRET, now_ms).await).await);
    let wecom = app
        .wecom_post(&wecom_text("md-1", "travel?"), wecom_sample::TOKEN)
        .await;
    assert_eq!(wecom.status(), 200);
    ids.extend(super::groups::conversation_tasks(&app, "zhangsan").await);
    let mx = json!([{"type": "m.room.message", "room_id": "!md:hs", "sender": "@ada:hs",
        "event_id": "$md", "origin_server_ts": 1, "content": {"msgtype": "m.text", "body": "travel?"}}]);
    assert_eq!(app.matrix_txn("t-md", mx).await.status(), 200);
    for id in ids {
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(
            task["reply"]["content"]["text"], ANSWER,
            "stored as written"
        );
    }
    let mut matrix = Vec::new();
    for _ in 0..100 {
        matrix = requests_to(&api, r"^/_matrix/client/v3/rooms/.*/send/").await;
        if !matrix.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    // Telegram: HTML parse mode, accepted by the double's entity parser; what the user
    // reads has no Markdown marks and keeps every character of the text.
    let tg = &requests_to(&api, "/sendMessage$").await[0];
    assert_eq!(tg["parse_mode"], "HTML");
    let html = tg["text"].as_str().unwrap();
    assert!(
        html.contains("<b>economy</b>") && html.contains("<s>4</s>"),
        "{html}"
    );
    assert!(
        html.contains("<a href=\"https://intra.example/p?a=1&amp;b=2\">the policy</a>"),
        "{html}"
    );
    let visible = telegram_html_entities(html).unwrap();
    assert!(
        visible.starts_with("报销 & travel\n\nBook economy"),
        "{visible}"
    );
    assert!(visible.contains("• flights < 6 h"), "{visible}");
    assert!(
        visible.contains("a<b> and <script>x</script>"),
        "raw HTML shown as text: {visible}"
    );
    assert!(!visible.contains("**") && !visible.contains("](") && !visible.contains("~~"));

    // Slack: mrkdwn with its escaping.
    let slack = &requests_to(&api, "/chat.postMessage$").await[0];
    let mrkdwn = slack["text"].as_str().unwrap();
    assert!(
        mrkdwn.contains("*economy*") && mrkdwn.contains("_receipts_"),
        "{mrkdwn}"
    );
    assert!(
        mrkdwn.contains("<https://intra.example/p?a=1&amp;b=2|the policy>"),
        "{mrkdwn}"
    );
    assert!(mrkdwn.contains("&lt;script&gt;"), "{mrkdwn}");
    assert!(!mrkdwn.contains("<script"), "{mrkdwn}");
    assert!(slack_visible(mrkdwn).contains("• flights < 6 h"));

    // Matrix: the plain body as written, HTML beside it, raw HTML escaped.
    let event = &matrix[0];
    assert_eq!(event["body"], ANSWER);
    assert_eq!(event["format"], "org.matrix.custom.html");
    let formatted = event["formatted_body"].as_str().unwrap();
    assert!(
        formatted.contains("<strong>economy</strong>"),
        "{formatted}"
    );
    assert!(formatted.contains("&lt;script&gt;"), "{formatted}");

    // The generic channel: the raw text and its HTML.
    let generic = received_replies(&app.receiver).await;
    assert_eq!(generic[0].1["text"], ANSWER);
    assert!(
        generic[0].1["html"]
            .as_str()
            .unwrap()
            .contains("<li>flights &lt; 6 h</li>")
    );

    // Lark: a post with one md element; DingTalk and WeCom: markdown messages.
    let lark = &requests_to(&api, "^/open-apis/im/v1/messages/[^/]+/reply$").await[0];
    assert_eq!(lark["msg_type"], "post");
    let post: Value = serde_json::from_str(lark["content"].as_str().unwrap()).unwrap();
    assert_eq!(
        post["zh_cn"]["content"][0][0],
        json!({"tag": "md", "text": ANSWER})
    );
    let dingtalk = &requests_to(&api, "^/robot/sendBySession$").await[0];
    assert_eq!(dingtalk["msgtype"], "markdown");
    assert_eq!(dingtalk["markdown"]["text"], ANSWER);
    assert_eq!(dingtalk["markdown"]["title"], "报销 & travel");
    let wecom = &requests_to(&api, "^/cgi-bin/message/send$").await[0];
    assert_eq!(wecom["msgtype"], "markdown");
    assert_eq!(wecom["markdown"]["content"], ANSWER);
    app.stop().await;
}

/// A formatting refusal (Telegram "can't parse entities", Lark 230001 for a post) is
/// answered by sending the answer once more as plain text: the user gets the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_refused_for_its_formatting_goes_again_as_plain_text() {
    let api = platform_api().await;
    Mock::given(method("POST"))
        .and(path(format!("/bot{TG_TOKEN}/sendMessage")))
        .and(body_partial_json(json!({"parse_mode": "HTML"})))
        .respond_with(ResponseTemplate::new(400).set_body_json(json!({"ok": false,
            "error_code": 400,
            "description": "Bad Request: can't parse entities: Unsupported start tag \"x\" at byte offset 0"})))
        .with_priority(1)
        .mount(&api)
        .await;
    mount_lark(&api).await;
    Mock::given(method("POST"))
        .and(path_regex(r"^/open-apis/im/v1/messages/[^/]+/reply$"))
        .and(body_partial_json(json!({"msg_type": "post"})))
        .respond_with(
            ResponseTemplate::new(400)
                .set_body_json(json!({"code": 230001, "msg": "invalid message content"})),
        )
        .with_priority(1)
        .mount(&api)
        .await;
    let uri = api.uri();
    let app = TestApp::spawn_with(
        markdown_model().await,
        accepting_receiver().await,
        move |c| {
            enable_platforms(c, &uri, "default");
            enable_lark(c, &uri, "default");
            c.replies.placeholder = String::new();
        },
    )
    .await;
    let tg = task_id_of(
        app.telegram(&tg_update(1, 42, 1, 42, "travel?"), Some(TG_SECRET))
            .await,
    )
    .await;
    let mut p2p = lark_message("ev-pl", "om_pl", "user", "travel?");
    p2p["event"]["message"]["chat_type"] = json!("p2p");
    let lark = task_id_of(app.lark("/webhooks/lark", &p2p, LARK_KEY, now()).await).await;
    for id in [tg, lark] {
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(task["reply"]["attempts"], 1, "one delivery: {task}");
    }
    let sent = requests_to(&api, "/sendMessage$").await;
    assert_eq!(sent.len(), 2);
    assert!(sent[1].get("parse_mode").is_none());
    let plain = sent[1]["text"].as_str().unwrap();
    assert!(
        plain.starts_with(
            "报销 & travel\n\nBook economy, keep receipts (see the policy (https://intra.example/p?a=1&b=2))."
        ),
        "{plain}"
    );
    let replies = requests_to(&api, "^/open-apis/im/v1/messages/[^/]+/reply$").await;
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[1]["msg_type"], "text");
    app.stop().await;
}
