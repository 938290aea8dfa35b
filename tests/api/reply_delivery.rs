//! The outbox delivers each reply once it can, always with the same idempotency key.

use std::time::Duration;

use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_waits_for_a_receiver_that_is_down_then_arrives_once() {
    // Reserve a port and leave it closed: the receiver is down.
    let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = reserved.local_addr().unwrap().port();
    drop(reserved);
    let model = echo_model().await;
    let placeholder = MockServer::start().await;
    let app = TestApp::spawn_with(model, placeholder, |c| {
        c.channels.generic.reply_url = format!("http://127.0.0.1:{port}/reply");
    })
    .await;
    let id = task_id_of(app.post_message(&message("c-down", 1, "hi")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| {
            t["reply"]["attempts"].as_i64().unwrap_or(0) >= 3
        })
        .await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(task["reply"]["status"], "PENDING");
    assert!(task["reply"]["last_error"].as_str().is_some());

    // The receiver comes back on the same address.
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let receiver = MockServer::builder().listener(listener).start().await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(ResponseTemplate::new(200))
        .mount(&receiver)
        .await;
    let task = app.wait_replied(id, WAIT).await;
    assert!(task["reply"]["attempts"].as_i64().unwrap() >= 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let replies = received_replies(&receiver).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0, format!("agent-task-{id}"));
    assert_eq!(replies[0].1["text"], "answer to: hi");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_errors_are_retried_with_the_same_key() {
    let receiver = receiver_refusing_first(2, 503).await;
    let model = echo_model().await;
    let app = TestApp::spawn_with(model, receiver, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-503r", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["reply"]["attempts"], 3);
    let replies = app.replies().await;
    assert_eq!(replies.len(), 3, "two refused tries and one accepted");
    assert!(
        replies
            .iter()
            .all(|(k, _)| k == &format!("agent-task-{id}"))
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_is_given_up_after_max_attempts_when_configured() {
    let receiver = receiver_answering(ResponseTemplate::new(500)).await;
    let model = echo_model().await;
    let app = TestApp::spawn_with(model, receiver, |c| c.outbox.max_attempts = 2).await;
    let id = task_id_of(app.post_message(&message("c-giveup", 1, "hi")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["reply"]["status"] == "FAILED")
        .await;
    assert_eq!(task["reply"]["attempts"], 2);
    let audit = task["audit"].as_array().unwrap();
    let failed = audit
        .iter()
        .find(|a| a["event"] == "REPLY_FAILED")
        .expect("REPLY_FAILED audited");
    assert_eq!(failed["risk_flag"], true);
    app.stop().await;
}

/// A slow reply holds one delivery slot, not the replies claimed after it: slots are refilled
/// as deliveries finish, not once a whole batch is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reply_does_not_hold_up_the_others() {
    let receiver = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .and(wiremock::matchers::body_partial_json(
            serde_json::json!({ "conversation_id": "c-slow" }),
        ))
        .respond_with(ResponseTemplate::new(200).set_delay(Duration::from_secs(5)))
        .with_priority(1)
        .mount(&receiver)
        .await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(ResponseTemplate::new(200))
        .with_priority(2)
        .mount(&receiver)
        .await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |c| c.outbox.batch = 2).await;
    let slow = task_id_of(app.post_message(&message("c-slow", 1, "hi")).await).await;
    app.wait_task(slow, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    let mut fast = Vec::new();
    for n in 0..6 {
        let conversation = format!("c-fast-{n}");
        fast.push(task_id_of(app.post_message(&message(&conversation, 1, "hi")).await).await);
    }
    for id in fast {
        app.wait_replied(id, Duration::from_secs(4)).await;
    }
    let task = app.get_task(slow).await;
    assert_eq!(
        task["reply"]["status"], "PENDING",
        "the slow reply is still being delivered while the others went out"
    );
    app.wait_replied(slow, WAIT).await;
    app.stop().await;
}

/// A reply still being delivered when the instance is told to stop is finished and recorded
/// before it stops, so the instance started after it does not send the reply again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_in_flight_at_shutdown_is_finished_and_not_sent_again() {
    let receiver =
        receiver_answering(ResponseTemplate::new(200).set_delay(Duration::from_millis(1500))).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-drain", 1, "hi")).await).await;
    let deadline = std::time::Instant::now() + WAIT;
    while app.receiver.received_requests().await.unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the reply never left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Stop while the receiver is still answering.
    let (db, model, receiver) = app.stop_keeping_db().await;
    let reply_url = format!("{}/reply", receiver.uri());
    let config = test_config(&db.url, &model.uri(), &reply_url);
    let again = TestApp::spawn_config(db, model, receiver, config).await;
    let task = again.get_task(id).await;
    assert_eq!(task["reply"]["status"], "SENT", "{task}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(again.receiver.received_requests().await.unwrap().len(), 1);
    again.stop().await;
}

/// A receiver that refuses the replies to `refused_message` with 503 (`times` times, or
/// always) and accepts every other reply; requests are kept in arrival order.
async fn receiver_refusing(refused_message: &str, times: Option<u64>) -> MockServer {
    use wiremock::matchers::body_partial_json;
    let receiver = MockServer::start().await;
    let refuse = Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .and(body_partial_json(
            serde_json::json!({ "in_reply_to": refused_message }),
        ))
        .respond_with(ResponseTemplate::new(503))
        .with_priority(1);
    match times {
        Some(n) => refuse.up_to_n_times(n).mount(&receiver).await,
        None => refuse.mount(&receiver).await,
    }
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(ResponseTemplate::new(200))
        .with_priority(2)
        .mount(&receiver)
        .await;
    receiver
}

/// Where in the receiver's arrivals the replies to `message_id` came (every try).
async fn arrivals_of(receiver: &MockServer, message_id: &str) -> Vec<usize> {
    received_replies(receiver)
        .await
        .iter()
        .enumerate()
        .filter(|(_, (_, body))| body["in_reply_to"] == message_id)
        .map(|(i, _)| i)
        .collect()
}

/// Issue 19, item 1: a conversation's replies reach the chat in task order. The reply to
/// the first message is refused three times (and retried with backoff) while the second
/// message's task finishes; its reply waits for the first instead of overtaking it. A reply
/// in another conversation is not held up. Fails without the order check in the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_replies_arrive_in_task_order_while_an_older_one_is_retried() {
    let receiver = receiver_refusing("msg-c-order-1", Some(3)).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |_| {}).await;
    let first = task_id_of(app.post_message(&message("c-order", 1, "one")).await).await;
    let second = task_id_of(app.post_message(&message("c-order", 2, "two")).await).await;
    let other = task_id_of(app.post_message(&message("c-other", 1, "elsewhere")).await).await;
    for id in [first, second, other] {
        app.wait_replied(id, WAIT).await;
    }
    let one = arrivals_of(&app.receiver, "msg-c-order-1").await;
    let two = arrivals_of(&app.receiver, "msg-c-order-2").await;
    let elsewhere = arrivals_of(&app.receiver, "msg-c-other-1").await;
    assert_eq!(one.len(), 4, "three refused tries and one accepted");
    assert_eq!(two.len(), 1);
    assert!(
        two[0] > *one.last().unwrap(),
        "the second reply arrived at {} before the first was accepted at {}",
        two[0],
        one.last().unwrap()
    );
    assert!(
        elsewhere[0] < *one.last().unwrap(),
        "another conversation waited for this one"
    );
    app.stop().await;
}

/// A reply given up after its last attempt does not hold its conversation forever: the
/// next reply goes once the older one is FAILED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_given_up_lets_its_conversations_next_reply_go() {
    let receiver = receiver_refusing("msg-c-given-up-1", None).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |c| {
        c.outbox.max_attempts = 2;
    })
    .await;
    let first = task_id_of(app.post_message(&message("c-given-up", 1, "one")).await).await;
    let second = task_id_of(app.post_message(&message("c-given-up", 2, "two")).await).await;
    let task = app.wait_replied(second, WAIT).await;
    assert_eq!(task["reply"]["status"], "SENT");
    let task = app
        .wait_task(first, WAIT, |t| t["reply"]["status"] == "FAILED")
        .await;
    assert_eq!(task["reply"]["attempts"], 2);
    let one = arrivals_of(&app.receiver, "msg-c-given-up-1").await;
    let two = arrivals_of(&app.receiver, "msg-c-given-up-2").await;
    assert_eq!(one.len(), 2);
    assert!(two[0] > one[1], "the next reply went before the last try");
    app.stop().await;
}

/// The order wait is bounded (`outbox.order_wait_secs`): a reply its receiver refuses for
/// good (never given up here) holds its conversation's next reply only that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_refused_for_good_holds_its_conversation_only_for_the_order_wait() {
    let receiver = receiver_refusing("msg-c-stuck-1", None).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |c| {
        c.outbox.max_attempts = 0;
        c.outbox.order_wait_secs = 1;
    })
    .await;
    let first = task_id_of(app.post_message(&message("c-stuck", 1, "one")).await).await;
    let second = task_id_of(app.post_message(&message("c-stuck", 2, "two")).await).await;
    let started = std::time::Instant::now();
    let task = app.wait_replied(second, WAIT).await;
    assert_eq!(task["reply"]["status"], "SENT");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the second reply did not wait for the first"
    );
    let task = app
        .wait_task(first, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(
        task["reply"]["status"], "PENDING",
        "the first is still retried"
    );
    app.stop().await;
}

