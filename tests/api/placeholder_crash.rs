//! Issue 20, item 4, with the real binary: SIGKILL after the placeholder was sent and its
//! message id recorded, before the answer → after the restart the same message is edited to
//! the answer; the chat never gets a second message. Runs on the suite's database (SQLite,
//! or PostgreSQL with `ASSISTD_TEST_POSTGRES_URL`).

use std::time::{Duration, Instant};

use assistd::domain::now_ms;
use assistd::store::Store;
use serde_json::{Value, json};

use crate::binary::RealServer;
use crate::helpers::*;
use crate::platforms::{SLACK_SECRET, platform_api, sends, slack_event};
use crate::strict_model::SlowStreamingModel;

const ANSWER: &str = "Resumed after the crash, this answer replaces the placeholder.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_after_the_placeholder_edits_the_same_message_after_restart() {
    let db = TestDb::new().await;
    let api = platform_api().await;
    // About 5 s per answer, not streamed: the placeholder shows "Thinking…" until then.
    let model = SlowStreamingModel::start(ANSWER, 6, Duration::from_millis(350)).await;
    let workdir = tempfile::tempdir().unwrap();
    let env: Vec<(String, String)> = [
        ("ASSISTD_DATABASE__URL", db.url.as_str()),
        ("ASSISTD_ADMIN__TOKEN", "crash-admin-token"),
        ("ASSISTD_WORKER__INSTANCE_ID", "placeholder-crash"),
        ("ASSISTD_WORKER__LEASE_SECS", "3"),
        ("ASSISTD_WORKER__POLL_INTERVAL_MS", "100"),
        ("ASSISTD_OUTBOX__POLL_INTERVAL_MS", "100"),
        ("ASSISTD_REPLIES__PLACEHOLDER_AFTER_MS", "200"),
        ("ASSISTD_REPLIES__STREAM_EDIT_MS", "0"),
        ("ASSISTD_CHANNELS__SLACK__ENABLED", "true"),
        ("ASSISTD_CHANNELS__SLACK__SIGNING_SECRET", SLACK_SECRET),
        ("ASSISTD_CHANNELS__SLACK__BOT_TOKEN", "xoxb-test"),
        ("ASSISTD_CHANNELS__SLACK__BOT_USER_ID", "UBOT"),
        ("ASSISTD_CHANNELS__SLACK__API_BASE_URL", &api.uri()),
        ("ASSISTD_LLM__BASE_URL", &format!("{}/v1", model.uri)),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let server = RealServer::start(&env, workdir.path()).await;
    let event = slack_event(
        "EvK1",
        json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> survive this", "ts": "1900.1", "channel": "CK"}),
    );
    let raw = serde_json::to_vec(&event).unwrap();
    let ts = (now_ms() / 1000).to_string();
    let resp = reqwest::Client::new()
        .post(format!("{}/webhooks/slack", server.addr))
        .header("content-type", "application/json")
        .header("X-Slack-Request-Timestamp", &ts)
        .header(
            "X-Slack-Signature",
            assistd::channels::slack::sign(SLACK_SECRET, &ts, &raw),
        )
        .body(raw)
        .send()
        .await
        .unwrap();
    let id = task_id_of(resp).await;

    let config = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = Store::connect(&config.database).await.unwrap();
    // The placeholder went out and its message id is recorded; the answer is not ready.
    let deadline = Instant::now() + WAIT;
    let placeholder = loop {
        let replies = store.task_replies(id).await.unwrap();
        if let Some(r) = replies
            .iter()
            .find(|r| r.placeholder && r.platform_message_id.is_some())
        {
            break r.clone();
        }
        assert!(Instant::now() < deadline, "no placeholder was recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    server.kill();
    let ts = placeholder.platform_message_id.unwrap();
    assert_eq!(sends(&api, "/chat.postMessage").await.len(), 1);
    assert!(sends(&api, "/chat.update").await.is_empty());

    let server = RealServer::start(&env, workdir.path()).await;
    let deadline = Instant::now() + Duration::from_secs(40);
    let reply = loop {
        let task = store.task(id).await.unwrap().unwrap();
        let reply = store.task_reply(id).await.unwrap().unwrap();
        if task.status.is_terminal() && reply.status == assistd::domain::ReplyStatus::Sent {
            break reply;
        }
        assert!(
            Instant::now() < deadline,
            "the task was not answered after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(server.terminate(), Some(0));
    let posts = sends(&api, "/chat.postMessage").await;
    assert_eq!(
        posts.len(),
        1,
        "a second message after the restart: {posts:?}"
    );
    assert_eq!(posts[0]["text"], "Thinking…");
    let updates: Vec<Value> = sends(&api, "/chat.update").await;
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert_eq!(updates[0]["ts"], ts.as_str());
    assert_eq!(updates[0]["text"], ANSWER);
    assert_eq!(reply.platform_message_id.as_deref(), Some(ts.as_str()));
    assert!(reply.edit && !reply.placeholder);
    // The killed run's call and the resumed run's.
    assert_eq!(model.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    store.close().await;
    db.drop_db().await;
}
