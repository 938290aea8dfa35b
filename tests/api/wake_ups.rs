//! Issue 35 part 3: a wake-up reaches one claimer. Two instances on one database: the one
//! whose webhook committed a task claims it itself when it has room, and the other is not
//! woken (its claims, `assistd_task_claims_total`, do not move); only when the first has no
//! room does its commit `NOTIFY` the others (PostgreSQL), and the second takes the task long
//! before its poll would have found it.

use std::time::Duration;

use serde_json::Value;
use wiremock::MockServer;

use crate::helpers::*;
use crate::strict_model::{ModelReply, last_content, model_mock};

/// `instance`'s claims so far, from any app's `/metrics` (the counters are per process).
async fn claims(addr: &str, instance: &str) -> u64 {
    let text = metrics_text(addr).await.unwrap();
    let prefix = format!("assistd_task_claims_total{{instance=\"{instance}\",");
    metric_sum(&text, &prefix).unwrap_or(0) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_reaches_one_claimer() {
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        let asked = last_content(body);
        let answer = ModelReply::text(format!("answer to: {asked}"));
        if asked.contains("slow") {
            answer.delayed(Duration::from_secs(6))
        } else {
            answer
        }
    })
    .mount(&model)
    .await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let postgres = db.url.starts_with("postgres");
    let reply_url = format!("{}/reply", receiver.uri());
    let model_url = model.uri();
    // Polls far apart: whatever is claimed within a test's time was claimed on a wake-up.
    let config = |instance: &str| {
        let mut c = test_config(&db.url, &model_url, &reply_url);
        c.worker.instance_id = instance.into();
        c.worker.poll_interval_ms = 120_000;
        c.worker.concurrency = 2;
        c.scheduler.enabled = false;
        c
    };
    let b = assistd::App::build(config("wake-b")).await.unwrap();
    let a = TestApp::spawn_config(db.share(), model, receiver, config("wake-a")).await;
    let token = tokio_util::sync::CancellationToken::new();
    let b_running = tokio::spawn(b.run_until_stopped(token.clone()));
    // B's first claim, at its start, finds nothing.
    let deadline = std::time::Instant::now() + WAIT;
    while claims(&a.addr, "wake-b").await == 0 {
        assert!(std::time::Instant::now() < deadline, "B never claimed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A has room: it claims what its webhook committed, and B is not woken.
    let before = claims(&a.addr, "wake-b").await;
    for n in 0..10 {
        let id = task_id_of(a.post_message(&message("wake", n, "hello")).await).await;
        let task = a.wait_replied(id, WAIT).await;
        assert_eq!(task["owner"], "wake-a", "{task}");
    }
    assert_eq!(
        claims(&a.addr, "wake-b").await,
        before,
        "a wake-up reached the instance that did not commit the tasks"
    );
    assert!(claims(&a.addr, "wake-a").await >= 10);

    if postgres {
        // A full (two slow answers in its two slots): its next commit wakes B, which takes
        // the task at once, not at its poll two minutes away.
        let mut slow = Vec::new();
        for (n, text) in ["slow one", "slow two"].iter().enumerate() {
            let posted = message(&format!("wake-slow-{n}"), 100, text);
            slow.push(task_id_of(a.post_message(&posted).await).await);
        }
        for id in &slow {
            let deadline = std::time::Instant::now() + WAIT;
            while a.get_task(*id).await["status"] != "RUNNING" {
                assert!(std::time::Instant::now() < deadline, "{id} never ran");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let id = task_id_of(a.post_message(&message("wake-third", 200, "hello")).await).await;
        let task = a.wait_replied(id, Duration::from_secs(20)).await;
        assert_eq!(task["owner"], "wake-b", "{task}");
        for id in slow {
            a.wait_replied(id, WAIT).await;
        }
    }
    token.cancel();
    let _ = b_running.await;
    a.stop().await;
}
