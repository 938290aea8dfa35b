//! Scheduled jobs: approval timeouts, orphan reclaim, retention, the per-tick lock, job runs
//! and instance roles.

use std::collections::BTreeMap;
use std::time::Duration;

use assistd::domain::NewMessage;
use assistd::domain::{JobRunStatus, now_ms};
use assistd::store::Store;
use serde_json::Value;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use assistd::store::jobs::{JobLock, LockGate};

use crate::helpers::*;

const SCHEDULED: LockGate = LockGate::Scheduled {
    default_enabled: true,
};
use crate::workflows::{NOTICE, calls_to, spawn_flow_with};

impl TestApp {
    async fn job_runs(&self, query: &str) -> reqwest::Response {
        self.http
            .get(format!("{}/api/admin/job-runs?{query}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overdue_approvals_are_cancelled_once_in_batches_and_the_requester_told() {
    let flow = spawn_flow_with(NOTICE, |c| c.scheduler.enabled = false).await;
    let app = &flow.app;
    let mut ids = Vec::new();
    for n in 0..4 {
        if n == 3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let id = task_id_of(
            app.post_message(&message(&format!("to{n}"), 1, "send it"))
                .await,
        )
        .await;
        ids.push(id);
        app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
            .await;
    }
    let deadline = |t: &Value| t["confirm_deadline"].as_i64().unwrap();
    let third = app.get_task(ids[2]).await;
    let fourth = app.get_task(ids[3]).await;
    let now = deadline(&third) + 1;
    assert!(deadline(&fourth) > now, "the fourth is not due yet");

    let svc = app.jobs.clone();
    let first = assistd::scheduler::confirm_timeout(&svc, 2, now)
        .await
        .unwrap();
    assert_eq!(
        (first.scanned, first.affected),
        (2, 2),
        "batch limit respected"
    );
    let second = assistd::scheduler::confirm_timeout(&svc, 2, now)
        .await
        .unwrap();
    assert_eq!(second.affected, 1);
    let third_run = assistd::scheduler::confirm_timeout(&svc, 2, now)
        .await
        .unwrap();
    assert_eq!(third_run.affected, 0, "cancelled once");

    let task = app
        .wait_task(ids[0], WAIT, |t| t["reply"]["status"] == "SENT")
        .await;
    assert_eq!(task["status"], "CANCELLED");
    assert_eq!(task["failure_type"], "TIMEOUT");
    assert_eq!(task["pending_actions"][0]["decision"], "EXPIRED");
    let event = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_TIMEOUT_CANCELLED")
        .unwrap();
    assert_eq!(event["risk_flag"], true);
    assert_eq!(
        app.get_task(ids[3]).await["status"],
        "WAITING_HUMAN_CONFIRM",
        "not yet due: untouched"
    );
    // An approval arriving after the deadline is refused.
    assert_eq!(app.confirm(ids[0], "approve", "alice").await.status(), 409);
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    let notices: Vec<(String, Value)> = app
        .replies()
        .await
        .into_iter()
        .filter(|(k, _)| k == &format!("agent-task-{}", ids[0]))
        .collect();
    assert_eq!(notices.len(), 1, "the requester is told once");
    assert!(notices[0].1["text"].as_str().unwrap().contains("in time"));
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_timeout_callbacks_are_signed_and_keyed() {
    let receiver_for_cb = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/callback"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&receiver_for_cb)
        .await;
    let cb_url = format!("{}/callback", receiver_for_cb.uri());
    let flow = spawn_flow_with(NOTICE, move |c| {
        c.scheduler.enabled = false;
        c.scheduler.jobs.confirm_timeout.approval_callback_url = cb_url;
    })
    .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("cb", 1, "send it")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let now = task["confirm_deadline"].as_i64().unwrap() + 1;
    let run = assistd::scheduler::confirm_timeout(&app.jobs, 500, now)
        .await
        .unwrap();
    assert_eq!(run.affected, 1);
    let deadline = std::time::Instant::now() + WAIT;
    let calls = loop {
        let calls = receiver_for_cb.received_requests().await.unwrap();
        if !calls.is_empty() {
            break calls;
        }
        assert!(std::time::Instant::now() < deadline, "no callback");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(calls.len(), 1);
    let req = &calls[0];
    assert_eq!(
        req.headers.get("idempotency-key").unwrap(),
        &format!("agent-task-{id}-timeout")
    );
    let ts = req
        .headers
        .get("x-assistd-timestamp")
        .unwrap()
        .to_str()
        .unwrap();
    let sig = req
        .headers
        .get("x-assistd-signature")
        .unwrap()
        .to_str()
        .unwrap();
    assistd::channels::generic::verify(
        SECRET,
        Some(ts),
        Some(sig),
        &req.body,
        now_ms() / 1000,
        300,
    )
    .unwrap();
    let body: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(body["event"], "TASK_TIMEOUT_CANCELLED");
    assert_eq!(body["task_id"], id);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tick_runs_in_one_instance_and_the_other_records_skipped() {
    let model = MockServer::start().await;
    let db = TestDb::new().await;
    let receiver = accepting_receiver().await;
    let mut apps = Vec::new();
    for instance in ["sched-a", "sched-b"] {
        let mut c = test_config(&db.url, &model.uri(), &format!("{}/reply", receiver.uri()));
        c.worker.instance_id = instance.into();
        c.scheduler.jobs.confirm_timeout.cron = "* * * * * *".into();
        c.scheduler.jobs.orphan_reclaim.enabled = false;
        c.scheduler.jobs.retention.enabled = false;
        let app = assistd::App::build(c).await.unwrap();
        let token = tokio_util::sync::CancellationToken::new();
        let addr = format!("http://{}", app.local_addr());
        let handle = tokio::spawn(app.run_until_stopped(token.clone()));
        apps.push((addr, token, handle));
    }
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    let http = reqwest::Client::new();
    let runs: Value = http
        .get(format!(
            "{}/api/admin/job-runs?job=confirm_timeout&limit=100",
            apps[0].0
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for (_, token, handle) in apps {
        token.cancel();
        let _ = handle.await;
    }
    let runs = runs["job_runs"].as_array().unwrap().clone();
    let mut per_tick: BTreeMap<i64, Vec<(String, String)>> = BTreeMap::new();
    for r in &runs {
        per_tick
            .entry(r["started_at"].as_i64().unwrap() / 1000)
            .or_default()
            .push((
                r["instance"].as_str().unwrap().into(),
                r["status"].as_str().unwrap().into(),
            ));
    }
    assert!(per_tick.len() >= 9, "ten ticks: {per_tick:?}");
    for (tick, outcomes) in &per_tick {
        let succeeded = outcomes.iter().filter(|(_, s)| s == "SUCCEEDED").count();
        assert!(succeeded <= 1, "tick {tick} ran twice: {outcomes:?}");
    }
    let skipped = runs.iter().filter(|r| r["status"] == "SKIPPED").count();
    assert!(
        skipped >= 2,
        "the other instance records SKIPPED: {per_tick:?}"
    );
    let instances: std::collections::HashSet<&str> = runs
        .iter()
        .map(|r| r["instance"].as_str().unwrap())
        .collect();
    assert_eq!(instances.len(), 2);
    db.drop_db().await;
}

async fn store_for(db: &TestDb) -> Store {
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = Store::connect(&cfg.database).await.unwrap();
    store.migrate().await.unwrap();
    publish_agents(&store, &cfg).await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lock_holder_loses_the_lock_when_its_lease_ends() {
    let db = TestDb::new().await;
    let store = store_for(&db).await;
    let now = now_ms();
    assert!(
        store
            .try_lock_job("j", "dies", 100, now + 1_000, now, SCHEDULED)
            .await
            .unwrap()
            == JobLock::Taken
    );
    assert!(
        store
            .try_lock_job("j", "other", 101, now + 1_000, now + 10, SCHEDULED)
            .await
            .unwrap()
            == JobLock::Held,
        "lease still runs"
    );
    assert!(
        store
            .try_lock_job("j", "other", 102, now + 5_000, now + 1_001, SCHEDULED)
            .await
            .unwrap()
            == JobLock::Taken,
        "lease over"
    );
    store.release_job("j", "other").await.unwrap();
    assert!(
        store
            .try_lock_job("j", "third", 102, now + 9_000, now + 2_000, SCHEDULED)
            .await
            .unwrap()
            == JobLock::Held,
        "same tick never twice"
    );
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphaned_running_tasks_go_back_to_pending_with_an_audit_event() {
    let db = TestDb::new().await;
    let store = store_for(&db).await;
    let now = now_ms();
    let msg = NewMessage {
        reply_context: None,
        channel: "generic".into(),
        event_id: "e1".into(),
        message_id: "m1".into(),
        conversation_id: "c".into(),
        sender_id: "u".into(),
        sender_name: None,
        text: "hi".into(),
        trace_context: None,
    };
    let id = store
        .ingest_message(&msg, "default", now - 300_000)
        .await
        .unwrap()
        .task_id;
    let claimed = store
        .claim_tasks("gone-instance", 1, now - 120_000, now - 150_000)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    // Expired, but within the grace period: left to the claim path.
    let (_, none) = store
        .reclaim_orphans(now - 200_000, 10, now, false)
        .await
        .unwrap();
    assert!(none.is_empty());
    let (scanned, reclaimed) = store
        .reclaim_orphans(now - 60_000, 10, now, false)
        .await
        .unwrap();
    assert_eq!((scanned, reclaimed.len()), (1, 1));
    assert_eq!(reclaimed[0].owner.as_deref(), Some("gone-instance"));
    let task = store.task(id).await.unwrap().unwrap();
    assert_eq!(task.status, assistd::domain::TaskStatus::Pending);
    let audit = store.task_audit(id).await.unwrap();
    let event = audit
        .iter()
        .find(|a| a.event == assistd::domain::AuditEvent::TaskReclaimed)
        .unwrap();
    assert!(event.summary.contains("gone-instance"), "{}", event.summary);
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_bodies_but_keeps_history() {
    let app = TestApp::spawn().await;
    let id = task_id_of(
        app.post_message(&message("ret", 1, "secret question"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    let finished = task["finished_at"].as_i64().unwrap();
    let svc = app.jobs.clone();
    let early = assistd::scheduler::retention(&svc, 500, finished + 1000)
        .await
        .unwrap();
    assert_eq!(early.affected, 0, "younger than the TTL");
    let ttl = svc.config.scheduler.jobs.retention.ttl_days as i64 * 86_400_000;
    let run = assistd::scheduler::retention(&svc, 500, finished + ttl + 1)
        .await
        .unwrap();
    assert_eq!(run.affected, 1);
    let again = assistd::scheduler::retention(&svc, 500, finished + ttl + 1)
        .await
        .unwrap();
    assert_eq!(again.scanned, 0, "purged tasks are not scanned again");
    // Job runs older than the TTL go too (issue 17, item 15); younger ones stay.
    let store = app.store();
    for (job, started) in [("old_job", finished - 5), ("new_job", finished + ttl)] {
        store
            .record_job_run(&assistd::store::jobs::NewJobRun {
                job,
                instance: "i",
                started_at: started,
                finished_at: started + 1,
                status: JobRunStatus::Succeeded,
                scanned: 0,
                affected: 0,
                error: None,
                trigger: "schedule",
                actor: None,
            })
            .await
            .unwrap();
    }
    assistd::scheduler::retention(&svc, 500, finished + ttl + 1)
        .await
        .unwrap();
    assert!(store.job_runs(Some("old_job"), 5).await.unwrap().is_empty());
    assert_eq!(store.job_runs(Some("new_job"), 5).await.unwrap().len(), 1);
    let task = app.get_task(id).await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(task["message"]["text"], "");
    // A model call keeps only the model it asked for (the summary's tokens are per model).
    let input = &task["steps"][0]["input"];
    let kept: serde_json::Value = serde_json::from_str(input.as_str().unwrap_or("")).unwrap();
    assert_eq!(kept, serde_json::json!({"model": "test-model"}), "{input}");
    assert!(task["steps"][0]["output"].is_null());
    assert_eq!(task["steps"][0]["status"], "SUCCEEDED");
    assert!(task["audit"].as_array().unwrap().len() >= 3, "audit stays");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runs_are_listed_for_admins() {
    let app = TestApp::spawn().await;
    let schedule = app.config.scheduler.jobs.orphan_reclaim.schedule();
    let status = assistd::scheduler::tick(&app.jobs, "orphan_reclaim", &schedule).await;
    assert_eq!(status, JobRunStatus::Succeeded);
    let runs: Value = app
        .job_runs("job=orphan_reclaim&limit=5")
        .await
        .json()
        .await
        .unwrap();
    let first = &runs["job_runs"][0];
    assert_eq!(first["job"], "orphan_reclaim");
    assert_eq!(first["status"], "SUCCEEDED");
    assert_eq!(first["instance"], "test-instance");
    assert!(first["finished_at"].as_i64().unwrap() >= first["started_at"].as_i64().unwrap());
    assert_eq!(app.job_runs("limit=0").await.status(), 400);
    let unauth = app
        .http
        .get(format!("{}/api/admin/job-runs", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(unauth.status(), 401);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_and_worker_roles_split_the_work() {
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let reply_url = format!("{}/reply", receiver.uri());
    let mut api_cfg = test_config(&db.url, &model.uri(), &reply_url);
    api_cfg.server.role = assistd::config::Role::Api;
    api_cfg.worker.instance_id = "api-1".into();
    let api = TestApp::spawn_config(db.share(), model, receiver, api_cfg).await;
    let id = task_id_of(api.post_message(&message("roles", 1, "hello")).await).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        api.get_task(id).await["status"],
        "PENDING",
        "the api role runs no workers"
    );

    let mut worker_cfg = test_config(&db.url, &api.model.uri(), &reply_url);
    worker_cfg.server.role = assistd::config::Role::Worker;
    worker_cfg.worker.instance_id = "worker-1".into();
    let worker = assistd::App::build(worker_cfg).await.unwrap();
    let worker_addr = format!("http://{}", worker.local_addr());
    let token = tokio_util::sync::CancellationToken::new();
    let handle = tokio::spawn(worker.run_until_stopped(token.clone()));
    let task = api.wait_replied(id, WAIT).await;
    assert_eq!(task["owner"], "worker-1");
    let http = reqwest::Client::new();
    assert_eq!(
        http.get(format!("{worker_addr}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        http.post(format!("{worker_addr}/webhooks/generic"))
            .send()
            .await
            .unwrap()
            .status(),
        404,
        "the worker role serves no webhooks"
    );
    token.cancel();
    let _ = handle.await;
    api.stop().await;
    db.drop_db().await;
}

/// Issue 19, item 4: a decision that comes after the deadline is refused (409) and audited
/// CONFIRM_DENIED with its reason and the risk flag, even before the timeout scan has run;
/// the tool is not called and the task still waits for the scan to cancel it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_after_the_deadline_is_refused_before_the_scan_runs() {
    let flow = spawn_flow_with(NOTICE, |c| {
        c.scheduler.enabled = false;
        for agent in c.agents.values_mut() {
            agent.confirm_deadline_secs = 1;
        }
    })
    .await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("late", 1, "send it")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let deadline = task["confirm_deadline"].as_i64().unwrap();
    tokio::time::sleep(Duration::from_millis(
        (deadline - now_ms() + 50).max(0) as u64
    ))
    .await;
    let late = app.confirm(id, "approve", "alice").await;
    assert_eq!(late.status(), 409);
    let body: Value = late.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap_or("").contains("deadline"),
        "{body}"
    );
    let task = app.get_task(id).await;
    assert_eq!(task["status"], "WAITING_HUMAN_CONFIRM");
    let denied = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "CONFIRM_DENIED")
        .expect("audited");
    assert_eq!(denied["risk_flag"], true);
    assert!(
        denied["summary"]
            .as_str()
            .unwrap()
            .contains("deadline passed"),
        "{denied}"
    );
    // A card action from the chat is refused the same way.
    let card = app
        .post_action(
            id,
            task["pending_actions"][0]["request"].as_str().unwrap(),
            "approve",
            "alice",
        )
        .await;
    assert_eq!(card.status(), 409);
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    flow.app.stop().await;
}
