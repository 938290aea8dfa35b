//! Issue 33, part 2: conversation scope. `channels.<platform>.conversation_scope` = auto
//! (direct chats per chat; groups per thread where the platform has threads, else per
//! member), chat, thread or user. A conversation is one history, one queue and one running
//! task; its answers go to its chat, into its thread where it has one: Telegram forum topics
//! (`message_thread_id`), Slack `thread_ts`, Lark `reply_in_thread` with `root_id`, Matrix
//! `m.thread` (see groups.rs), the generic channel's documented `thread_id`.

use std::time::Duration;

use serde_json::{Value, json};

use super::groups::conversation_tasks;
use super::*;
use crate::strict_model::{ModelReply, last_content, model_mock};

/// A Telegram group is a conversation per member: one member's slow question does not hold
/// up another's, each has its own history, and both answers go to the group; a forum
/// topic is its own conversation, answered in the topic; a private chat is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_groups_are_per_member_and_forum_topics_per_topic() {
    let api = platform_api().await;
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        let question = last_content(body);
        let reply = ModelReply::text(format!("answer to: {question}"));
        if question.contains("slow") {
            reply.delayed(Duration::from_secs(4))
        } else {
            reply
        }
    })
    .mount(&model)
    .await;
    let uri = api.uri();
    let app = TestApp::spawn_with(model, accepting_receiver().await, move |c| {
        enable_platforms(c, &uri, "default");
    })
    .await;
    let ask = |update: i64, from: i64, text: &str| tg_update(update, -500, update, from, text);
    let slow = task_id_of(
        app.telegram(
            &ask(1, 42, "@helper_bot slow: the travel policy?"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let quick = task_id_of(
        app.telegram(&ask(2, 43, "@helper_bot where is room 4?"), Some(TG_SECRET))
            .await,
    )
    .await;
    assert_eq!(conversation_tasks(&app, "-500#u=42").await, [slow]);
    assert_eq!(conversation_tasks(&app, "-500#u=43").await, [quick]);
    // The second member's answer does not wait for the first member's.
    app.wait_replied(quick, WAIT).await;
    let first = app.get_task(slow).await;
    assert_ne!(
        first["reply"]["status"], "SENT",
        "the slow answer is still being written: {first}"
    );
    app.wait_replied(slow, WAIT).await;

    // A forum topic: `is_topic_message` with its `message_thread_id`.
    let mut topic = ask(3, 42, "@helper_bot 报销怎么申请？");
    topic["message"]["is_topic_message"] = json!(true);
    topic["message"]["message_thread_id"] = json!(7);
    topic["message"]["chat"]["type"] = json!("supergroup");
    topic["message"]["chat"]["is_forum"] = json!(true);
    let in_topic = task_id_of(app.telegram(&topic, Some(TG_SECRET)).await).await;
    assert_eq!(conversation_tasks(&app, "-500#t=7").await, [in_topic]);
    // A reply in an ordinary group carries a message_thread_id too: not a topic.
    let mut reply = ask(4, 43, "@helper_bot and room 5?");
    reply["message"]["message_thread_id"] = json!(2);
    let not_topic = task_id_of(app.telegram(&reply, Some(TG_SECRET)).await).await;
    assert_eq!(
        conversation_tasks(&app, "-500#u=43").await,
        [quick, not_topic]
    );
    app.wait_replied(in_topic, WAIT).await;
    app.wait_replied(not_topic, WAIT).await;
    let sent = requests_to(&api, "/sendMessage$").await;
    assert!(sent.iter().all(|b| b["chat_id"] == "-500"), "{sent:?}");
    let topic_answer: Vec<&Value> = sent
        .iter()
        .filter(|b| b["text"] == "answer to: 报销怎么申请？")
        .collect();
    assert_eq!(topic_answer.len(), 1);
    assert_eq!(topic_answer[0]["message_thread_id"], 7);
    assert_eq!(
        sent.iter()
            .filter(|b| b.get("message_thread_id").is_some())
            .count(),
        1,
        "only the topic's answer names a thread"
    );
    // The second member's follow-up saw only their own history.
    let second = app.get_task(not_topic).await;
    assert_eq!(second["reply"]["content"]["text"], "answer to: and room 5?");
    let calls = crate::helpers::model_bodies(&app.model).await;
    let follow_up = calls
        .iter()
        .find(|c| last_content(c) == "and room 5?")
        .unwrap();
    let history = follow_up["messages"].to_string();
    assert!(history.contains("where is room 4?"), "{history}");
    assert!(!history.contains("travel policy"), "{history}");

    // A private chat is one conversation.
    let private = task_id_of(
        app.telegram(&tg_update(5, 42, 1, 42, "hello"), Some(TG_SECRET))
            .await,
    )
    .await;
    assert_eq!(conversation_tasks(&app, "42").await, [private]);
    app.stop().await;
}

/// Slack: a DM is one conversation answered in the DM (no thread); a channel question
/// opens a thread (`<channel>:<ts>`, the key Slack conversations had before scopes, so a
/// thread begun before the upgrade goes on); `user` puts each member's questions in a
/// channel in one conversation, answered in the channel; `thread` in a DM is per thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_direct_messages_are_one_conversation_and_channels_go_by_thread() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let event = |id: &str, kind: &str, channel: &str, ts: &str, thread: Option<&str>| {
        let mut e = json!({"type": "message", "channel_type": kind, "user": "U1",
            "text": format!("<@UBOT> question {id}"), "ts": ts, "channel": channel});
        if let Some(t) = thread {
            e["thread_ts"] = json!(t);
        }
        slack_event(id, e)
    };
    let dm1 = task_id_of(
        app.slack_event(&event("E1", "im", "D5", "1800.0001", None))
            .await,
    )
    .await;
    let dm2 = task_id_of(
        app.slack_event(&event("E2", "im", "D5", "1800.0002", None))
            .await,
    )
    .await;
    assert_eq!(conversation_tasks(&app, "D5").await, [dm1, dm2]);
    let top = task_id_of(
        app.slack_event(&event("E3", "channel", "C5", "1800.0003", None))
            .await,
    )
    .await;
    let in_thread = task_id_of(
        app.slack_event(&event(
            "E4",
            "channel",
            "C5",
            "1800.0004",
            Some("1800.0003"),
        ))
        .await,
    )
    .await;
    assert_eq!(
        conversation_tasks(&app, "C5:1800.0003").await,
        [top, in_thread]
    );
    for id in [dm1, dm2, top, in_thread] {
        app.wait_replied(id, WAIT).await;
    }
    let posts = requests_to(&api, "/chat.postMessage$").await;
    let dm_posts: Vec<&Value> = posts.iter().filter(|b| b["channel"] == "D5").collect();
    assert_eq!(dm_posts.len(), 2);
    assert!(
        dm_posts.iter().all(|b| b.get("thread_ts").is_none()),
        "{dm_posts:?}"
    );
    assert!(
        posts
            .iter()
            .filter(|b| b["channel"] == "C5")
            .all(|b| b["thread_ts"] == "1800.0003"),
        "{posts:?}"
    );
    app.stop().await;

    let api = platform_api().await;
    let app = spawn_platforms(&api, |c| {
        c.channels.slack.conversation_scope = assistd::channels::platform::Scope::User;
    })
    .await;
    let a = task_id_of(
        app.slack_event(&event("E5", "channel", "C6", "1800.0005", None))
            .await,
    )
    .await;
    let b = task_id_of(
        app.slack_event(&event(
            "E6",
            "channel",
            "C6",
            "1800.0006",
            Some("1800.0001"),
        ))
        .await,
    )
    .await;
    assert_eq!(conversation_tasks(&app, "C6#u=U1").await, [a, b]);
    app.wait_replied(a, WAIT).await;
    app.wait_replied(b, WAIT).await;
    let posts = requests_to(&api, "/chat.postMessage$").await;
    assert!(
        posts
            .iter()
            .all(|p| p["channel"] == "C6" && p.get("thread_ts").is_none()),
        "{posts:?}"
    );
    app.stop().await;

    let api = platform_api().await;
    let app = spawn_platforms(&api, |c| {
        c.channels.slack.conversation_scope = assistd::channels::platform::Scope::Thread;
    })
    .await;
    let dm = task_id_of(
        app.slack_event(&event("E7", "im", "D7", "1800.0007", None))
            .await,
    )
    .await;
    assert_eq!(conversation_tasks(&app, "D7:1800.0007").await, [dm]);
    app.stop().await;
}

