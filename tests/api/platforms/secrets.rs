//! Failed sends on every platform show and log no secret.

use serde_json::{Value, json};

use super::*;

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
