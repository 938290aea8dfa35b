//! Issue 20, items 1–4: a slow run shows a placeholder that becomes the answer, a streamed
//! answer is shown as it comes by editing that one message, and a fast answer shows no
//! placeholder at all, against the stateful platform doubles (`chat_doubles`) and a model
//! that streams over time.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use super::*;
use crate::strict_model::SlowStreamingModel;

const ANSWER: &str = "The answer comes in several pieces and ends right here.";

/// The app against `api`, answering with a model that streams `ANSWER` six bytes every
/// `every`.
async fn streaming_app(
    api: &MockServer,
    every: Duration,
    tweak: impl FnOnce(&mut assistd::Config) + Send + 'static,
) -> (TestApp, SlowStreamingModel) {
    let model = SlowStreamingModel::start(ANSWER, 6, every).await;
    let (uri, model_uri) = (api.uri(), model.uri.clone());
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            enable_platforms(c, &uri, "default");
            enable_lark(c, &uri, "default");
            enable_matrix(c, &uri);
            c.llm.base_url = format!("{model_uri}/v1");
            tweak(c);
        },
    )
    .await;
    (app, model)
}

/// Requests to `api` on paths ending with `suffix`, in order, with their JSON bodies.
async fn calls_to(api: &MockServer, suffix: &str) -> Vec<(String, Value)> {
    api.received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path().ends_with(suffix))
        .map(|r| {
            (
                r.url.path().to_string(),
                serde_json::from_slice(&r.body).unwrap_or(Value::Null),
            )
        })
        .collect()
}

/// Slack showed one message, `placeholder`, then one edit of it to the answer.
async fn placeholder_then_answer(api: &MockServer, task: &Value, placeholder: &str) {
    let posts = calls_to(api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1, "{posts:?}");
    assert_eq!(posts[0].1["text"], placeholder);
    let updates = calls_to(api, "/chat.update").await;
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert_eq!(updates[0].1["text"], ANSWER);
    assert_eq!(updates[0].1["ts"], task["reply"]["platform_message_id"]);
}