/// The reply receiver double is as strict as the IM it stands for: a reply not signed with
/// the channel secret, or signed for another body or an old timestamp, is refused (401), so
/// every test that sees a reply delivered also shows assistd signed it by the contract.
#[tokio::test]
async fn the_receiver_double_refuses_replies_not_signed_by_the_contract() {
    let receiver = accepting_receiver().await;
    let url = format!("{}/reply", receiver.uri());
    let body = br#"{"task_id":1,"text":"hi"}"#;
    let now = assistd::domain::now_ms() / 1000;
    let post = |ts: i64, signature: String, body: &'static [u8]| {
        let url = url.clone();
        async move {
            reqwest::Client::new()
                .post(url)
                .header("X-Assistd-Timestamp", ts.to_string())
                .header("X-Assistd-Signature", signature)
                .body(body.to_vec())
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let sign = assistd::channels::generic::sign;
    assert_eq!(post(now, sign(SECRET, now, body), body).await, 200);
    assert_eq!(post(now, sign("other", now, body), body).await, 401);
    assert_eq!(post(now, sign(SECRET, now, body), b"{}").await, 401);
    let old = now - 3_600;
    assert_eq!(post(old, sign(SECRET, old, body), body).await, 401);
    let unsigned = reqwest::Client::new()
        .post(&url)
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), 401);
}