/// Lark: a group question opens a thread (the reply is `reply_in_thread`), a message in the
/// thread (`root_id`) is of the same conversation; a p2p chat is one. DingTalk groups have
/// no threads: a conversation per member. The generic channel: `thread_id` in a group, per
/// sender without one; the reply names the chat and the thread; a `conversation_id` that
/// would read as a scoped key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_threads_dingtalk_members_and_generic_thread_ids() {
    let api = platform_api().await;
    mount_lark(&api).await;
    mount_dingtalk_session(&api).await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| {
        enable_lark(c, &uri, "default");
        enable_dingtalk(c, &uri);
    })
    .await;
    let root = lark_message("ev-s1", "om_q1", "user", "@_user_1 年假有几天？");
    let asked = task_id_of(app.lark("/webhooks/lark", &root, LARK_KEY, now()).await).await;
    let mut follow = lark_message("ev-s2", "om_q2", "user", "@_user_1 病假呢？");
    follow["event"]["message"]["root_id"] = json!("om_q1");
    follow["event"]["message"]["parent_id"] = json!("om_q1");
    let followed = task_id_of(app.lark("/webhooks/lark", &follow, LARK_KEY, now()).await).await;
    assert_eq!(
        conversation_tasks(&app, "oc_chat#t=om_q1").await,
        [asked, followed]
    );
    app.wait_replied(asked, WAIT).await;
    app.wait_replied(followed, WAIT).await;
    let replies = requests_to(&api, "^/open-apis/im/v1/messages/[^/]+/reply$").await;
    assert_eq!(replies.len(), 2);
    assert!(
        replies.iter().all(|r| r["reply_in_thread"] == true),
        "{replies:?}"
    );

    // DingTalk: a group, per member.
    let now_ms = assistd::domain::now_ms();
    let session = format!("{}/robot/sendBySession?session=s1", api.uri());
    let group = dingtalk_message("dt-s1", "2", &session, now_ms + 3_600_000, "报销流程？");
    let dt = task_id_of(app.dingtalk(&group, DT_SECRET, now_ms).await).await;
    assert_eq!(conversation_tasks(&app, "cid-group#u=staff-1").await, [dt]);
    app.wait_replied(dt, WAIT).await;

    // The generic channel.
    let message = |id: &str, extra: Value| {
        let mut m = json!({"event_id": id, "message_id": id, "conversation_id": "team-7",
            "sender_id": "u-1", "text": "question", "chat_type": "group", "mentioned": true});
        for (k, v) in extra.as_object().unwrap() {
            m[k] = v.clone();
        }
        m
    };
    let threaded = task_id_of(
        app.post_message(&message("g1", json!({"thread_id": "th-1"})))
            .await,
    )
    .await;
    let member = task_id_of(app.post_message(&message("g2", json!({}))).await).await;
    assert_eq!(conversation_tasks(&app, "team-7#t=th-1").await, [threaded]);
    assert_eq!(conversation_tasks(&app, "team-7#u=u-1").await, [member]);
    for bad in [
        json!({"conversation_id": "team#u=x"}),
        json!({"thread_id": 5}),
        json!({"thread_id": ""}),
    ] {
        let resp = app.post_message(&message("g3", bad.clone())).await;
        assert_eq!(resp.status(), 400, "{bad}");
    }
    app.wait_replied(threaded, WAIT).await;
    app.wait_replied(member, WAIT).await;
    let received = requests_to(&app.receiver, "^/reply$").await;
    let to_thread = received.iter().find(|r| r["task_id"] == threaded).unwrap();
    assert_eq!(to_thread["conversation_id"], "team-7");
    assert_eq!(to_thread["thread_id"], "th-1");
    let to_member = received.iter().find(|r| r["task_id"] == member).unwrap();
    assert_eq!(to_member["conversation_id"], "team-7");
    assert!(to_member.get("thread_id").is_none(), "{to_member}");
    app.stop().await;
}
