//! A 12,000-character answer (English paragraphs, a Chinese run without spaces, emoji ZWJ
//! sequences across a cut) on every platform: numbered parts, each within the platform's
//! documented limit in its own unit, in order, each under its own key, nothing lost or cut
//! inside a character or an emoji sequence. The doubles refuse what the platforms refuse.

use std::time::Duration;

use serde_json::{Value, json};
use unicode_segmentation::UnicodeSegmentation;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer};

use super::*;
use crate::strict_model::{ModelReply, model_mock};

const FAMILY: &str = "👨\u{200d}👩\u{200d}👧\u{200d}👦";

/// About 12,000 characters: English sentences, then Chinese without a space, then emoji
/// family sequences without a space, then English again.
pub(crate) fn long_answer() -> String {
    let english =
        "The travel policy covers flights, hotels and meals. Book through the portal two weeks ahead. "
            .repeat(40);
    let chinese = "差旅政策适用于所有员工请提前两周通过门户预订机票和酒店".repeat(110);
    let emoji = FAMILY.repeat(400);
    let answer = format!(
        "{}\n\n{chinese}\n\n{emoji}\n\n{}",
        english.trim(),
        english.trim()
    );
    assert!(answer.chars().count() > 11_000);
    answer
}

/// Six long answers: about 80 KB, past Matrix's and Lark's limits too.
fn huge_answer() -> String {
    vec![long_answer(); 6].join("\n\n")
}

/// Answers a question asking for a "huge" answer with `huge_answer`, one asking for a
/// "short" one in three words, any other with `long_answer`.
async fn long_model() -> MockServer {
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        let question = crate::helpers::last_content(body);
        ModelReply::text(if question.contains("huge") {
            huge_answer()
        } else if question.contains("short") {
            "a short answer".to_string()
        } else {
            long_answer()
        })
    })
    .mount(&model)
    .await;
    model
}

/// Checks the texts a platform received, in order: numbered `(k/n) `, each within `fits`,
/// together the whole answer, no emoji sequence broken.
fn check_parts(platform: &str, texts: &[String], fits: impl Fn(&str) -> bool) {
    check_parts_of(platform, &long_answer(), texts, fits)
}

fn check_parts_of(platform: &str, answer: &str, texts: &[String], fits: impl Fn(&str) -> bool) {
    let n = texts.len();
    assert!(
        n > 1,
        "{platform}: one message of {} chars",
        texts[0].chars().count()
    );
    let mut joined = String::new();
    for (k, text) in texts.iter().enumerate() {
        assert!(fits(text), "{platform}: part {} is over the limit", k + 1);
        let marker = format!("({}/{n}) ", k + 1);
        let body = text
            .strip_prefix(&marker)
            .unwrap_or_else(|| panic!("{platform}: part {} is not marked {marker:?}", k + 1));
        joined.push_str(body);
        joined.push('\n');
    }
    let strip = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
    assert_eq!(strip(&joined), strip(answer), "{platform}: text lost");
    let families = joined.graphemes(true).filter(|g| *g == FAMILY).count();
    let want = answer.graphemes(true).filter(|g| *g == FAMILY).count();
    assert_eq!(families, want, "{platform}: an emoji sequence was cut");
}