/// `instance`'s reply deliveries started with replies from `source` (`handed`, `claimed`),
/// from its `/metrics` (the counters are per process, labelled by instance).
async fn deliveries(app: &TestApp, instance: &str, source: &str) -> u64 {
    let labels = format!("source=\"{source}\"}}");
    instance_counter(app, "assistd_reply_deliveries_total", instance, &labels).await
}

/// `instance`'s claims of due replies, whether they found some or none.
async fn reply_claims(app: &TestApp, instance: &str) -> u64 {
    instance_counter(app, "assistd_reply_claims_total", instance, "").await
}

/// The sum of `instance`'s series of counter `metric` whose labels after the instance begin
/// with `labels`, from its `/metrics`.
async fn instance_counter(app: &TestApp, metric: &str, instance: &str, labels: &str) -> u64 {
    let text = metrics_text(&app.addr).await.unwrap();
    let prefix = format!("{metric}{{instance=\"{instance}\",{labels}");
    metric_sum(&text, &prefix).unwrap_or(0) as u64
}

/// Issue 35 part 2: on PostgreSQL a finishing task's reply is committed already leased to
/// its instance and handed to that instance's outbox, which sends it without claiming it
/// (no row lock, no second row version). The outbox's poll is far away, so a claim could
/// only come from a wake-up. On SQLite every reply is claimed as before. Each reply arrives
/// once, its first attempt counted. Fails with `hand_until` always `None`. And on
/// PostgreSQL the outbox makes no claim at all meanwhile: a delivered reply with nothing
/// else pending in its conversation is not followed by a claim that would find nothing
/// (fails with `WriteOut::Sent`'s `more_due` always true).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_tasks_reply_goes_to_its_own_outbox_without_a_claim() {
    let instance = "handoff-1";
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.worker.instance_id = instance.into();
        c.outbox.poll_interval_ms = 120_000;
        // No placeholder (a slow run's, under a loaded test run): it would be claimed.
        c.replies.placeholder = String::new();
    })
    .await;
    // A first reply, so the outbox surely runs (a task finishing before it started leaves
    // its reply to a claim).
    let first = task_id_of(app.post_message(&message("c-handoff-0", 1, "hi")).await).await;
    app.wait_replied(first, WAIT).await;
    // Whatever the first delivery's end led to has happened.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = (
        deliveries(&app, instance, "handed").await,
        deliveries(&app, instance, "claimed").await,
    );
    let claims_before = reply_claims(&app, instance).await;
    let mut ids = Vec::new();
    for n in 1..=3 {
        let conversation = format!("c-handoff-{n}");
        ids.push(task_id_of(app.post_message(&message(&conversation, 1, "hi")).await).await);
    }
    for &id in &ids {
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(task["reply"]["attempts"], 1, "{task}");
    }
    let (handed, claimed) = (
        deliveries(&app, instance, "handed").await - before.0,
        deliveries(&app, instance, "claimed").await - before.1,
    );
    if app.db.is_postgres() {
        assert_eq!(
            (handed, claimed),
            (3, 0),
            "every reply handed, none claimed"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            reply_claims(&app, instance).await - claims_before,
            0,
            "no claim after deliveries that left nothing pending"
        );
    } else {
        assert_eq!((handed, claimed), (0, 3), "SQLite claims every reply");
    }
    let keys: std::collections::BTreeSet<String> = app
        .replies()
        .await
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    let expected: std::collections::BTreeSet<String> = ids
        .iter()
        .chain([&first])
        .map(|id| format!("agent-task-{id}"))
        .collect();
    assert_eq!(keys, expected);
    assert_eq!(app.replies().await.len(), 4, "each reply once");
    app.stop().await;
}