async fn slack_question(app: &TestApp, event: &str, ts: &str) -> i64 {
    let mention = slack_event(
        event,
        json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> tell me", "ts": ts, "channel": "C7"}),
    );
    task_id_of(app.slack_event(&mention).await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_streams_the_answer_into_one_placeholder_message() {
    let api = platform_api().await;
    // The placeholder at once, so an edit of the text so far (`stream_edit_ms` apart) fits
    // in the ~2.3 s stream before the answer, even on a loaded machine: after the default
    // second's wait, a placeholder sent late left room for the answer's edit alone.
    let (app, model) = streaming_app(&api, Duration::from_millis(250), |c| {
        c.replies.placeholder_after_ms = 0;
    })
    .await;
    let id = slack_question(&app, "EvS1", "1800.1").await;
    let task = app.wait_replied(id, WAIT).await;
    let posts = calls_to(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1, "one message per question: {posts:?}");
    let ts = task["reply"]["platform_message_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(task["reply"]["edit"], true);
    assert_eq!(task["reply"]["placeholder"], false);
    let updates = calls_to(&api, "/chat.update").await;
    // Partial text, then the answer; every edit of the placeholder's own message.
    assert!(updates.len() >= 2, "{updates:?}");
    assert!(
        updates
            .iter()
            .all(|(_, u)| u["ts"] == ts.as_str() && u["channel"] == "C7")
    );
    assert_eq!(updates.last().unwrap().1["text"], ANSWER);
    let first = posts[0].1["text"].as_str().unwrap();
    assert!(
        first == "Thinking…" || ANSWER.starts_with(first),
        "the placeholder shows the text so far: {first}"
    );
    assert_eq!(posts[0].1["thread_ts"], "1800.1");
    assert_eq!(model.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_shows_typing_then_one_streamed_message_edited_into_the_answer() {
    let api = platform_api().await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(250), |_| {}).await;
    let id = task_id_of(
        app.telegram(
            &tg_update(70, -300, 8, 42, "@helper_bot tell me"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    let order: Vec<String> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.url.path().rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(order[0], "sendChatAction", "typing comes first: {order:?}");
    let sent = calls_to(&api, "/sendMessage").await;
    assert_eq!(sent.len(), 1, "{order:?}");
    let message_id: i64 = task["reply"]["platform_message_id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let edits = calls_to(&api, "/editMessageText").await;
    assert!(!edits.is_empty());
    assert!(
        edits
            .iter()
            .all(|(_, e)| e["message_id"] == message_id && e["chat_id"] == "-300")
    );
    assert_eq!(edits.last().unwrap().1["text"], ANSWER);
    // Telegram has typing, so the placeholder waited for text instead of "Thinking…".
    assert!(ANSWER.starts_with(sent[0].1["text"].as_str().unwrap()));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_streams_by_replacing_the_placeholder_event() {
    let api = platform_api().await;
    mount_room_sends(&api).await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(250), |_| {}).await;
    let resp = app
        .matrix_txn(
            "stream-1",
            json!([{"type": "m.room.message", "room_id": "!r:hs", "sender": "@ada:hs",
                    "event_id": "$q-stream", "origin_server_ts": 1,
                    "content": {"msgtype": "m.text", "body": "@assistd:hs: tell me"}}]),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let tasks: Value = app.list("conversation=!r:hs").await.json().await.unwrap();
    let id = tasks["tasks"][0]["id"].as_i64().unwrap();
    let task = app.wait_replied(id, WAIT).await;
    let sends = calls_to(&api, "").await;
    let sends: Vec<&Value> = sends
        .iter()
        .filter(|(p, _)| p.contains("/send/m.room.message/"))
        .map(|(_, b)| b)
        .collect();
    let (edits, new): (Vec<&Value>, Vec<&Value>) = sends
        .into_iter()
        .partition(|b| b["m.relates_to"]["rel_type"] == "m.replace");
    assert_eq!(new.len(), 1, "{new:?}");
    let event = task["reply"]["platform_message_id"].as_str().unwrap();
    assert!(!edits.is_empty());
    assert!(edits.iter().all(|e| e["m.relates_to"]["event_id"] == event));
    let last = edits.last().unwrap();
    assert_eq!(last["m.new_content"]["body"], ANSWER);
    assert_eq!(last["body"], format!("* {ANSWER}"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_streams_into_one_shared_card() {
    let api = platform_api().await;
    mount_lark(&api).await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(250), |_| {}).await;
    let resp = app
        .lark(
            "/webhooks/lark",
            &lark_message("ev-stream", "om_q1", "user", "@_user_1 tell me"),
            LARK_KEY,
            now(),
        )
        .await;
    let id = task_id_of(resp).await;
    let task = app.wait_replied(id, WAIT).await;
    let replies = calls_to(&api, "/reply").await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].1["msg_type"], "interactive");
    let card_id = task["reply"]["platform_message_id"].as_str().unwrap();
    let patches: Vec<(String, Value)> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.method.as_str() == "PATCH")
        .map(|r| {
            (
                r.url.path().to_string(),
                serde_json::from_slice(&r.body).unwrap(),
            )
        })
        .collect();
    assert!(!patches.is_empty());
    assert!(patches.iter().all(|(p, _)| p.ends_with(card_id)));
    let last: Value =
        serde_json::from_str(patches.last().unwrap().1["content"].as_str().unwrap()).unwrap();
    assert_eq!(last["elements"][0]["text"]["content"], ANSWER);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_answer_shows_no_placeholder() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let id = slack_question(&app, "EvF1", "1801.1").await;
    app.wait_replied(id, WAIT).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let posts = calls_to(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1);
    assert_eq!(posts[0].1["text"], "answer to: tell me");
    assert!(calls_to(&api, "/chat.update").await.is_empty());
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_streaming_the_placeholder_is_edited_once_into_the_answer() {
    let api = platform_api().await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(150), |c| {
        c.replies.stream_edit_ms = 0;
        c.replies.placeholder = "Working on it…".into();
    })
    .await;
    let id = slack_question(&app, "EvN1", "1802.1").await;
    let task = app.wait_replied(id, WAIT).await;
    placeholder_then_answer(&api, &task, "Working on it…").await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_can_turn_the_placeholder_off() {
    let api = platform_api().await;
    let (app, model) = streaming_app(&api, Duration::from_millis(100), |c| {
        c.agents.get_mut("default").unwrap().placeholder = Some(String::new());
    })
    .await;
    let id = slack_question(&app, "EvO1", "1803.1").await;
    app.wait_replied(id, WAIT).await;
    let posts = calls_to(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1);
    assert_eq!(posts[0].1["text"], ANSWER);
    assert!(calls_to(&api, "/chat.update").await.is_empty());
    assert_eq!(model.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    app.stop().await;
}

/// Answers like `inner`, `delay` later.
struct Slow<R>(R, Duration);

impl<R: Respond> Respond for Slow<R> {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        self.0.respond(request).set_delay(self.1)
    }
}

/// The answer is committed while the placeholder's send is still in flight: the send's
/// outcome then leaves the row to edit the message just created, not to stop at it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_ready_while_the_placeholder_is_in_flight_edits_it() {
    let api = MockServer::start().await;
    let slack = super::chat_doubles::SlackMessages::default();
    Mock::given(method("POST"))
        .and(path("/chat.postMessage"))
        .respond_with(Slow(slack.clone(), Duration::from_millis(1500)))
        .mount(&api)
        .await;
    Mock::given(method("POST"))
        .and(path("/chat.update"))
        .respond_with(slack)
        .mount(&api)
        .await;
    // 13 events of 100 ms: the answer is ready at about 1.3 s, the placeholder goes at
    // 0.2 s and its send returns at about 1.7 s.
    let (app, _model) = streaming_app(&api, Duration::from_millis(100), |c| {
        c.replies.stream_edit_ms = 0;
        c.replies.placeholder_after_ms = 200;
    })
    .await;
    let id = slack_question(&app, "EvR1", "1804.1").await;
    let task = app.wait_replied(id, WAIT).await;
    placeholder_then_answer(&api, &task, "Thinking…").await;
    app.stop().await;
}

/// Item 6: the console shows the streamed text as it comes (its page polls the
/// conversation), then the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_the_streamed_text_as_it_comes() {
    let api = platform_api().await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(200), |_| {}).await;
    let http = reqwest::Client::new();
    let resp = http
        .post(format!("{}/console/messages", app.addr))
        .json(&json!({"conversation_id": "live-1", "text": "stream to me"}))
        .send()
        .await
        .unwrap();
    let id = task_id_of(resp).await;
    let mut partials: Vec<String> = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    let answer = loop {
        let conv: Value = http
            .get(format!("{}/console/conversations/live-1", app.addr))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let m = &conv["messages"][0];
        assert_eq!(m["task_id"], id);
        if let Some(answer) = m["answer"].as_str() {
            assert!(m["partial"].is_null(), "no partial beside the answer");
            break answer.to_string();
        }
        if let Some(p) = m["partial"].as_str()
            && partials.last().map(String::as_str) != Some(p)
        {
            partials.push(p.to_string());
        }
        assert!(std::time::Instant::now() < deadline, "never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answer, ANSWER);
    assert!(
        partials.len() >= 2,
        "the text grew as it came: {partials:?}"
    );
    assert!(partials.iter().all(|p| ANSWER.starts_with(p.as_str())));
    assert!(partials.windows(2).all(|w| w[1].len() > w[0].len()));
    app.stop().await;
}

/// Waits until the task's placeholder was sent; returns its platform message id.
async fn placeholder_sent(app: &TestApp, id: i64) -> String {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let replies = app.store().task_replies(id).await.unwrap();
        if let Some(m) = replies
            .iter()
            .find(|r| r.placeholder && r.status == assistd::domain::ReplyStatus::Sent)
            .and_then(|r| r.platform_message_id.clone())
        {
            return m;
        }
        assert!(std::time::Instant::now() < deadline, "no placeholder sent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A run an admin cancels: the cancel notice takes the placeholder's place, by an edit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_turns_its_placeholder_into_the_notice() {
    let api = platform_api().await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(400), |c| {
        c.replies.stream_edit_ms = 0;
        c.replies.placeholder_after_ms = 0;
    })
    .await;
    let id = slack_question(&app, "EvC1", "1805.1").await;
    let ts = placeholder_sent(&app, id).await;
    assert_eq!(app.control(id, "cancel").await.status(), 200);
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "CANCELLED");
    let posts = calls_to(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1, "{posts:?}");
    let updates = calls_to(&api, "/chat.update").await;
    assert_eq!(updates.len(), 1, "{updates:?}");
    assert_eq!(updates[0].1["ts"], ts.as_str());
    assert!(
        updates[0].1["text"]
            .as_str()
            .unwrap()
            .contains("cancelled before it was answered")
    );
    app.stop().await;
}

/// The placeholder is written only for a run that still owns its task (the fence), once
/// per reply key, and never over an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placeholder_is_queued_only_under_the_runs_fence_and_never_over_an_answer() {
    use assistd::store::outbox::NewPlaceholder;
    let api = platform_api().await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(300), |c| {
        // Nothing is queued by the app itself.
        c.replies.placeholder = String::new();
    })
    .await;
    let id = slack_question(&app, "EvP1", "1806.1").await;
    let store = app.store();
    let deadline = std::time::Instant::now() + WAIT;
    let task = loop {
        let task = store.task(id).await.unwrap().unwrap();
        if task.status == assistd::domain::TaskStatus::Running {
            break task;
        }
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let fence = assistd::domain::Fence {
        task_id: id,
        owner: task.owner.clone().unwrap(),
        version: task.version,
    };
    let key = format!("agent-task-{id}");
    let placeholder = NewPlaceholder {
        key: &key,
        channel: "slack",
        conversation_id: &task.conversation_id,
        in_reply_to: "1806.1",
        content: r#"{"text":"Thinking…"}"#,
    };
    let now = assistd::domain::now_ms();
    let stale = assistd::domain::Fence {
        version: fence.version + 1,
        ..fence.clone()
    };
    assert!(
        !store
            .queue_placeholder(&stale, &placeholder, now)
            .await
            .unwrap()
    );
    let stranger = assistd::domain::Fence {
        owner: "another-instance".into(),
        ..fence.clone()
    };
    assert!(
        !store
            .queue_placeholder(&stranger, &placeholder, now)
            .await
            .unwrap()
    );
    assert!(store.task_replies(id).await.unwrap().is_empty());
    assert!(
        store
            .queue_placeholder(&fence, &placeholder, now)
            .await
            .unwrap()
    );
    assert!(
        !store
            .queue_placeholder(&fence, &placeholder, now)
            .await
            .unwrap()
    );
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["reply"]["content"]["text"], ANSWER);
    // Over the answer: refused (the run is over), and the answer stands.
    assert!(
        !store
            .queue_placeholder(&fence, &placeholder, now)
            .await
            .unwrap()
    );
    let replies = store.task_replies(id).await.unwrap();
    assert_eq!(replies.len(), 1);
    assert!(!replies[0].placeholder);
    assert!(replies[0].content.contains("ends right here"));
    app.stop().await;
}

/// Slack's assistant thread status stands in for typing: shown at the claim, cleared at
/// the end; the placeholder then waits for streamed text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_shows_the_assistant_thread_status_while_the_answer_streams() {
    let api = platform_api().await;
    Mock::given(method("POST"))
        .and(path("/assistant.threads.setStatus"))
        .respond_with(super::chat_doubles::SlackAssistantStatus)
        .mount(&api)
        .await;
    let (app, _model) = streaming_app(&api, Duration::from_millis(250), |c| {
        c.channels.slack.assistant_status = "is thinking…".into();
    })
    .await;
    let id = slack_question(&app, "EvA1", "1807.1").await;
    app.wait_replied(id, WAIT).await;
    let deadline = std::time::Instant::now() + WAIT;
    let statuses = loop {
        let statuses = calls_to(&api, "/assistant.threads.setStatus").await;
        if statuses.last().is_some_and(|(_, s)| s["status"] == "") {
            break statuses;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "status not cleared: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        statuses[0].1,
        json!({"channel_id": "C7", "thread_ts": "1807.1", "status": "is thinking…"})
    );
    let order: Vec<String> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.url.path().to_string())
        .collect();
    let first_post = order.iter().position(|p| p == "/chat.postMessage").unwrap();
    assert_eq!(order[0], "/assistant.threads.setStatus", "{order:?}");
    let posts = calls_to(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 1);
    // The placeholder waited for text: it never said "Thinking…".
    assert!(
        ANSWER.starts_with(posts[0].1["text"].as_str().unwrap()),
        "{posts:?}"
    );
    assert!(first_post > 0);
    app.stop().await;
}

/// DingTalk robot messages cannot be edited; with a card template the placeholder is a
/// card under the reply key, updated with the streamed text and then the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dingtalk_streams_into_one_card() {
    let api = platform_api().await;
    Mock::given(method("POST"))
        .and(path("/v1.0/oauth2/accessToken"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"accessToken": "dt-token", "expireIn": 7200})),
        )
        .mount(&api)
        .await;
    let cards = super::chat_doubles::DingTalkCards::default();
    Mock::given(method("POST"))
        .and(path("/v1.0/card/instances/createAndDeliver"))
        .respond_with(cards.clone())
        .mount(&api)
        .await;
    Mock::given(method("PUT"))
        .and(path("/v1.0/card/instances"))
        .respond_with(cards)
        .mount(&api)
        .await;
    let uri = api.uri();
    let (app, _model) = streaming_app(&api, Duration::from_millis(250), move |c| {
        let d = &mut c.channels.dingtalk;
        d.enabled = true;
        d.app_key = "dt-key".into();
        d.app_secret = DT_SECRET.into();
        d.robot_code = "ding-robot".into();
        d.session_webhook_origins = vec![uri.clone()];
        d.api_base_url = uri;
        d.card_template_id = "tpl-ai.schema".into();
        d.per_chat_interval_ms = 0;
    })
    .await;
    let session = format!("{}/robot/sendBySession?session=s9", api.uri());
    let now_ms = assistd::domain::now_ms();
    let msg = dingtalk_message("dt-stream-1", "2", &session, now_ms + 3_600_000, "tell me");
    let id = task_id_of(app.dingtalk(&msg, DT_SECRET, now_ms).await).await;
    let task = app.wait_replied(id, WAIT).await;
    let created = calls_to(&api, "/createAndDeliver").await;
    assert_eq!(created.len(), 1, "{created:?}");
    let key = format!("agent-task-{id}");
    assert_eq!(created[0].1["outTrackId"], key.as_str());
    assert_eq!(created[0].1["openSpaceId"], "dtv1.card//IM_GROUP.cid-group");
    assert_eq!(task["reply"]["platform_message_id"], key.as_str());
    let updates: Vec<Value> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.method.as_str() == "PUT" && r.url.path() == "/v1.0/card/instances")
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    assert!(!updates.is_empty());
    assert!(updates.iter().all(|u| u["outTrackId"] == key.as_str()));
    assert_eq!(
        updates.last().unwrap()["cardData"]["cardParamMap"]["content"],
        ANSWER
    );
    // Nothing went as a robot message.
    assert!(calls_to(&api, "/robot/sendBySession").await.is_empty());
    assert!(calls_to(&api, "/groupMessages/send").await.is_empty());
    app.stop().await;
}

