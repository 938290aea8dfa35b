//! Streamed answers longer than one message (issue 33, part 3): the stream goes on in its
//! next parts while it is written, on every platform that can edit a message, each part sent
//! once and edited into its final `(k/n) ` text by the answer's delivery; a part whose send
//! is in doubt is found by its key where the platform can (Matrix, Lark, Slack) and makes
//! the answer UNKNOWN where it cannot (Telegram), never shown twice.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer};

use super::long_answers::{check_parts, check_parts_of, huge_answer, long_answer};
use super::*;

/// Telegram's and Slack's message calls `api` received, in order: (method, body).
async fn message_calls(api: &MockServer, methods: &[&str]) -> Vec<(String, Value)> {
    api.received_requests()
        .await
        .unwrap()
        .iter()
        .filter_map(|r| {
            let call = r.url.path().rsplit('/').next().unwrap().to_string();
            methods
                .contains(&call.as_str())
                .then(|| (call, serde_json::from_slice(&r.body).unwrap_or(Value::Null)))
        })
        .collect()
}

/// The final text of every message sent by `send` calls (the double numbers them
/// `id_of(n)` for the n-th send, from 0): its last edit by `edit` calls (`id_field` naming
/// the message), else the text it was sent with. Also whether each was edited.
fn final_texts(
    calls: &[(String, Value)],
    (send, edit, id_field): (&str, &str, &str),
    id_of: impl Fn(usize) -> String,
) -> Vec<(String, String, usize)> {
    let id_text = |v: &Value| match v {
        Value::Number(n) => n.to_string(),
        other => other.as_str().unwrap_or("").to_string(),
    };
    calls
        .iter()
        .filter(|(c, _)| c == send)
        .enumerate()
        .map(|(n, (_, sent))| {
            let id = id_of(n);
            let edits: Vec<&Value> = calls
                .iter()
                .filter(|(c, b)| c == edit && id_text(&b[id_field]) == id)
                .map(|(_, b)| b)
                .collect();
            let text = edits.last().copied().unwrap_or(sent)["text"]
                .as_str()
                .unwrap()
                .to_string();
            (id, text, edits.len())
        })
        .collect()
}

/// A 12,000-character answer streamed into Telegram goes on in its next parts while it is
/// written: no message or edit ever goes past 4,096 UTF-16 units, part 2 is sent once with
/// the streamed text (no `(k/n)` marker yet) and edited as it grows, and the answer's
/// delivery edits every streamed part into its final numbered text — one message per part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_streamed_answer_goes_on_in_its_next_parts_on_telegram() {
    let api = platform_api().await;
    let (app, _model, _) = streaming_long_answer(&api, |c, uri| {
        enable_platforms(c, uri, "default");
        c.channels.telegram.per_chat_interval_ms = 100;
    })
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
    let calls = message_calls(&api, &["sendMessage", "editMessageText"]).await;
    for (call, body) in &calls {
        let units = body["text"].as_str().unwrap().encode_utf16().count();
        assert!(units <= 4096, "{call} of {units} UTF-16 units");
    }
    // The Telegram double numbers the messages it takes 99, 100, …
    let finals = final_texts(
        &calls,
        ("sendMessage", "editMessageText", "message_id"),
        |n| (99 + n).to_string(),
    );
    assert_eq!(task["reply"]["platform_message_id"], "99");
    let sends: Vec<&Value> = calls
        .iter()
        .filter(|(c, _)| c == "sendMessage")
        .map(|(_, b)| b)
        .collect();
    let part2 = sends[1]["text"].as_str().unwrap();
    assert!(
        !part2.starts_with("(2/"),
        "part 2 was sent while the answer streamed, not at its end: {}",
        &part2[..20]
    );
    assert!(
        finals[1].2 >= 2,
        "part 2 grew as it streamed, then took its final text: {} edits",
        finals[1].2
    );
    let texts: Vec<String> = finals.into_iter().map(|(_, t, _)| t).collect();
    check_parts("telegram (streamed)", &texts, |t| {
        t.encode_utf16().count() <= 4096
    });
    app.stop().await;
}

