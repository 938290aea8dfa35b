//! Issue 33, "Done means": group manners and conversation scopes with inputs built by the
//! platforms' own SDKs (`platform_sdks.py`): Telegram updates from python-telegram-bot's
//! objects (a mention entity, a forum topic, a reply to the bot), and a WeCom callback
//! encrypted and signed by wechatpy's enterprise crypto.

use serde_json::{Value, json};

use super::groups::conversation_tasks;
use super::*;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/api/platform_sdks.py");

/// What the SDK script builds from `spec`.
fn built(spec: Value) -> Value {
    crate::helpers::python_json(SCRIPT, &spec.to_string()).unwrap_or_else(|e| panic!("{e}"))
}

fn tg(update_id: i64, from: i64, text: &str, extra: Value) -> Value {
    let mut spec = json!({"platform": "telegram", "update_id": update_id, "message_id": update_id,
        "chat_id": -500, "chat_type": "supergroup", "from_id": from, "bot": "helper_bot", "text": text});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    built(spec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(assistd_has_platform_sdks),
    ignore = "needs the platforms' SDKs (pip install 'python-telegram-bot==21.11.1' 'wechatpy==1.8.18' 'cryptography>=42'); .ci/run installs them"
)]
async fn telegram_updates_built_by_python_telegram_bot_are_addressed_and_scoped() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let chatter = app
        .telegram(&tg(1, 42, "lunch at noon?", json!({})), Some(TG_SECRET))
        .await;
    let body: Value = chatter.json().await.unwrap();
    assert!(body["ignored"].is_string(), "{body}");
    let mention = task_id_of(
        app.telegram(
            &tg(2, 42, "@helper_bot where is room 4?", json!({})),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let reply = task_id_of(
        app.telegram(
            &tg(3, 43, "and on Sundays?", json!({"reply_to_bot": true})),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let topic = task_id_of(
        app.telegram(
            &tg(
                4,
                42,
                "@helper_bot 报销怎么申请？",
                json!({"forum": true, "topic": 7}),
            ),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    assert_eq!(conversation_tasks(&app, "-500#u=42").await, [mention]);
    assert_eq!(conversation_tasks(&app, "-500#u=43").await, [reply]);
    assert_eq!(conversation_tasks(&app, "-500#t=7").await, [topic]);
    let task = app.wait_replied(mention, WAIT).await;
    assert_eq!(
        task["reply"]["content"]["text"],
        "answer to: where is room 4?"
    );
    app.wait_replied(topic, WAIT).await;
    let sent = requests_to(&api, "/sendMessage$").await;
    assert!(
        sent.iter()
            .any(|b| b["message_thread_id"] == 7 && b["text"] == "answer to: 报销怎么申请？"),
        "{sent:?}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(assistd_has_platform_sdks),
    ignore = "needs the platforms' SDKs (pip install 'python-telegram-bot==21.11.1' 'wechatpy==1.8.18' 'cryptography>=42'); .ci/run installs them"
)]
async fn a_wecom_callback_sealed_by_wechatpy_is_taken_and_answered() {
    let api = platform_api().await;
    mount_wecom(&api).await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| enable_wecom(c, &uri, "default")).await;
    let ts = now();
    let sealed = built(json!({"platform": "wecom", "token": wecom_sample::TOKEN,
        "aes_key": wecom_sample::AES_KEY, "corp_id": wecom_sample::CORP,
        "xml": wecom_text("sdk-1", "年假有几天？"), "nonce": "sdk-nonce", "timestamp": ts}));
    let body = format!(
        "<xml><ToUserName><![CDATA[{}]]></ToUserName><Encrypt><![CDATA[{}]]></Encrypt><AgentID><![CDATA[1000002]]></AgentID></xml>",
        wecom_sample::CORP,
        sealed["encrypt"].as_str().unwrap()
    );
    let resp = app
        .http
        .post(format!(
            "{}/webhooks/wecom?msg_signature={}&timestamp={ts}&nonce=sdk-nonce",
            app.addr,
            sealed["signature"].as_str().unwrap()
        ))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ids = conversation_tasks(&app, "zhangsan").await;
    assert_eq!(ids.len(), 1);
    let task = app.wait_replied(ids[0], WAIT).await;
    assert_eq!(task["reply"]["content"]["text"], "answer to: 年假有几天？");
    app.stop().await;
}
