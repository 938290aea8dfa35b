//! Issue 33, part 1: in group chats the bot answers only what is addressed to it (a mention,
//! a reply to its message, a configured prefix; `group_reply = "all"` answers everything),
//! direct chats always; a group message that is not a question is acknowledged (200, the
//! platform does not retry) and creates nothing; edits are never questions. Each platform's
//! own fields, as its documentation gives them: Telegram `chat.type`, `entities`,
//! `reply_to_message`; Slack `channel_type`, `app_mention`, `parent_user_id`; Lark
//! `chat_type`, `mentions`; DingTalk `conversationType`, `isInAtList`; the generic channel's
//! documented `chat_type`, `mentioned`, `reply_to_bot`; Matrix `m.replace` edits.

use serde_json::{Value, json};

use super::*;

async fn counts(app: &TestApp) -> (i64, i64) {
    let (messages, tasks, _) = app.store().intake_row_counts().await.unwrap();
    (messages, tasks)
}

async fn ignored(resp: reqwest::Response) -> String {
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    body["ignored"]
        .as_str()
        .unwrap_or_else(|| panic!("not ignored: {body}"))
        .to_string()
}

fn tg_group(update_id: i64, message_id: i64, text: &str) -> Value {
    tg_update(update_id, -500, message_id, 42, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telegram_groups_answer_mentions_replies_and_prefixes_only() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |c| {
        c.channels.telegram.prefixes = vec!["/ask".into()];
    })
    .await;
    // Chatter in the group: acknowledged, nothing written.
    let chatter = app
        .telegram(&tg_group(1, 1, "lunch at noon?"), Some(TG_SECRET))
        .await;
    assert!(ignored(chatter).await.contains("not addressed"));
    assert_eq!(counts(&app).await, (0, 0));
    // A mention by name, a text_mention entity, a reply to the bot, a prefix: questions.
    let mention = app
        .telegram(
            &tg_group(2, 2, "@helper_bot where is room 4?"),
            Some(TG_SECRET),
        )
        .await;
    let mention = task_id_of(mention).await;
    let mut entity = tg_group(3, 3, "Helper, the wifi password?");
    entity["message"]["entities"] = json!([{"type": "text_mention", "offset": 0, "length": 6,
        "user": {"id": 7, "is_bot": true, "first_name": "Helper", "username": "helper_bot"}}]);
    task_id_of(app.telegram(&entity, Some(TG_SECRET)).await).await;
    let mut reply = tg_group(4, 4, "and on Sundays?");
    reply["message"]["reply_to_message"] = json!({"message_id": 99, "date": 1,
        "chat": {"id": -500, "type": "group"},
        "from": {"id": 7, "is_bot": true, "first_name": "Helper", "username": "helper_bot"},
        "text": "The canteen opens at 8."});
    task_id_of(app.telegram(&reply, Some(TG_SECRET)).await).await;
    let prefixed = task_id_of(
        app.telegram(&tg_group(5, 5, "/ask 报销怎么申请？"), Some(TG_SECRET))
            .await,
    )
    .await;
    // A reply to another member is chatter.
    let mut other = tg_group(6, 6, "thanks!");
    other["message"]["reply_to_message"] = json!({"message_id": 98, "date": 1,
        "chat": {"id": -500, "type": "group"},
        "from": {"id": 43, "is_bot": false, "first_name": "Bo"}, "text": "see you"});
    ignored(app.telegram(&other, Some(TG_SECRET)).await).await;
    // A private chat is always answered; an edit never.
    task_id_of(
        app.telegram(&tg_update(7, 42, 1, 42, "hello"), Some(TG_SECRET))
            .await,
    )
    .await;
    let edit = json!({"update_id": 8, "edited_message": {"message_id": 2, "date": 1,
        "from": {"id": 42, "is_bot": false, "first_name": "Ada"},
        "chat": {"id": -500, "type": "group"}, "text": "@helper_bot where is room 5?"}});
    ignored(app.telegram(&edit, Some(TG_SECRET)).await).await;
    assert_eq!(counts(&app).await, (5, 5));
    let task = app.wait_replied(prefixed, WAIT).await;
    assert_eq!(
        task["reply"]["content"]["text"],
        "answer to: 报销怎么申请？"
    );
    let task = app.wait_replied(mention, WAIT).await;
    assert_eq!(
        task["reply"]["content"]["text"],
        "answer to: where is room 4?"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_channels_answer_mentions_and_thread_replies_to_the_bot_direct_messages_always() {
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let chatter = slack_event(
        "EvG1",
        json!({"type": "message", "channel_type": "channel", "user": "U1", "text": "standup in 5",
            "ts": "1800.0001", "channel": "C5"}),
    );
    ignored(app.slack_event(&chatter).await).await;
    assert_eq!(counts(&app).await, (0, 0));
    let direct = slack_event(
        "EvG2",
        json!({"type": "message", "channel_type": "im", "user": "U1", "text": "what is the VPN address?",
            "ts": "1800.0002", "channel": "D5"}),
    );
    task_id_of(app.slack_event(&direct).await).await;
    let in_thread = slack_event(
        "EvG3",
        json!({"type": "message", "channel_type": "channel", "user": "U2", "text": "and the port?",
            "ts": "1800.0004", "thread_ts": "1800.0003", "parent_user_id": "UBOT", "channel": "C5"}),
    );
    task_id_of(app.slack_event(&in_thread).await).await;
    let mention = slack_event(
        "EvG4",
        json!({"type": "message", "channel_type": "channel", "user": "U2", "text": "<@UBOT> thanks, and DNS?",
            "ts": "1800.0005", "channel": "C5"}),
    );
    task_id_of(app.slack_event(&mention).await).await;
    let edited = slack_event(
        "EvG5",
        json!({"type": "message", "subtype": "message_changed", "channel_type": "channel", "channel": "C5",
            "ts": "1800.0006", "message": {"user": "U2", "text": "<@UBOT> thanks, and NTP?", "ts": "1800.0005"}}),
    );
    ignored(app.slack_event(&edited).await).await;
    assert_eq!(counts(&app).await, (3, 3));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_dingtalk_and_matrix_groups_answer_only_what_is_addressed() {
    let api = platform_api().await;
    mount_lark(&api).await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| {
        enable_lark(c, &uri, "default");
        enable_matrix(c, &uri);
        enable_dingtalk(c, &uri);
    })
    .await;
    // Lark: a group message that mentions nobody is chatter; a p2p message is a question.
    let mut chatter = lark_message("ev-g1", "om_g1", "user", "会议改到三点");
    chatter["event"]["message"]["mentions"] = json!([]);
    ignored(app.lark("/webhooks/lark", &chatter, LARK_KEY, now()).await).await;
    let mut p2p = lark_message("ev-g2", "om_g2", "user", "年假有几天？");
    p2p["event"]["message"]["chat_type"] = json!("p2p");
    p2p["event"]["message"]["mentions"] = json!([]);
    assert_eq!(
        app.lark("/webhooks/lark", &p2p, LARK_KEY, now())
            .await
            .status(),
        200
    );
    // DingTalk: a group message not @-ing the robot is chatter; a 1:1 message a question.
    let now_ms = assistd::domain::now_ms();
    let session = format!("{}/robot/sendBySession?session=s1", api.uri());
    let mut not_at = dingtalk_message("dt-g1", "2", &session, now_ms + 3_600_000, "收到");
    not_at["isInAtList"] = json!(false);
    ignored(app.dingtalk(&not_at, DT_SECRET, now_ms).await).await;
    let direct = dingtalk_message("dt-g2", "1", &session, now_ms + 3_600_000, "报销流程？");
    // A timestamp/sign pair is good for one body only: the next message signs anew.
    assert_eq!(
        app.dingtalk(&direct, DT_SECRET, now_ms + 1).await.status(),
        200
    );
    // Matrix: a user's edit of a message arrives as a new m.room.message: not a question.
    let edit = json!({"type": "m.room.message", "room_id": "!r:hs", "sender": "@ada:hs",
        "event_id": "$edit1", "content": {"msgtype": "m.text", "body": "* @assistd:hs where?",
            "m.new_content": {"msgtype": "m.text", "body": "@assistd:hs where?"},
            "m.relates_to": {"rel_type": "m.replace", "event_id": "$orig"}}});
    assert_eq!(app.matrix_txn("g1", json!([edit])).await.status(), 200);
    assert_eq!(counts(&app).await, (2, 2), "the p2p and 1:1 questions only");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generic_channel_takes_chat_type_mentioned_and_reply_to_bot() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.channels.generic.prefixes = vec!["助手".into()];
    })
    .await;
    let with = |n: u32, text: &str, extra: Value| {
        let mut m = message("team-room", n, text);
        for (k, v) in extra.as_object().unwrap() {
            m[k] = v.clone();
        }
        m
    };
    let chatter = with(1, "coffee?", json!({"chat_type": "group"}));
    assert!(
        ignored(app.post_message(&chatter).await)
            .await
            .contains("not addressed")
    );
    assert_eq!(counts(&app).await, (0, 0));
    let bad = with(2, "hi", json!({"chat_type": "channel"}));
    let resp = app.post_message(&bad).await;
    assert_eq!(resp.status(), 400);
    assert!(resp.text().await.unwrap().contains("chat_type"));
    let bad = with(3, "hi", json!({"chat_type": "group", "mentioned": "yes"}));
    assert_eq!(app.post_message(&bad).await.status(), 400);
    assert_eq!(counts(&app).await, (0, 0), "nothing written for a bad body");
    let mentioned = with(
        4,
        "the VPN?",
        json!({"chat_type": "group", "mentioned": true}),
    );
    task_id_of(app.post_message(&mentioned).await).await;
    let reply = with(
        5,
        "and DNS?",
        json!({"chat_type": "group", "reply_to_bot": true}),
    );
    task_id_of(app.post_message(&reply).await).await;
    let prefixed = with(6, "助手：年假几天？", json!({"chat_type": "group"}));
    let id = task_id_of(app.post_message(&prefixed).await).await;
    // Without chat_type a message is direct, as before.
    task_id_of(app.post_message(&message("dm", 7, "hello")).await).await;
    assert_eq!(counts(&app).await, (4, 4));
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["reply"]["content"]["text"], "answer to: 年假几天？");
    app.stop().await;
}