/// Issue 35 part 2: after a delivery the outbox claims only when a reply of the
/// conversation may have waited for it, and then at once. Polls two minutes apart; the
/// receiver answers replies of conversation `c-behind` after 4 s, others at once.
/// 1. The first answer of `c-behind` is being sent.
/// 2. The second is committed meanwhile: it waits behind the first (order); its wake-up
///    calls for a claim, which comes `outbox.claim_wait_ms` later at the latest (no delivery
///    ends before) and finds nothing due.
/// 3. An answer in another conversation is committed: on SQLite its wake-up's claim takes it
///    (at the latest `claim_wait_ms` after the wake-up: the first's slow send does not hold
///    it up); on PostgreSQL it is handed to the outbox without a claim. It is sent while the
///    first is still being sent (fails if a claim waited for a delivery to end), and its
///    mark says nothing of its conversation is due, so no claim follows.
/// 4. The first ends; its mark says a reply of its conversation is pending, so a claim
///    follows at once and the second goes, not at the poll. Fails if the mark's `more_due`
///    were false for it (the second would wait the two minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_waiting_behind_its_conversations_previous_goes_when_that_is_sent() {
    use wiremock::matchers::body_string_contains;
    let instance = "waits-behind";
    let receiver = receiver_answering(ResponseTemplate::new(200)).await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .and(body_string_contains("c-behind"))
        .respond_with(ResponseTemplate::new(200).set_delay(Duration::from_millis(4000)))
        .with_priority(1)
        .mount(&receiver)
        .await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |c| {
        c.worker.instance_id = instance.into();
        c.outbox.poll_interval_ms = 120_000;
        c.replies.placeholder = String::new();
    })
    .await;
    let first = task_id_of(app.post_message(&message("c-behind", 1, "one")).await).await;
    let second = task_id_of(app.post_message(&message("c-behind", 2, "two")).await).await;
    app.wait_task(second, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    let other = task_id_of(app.post_message(&message("c-other", 1, "hi")).await).await;
    app.wait_replied(other, WAIT).await;
    let task = app.get_task(first).await;
    assert_ne!(task["reply"]["status"], "SENT", "still being sent: {task}");
    // Well before the poll, two minutes away.
    for id in [first, second] {
        let task = app.wait_replied(id, Duration::from_secs(30)).await;
        assert_eq!(task["reply"]["attempts"], 1, "{task}");
    }
    let keys: Vec<String> = app
        .replies()
        .await
        .into_iter()
        .map(|(key, _)| key)
        .filter(|key| key != &format!("agent-task-{other}"))
        .collect();
    assert_eq!(
        keys,
        [
            format!("agent-task-{first}"),
            format!("agent-task-{second}")
        ],
        "in order, once each"
    );
    app.stop().await;
}