/// The user deleted the placeholder before the answer came: the edit is refused for good
/// (`message_not_found`), so the answer goes as a new message, under `<key>-answer`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_placeholder_was_deleted_goes_as_a_new_message() {
    let api = MockServer::start().await;
    let slack = super::chat_doubles::SlackMessages::default();
    for call in ["/chat.postMessage", "/chat.update"] {
        Mock::given(method("POST"))
            .and(path(call))
            .respond_with(slack.clone())
            .mount(&api)
            .await;
    }
    let (app, _model) = streaming_app(&api, Duration::from_millis(300), |c| {
        c.replies.stream_edit_ms = 0;
        c.replies.placeholder_after_ms = 0;
        c.channels.slack.per_chat_interval_ms = 0;
    })
    .await;
    let id = slack_question(&app, "EvD1", "1808.1").await;
    let ts = placeholder_sent(&app, id).await;
    slack.delete(&ts);
    let task = app.wait_replied(id, WAIT).await;
    let posts = calls_to(&api, "/chat.postMessage").await;
    assert_eq!(posts.len(), 2, "{posts:?}");
    assert_eq!(posts[1].1["text"], ANSWER);
    assert_eq!(
        posts[1].1["metadata"]["event_payload"]["key"],
        format!("agent-task-{id}-answer")
    );
    assert_eq!(
        calls_to(&api, "/chat.update").await.len(),
        1,
        "one refused edit"
    );
    assert_ne!(task["reply"]["platform_message_id"], ts.as_str());
    assert_eq!(task["reply"]["edit"], false);
    app.stop().await;
}

/// WeCom app messages cannot be edited: a slow answer gets no placeholder, only the one
/// final message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wecom_gets_no_placeholder_only_the_answer() {
    let api = wecom_api().await;
    let uri = api.uri();
    let (app, _model) = streaming_app(&api, Duration::from_millis(200), move |c| {
        enable_wecom(c, &uri, "default");
    })
    .await;
    let resp = app
        .wecom_post(&wecom_text("2001", "tell me"), wecom_sample::TOKEN)
        .await;
    assert_eq!(resp.status(), 200);
    let tasks: Value = app
        .list("conversation=zhangsan")
        .await
        .json()
        .await
        .unwrap();
    let id = tasks["tasks"][0]["id"].as_i64().unwrap();
    let task = app.wait_replied(id, WAIT).await;
    let sent = calls_to(&api, "/cgi-bin/message/send").await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].1["text"]["content"], ANSWER);
    assert_eq!(task["reply"]["edit"], false);
    assert_eq!(app.store().task_replies(id).await.unwrap().len(), 1);
    app.stop().await;
}