/// The ids of the tasks of the conversation `key`, oldest first.
pub(crate) async fn conversation_tasks(app: &TestApp, key: &str) -> Vec<i64> {
    let query = format!(
        "conversation={}",
        url::form_urlencoded::byte_serialize(key.as_bytes()).collect::<String>()
    );
    let tasks: Value = app.list(&query).await.json().await.unwrap();
    let mut ids: Vec<i64> = tasks["tasks"]
        .as_array()
        .unwrap_or_else(|| panic!("{tasks}"))
        .iter()
        .map(|t| t["id"].as_i64().unwrap())
        .collect();
    ids.sort();
    ids
}

fn mx_text(room: &str, event_id: &str, content: Value) -> Value {
    json!({"type": "m.room.message", "room_id": room, "sender": "@ada:hs", "event_id": event_id,
           "origin_server_ts": 1, "content": content})
}

fn mx_member(room: &str, user: &str, membership: &str) -> Value {
    json!({"type": "m.room.member", "room_id": room, "sender": user, "state_key": user,
           "event_id": format!("$m-{user}-{membership}"), "content": {"membership": membership}})
}

/// Matrix: a room is a direct chat when it has at most two joined members and is in the
/// bot's `m.direct` (an invite marked `is_direct` puts it there); in any other room the bot
/// answers a mention (`m.mentions`, its ID, a pill), a reply to one of its messages or a
/// prefix; a membership change is seen at once; a homeserver that cannot say what a room is
/// gets 503 and the transaction is taken when sent again, nothing written before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_rooms_answer_mentions_and_replies_direct_chats_always() {
    let hs = wiremock::MockServer::start().await;
    let rooms = mount_room_sends(&hs).await;
    rooms.room("!team:hs", &["@ada:hs", "@bo:hs", "@cy:hs"], None);
    // Two members but never marked direct: a group of two.
    rooms.room("!pair:hs", &["@ada:hs"], None);
    let uri = hs.uri();
    let app = spawn_platforms(&hs, move |c| {
        enable_matrix(c, &uri);
        c.channels.matrix.prefixes = vec!["!ask".into()];
    })
    .await;
    let text = |body: &str| json!({"msgtype": "m.text", "body": body});
    let chatter = mx_text("!team:hs", "$c1", text("lunch at noon?"));
    let pair = mx_text("!pair:hs", "$c2", text("are you there?"));
    let notice = mx_text(
        "!r:hs",
        "$c3",
        json!({"msgtype": "m.notice", "body": "build passed"}),
    );
    assert_eq!(
        app.matrix_txn("t1", json!([chatter, pair, notice]))
            .await
            .status(),
        200
    );
    assert_eq!(
        counts(&app).await,
        (0, 0),
        "chatter, a group of two, a notice"
    );
    // A mention by m.mentions, by pill, by ID, and a prefix: four questions.
    let by_mentions = mx_text(
        "!team:hs",
        "$q1",
        json!({"msgtype": "m.text", "body": "assistd: where is room 4?",
        "m.mentions": {"user_ids": ["@assistd:hs"]}}),
    );
    let by_pill = mx_text(
        "!team:hs",
        "$q2",
        json!({"msgtype": "m.text", "body": "assistd: the wifi?",
        "format": "org.matrix.custom.html",
        "formatted_body": "<a href=\"https://matrix.to/#/@assistd:hs\">assistd</a>: the wifi?"}),
    );
    let by_id = mx_text("!pair:hs", "$q3", text("@assistd:hs 报销怎么申请？"));
    let by_prefix = mx_text("!team:hs", "$q4", text("!ask holidays?"));
    assert_eq!(
        app.matrix_txn("t2", json!([by_mentions, by_pill, by_id, by_prefix]))
            .await
            .status(),
        200
    );
    assert_eq!(counts(&app).await, (4, 4));
    // Each question in the room opened a thread: its own conversation, answered in it.
    let first = conversation_tasks(&app, "!team:hs#t=$q1").await;
    assert_eq!(first.len(), 1);
    let answered = app.wait_replied(first[0], WAIT).await;
    let answer_event = answered["reply"]["platform_message_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no event id: {answered}"))
        .to_string();
    let sent: Vec<Value> = hs
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.method.as_str() == "PUT" && r.url.path().contains("/send/"))
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    assert!(
        sent.iter().any(|b| b["m.relates_to"]
            == json!({"rel_type": "m.thread", "event_id": "$q1", "is_falling_back": true,
                      "m.in_reply_to": {"event_id": "$q1"}})),
        "the answer goes into the question's thread: {sent:?}"
    );
    // A reply to the bot's answer in its thread (with the quoted fallback) is a question
    // of that thread's conversation; a reply to a member's message is chatter.
    let reply = mx_text(
        "!team:hs",
        "$q5",
        json!({"msgtype": "m.text",
        "body": "> <@assistd:hs> answer to: where is room 4?\n\nand room 5?",
        "m.relates_to": {"rel_type": "m.thread", "event_id": "$q1", "is_falling_back": false,
            "m.in_reply_to": {"event_id": answer_event}}}),
    );
    let other = mx_text(
        "!team:hs",
        "$c4",
        json!({"msgtype": "m.text", "body": "thanks",
        "m.relates_to": {"m.in_reply_to": {"event_id": "$q1"}}}),
    );
    assert_eq!(
        app.matrix_txn("t3", json!([reply, other])).await.status(),
        200
    );
    assert_eq!(counts(&app).await, (5, 5));
    let mut texts = Vec::new();
    for id in conversation_tasks(&app, "!team:hs#t=$q1").await {
        let task = app.get_task(id).await;
        texts.push(task["message"]["text"].as_str().unwrap_or("").to_string());
    }
    assert_eq!(texts, ["where is room 4?", "and room 5?"]);

    // An invite marked is_direct: the bot joins and records the room in m.direct; from
    // then on the room is a direct chat, answered without a mention.
    rooms.invite("!dm:hs", &["@ada:hs"]);
    let invite = json!({"type": "m.room.member", "room_id": "!dm:hs", "sender": "@ada:hs",
        "state_key": "@assistd:hs", "event_id": "$inv", "content": {"membership": "invite", "is_direct": true}});
    assert_eq!(app.matrix_txn("t4", json!([invite])).await.status(), 200);
    assert_eq!(
        rooms.direct()["@ada:hs"],
        json!([
            "!r:hs",
            "!room:hs",
            "!s:hs",
            "!nul:hs",
            "!batch:hs",
            "!dm:hs"
        ])
    );
    let direct = mx_text("!dm:hs", "$q6", text("what is the VPN address?"));
    assert_eq!(app.matrix_txn("t5", json!([direct])).await.status(), 200);
    assert_eq!(counts(&app).await, (6, 6));
    // A third member joins: the join event in the transaction makes it a group at once.
    rooms.join("!dm:hs", "@bo:hs");
    let joined = mx_member("!dm:hs", "@bo:hs", "join");
    let after = mx_text("!dm:hs", "$c5", text("hi Bo"));
    assert_eq!(
        app.matrix_txn("t6", json!([joined, after])).await.status(),
        200
    );
    assert_eq!(counts(&app).await, (6, 6), "a room of three is a group");

    // The homeserver cannot say what a new room is: 503 (M_UNKNOWN), nothing written; sent
    // again once it can, the transaction is taken.
    let unknown = mx_text("!new2:hs", "$q7", text("hello?"));
    let resp = app.matrix_txn("t7", json!([unknown.clone()])).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.json::<Value>().await.unwrap()["errcode"], "M_UNKNOWN");
    assert_eq!(counts(&app).await, (6, 6));
    rooms.room("!new2:hs", &["@ada:hs"], Some("@ada:hs"));
    assert_eq!(app.matrix_txn("t7", json!([unknown])).await.status(), 200);
    assert_eq!(counts(&app).await, (7, 7));
    app.stop().await;
}