/// A reply is handed only with a free delivery slot of its outbox reserved, so its counted
/// first attempt starts at once (a counted attempt with no result reads as a send in doubt,
/// which platforms that cannot deduplicate do not repeat). One slot and a receiver that
/// answers after 2.5 s: the first reply is handed; the two finished while it is being sent
/// find no free slot and wait uncounted for a claim. Every reply arrives exactly once, each
/// after a single attempt. (A handed reply whose lease would lapse before its send could
/// end is put back unsent: `platforms::telegram::a_telegram_reply_left_mid_send_by_another_instance_is_not_resent`
/// runs with a lease shorter than the send timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_finished_while_every_delivery_slot_is_busy_is_claimed_not_handed() {
    let instance = "handoff-lapse";
    let receiver =
        receiver_answering(ResponseTemplate::new(200).set_delay(Duration::from_millis(2500))).await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |c| {
        c.worker.instance_id = instance.into();
        c.outbox.batch = 1;
        c.outbox.timeout_secs = 3;
        c.outbox.lease_secs = 4;
    })
    .await;
    let mut ids = Vec::new();
    for n in 1..=3 {
        let conversation = format!("c-lapse-{n}");
        ids.push(task_id_of(app.post_message(&message(&conversation, 1, "hi")).await).await);
    }
    for &id in &ids {
        let task = app.wait_replied(id, Duration::from_secs(60)).await;
        assert_eq!(task["reply"]["attempts"], 1, "{task}");
    }
    let (handed, claimed) = (
        deliveries(&app, instance, "handed").await,
        deliveries(&app, instance, "claimed").await,
    );
    if app.db.is_postgres() {
        assert!(handed >= 1, "the first reply was handed ({handed})");
        assert!(
            claimed >= 1,
            "a reply whose lease ran short was claimed ({claimed})"
        );
        assert_eq!(handed + claimed, 3, "one delivery each");
    } else {
        assert_eq!((handed, claimed), (0, 3));
    }
    let replies = app.replies().await;
    let mut keys: Vec<String> = replies.into_iter().map(|(key, _)| key).collect();
    keys.sort();
    let mut expected: Vec<String> = ids.iter().map(|id| format!("agent-task-{id}")).collect();
    expected.sort();
    assert_eq!(keys, expected, "each reply exactly once");
    app.stop().await;
}