fn no_placeholders(c: &mut assistd::Config) {
    c.replies.placeholder = String::new();
    c.replies.stream_edit_ms = 0;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_goes_as_numbered_parts_on_telegram_slack_and_the_generic_channel() {
    let api = platform_api().await;
    let uri = api.uri();
    let app = TestApp::spawn_with(long_model().await, accepting_receiver().await, move |c| {
        enable_platforms(c, &uri, "default");
        no_placeholders(c);
        c.channels.generic.max_text_chars = 3000;
    })
    .await;

    let tg = task_id_of(
        app.telegram(
            &tg_update(1, -100, 5, 42, "@helper_bot the travel policy?"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let slack = task_id_of(
        app.slack_event(&slack_event(
            "Ev1",
            json!({"type": "app_mention", "user": "U1", "text": "<@UBOT> travel?", "ts": "1700.0001", "channel": "C9"}),
        ))
        .await,
    )
    .await;
    let generic = task_id_of(app.post_message(&message("conv-long", 1, "travel?")).await).await;
    for id in [tg, slack, generic] {
        app.wait_replied(id, WAIT).await;
    }

    let texts = |bodies: Vec<Value>| -> Vec<String> {
        bodies
            .iter()
            .map(|b| b["text"].as_str().unwrap().to_string())
            .collect()
    };
    let telegram = texts(sends(&api, &format!("/bot{TG_TOKEN}/sendMessage")).await);
    check_parts("telegram", &telegram, |t| t.encode_utf16().count() <= 4096);
    let slack_texts = texts(sends(&api, "/chat.postMessage").await);
    check_parts("slack", &slack_texts, |t| t.chars().count() <= 4000);

    let replies = app.replies().await;
    let keys: Vec<&str> = replies.iter().map(|(k, _)| k.as_str()).collect();
    let n = replies.len();
    let mut want = vec![format!("agent-task-{generic}")];
    want.extend((2..=n).map(|k| format!("agent-task-{generic}-part-{k}")));
    assert_eq!(keys, want, "each part under its own key, in order");
    let generic_texts: Vec<String> = replies
        .iter()
        .map(|(_, b)| b["text"].as_str().unwrap().to_string())
        .collect();
    check_parts("generic", &generic_texts, |t| t.chars().count() <= 3000);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_goes_as_numbered_parts_on_matrix_lark_wecom_and_dingtalk() {
    let api = platform_api().await;
    mount_lark(&api).await;
    mount_room_sends(&api).await;
    mount_wecom(&api).await;
    mount_dingtalk_session(&api).await;
    let uri = api.uri();
    let app = TestApp::spawn_with(long_model().await, accepting_receiver().await, move |c| {
        no_placeholders(c);
        enable_matrix(c, &uri);
        enable_lark(c, &uri, "default");
        enable_wecom(c, &uri, "default");
        // Parts keep the chat's send pace; a short one keeps the test short.
        c.channels.wecom.per_chat_interval_ms = 200;
        c.channels.dingtalk.per_chat_interval_ms = 200;
        enable_dingtalk(c, &uri);
    })
    .await;

    let matrix = json!({"type": "m.room.message", "room_id": "!room:hs", "sender": "@ada:hs",
        "event_id": "$q1", "content": {"msgtype": "m.text", "body": "@assistd:hs a huge answer please"}});
    assert_eq!(app.matrix_txn("t1", json!([matrix])).await.status(), 200);
    let now_ms = assistd::domain::now_ms();
    let lark = app
        .lark(
            "/webhooks/lark",
            &lark_message("ev-long", "om_q", "user", "@_user_1 a huge answer please"),
            LARK_KEY,
            now(),
        )
        .await;
    assert_eq!(lark.status(), 200);
    let wecom = app
        .wecom_post(&wecom_text("9001", "travel?"), wecom_sample::TOKEN)
        .await;
    assert_eq!(wecom.status(), 200);
    let session = format!("{}/robot/sendBySession?session=s1", api.uri());
    let dingtalk = dingtalk_message("msg-long", "2", &session, now_ms + 3_600_000, "travel?");
    assert_eq!(
        app.dingtalk(&dingtalk, DT_SECRET, now_ms).await.status(),
        200
    );

    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let listed = app.admin_json("/api/tasks?limit=50").await;
        let tasks: Vec<i64> = listed["tasks"]
            .as_array()
            .map(|t| t.iter().filter_map(|t| t["id"].as_i64()).collect())
            .unwrap_or_default();
        let mut done = 0;
        for id in &tasks {
            let task = app.get_task(*id).await;
            if task["reply"]["status"] == "SENT" {
                done += 1;
            }
        }
        if tasks.len() == 4 && done == 4 {
            break;
        }
        if std::time::Instant::now() >= deadline {
            let mut states = Vec::new();
            for id in &tasks {
                let task = app.get_task(*id).await;
                states.push(json!([
                    task["channel"],
                    task["status"],
                    task["reply"]["status"],
                    task["reply"]["last_error"],
                    task["reply"]["attempts"]
                ]));
            }
            panic!("{done} of 4 answered: {states:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let requests = api.received_requests().await.unwrap();
    let bodies = |pattern: &str| -> Vec<Value> {
        let re = regex::Regex::new(pattern).unwrap();
        requests
            .iter()
            .filter(|r| re.is_match(r.url.path()))
            .map(|r| serde_json::from_slice(&r.body).unwrap())
            .collect()
    };
    let matrix_texts: Vec<String> = bodies(r"/send/m\.room\.message/")
        .iter()
        .map(|b| b["body"].as_str().unwrap().to_string())
        .collect();
    check_parts_of("matrix", &huge_answer(), &matrix_texts, |t| {
        serde_json::to_string(t).unwrap().len() <= 30_002
    });
    let lark_texts: Vec<String> = bodies(r"^/open-apis/im/v1/messages/[^/]+/reply$")
        .iter()
        .map(|b| {
            let content: Value = serde_json::from_str(b["content"].as_str().unwrap()).unwrap();
            content["text"].as_str().unwrap().to_string()
        })
        .collect();
    check_parts_of("lark", &huge_answer(), &lark_texts, |t| {
        t.len() <= 30 * 1024
    });
    let wecom_texts: Vec<String> = bodies("^/cgi-bin/message/send$")
        .iter()
        .map(|b| b["text"]["content"].as_str().unwrap().to_string())
        .collect();
    check_parts("wecom", &wecom_texts, |t| t.len() <= 2048);
    let dingtalk_texts: Vec<String> = bodies("^/robot/sendBySession$")
        .iter()
        .map(|b| b["text"]["content"].as_str().unwrap().to_string())
        .collect();
    check_parts("dingtalk", &dingtalk_texts, |t| t.chars().count() <= 2000);
    app.stop().await;
}

/// A 12,000-character answer streamed into Telegram: no edit ever goes past 4,096 UTF-16
/// units (the streamed message stops at its first part), and the answer ends as that
/// message edited into part 1 plus the other parts as new messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_streamed_answer_never_edits_past_the_limit() {
    let api = platform_api().await;
    let model = crate::strict_model::SlowStreamingModel::start(
        &long_answer(),
        200,
        Duration::from_millis(25),
    )
    .await;
    let (uri, model_uri) = (api.uri(), model.uri.clone());
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            enable_platforms(c, &uri, "default");
            c.llm.base_url = format!("{model_uri}/v1");
            c.replies.stream_edit_ms = 60;
            c.replies.placeholder_after_ms = 0;
            c.channels.telegram.per_chat_interval_ms = 100;
        },
    )
    .await;
    let id = task_id_of(
        app.telegram(
            &tg_update(2, -200, 6, 42, "@helper_bot the travel policy?"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    let calls: Vec<(String, Value)> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path().ends_with("Message") || r.url.path().ends_with("MessageText"))
        .map(|r| {
            (
                r.url.path().rsplit('/').next().unwrap().to_string(),
                serde_json::from_slice(&r.body).unwrap(),
            )
        })
        .collect();
    for (call, body) in &calls {
        let text = body["text"].as_str().unwrap();
        assert!(
            text.encode_utf16().count() <= 4096,
            "{call} of {} UTF-16 units",
            text.encode_utf16().count()
        );
    }
    let edits: Vec<&Value> = calls
        .iter()
        .filter(|(c, _)| c == "editMessageText")
        .map(|(_, b)| b)
        .collect();
    let summary: Vec<(String, usize)> = calls
        .iter()
        .map(|(c, b)| (c.clone(), b["text"].as_str().unwrap().chars().count()))
        .collect();
    assert!(edits.len() > 1, "the answer was streamed: {summary:?}");
    let sends: Vec<&Value> = calls
        .iter()
        .filter(|(c, _)| c == "sendMessage")
        .map(|(_, b)| b)
        .collect();
    let streamed_id = task["reply"]["platform_message_id"].as_str().unwrap();
    assert!(edits.iter().all(
        |e| e["message_id"].as_i64().map(|id| id.to_string()).as_deref() == Some(streamed_id)
    ));
    let mut texts = vec![edits.last().unwrap()["text"].as_str().unwrap().to_string()];
    texts.extend(
        sends[1..]
            .iter()
            .map(|b| b["text"].as_str().unwrap().to_string()),
    );
    check_parts("telegram (streamed)", &texts, |t| {
        t.encode_utf16().count() <= 4096
    });
    app.stop().await;
}

/// The real binary is killed while it delivers the parts of a long answer to the in-house
/// IM (part 1 accepted, part 2 in flight); after the restart only the missing parts go: part
/// 1 never again, part 2 again under its same key (the IM drops the repeat), the rest once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_parts_resumes_with_the_missing_parts_only() {
    use crate::binary::{RealServer, server_envs};
    use wiremock::matchers::header;
    let db = TestDb::new().await;
    let model = long_model().await;
    let receiver = accepting_receiver().await;
    // Part 2 hangs until the server is killed.
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(header("idempotency-key", "agent-task-1-part-2"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_delay(Duration::from_secs(60)))
        .with_priority(1)
        .up_to_n_times(1)
        .mount(&receiver)
        .await;
    let workdir = tempfile::tempdir().unwrap();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[
            ("ASSISTD_CHANNELS__GENERIC__MAX_TEXT_CHARS", "3000"),
            ("ASSISTD_OUTBOX__POLL_INTERVAL_MS", "100"),
            ("ASSISTD_OUTBOX__TIMEOUT_SECS", "2"),
            ("ASSISTD_OUTBOX__LEASE_SECS", "3"),
            ("ASSISTD_WORKER__LEASE_SECS", "3"),
        ],
    );
    let server = RealServer::start(&envs, workdir.path()).await;
    let resp = server
        .post_message(&message("parts", 1, "the travel policy?"))
        .await;
    let id = task_id_of(resp).await;
    assert_eq!(id, 1, "the hanging part's key names task 1");

    let config = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = assistd::store::Store::connect(&config.database)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let reply = store.task_reply(id).await.unwrap();
        let in_flight = received_replies(&receiver)
            .await
            .iter()
            .any(|(k, _)| k == "agent-task-1-part-2");
        if reply.is_some_and(|r| r.parts_sent == 1) && in_flight {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "part 2 never went");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();

    let server = RealServer::start(&envs, workdir.path()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let reply = store.task_reply(id).await.unwrap().unwrap();
        if reply.status == assistd::domain::ReplyStatus::Sent {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the answer's parts were not all delivered after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(server.terminate(), Some(0));
    let received = received_replies(&receiver).await;
    let count = |key: &str| received.iter().filter(|(k, _)| k == key).count();
    let n = received
        .iter()
        .filter_map(|(_, b)| b["text"].as_str())
        .find_map(|t| t.strip_prefix("(1/"))
        .and_then(|t| t.split(')').next())
        .and_then(|n| n.parse::<usize>().ok())
        .expect("part 1 is numbered");
    assert_eq!(count("agent-task-1"), 1, "part 1 went again");
    assert_eq!(
        count("agent-task-1-part-2"),
        2,
        "part 2: in flight, then again"
    );
    for k in 3..=n {
        assert_eq!(count(&format!("agent-task-1-part-{k}")), 1, "part {k}");
    }
    // As the IM keeps them: one message per key, in order, the whole answer.
    let mut texts: Vec<String> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (key, body) in &received {
        if seen.insert(key.clone()) {
            texts.push(body["text"].as_str().unwrap().to_string());
        }
    }
    check_parts("generic (restarted)", &texts, |t| t.chars().count() <= 3000);
    store.close().await;
    db.drop_db().await;
}

/// Reply order holds across parts: while a long answer's parts wait for the chat's pace, the
/// next question's answer in that conversation waits for all of them (WeCom, 2,048 bytes a
/// message, paced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_answer_waits_for_every_part_of_a_long_one() {
    let api = MockServer::start().await;
    mount_wecom(&api).await;
    let uri = api.uri();
    let app = TestApp::spawn_with(long_model().await, accepting_receiver().await, move |c| {
        no_placeholders(c);
        enable_wecom(c, &uri, "default");
        c.channels.wecom.per_chat_interval_ms = 150;
    })
    .await;
    for (id, text) in [("9101", "the travel policy?"), ("9102", "and a short one?")] {
        let resp = app
            .wecom_post(&wecom_text(id, text), wecom_sample::TOKEN)
            .await;
        assert_eq!(resp.status(), 200);
    }
    let deadline = std::time::Instant::now() + WAIT;
    let texts = loop {
        let texts: Vec<String> = sends(&api, "/cgi-bin/message/send")
            .await
            .iter()
            .map(|b| b["text"]["content"].as_str().unwrap().to_string())
            .collect();
        if texts.last().is_some_and(|t| t == "a short answer") {
            break texts;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} sends",
            texts.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (short, long) = texts.split_last().unwrap();
    assert_eq!(short, "a short answer");
    check_parts("wecom (then the next answer)", long, |t| t.len() <= 2048);
    app.stop().await;
}

/// An app answering with `huge_answer`, streamed in 2,000-character pieces every 40 ms,
/// edits every 60 ms, on the platform `enable` turns on against `api` (its URL given).
async fn streaming_huge_answer(
    api: &MockServer,
    enable: impl FnOnce(&mut assistd::Config, &str) + Send + 'static,
) -> (TestApp, crate::strict_model::SlowStreamingModel, String) {
    let answer = huge_answer();
    let model =
        crate::strict_model::SlowStreamingModel::start(&answer, 2_000, Duration::from_millis(40))
            .await;
    let (uri, model_uri) = (api.uri(), model.uri.clone());
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            enable(c, &uri);
            c.llm.base_url = format!("{model_uri}/v1");
            c.replies.stream_edit_ms = 60;
            c.replies.placeholder_after_ms = 0;
        },
    )
    .await;
    (app, model, answer)
}

/// Issue 33, part 3, streaming: on a platform that drops repeated sends by key (Matrix), a
/// streamed answer that outgrows its message goes on in the next part while it is being
/// written — part 2 is sent once under `<key>-part-2` and edited as the text grows — and the
/// answer's delivery edits the streamed parts into their final `(k/n) ` texts instead of
/// sending them again; no event ever exceeds the homeserver's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_goes_on_in_its_next_parts_on_matrix() {
    let api = MockServer::start().await;
    let rooms = mount_room_sends(&api).await;
    rooms.room("!long:hs", &["@ada:hs"], Some("@ada:hs"));
    let (app, _model, answer) = streaming_huge_answer(&api, enable_matrix).await;
    let mx = json!([{"type": "m.room.message", "room_id": "!long:hs", "sender": "@ada:hs",
        "event_id": "$long", "origin_server_ts": 1, "content": {"msgtype": "m.text", "body": "the travel policy, all of it?"}}]);
    assert_eq!(app.matrix_txn("t-long", mx).await.status(), 200);
    let id = crate::platforms::groups::conversation_tasks(&app, "!long:hs").await[0];
    let task = app.wait_replied(id, WAIT).await;
    // (txn id, body) of every room send, in order.
    let sends: Vec<(String, Value)> = api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.method.as_str() == "PUT" && r.url.path().contains("/send/"))
        .map(|r| {
            assert!(r.body.len() <= 65_536, "an event over the limit");
            let txn = r.url.path().rsplit('/').next().unwrap();
            (
                percent_encoding::percent_decode_str(txn)
                    .decode_utf8_lossy()
                    .into_owned(),
                serde_json::from_slice(&r.body).unwrap(),
            )
        })
        .collect();
    let key = format!("agent-task-{id}");
    let part2 = format!("{key}-part-2");
    let part2_sends: Vec<&(String, Value)> = sends.iter().filter(|(t, _)| *t == part2).collect();
    assert_eq!(part2_sends.len(), 1, "part 2 sent once");
    // The events as the double numbers them: `$e<n>` in the order of new transaction ids
    // (a repeated one answers its first event).
    let mut events: Vec<(String, String, &Value)> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for (txn, body) in &sends {
        let n = seen.len() + 1;
        let id = seen.entry(txn.clone()).or_insert(format!("$e{n}")).clone();
        events.push((txn.clone(), id, body));
    }
    let event_of = |txn: &str| {
        events
            .iter()
            .find(|(t, _, _)| t == txn)
            .map(|(_, id, _)| id.clone())
    };
    let final_of = |event: &str| {
        events
            .iter()
            .rev()
            .find(|(_, _, b)| {
                b["m.relates_to"]["rel_type"] == "m.replace"
                    && b["m.relates_to"]["event_id"] == event
            })
            .map(|(_, _, b)| b["m.new_content"]["body"].as_str().unwrap().to_string())
    };
    let part2_event = event_of(&part2).unwrap();
    let edits_of_part2 = events
        .iter()
        .filter(|(_, _, b)| b["m.relates_to"]["event_id"] == part2_event.as_str())
        .count();
    assert!(
        edits_of_part2 >= 2,
        "part 2 grew while streamed, then took its final text: {edits_of_part2} edits"
    );
    let last = final_of(&part2_event).unwrap();
    assert!(last.starts_with("(2/"), "{}", &last[..20]);
    // The final parts: part 1 (the placeholder, edited) and every later part as its last
    // edit shows it (streamed) or as it was sent, numbered, together the whole answer.
    let placeholder_event = task["reply"]["platform_message_id"].as_str().unwrap();
    let mut finals = vec![final_of(placeholder_event).unwrap()];
    for k in 2.. {
        let txn = format!("{key}-part-{k}");
        let Some(event) = event_of(&txn) else { break };
        let sent = events.iter().find(|(t, _, _)| *t == txn).unwrap().2;
        finals.push(final_of(&event).unwrap_or_else(|| sent["body"].as_str().unwrap().to_string()));
    }
    check_parts_of("matrix (streamed)", &answer, &finals, |t| {
        serde_json::to_string(t).unwrap().len() <= 30_000
    });
    app.stop().await;
}

/// The same on Lark (a reply's `uuid` drops a repeat): part 2 goes once as an editable card
/// while the answer streams, is updated (`PATCH`) as it grows, and ends as its final part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_goes_on_in_its_next_parts_on_lark() {
    let api = MockServer::start().await;
    mount_lark(&api).await;
    let (app, _model, answer) =
        streaming_huge_answer(&api, |c, uri| enable_lark(c, uri, "default")).await;
    let asked = lark_message("ev-stream", "om_q", "user", "@_user_1 the whole policy?");
    let id = task_id_of(app.lark("/webhooks/lark", &asked, LARK_KEY, now()).await).await;
    let task = app.wait_replied(id, WAIT).await;
    let requests = api.received_requests().await.unwrap();
    // Replies (new messages `om_<n>` in the order of new uuids) and card updates, in order.
    let mut ids = std::collections::HashMap::new();
    let mut updates: Vec<(String, String)> = Vec::new();
    let mut sent: Vec<(String, String, Value)> = Vec::new();
    for r in &requests {
        let path = r.url.path();
        if !path.starts_with("/open-apis/im/v1/messages/") {
            continue;
        }
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let content: Value =
            serde_json::from_str(body["content"].as_str().unwrap_or("null")).unwrap();
        if r.method.as_str() == "POST" {
            let uuid = body["uuid"].as_str().unwrap().to_string();
            let n = ids.len() + 1;
            let id = ids.entry(uuid.clone()).or_insert(format!("om_{n}")).clone();
            sent.push((uuid, id, content));
        } else if r.method.as_str() == "PATCH" {
            let id = path.rsplit('/').next().unwrap().to_string();
            let text = content["elements"][0]["text"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            updates.push((id, text));
        }
    }
    let key = format!("agent-task-{id}");
    let part2 = format!("{key}-part-2");
    let part2_sends: Vec<&(String, String, Value)> =
        sent.iter().filter(|(u, _, _)| *u == part2).collect();
    assert_eq!(part2_sends.len(), 1, "part 2 sent once");
    assert_eq!(
        part2_sends[0].2["config"]["update_multi"], true,
        "as an editable card"
    );
    let part2_id = &part2_sends[0].1;
    let final_of = |id: &str| {
        updates
            .iter()
            .rev()
            .find(|(m, _)| m == id)
            .map(|(_, t)| t.clone())
    };
    let part2_updates = updates.iter().filter(|(m, _)| m == part2_id).count();
    assert!(
        part2_updates >= 2,
        "part 2 grew, then took its final text: {part2_updates}"
    );
    let mut finals =
        vec![final_of(task["reply"]["platform_message_id"].as_str().unwrap()).unwrap()];
    for k in 2.. {
        let uuid = format!("{key}-part-{k}");
        let Some((_, id, content)) = sent.iter().find(|(u, _, _)| *u == uuid) else {
            break;
        };
        finals.push(final_of(id).unwrap_or_else(|| content["text"].as_str().unwrap().to_string()));
    }
    assert!(finals[1].starts_with("(2/"));
    check_parts_of("lark (streamed)", &answer, &finals, |t| {
        t.len() <= 30 * 1024
    });
    app.stop().await;
}

/// A streamed part whose message id was lost (Lark accepted part 2 but its answer never
/// came back, so the run could not record it): the answer's delivery sends part 2 again
/// under its key, Lark answers with the message it already holds, and the delivery edits
/// it into the final part — one message for part 2, showing its final text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_part_whose_id_was_lost_is_found_by_its_key_and_edited() {
    use wiremock::matchers::path_regex;
    use wiremock::{Request, Respond, ResponseTemplate};
    /// Lark's reply API that accepts a streamed part 2 (an editable card) but loses every
    /// answer to it while the answer streams.
    struct LosingPart2(super::chat_doubles::LarkMessages);
    impl Respond for LosingPart2 {
        fn respond(&self, request: &Request) -> ResponseTemplate {
            let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
            let answer = self.0.respond(request);
            // A streamed part has no `(k/n) ` marker yet; the delivery's has.
            let card: Value = serde_json::from_str(body["content"].as_str().unwrap_or("null"))
                .unwrap_or(Value::Null);
            let streamed = !card["elements"][0]["text"]["content"]
                .as_str()
                .unwrap_or("")
                .starts_with("(2/");
            let lost = body["uuid"]
                .as_str()
                .is_some_and(|u| u.ends_with("-part-2"))
                && streamed;
            if lost {
                ResponseTemplate::new(504)
            } else {
                answer
            }
        }
    }
    let api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/open-apis/auth/v3/tenant_access_token/internal"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_body_json(
            json!({"code": 0, "msg": "ok", "tenant_access_token": "t-abc", "expire": 7200}),
        ))
        .mount(&api)
        .await;
    let messages = super::chat_doubles::LarkMessages::default();
    Mock::given(method("POST"))
        .and(path_regex(r"^/open-apis/im/v1/messages/[^/]+/reply$"))
        .respond_with(LosingPart2(messages.clone()))
        .mount(&api)
        .await;
    Mock::given(path_regex(r"^/open-apis/im/v1/messages/[^/]+$"))
        .respond_with(messages)
        .mount(&api)
        .await;
    let (app, _model, _) =
        streaming_huge_answer(&api, |c, uri| enable_lark(c, uri, "default")).await;
    let asked = lark_message("ev-lost", "om_q", "user", "@_user_1 the whole policy?");
    let id = task_id_of(app.lark("/webhooks/lark", &asked, LARK_KEY, now()).await).await;
    app.wait_replied(id, WAIT).await;
    let part2 = format!("agent-task-{id}-part-2");
    let requests = api.received_requests().await.unwrap();
    let mut uuids = Vec::new();
    let mut part2_kinds = Vec::new();
    let mut patches = Vec::new();
    for r in &requests {
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if r.method.as_str() == "POST" && r.url.path().ends_with("/reply") {
            let uuid = body["uuid"].as_str().unwrap().to_string();
            if uuid == part2 {
                let card: Value = serde_json::from_str(body["content"].as_str().unwrap()).unwrap();
                let text = card["elements"][0]["text"]["content"]
                    .as_str()
                    .unwrap_or("");
                part2_kinds.push(if text.starts_with("(2/") {
                    "final"
                } else {
                    "streamed"
                });
            }
            if !uuids.contains(&uuid) {
                uuids.push(uuid);
            }
        } else if r.method.as_str() == "PATCH" {
            let content: Value = serde_json::from_str(body["content"].as_str().unwrap()).unwrap();
            patches.push((
                r.url.path().rsplit('/').next().unwrap().to_string(),
                content["elements"][0]["text"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            ));
        }
    }
    assert_eq!(
        part2_kinds.first(),
        Some(&"streamed"),
        "part 2 was streamed first: {part2_kinds:?}"
    );
    assert_eq!(
        part2_kinds.last(),
        Some(&"final"),
        "and sent again by the delivery: {part2_kinds:?}"
    );
    // One message for part 2 (the double numbers messages by new uuids), edited last into
    // its final text.
    let part2_id = format!("om_{}", uuids.iter().position(|u| *u == part2).unwrap() + 1);
    let last = patches
        .iter()
        .rev()
        .find(|(m, _)| *m == part2_id)
        .map(|(_, t)| t.as_str())
        .unwrap_or_else(|| panic!("part 2 was never edited: {patches:?}"));
    assert!(last.starts_with("(2/"), "{}", &last[..20]);
    app.stop().await;
}