/// `group_context = N`: the last N group messages not addressed to the bot are kept per chat
/// (acknowledged as kept, no task, once however often the platform delivers one) and shown to the model before the chat's next question;
/// other chats' chatter is not; retention removes them at the messages' age; with the
/// default 0 nothing is kept. Through a Telegram group and a Matrix transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_chatter_is_kept_as_context_for_the_next_question() {
    let api = platform_api().await;
    let rooms = mount_room_sends(&api).await;
    rooms.room("!ctx:hs", &["@ada:hs", "@bo:hs"], None);
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| {
        c.channels.telegram.group_context = 2;
        enable_matrix(c, &uri);
        c.channels.matrix.group_context = 5;
    })
    .await;
    for (n, text) in [
        (1, "the train is late"),
        (2, "meeting moved to 3pm"),
        (3, "lunch at noon"),
    ] {
        let said = app
            .telegram(&tg_update(n, -700, n, 40 + n, text), Some(TG_SECRET))
            .await;
        assert_eq!(
            ignored(said).await,
            "a group message not addressed to the bot; kept as context"
        );
    }
    // Telegram delivers an update again when it missed our answer: it is kept once.
    let again = app
        .telegram(&tg_update(3, -700, 3, 43, "lunch at noon"), Some(TG_SECRET))
        .await;
    ignored(again).await;
    // Another group's chatter is its own.
    ignored(
        app.telegram(&tg_update(4, -701, 1, 50, "secret plans"), Some(TG_SECRET))
            .await,
    )
    .await;
    assert_eq!(counts(&app).await, (0, 0));
    let messages = ask_about_the_meeting(&app, 5, -700).await;
    let n = messages.len();
    assert_eq!(messages[n - 1]["content"], "when is the meeting?");
    let context = messages[n - 2]["content"].as_str().unwrap();
    assert!(
        context.contains("ada: meeting moved to 3pm\nada: lunch at noon"),
        "the last two, oldest first: {context}"
    );
    assert!(
        !context.contains("train") && !context.contains("secret plans"),
        "{context}"
    );

    // Matrix: chatter in a transaction is kept too.
    let mx = json!([mx_text(
        "!ctx:hs",
        "$c1",
        json!({"msgtype": "m.text", "body": "deploy is done"})
    )]);
    assert_eq!(app.matrix_txn("t-ctx", mx).await.status(), 200);
    let kept = app
        .store()
        .group_context("matrix", "!ctx:hs", i64::MAX, 10)
        .await
        .unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(
        (kept[0].sender_id.as_str(), kept[0].text.as_str()),
        ("@ada:hs", "deploy is done")
    );

    // Retention removes them at the age of the other messages.
    let ttl = app.config.scheduler.jobs.retention.ttl_days as i64 * 86_400_000;
    assistd::scheduler::retention(&app.jobs, 500, assistd::domain::now_ms() + ttl + 1)
        .await
        .unwrap();
    for (channel, chat) in [
        ("telegram", "-700"),
        ("telegram", "-701"),
        ("matrix", "!ctx:hs"),
    ] {
        let left = app
            .store()
            .group_context(channel, chat, i64::MAX, 10)
            .await
            .unwrap();
        assert!(left.is_empty(), "{channel} {chat}: {left:?}");
    }
    app.stop().await;

    // The default keeps nothing.
    let api = platform_api().await;
    let app = spawn_platforms(&api, |_| {}).await;
    let said = app
        .telegram(&tg_update(1, -700, 1, 41, "lunch at noon"), Some(TG_SECRET))
        .await;
    assert_eq!(
        ignored(said).await,
        "a group message not addressed to the bot"
    );
    let kept = app
        .store()
        .group_context("telegram", "-700", i64::MAX, 10)
        .await
        .unwrap();
    assert!(kept.is_empty());
    app.stop().await;
}

