//! Issue 32, part 5: a burst of questions never becomes failure notices. A provider limits
//! the requests it takes at once; `max_concurrency` keeps this instance under that limit,
//! workers claim only tasks whose provider has a free slot (the others stay queued in the
//! database), a 429 pauses the whole provider, and a task fails RATE_LIMITED only when the
//! provider keeps refusing past `llm.rate_limit_patience_secs`. The provider is the strict
//! `LimitedModel` double: 429 above its own limit, as real providers answer.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wiremock::MockServer;

use crate::helpers::*;

/// Waits until the receiver has `n` replies, or panics after `timeout`.
async fn wait_replies(app: &TestApp, n: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = app.replies().await.len();
        if got >= n {
            return;
        }
        assert!(Instant::now() < deadline, "{got} of {n} replies");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 400 questions at once against a provider that takes 16 at a time: none is refused, and
/// every one is answered. Before: 233 of 400 users got a RATE_LIMITED failure notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_answered_within_the_providers_limit() {
    const N: usize = 400;
    let latency = Duration::from_millis(50);
    let model = LimitedModel::start(16, latency, None).await;
    let uri = model.uri.clone();
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            c.llm.base_url = format!("{uri}/v1");
            c.llm.max_concurrency = 16;
        },
    )
    .await;
    let started = Instant::now();
    for n in 0..N {
        let resp = app
            .post_message(&message(&format!("burst-{n}"), 1, "hello"))
            .await;
        assert_eq!(resp.status(), 200);
    }
    wait_replies(&app, N, Duration::from_secs(120)).await;
    let drained = started.elapsed();
    let ideal = latency * (N as u32) / 16;
    println!("{N} messages drained in {drained:?}; ideal at 16 at once: {ideal:?}");
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(model.refused.load(SeqCst), 0, "the provider refused calls");
    assert_eq!(model.answered.load(SeqCst), N as u64);
    assert!(model.most_in_flight.load(SeqCst) <= 16);
    let failed: Value = app.admin_json("/api/tasks?status=FAILED&limit=10").await;
    assert!(failed["tasks"].as_array().unwrap().is_empty(), "{failed:#}");
    app.stop().await;
}

/// Tasks of a second provider keep flowing while the first is saturated: with 4 worker
/// slots and a slow provider limited to 2 calls, only 2 of its tasks are claimed at a time,
/// so the console's questions (another provider) are answered while its backlog waits
/// queued. Before, its tasks took every worker slot and the others waited behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_providers_tasks_flow_while_one_is_saturated() {
    let slow = LimitedModel::start(2, Duration::from_millis(1500), None).await;
    let fast = LimitedModel::start(100, Duration::from_millis(20), None).await;
    let (slow_uri, fast_uri) = (slow.uri.clone(), fast.uri.clone());
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            c.worker.concurrency = 4;
            c.llm.base_url = format!("{fast_uri}/v1");
            let mut provider = c.llm.default_provider();
            provider.base_url = format!("{slow_uri}/v1");
            provider.max_concurrency = 2;
            c.llm.providers.insert("slow".into(), provider);
            let mut agent = c.agents["default"].clone();
            agent.provider = "slow".into();
            c.agents.insert("slowagent".into(), agent);
            c.channels.generic.agent = "slowagent".into();
            c.channels.console.agent = "default".into();
        },
    )
    .await;
    let mut slow_tasks = Vec::new();
    for n in 0..12 {
        let id = task_id_of(
            app.post_message(&message(&format!("slow-{n}"), 1, "think hard"))
                .await,
        )
        .await;
        slow_tasks.push(id);
    }
    let mut fast_tasks = Vec::new();
    for n in 0..4 {
        let resp = app
            .http
            .post(format!("{}/console/messages", app.addr))
            .json(&json!({"conversation_id": format!("fast-{n}"), "text": "quick one"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        fast_tasks.push(
            resp.json::<Value>().await.unwrap()["task_id"]
                .as_i64()
                .unwrap(),
        );
    }
    for id in &fast_tasks {
        let task = app.wait_replied(*id, WAIT).await;
        assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    }
    let mut waiting = 0;
    for id in &slow_tasks {
        if app.get_task(*id).await["status"] == "PENDING" {
            waiting += 1;
        }
    }
    assert!(
        waiting >= 6,
        "the fast provider's answers came only after most of the slow backlog ({waiting} of 12 waiting)"
    );
    use std::sync::atomic::Ordering::SeqCst;
    assert!(slow.most_in_flight.load(SeqCst) <= 2);
    for id in &slow_tasks {
        let task = app.wait_replied(*id, Duration::from_secs(60)).await;
        assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    }
    assert_eq!(slow.refused.load(SeqCst), 0);
    app.stop().await;
}

/// A provider that answers 429 to everything for 30 s and then recovers loses no task: the
/// calls wait (the whole provider pauses for each Retry-After) and are answered after.
/// Before: each call was retried 6 times a second apart, then failed RATE_LIMITED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_refusing_for_30_s_loses_no_task() {
    let model = LimitedModel::start(
        100,
        Duration::from_millis(20),
        Some(Instant::now() + Duration::from_secs(30)),
    )
    .await;
    let uri = model.uri.clone();
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            c.llm.base_url = format!("{uri}/v1");
        },
    )
    .await;
    let mut ids = Vec::new();
    for n in 0..20 {
        ids.push(
            task_id_of(
                app.post_message(&message(&format!("busy-{n}"), 1, "hi"))
                    .await,
            )
            .await,
        );
    }
    for id in ids {
        let task = app.wait_replied(id, Duration::from_secs(90)).await;
        assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    }
    use std::sync::atomic::Ordering::SeqCst;
    assert!(model.refused.load(SeqCst) > 0, "the provider did refuse");
    assert_eq!(model.answered.load(SeqCst), 20);
    app.stop().await;
}