/// A streamed part Telegram may have taken (its answer lost in a timeout) cannot be found
/// again, and sending it once more could show it twice: the stream stops sending parts, and
/// the answer's delivery gives the answer up as UNKNOWN (naming the part) after its first
/// part, for an admin to see — no part is ever shown twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_part_in_doubt_on_telegram_makes_the_answer_unknown_not_doubled() {
    use wiremock::{Request, Respond, ResponseTemplate};
    /// Telegram's message store, whose answer to the second `sendMessage` (part 2,
    /// streamed) comes after the client gave up.
    struct SlowSecondSend(
        super::chat_doubles::TelegramMessages,
        std::sync::atomic::AtomicUsize,
    );
    impl Respond for SlowSecondSend {
        fn respond(&self, request: &Request) -> ResponseTemplate {
            let answer = self.0.respond(request);
            let sends = if request.url.path().ends_with("/sendMessage") {
                self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
            } else {
                0
            };
            if sends == 2 {
                answer.set_delay(Duration::from_secs(4))
            } else {
                answer
            }
        }
    }
    let api = platform_api().await;
    // One message store for both calls; each mock counts its own sends (edits count none).
    let held = super::chat_doubles::TelegramMessages::default();
    for call in ["sendMessage", "editMessageText"] {
        Mock::given(method("POST"))
            .and(path(format!("/bot{TG_TOKEN}/{call}")))
            .respond_with(SlowSecondSend(held.clone(), Default::default()))
            .with_priority(1)
            .mount(&api)
            .await;
    }
    let (app, _model, _) = streaming_long_answer(&api, |c, uri| {
        enable_platforms(c, uri, "default");
        c.outbox.timeout_secs = 1;
    })
    .await;
    let id = task_id_of(
        app.telegram(
            &tg_update(3, -300, 7, 42, "@helper_bot the travel policy?"),
            Some(TG_SECRET),
        )
        .await,
    )
    .await;
    let task = app
        .wait_task(id, WAIT, |t| t["reply"]["status"] == "UNKNOWN")
        .await;
    let error = task["reply"]["last_error"].as_str().unwrap_or("");
    assert!(error.contains("part 2"), "{:#}", task["reply"]);
    let calls = message_calls(&api, &["sendMessage", "editMessageText"]).await;
    let sends = calls.iter().filter(|(c, _)| c == "sendMessage").count();
    assert_eq!(
        sends, 2,
        "the placeholder and part 2, neither sent again: {calls:?}"
    );
    // Part 1 took its final text before the delivery stopped at part 2.
    let finals = final_texts(
        &calls,
        ("sendMessage", "editMessageText", "message_id"),
        |n| (99 + n).to_string(),
    );
    assert!(finals[0].1.starts_with("(1/"), "{}", &finals[0].1[..20]);
    app.stop().await;
}

/// On Slack a streamed part carries its key in message metadata: a part whose answer was
/// lost is found by the delivery (`conversations.history` in a direct message, where the
/// answer goes top-level) and edited, not posted again — one message per part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_streamed_answer_goes_on_in_its_next_parts_on_slack() {
    use wiremock::{Request, Respond, ResponseTemplate};
    /// Slack's message store, which loses its answer to a streamed part 2 (no marker yet).
    struct LosingPart2(super::chat_doubles::SlackMessages);
    impl Respond for LosingPart2 {
        fn respond(&self, request: &Request) -> ResponseTemplate {
            let answer = self.0.respond(request);
            let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
            let part2 = body["metadata"]["event_payload"]["key"]
                .as_str()
                .is_some_and(|k| k.ends_with("-part-2"));
            let streamed = !body["text"].as_str().unwrap_or("").starts_with("(2/");
            if request.url.path() == "/chat.postMessage" && part2 && streamed {
                ResponseTemplate::new(504)
            } else {
                answer
            }
        }
    }
    let api = platform_api().await;
    let slack = super::chat_doubles::SlackMessages::default();
    for call in ["/chat.postMessage", "/chat.update"] {
        Mock::given(method("POST"))
            .and(path(call))
            .respond_with(LosingPart2(slack.clone()))
            .with_priority(1)
            .mount(&api)
            .await;
    }
    Mock::given(method("GET"))
        .and(path("/conversations.history"))
        .respond_with(slack.clone())
        .with_priority(1)
        .mount(&api)
        .await;
    let (app, _model, _) = streaming_long_answer(&api, |c, uri| {
        enable_platforms(c, uri, "default");
    })
    .await;
    let ev = slack_event(
        "EvStream",
        json!({"type": "message", "channel_type": "im", "user": "U1", "text": "the travel policy?", "ts": "1600.0001", "channel": "D7"}),
    );
    let id = task_id_of(app.slack_event(&ev).await).await;
    app.wait_replied(id, WAIT).await;
    let calls = message_calls(&api, &["chat.postMessage", "chat.update"]).await;
    let key_of = |b: &Value| {
        b["metadata"]["event_payload"]["key"]
            .as_str()
            .map(str::to_string)
    };
    let part2 = format!("agent-task-{id}-part-2");
    let part2_posts = calls
        .iter()
        .filter(|(c, b)| c == "chat.postMessage" && key_of(b).as_deref() == Some(&part2))
        .count();
    assert_eq!(
        part2_posts, 1,
        "part 2 posted once (streamed), found again, not reposted"
    );
    let history = requests_to(&api, "^/conversations.history$").await;
    assert!(!history.is_empty(), "the lost part was looked for");
    // The double numbers the messages it takes 1700.0001, 1700.0002, …
    let finals = final_texts(&calls, ("chat.postMessage", "chat.update", "ts"), |n| {
        format!("1700.{:04}", n + 1)
    });
    for (_, body) in &calls {
        assert!(body["text"].as_str().unwrap().chars().count() <= 4000);
    }
    let texts: Vec<String> = finals.into_iter().map(|(_, t, _)| t).collect();
    check_parts("slack (streamed)", &texts, |t| t.chars().count() <= 4000);
    app.stop().await;
}