/// Lark: a group message replying to one of the bot's messages (`parent_id`, looked up with
/// `GET /im/v1/messages/{id}`: its sender is the app) is a question without a mention; a
/// reply to a member's message is chatter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lark_replies_to_the_bot_are_questions() {
    let api = platform_api().await;
    mount_lark(&api).await;
    let uri = api.uri();
    let app = spawn_platforms(&api, move |c| enable_lark(c, &uri, "default")).await;
    let asked = lark_message("ev-r1", "om_r1", "user", "@_user_1 年假有几天？");
    let first = task_id_of(app.lark("/webhooks/lark", &asked, LARK_KEY, now()).await).await;
    let answered = app.wait_replied(first, WAIT).await;
    let answer = answered["reply"]["platform_message_id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut reply = lark_message("ev-r2", "om_r2", "user", "病假呢？");
    reply["event"]["message"]["mentions"] = json!([]);
    reply["event"]["message"]["parent_id"] = json!(answer);
    reply["event"]["message"]["root_id"] = json!("om_r1");
    let second = task_id_of(app.lark("/webhooks/lark", &reply, LARK_KEY, now()).await).await;
    let task = app.wait_replied(second, WAIT).await;
    assert_eq!(task["reply"]["content"]["text"], "answer to: 病假呢？");
    assert_eq!(
        task["conversation_id"], "oc_chat#t=om_r1",
        "in the question's thread"
    );
    let mut other = lark_message("ev-r3", "om_r3", "user", "谢谢");
    other["event"]["message"]["mentions"] = json!([]);
    other["event"]["message"]["parent_id"] = json!("om_r1");
    ignored(app.lark("/webhooks/lark", &other, LARK_KEY, now()).await).await;
    assert_eq!(counts(&app).await, (2, 2));
    app.stop().await;
}

