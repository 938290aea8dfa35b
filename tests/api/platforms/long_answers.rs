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
pub(crate) fn huge_answer() -> String {
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
pub(crate) fn check_parts(platform: &str, texts: &[String], fits: impl Fn(&str) -> bool) {
    check_parts_of(platform, &long_answer(), texts, fits)
}

pub(crate) fn check_parts_of(
    platform: &str,
    answer: &str,
    texts: &[String],
    fits: impl Fn(&str) -> bool,
) {
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