/// An app answering with `answer`, streamed in `piece`-character pieces every `every`,
/// edits every 60 ms, on the platform `enable` turns on against `api` (its URL given).
async fn streaming(
    api: &MockServer,
    (answer, piece, every): (String, usize, Duration),
    enable: impl FnOnce(&mut assistd::Config, &str) + Send + 'static,
) -> (TestApp, crate::strict_model::SlowStreamingModel, String) {
    let model = crate::strict_model::SlowStreamingModel::start(&answer, piece, every).await;
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

/// `huge_answer` (about 80 KB) in 2,000-character pieces every 40 ms.
async fn streaming_huge_answer(
    api: &MockServer,
    enable: impl FnOnce(&mut assistd::Config, &str) + Send + 'static,
) -> (TestApp, crate::strict_model::SlowStreamingModel, String) {
    let answer = (huge_answer(), 2_000, Duration::from_millis(40));
    streaming(api, answer, enable).await
}

/// `long_answer` (12,000 characters) in 200-character pieces every 25 ms.
async fn streaming_long_answer(
    api: &MockServer,
    enable: impl FnOnce(&mut assistd::Config, &str) + Send + 'static,
) -> (TestApp, crate::strict_model::SlowStreamingModel, String) {
    let answer = (long_answer(), 200, Duration::from_millis(25));
    streaming(api, answer, enable).await
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

/// DingTalk names a card by the sender's key (`outTrackId`): a streamed part card whose
/// answer timed out is settled by the delivery updating the card its key names, not by a
/// second card; the parts the stream never reached go as robot text messages. Every card
/// is created once and every part ends in its numbered final text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_streamed_answer_goes_on_in_its_next_parts_on_dingtalk() {
    use wiremock::{Request, Respond, ResponseTemplate};
    /// DingTalk's cards, whose answer to creating part 2's card comes after the client gave up.
    struct SlowPart2(super::chat_doubles::DingTalkCards);
    impl Respond for SlowPart2 {
        fn respond(&self, request: &Request) -> ResponseTemplate {
            let answer = self.0.respond(request);
            let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
            let part2 = body["outTrackId"]
                .as_str()
                .is_some_and(|t| t.ends_with("-part-2"));
            if request.url.path().ends_with("/createAndDeliver") && part2 {
                answer.set_delay(Duration::from_secs(3))
            } else {
                answer
            }
        }
    }
    let api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1.0/oauth2/accessToken"))
        .respond_with(
            wiremock::ResponseTemplate::new(200)
                .set_body_json(json!({"accessToken": "dt-token", "expireIn": 7200})),
        )
        .mount(&api)
        .await;
    let cards = super::chat_doubles::DingTalkCards::default();
    for (verb, at) in [
        ("POST", "/v1.0/card/instances/createAndDeliver"),
        ("PUT", "/v1.0/card/instances"),
    ] {
        Mock::given(method(verb))
            .and(path(at))
            .respond_with(SlowPart2(cards.clone()))
            .mount(&api)
            .await;
    }
    mount_dingtalk_session(&api).await;
    let (app, _model, _) = streaming_long_answer(&api, |c, uri| {
        enable_dingtalk(c, uri);
        c.channels.dingtalk.card_template_id = "tpl-ai.schema".into();
        c.channels.dingtalk.per_chat_interval_ms = 0;
        c.outbox.timeout_secs = 1;
    })
    .await;
    let session = format!("{}/robot/sendBySession?session=s9", api.uri());
    let now_ms = assistd::domain::now_ms();
    let msg = dingtalk_message("dt-long", "2", &session, now_ms + 3_600_000, "the policy?");
    let id = task_id_of(app.dingtalk(&msg, DT_SECRET, now_ms).await).await;
    app.wait_replied(id, WAIT).await;
    let key = format!("agent-task-{id}");
    let created: Vec<String> = requests_to(&api, "/createAndDeliver$")
        .await
        .iter()
        .map(|b| b["outTrackId"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        created,
        [key.clone(), format!("{key}-part-2")],
        "each card once"
    );
    let updates = requests_to(&api, "^/v1.0/card/instances$").await;
    let card_final = |track: &str| {
        updates
            .iter()
            .rev()
            .find(|u| u["outTrackId"] == track)
            .map(|u| {
                u["cardData"]["cardParamMap"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .unwrap_or_else(|| panic!("card {track} never updated"))
    };
    let mut texts = vec![card_final(&key), card_final(&format!("{key}-part-2"))];
    texts.extend(
        requests_to(&api, "^/robot/sendBySession$")
            .await
            .iter()
            .map(|b| b["text"]["content"].as_str().unwrap().to_string()),
    );
    check_parts("dingtalk (streamed)", &texts, |t| t.chars().count() <= 2000);
    app.stop().await;
}

/// The real binary is killed while a long answer streams into Telegram, once part 2 was
/// sent and recorded; after the restart the resumed run finds part 2 recorded and edits it
/// instead of sending it again (Telegram cannot drop a repeat), and the answer ends with
/// exactly one Telegram message per part, each in its final numbered text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_while_streaming_into_parts_sends_no_part_twice() {
    use crate::binary::{RealServer, server_envs};
    let db = TestDb::new().await;
    let api = platform_api().await;
    let model = crate::strict_model::SlowStreamingModel::start(
        &long_answer(),
        200,
        Duration::from_millis(40),
    )
    .await;
    let receiver = accepting_receiver().await;
    let workdir = tempfile::tempdir().unwrap();
    let api_uri = api.uri();
    let envs = server_envs(
        &db,
        &model.uri,
        &receiver.uri(),
        &[
            ("ASSISTD_CHANNELS__TELEGRAM__ENABLED", "true"),
            ("ASSISTD_CHANNELS__TELEGRAM__BOT_TOKEN", TG_TOKEN),
            ("ASSISTD_CHANNELS__TELEGRAM__SECRET_TOKEN", TG_SECRET),
            ("ASSISTD_CHANNELS__TELEGRAM__API_BASE_URL", &api_uri),
            ("ASSISTD_CHANNELS__TELEGRAM__BOT_USERNAME", "helper_bot"),
            ("ASSISTD_CHANNELS__TELEGRAM__PER_CHAT_INTERVAL_MS", "0"),
            ("ASSISTD_REPLIES__STREAM_EDIT_MS", "60"),
            ("ASSISTD_REPLIES__PLACEHOLDER_AFTER_MS", "0"),
            ("ASSISTD_OUTBOX__POLL_INTERVAL_MS", "100"),
            ("ASSISTD_OUTBOX__TIMEOUT_SECS", "2"),
            ("ASSISTD_OUTBOX__LEASE_SECS", "3"),
            ("ASSISTD_WORKER__LEASE_SECS", "3"),
        ],
    );
    let server = RealServer::start(&envs, workdir.path()).await;
    let asked = reqwest::Client::new()
        .post(format!("{}/webhooks/telegram", server.addr))
        .header("X-Telegram-Bot-Api-Secret-Token", TG_SECRET)
        .json(&tg_update(9, 4242, 1, 4242, "the travel policy?"))
        .send()
        .await
        .unwrap();
    let id = task_id_of(asked).await;
    // Part 2 (message 100) edited: its id was recorded before its first edit could go.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let calls = message_calls(&api, &["editMessageText"]).await;
        if calls.iter().any(|(_, b)| b["message_id"] == 100) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "part 2 never streamed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();

    let server = RealServer::start(&envs, workdir.path()).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let task = server.admin_json(&format!("/api/tasks/{id}")).await;
        if task["status"] == "SUCCEEDED" && task["reply"]["status"] == "SENT" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the answer was not delivered after the restart: {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(server.terminate(), Some(0));
    let calls = message_calls(&api, &["sendMessage", "editMessageText"]).await;
    let finals = final_texts(
        &calls,
        ("sendMessage", "editMessageText", "message_id"),
        |n| (99 + n).to_string(),
    );
    let texts: Vec<String> = finals.into_iter().map(|(_, t, _)| t).collect();
    // One message per part: as many sends as parts, each ending in its own numbered text.
    check_parts("telegram (killed while streaming)", &texts, |t| {
        t.encode_utf16().count() <= 4096
    });
    db.drop_db().await;
}