/// A workflow agent gets the group's chatter too: as `group_context` in its templates and as
/// one message after the history, before the prompt, in its `llm` (and `agent`) model calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_agent_sees_the_group_chatter() {
    const FLOW: &str = r#"{"start": "ask", "nodes": [
        {"id": "ask", "type": "llm", "next": "done",
         "prompt": "Chatter:{% for m in group_context %} {{ m.sender }}={{ m.text }};{% endfor %} Question: {{ message.text }}"},
        {"id": "done", "type": "reply", "text": "{{ steps.ask.text }}"}]}"#;
    let api = platform_api().await;
    let uri = api.uri();
    let flow = crate::workflows::spawn_flow_with(FLOW, move |c| {
        enable_platforms(c, &uri, "flow");
        c.channels.telegram.group_context = 2;
    })
    .await;
    let app = &flow.app;
    for (n, text) in [
        (1, "the train is late"),
        (2, "meeting moved to 3pm"),
        (3, "lunch at noon"),
    ] {
        let said = app
            .telegram(&tg_update(n, -800, n, 40 + n, text), Some(TG_SECRET))
            .await;
        ignored(said).await;
    }
    let messages = ask_about_the_meeting(app, 4, -800).await;
    let n = messages.len();
    let prompt = messages[n - 1]["content"].as_str().unwrap();
    assert_eq!(
        prompt,
        "Chatter: ada=meeting moved to 3pm; ada=lunch at noon; Question: when is the meeting?"
    );
    let context = messages[n - 2]["content"].as_str().unwrap();
    assert!(
        context.contains("ada: meeting moved to 3pm\nada: lunch at noon")
            && !context.contains("train"),
        "{context}"
    );
    flow.app.stop().await;
}

/// Asks the bot in Telegram group `chat` (update and message `n`) when the meeting is, and
/// returns the messages of the model call that answered.
async fn ask_about_the_meeting(app: &TestApp, n: i64, chat: i64) -> Vec<Value> {
    let asked = tg_update(n, chat, n, 41, "@helper_bot when is the meeting?");
    let id = task_id_of(app.telegram(&asked, Some(TG_SECRET)).await).await;
    app.wait_replied(id, WAIT).await;
    let calls = model_bodies(&app.model).await;
    calls.last().unwrap()["messages"]
        .as_array()
        .unwrap()
        .clone()
}
