//! The generic webhook's progress contract (issue 20, item 5, for workflow nodes' `progress`
//! lines): extra signed POSTs keyed `<reply key>-progress-<revision>`, only when
//! `channels.generic.progress` is on; the final reply unchanged.

use std::time::Duration;

use serde_json::{Value, json};

use crate::helpers::*;
use crate::workflows::spawn_flow_with;

const LOOK_CONFIRM_ANSWER: &str = r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "lookup_a", "args": {"q": "x"}, "progress": "Looking up {{ message.text }}…", "next": "ok"},
  {"id": "ok", "type": "human_confirm", "message": "Go on?", "progress": "Asking for approval…", "next": "think"},
  {"id": "think", "type": "llm", "prompt": "Say {{ steps.look.value }}", "progress": "Writing the answer…", "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.think.text }}"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_lines_are_posted_signed_once_per_node_when_switched_on() {
    let flow = spawn_flow_with(LOOK_CONFIRM_ANSWER, |c| c.channels.generic.progress = true).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-prog", 1, "ticket T-42")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    app.wait_replied(id, WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let posts = received_replies(&app.receiver).await;
    let progress: Vec<&(String, Value)> = posts
        .iter()
        .filter(|(_, b)| b["type"] == "progress")
        .collect();
    // One line per node as it first starts; the resumed run replays the first two nodes
    // without showing them again.
    assert_eq!(
        progress.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        vec![
            format!("agent-task-{id}-progress-1"),
            format!("agent-task-{id}-progress-2"),
            format!("agent-task-{id}-progress-3"),
        ]
    );
    assert_eq!(
        progress[0].1,
        json!({"type": "progress", "task_id": id, "conversation_id": "c-prog",
               "in_reply_to": "msg-c-prog-1", "revision": 1, "text": "Looking up ticket T-42…"})
    );
    assert_eq!(progress[2].1["text"], "Writing the answer…");
    // Signed like replies.
    let raw = app.receiver.received_requests().await.unwrap();
    let first = raw
        .iter()
        .find(|r| {
            r.headers.get("idempotency-key").unwrap() == &format!("agent-task-{id}-progress-1")
        })
        .unwrap();
    let header = |n: &str| first.headers.get(n).unwrap().to_str().unwrap().to_string();
    assistd::channels::generic::verify(
        SECRET,
        Some(&header("x-assistd-timestamp")),
        Some(&header("x-assistd-signature")),
        &first.body,
        assistd::domain::now_ms() / 1000,
        300,
    )
    .expect("progress is signed");
    // The final reply is unchanged: the last POST, under the task's key.
    let last = posts.last().unwrap();
    assert_eq!(last.0, format!("agent-task-{id}"));
    assert_eq!(last.1["type"], "text");
    // A restarted task shows its lines again, under its new reply key.
    assert_eq!(app.control(id, "restart").await.status(), 200);
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again: Vec<String> = received_replies(&app.receiver)
        .await
        .into_iter()
        .filter(|(_, b)| b["type"] == "progress")
        .map(|(k, _)| k)
        .skip(3)
        .collect();
    assert_eq!(
        again,
        vec![
            format!("agent-task-{id}-r1-progress-1"),
            format!("agent-task-{id}-r1-progress-2"),
        ]
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_see_no_progress_unless_switched_on() {
    let flow = spawn_flow_with(LOOK_CONFIRM_ANSWER, |_| {}).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-noprog", 1, "T-43")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    app.wait_replied(id, WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let posts = received_replies(&app.receiver).await;
    assert!(
        posts.iter().all(|(_, b)| b["type"] != "progress"),
        "{posts:?}"
    );
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progress_line_on_a_reply_node_is_refused_at_publish() {
    let app = TestApp::spawn().await;
    let resp = app
        .http
        .post(format!("{}/api/agents/flowy/versions", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"mode": "workflow", "system_prompt": "You help.", "workflow": {
            "start": "done", "nodes": [{"id": "done", "type": "reply", "text": "hi", "progress": "Replying…"}]}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert!(
        err["error"].as_str().unwrap().contains("`progress`"),
        "{err}"
    );
    app.stop().await;
}

/// On a platform that can edit, a node's progress line shows in the run's placeholder,
/// which the answer then replaces: one message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progress_line_shows_in_the_placeholder_on_slack() {
    let api = crate::platforms::platform_api().await;
    let uri = api.uri();
    let flow = crate::workflows::spawn_flow_scripted(
        r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "lookup_a", "args": {"q": "x"}, "progress": "Looking up {{ message.text }}…", "next": "think"},
  {"id": "think", "type": "llm", "prompt": "Say {{ steps.look.value }}", "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.think.text }}"}]}"#,
        |_: &Value| crate::strict_model::ModelReply::text("T-42 is open"),
        move |c| {
            crate::platforms::enable_platforms(c, &uri, "flow");
            c.replies.placeholder_after_ms = 0;
            c.replies.stream_edit_ms = 100;
            c.channels.slack.per_chat_interval_ms = 0;
        },
    )
    .await;
    // The lookup takes a while: long enough for its line to be shown.
    wiremock::Mock::given(wiremock::matchers::method("GET"))
        .and(wiremock::matchers::path("/tools/a"))
        .respond_with(
            wiremock::ResponseTemplate::new(200)
                .set_body_json(json!({"value": "alpha"}))
                .set_delay(Duration::from_millis(1500)),
        )
        .with_priority(1)
        .mount(&flow.tools)
        .await;
    let app = &flow.app;
    let mention = crate::platforms::slack_event(
        "EvW1",
        json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> ticket T-42", "ts": "1900.5", "channel": "CW"}),
    );
    let id = task_id_of(app.slack_event(&mention).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let posts = crate::platforms::sends(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1, "{posts:?}");
    let updates = crate::platforms::sends(&api, "/chat.update").await;
    let answer = task["reply"]["content"]["text"].as_str().unwrap();
    // The placeholder showed the line, then the answer, in the one message.
    let shown: Vec<&Value> = std::iter::once(&posts[0]["text"])
        .chain(updates.iter().map(|u| &u["text"]))
        .collect();
    assert!(
        shown.contains(&&json!("Looking up ticket T-42…")),
        "{shown:?}"
    );
    assert_eq!(updates.last().unwrap()["text"], answer);
    assert!(
        updates
            .iter()
            .all(|u| u["ts"] == task["reply"]["platform_message_id"])
    );
    flow.app.stop().await;
}

/// Issue 33, part 5: with `channels.generic.progress`, the in-house IM gets live feedback
/// for a single-turn answer too: a `typing` event as the task is claimed (and one clearing
/// it at the end), and the streamed answer as progress revisions — the text so far,
/// `revision` 1, 2, … at most every `replies.stream_edit_ms`, keys
/// `agent-task-<id>-progress-<n>` — all before the final reply, which is unchanged. Off,
/// nothing but the reply is posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_single_turn_answer_reaches_the_generic_channel_as_progress_revisions() {
    use crate::strict_model::SlowStreamingModel;
    const ANSWER: &str = "The travel policy: book economy, keep receipts, file within 30 days.";
    for progress in [true, false] {
        let model = SlowStreamingModel::start(ANSWER, 6, Duration::from_millis(120)).await;
        let model_uri = model.uri.clone();
        let app = TestApp::spawn_with(
            wiremock::MockServer::start().await,
            accepting_receiver().await,
            move |c| {
                c.llm.base_url = format!("{model_uri}/v1");
                c.channels.generic.progress = progress;
                c.replies.stream_edit_ms = 300;
            },
        )
        .await;
        let mut question = message("c-live", 1, "the travel policy?");
        question["thread_id"] = json!("th-9");
        question["chat_type"] = json!("group");
        question["mentioned"] = json!(true);
        let id = task_id_of(app.post_message(&question).await).await;
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(task["reply"]["content"]["text"], ANSWER);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let posts = received_replies(&app.receiver).await;
        let reply_at = posts
            .iter()
            .position(|(k, _)| *k == format!("agent-task-{id}"))
            .unwrap();
        assert_eq!(posts[reply_at].1["text"], ANSWER, "the reply is unchanged");
        if !progress {
            assert_eq!(posts.len(), 1, "{posts:?}");
            app.stop().await;
            continue;
        }
        let typing: Vec<&Value> = posts
            .iter()
            .filter(|(_, b)| b["type"] == "typing")
            .map(|(_, b)| b)
            .collect();
        assert_eq!(
            *typing[0],
            json!({"type": "typing", "conversation_id": "c-live", "thread_id": "th-9",
                   "typing": true, "timeout_ms": 30000})
        );
        let first_post = posts
            .iter()
            .position(|(_, b)| b["type"] == "typing")
            .unwrap();
        assert_eq!(first_post, 0, "typing comes first: {posts:?}");
        let revisions: Vec<&(String, Value)> = posts
            .iter()
            .filter(|(_, b)| b["type"] == "progress")
            .collect();
        assert!(revisions.len() >= 2, "{posts:?}");
        for (n, (key, body)) in revisions.iter().enumerate() {
            let n = n as i64 + 1;
            assert_eq!(*key, format!("agent-task-{id}-progress-{n}"));
            assert_eq!(body["revision"], n);
            assert_eq!(body["conversation_id"], "c-live");
            assert_eq!(body["thread_id"], "th-9");
            assert_eq!(body["in_reply_to"], "msg-c-live-1");
            let text = body["text"].as_str().unwrap();
            assert!(ANSWER.starts_with(text) && !text.is_empty(), "{text}");
        }
        let texts: Vec<usize> = revisions
            .iter()
            .map(|(_, b)| b["text"].as_str().unwrap().len())
            .collect();
        assert!(texts.windows(2).all(|w| w[0] < w[1]), "growing: {texts:?}");
        let last_progress = posts
            .iter()
            .rposition(|(_, b)| b["type"] == "progress")
            .unwrap();
        assert!(
            last_progress < reply_at,
            "progress before the reply: {posts:?}"
        );
        app.stop().await;
    }
}
