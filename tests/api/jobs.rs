//! Job control (run now, switch off and on for every instance), orphan-reclaim alerts and
//! audit trails by target (issue 19, items 5 and 6).

use std::sync::Arc;
use std::time::Duration;

use assistd::domain::{JobRunStatus, NewMessage, now_ms};
use assistd::scheduler::{Jobs, tick};
use assistd::store::jobs::{JobLock, LockGate};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::helpers::*;

impl TestApp {
    async fn admin_post(&self, route: &str, body: Option<Value>) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}{route}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .header("X-Assistd-Actor", "alice");
        if let Some(body) = body {
            req = req.json(&body);
        }
        req.send().await.unwrap()
    }

    async fn admin_get(&self, route: &str) -> Value {
        let resp = self
            .http
            .get(format!("{}{route}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{route}");
        resp.json().await.unwrap()
    }

    /// The same jobs as another instance on the same database would run them.
    fn other_instance(&self) -> Jobs {
        Jobs {
            config: self.config.clone(),
            store: self.store().clone(),
            instance_id: "other-instance".into(),
            wake: Arc::new(assistd::wake::Wake::default()),
        }
    }
}

pub(crate) fn events(trail: &Value) -> Vec<(String, String)> {
    trail["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["event"].as_str().unwrap().to_string(),
                a["actor"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_now_under_its_lock_recorded_as_manual_with_its_actor() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.scheduler.enabled = false
    })
    .await;
    let resp = app.admin_post("/api/admin/jobs/retention/run", None).await;
    assert_eq!(resp.status(), 200);
    let run: Value = resp.json().await.unwrap();
    assert_eq!(run["status"], "SUCCEEDED");
    assert_eq!(run["trigger"], "manual");
    assert_eq!(run["actor"], "admin:alice");
    let runs = app.admin_get("/api/admin/job-runs?job=retention").await;
    assert_eq!(runs["job_runs"].as_array().unwrap().len(), 1);
    assert_eq!(runs["job_runs"][0]["trigger"], "manual");
    assert_eq!(runs["job_runs"][0]["actor"], "admin:alice");

    // While another run holds the lock, run-now is refused and records no run.
    let now = now_ms();
    let store = app.store();
    assert_eq!(
        store
            .try_lock_job(
                "retention",
                "other-instance",
                now / 1000 + 5,
                now + 60_000,
                now,
                LockGate::Manual
            )
            .await
            .unwrap(),
        JobLock::Taken
    );
    let resp = app.admin_post("/api/admin/jobs/retention/run", None).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        app.admin_get("/api/admin/job-runs?job=retention").await["job_runs"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    store
        .release_job("retention", "other-instance")
        .await
        .unwrap();

    // The job's own trail names who ran it, newest first.
    let trail = app
        .admin_get("/api/admin/audit?target_type=job&target_id=retention")
        .await;
    let ev = events(&trail);
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert!(ev.iter().all(|(e, a)| e == "JOB_RUN" && a == "admin:alice"));
    assert!(
        trail["audit"][0]["summary"]
            .as_str()
            .unwrap()
            .contains("refused")
    );
    assert!(
        trail["audit"][1]["summary"]
            .as_str()
            .unwrap()
            .contains("SUCCEEDED")
    );

    assert_eq!(
        app.admin_post("/api/admin/jobs/nope/run", None)
            .await
            .status(),
        404
    );
    let anonymous = app
        .http
        .post(format!("{}/api/admin/jobs/retention/run", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_trail_query_is_checked() {
    let app = TestApp::spawn().await;
    for bad in [
        "target_type=planet&target_id=x",
        "target_type=job",
        "target_type=job&target_id=retention&limit=0",
    ] {
        let resp = app
            .http
            .get(format!("{}/api/admin/audit?{bad}", app.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{bad}");
    }
    app.stop().await;
}

/// A task's trail by target comes from the task's own rows (the target index leaves task
/// rows out, migration 0010); a reply's from the target index. Newest first either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_and_its_reply_have_their_own_audit_trails() {
    let app = TestApp::spawn().await;
    let id = task_id_of(app.post_message(&message("c-trail", 1, "hello")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    let trail = app
        .admin_get(&format!("/api/admin/audit?target_type=task&target_id={id}"))
        .await;
    let ev: Vec<String> = events(&trail).into_iter().map(|(e, _)| e).collect();
    assert_eq!(
        ev,
        ["TASK_SUCCEEDED", "TASK_RUNNING", "TASK_CREATED"],
        "{trail}"
    );
    let reply = task["replies"][0]["id"].as_i64().unwrap();
    let trail = app
        .admin_get(&format!(
            "/api/admin/audit?target_type=reply&target_id={reply}"
        ))
        .await;
    let ev: Vec<String> = events(&trail).into_iter().map(|(e, _)| e).collect();
    assert_eq!(ev, ["REPLY_SENT"], "{trail}");
    // An id that names no task is an empty trail, not an error.
    for target in ["task&target_id=abc", "task&target_id=999999"] {
        let trail = app
            .admin_get(&format!("/api/admin/audit?target_type={target}"))
            .await;
        assert_eq!(trail["audit"], json!([]), "{target}");
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_switched_off_stops_on_every_instance_until_switched_on() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.scheduler.enabled = false;
        c.scheduler.jobs.retention.enabled = false;
    })
    .await;
    let jobs = app.admin_get("/api/admin/jobs").await;
    let state = |jobs: &Value, name: &str| {
        jobs["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["job"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(state(&jobs, "orphan_reclaim")["enabled"], true);
    assert_eq!(state(&jobs, "orphan_reclaim")["source"], "config");
    assert_eq!(state(&jobs, "retention")["enabled"], false);

    let orphan = app.config.scheduler.jobs.orphan_reclaim.schedule();
    let resp = app
        .admin_post(
            "/api/admin/jobs/orphan_reclaim/enabled",
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["enabled"], false);
    assert_eq!(body["source"], "admin");
    assert_eq!(body["switched_by"], "admin:alice");
    // Off for this instance and for another on the same database: nothing runs or is
    // recorded.
    let other = app.other_instance();
    assert_eq!(
        tick(&app.jobs, "orphan_reclaim", &orphan).await,
        JobRunStatus::Skipped
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        tick(&other, "orphan_reclaim", &orphan).await,
        JobRunStatus::Skipped
    );
    let runs = app
        .admin_get("/api/admin/job-runs?job=orphan_reclaim")
        .await;
    assert!(runs["job_runs"].as_array().unwrap().is_empty(), "{runs}");
    // An admin may still run it by hand.
    assert_eq!(
        app.admin_post("/api/admin/jobs/orphan_reclaim/run", None)
            .await
            .status(),
        200
    );

    // On again: the next tick runs, on whichever instance.
    assert_eq!(
        app.admin_post(
            "/api/admin/jobs/orphan_reclaim/enabled",
            Some(json!({"enabled": true}))
        )
        .await
        .status(),
        200
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        tick(&other, "orphan_reclaim", &orphan).await,
        JobRunStatus::Succeeded
    );

    // A job off in config runs once an admin switches it on; the database wins from then.
    let retention = app.config.scheduler.jobs.retention.schedule();
    assert_eq!(
        tick(&other, "retention", &retention).await,
        JobRunStatus::Skipped
    );
    app.admin_post(
        "/api/admin/jobs/retention/enabled",
        Some(json!({"enabled": true})),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        tick(&other, "retention", &retention).await,
        JobRunStatus::Succeeded
    );

    let trail = app
        .admin_get("/api/admin/audit?target_type=job&target_id=orphan_reclaim")
        .await;
    let ev: Vec<String> = events(&trail).into_iter().map(|e| e.0).collect();
    assert_eq!(ev, vec!["JOB_ENABLED", "JOB_RUN", "JOB_DISABLED"]);

    for bad in [
        json!({"enabled": "yes"}),
        json!({}),
        json!({"enabled": true, "x": 1}),
    ] {
        let resp = app
            .admin_post("/api/admin/jobs/retention/enabled", Some(bad.clone()))
            .await;
        assert_eq!(resp.status(), 400, "{bad}");
    }
    assert_eq!(
        app.admin_post(
            "/api/admin/jobs/nope/enabled",
            Some(json!({"enabled": true}))
        )
        .await
        .status(),
        404
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_reclaim_posts_a_signed_alert_naming_the_task_and_its_last_owner() {
    let alerts = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/alerts"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&alerts)
        .await;
    let url = format!("{}/alerts", alerts.uri());
    // The scan below runs as if the orphan's hour-long lease had passed.
    let db = TestDb::new().await;
    let now = now_ms();
    let id = orphaned_task(&db, now).await;
    let (model, receiver) = (echo_model().await, accepting_receiver().await);
    let mut config = test_config(&db.url, &model.uri(), &format!("{}/reply", receiver.uri()));
    config.scheduler.enabled = false;
    config.scheduler.jobs.orphan_reclaim.alert_url = url;
    let app = TestApp::spawn_config(db, model, receiver, config).await;
    let run = assistd::scheduler::orphan_reclaim(&app.jobs, 500, now + 3_700_000)
        .await
        .unwrap();
    assert_eq!(run.affected, 1);

    let deadline = std::time::Instant::now() + WAIT;
    let calls = loop {
        let calls = alerts.received_requests().await.unwrap();
        if !calls.is_empty() {
            break calls;
        }
        assert!(std::time::Instant::now() < deadline, "no alert");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(calls.len(), 1);
    let req = &calls[0];
    let key = req
        .headers
        .get("idempotency-key")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(
        key.starts_with(&format!("agent-task-{id}-reclaimed-v")),
        "{key}"
    );
    let header = |name: &str| req.headers.get(name).unwrap().to_str().unwrap().to_string();
    assistd::channels::generic::verify(
        SECRET,
        Some(&header("x-assistd-timestamp")),
        Some(&header("x-assistd-signature")),
        &req.body,
        now_ms() / 1000,
        300,
    )
    .expect("signed like replies");
    let body: Value = serde_json::from_slice(&req.body).unwrap();
    assert_eq!(body["event"], "TASK_RECLAIMED");
    assert_eq!(body["task_id"], id);
    assert_eq!(body["last_owner"], "ghost-instance");
    assert_eq!(body["conversation_id"], "c-orphan");
    // The alert is an outbox row of the task: retried, recorded, never sent twice.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(alerts.received_requests().await.unwrap().len(), 1);
    let task = app.get_task(id).await;
    let alert = task["replies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["idempotency_key"] == key)
        .cloned()
        .unwrap();
    assert_eq!(alert["status"], "SENT");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_has_its_own_audit_trail() {
    let flow = crate::workflows::spawn_flow(crate::workflows::NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-trail", 1, "send")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let action = task["pending_actions"][0]["id"].as_i64().unwrap();
    // Someone not allowed tries first; then alice approves.
    assert_eq!(app.confirm(id, "approve", "mallory").await.status(), 403);
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    app.wait_replied(id, WAIT).await;
    let trail = app
        .admin_get(&format!(
            "/api/admin/audit?target_type=approval&target_id={action}"
        ))
        .await;
    let ev = events(&trail);
    assert_eq!(
        ev.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
        vec!["TASK_CONFIRMED", "CONFIRM_DENIED", "TASK_WAITING_CONFIRM"],
        "{ev:?}"
    );
    assert_eq!(ev[0].1, "alice");
    assert_eq!(ev[1].1, "mallory");
    assert!(
        trail["audit"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a["task_id"] == id)
    );
    // The task's own timeline still has every event, each naming its target.
    let task = app.get_task(id).await;
    let sent = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "REPLY_SENT")
        .cloned()
        .unwrap();
    assert_eq!(sent["target_type"], "reply");
    let created = &task["audit"][0];
    assert_eq!(created["event"], "TASK_CREATED");
    assert_eq!(created["target_type"], "task");
    assert_eq!(created["target_id"], id.to_string());
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_scheduler_panel_runs_and_switches_jobs_with_csrf() {
    use crate::admin_pages::{browser, csrf_of, sign_in};
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.scheduler.enabled = false
    })
    .await;
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let page = || async {
        http.get(format!("{}/admin", app.addr))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let post = |route: &'static str, csrf: String| {
        let (http, cookie, addr) = (http.clone(), cookie.clone(), app.addr.clone());
        async move {
            http.post(format!("{addr}{route}"))
                .header("cookie", &cookie)
                .form(&[("csrf", csrf)])
                .send()
                .await
                .unwrap()
        }
    };
    let html = page().await;
    assert!(
        html.contains("id=\"switch-retention\"") && html.contains("Switch off"),
        "{html}"
    );
    let csrf = csrf_of(&html);
    assert_eq!(
        post("/admin/jobs/retention/disable", "0".repeat(64))
            .await
            .status(),
        403
    );
    let jobs = app.admin_get("/api/admin/jobs").await;
    assert!(
        jobs["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|j| j["enabled"] == true)
    );

    assert_eq!(
        post("/admin/jobs/retention/disable", csrf.clone())
            .await
            .status(),
        303
    );
    let html = page().await;
    assert!(html.contains("off (switched by admin:web)"), "{html}");
    let resp = post("/admin/jobs/retention/run", csrf.clone()).await;
    assert_eq!(resp.status(), 303);
    let location = resp.headers()["location"].to_str().unwrap().to_string();
    assert!(location.contains("SUCCEEDED"), "{location}");
    let runs = app.admin_get("/api/admin/job-runs?job=retention").await;
    assert_eq!(runs["job_runs"][0]["actor"], "admin:web");
    assert_eq!(
        post("/admin/jobs/retention/enable", csrf).await.status(),
        303
    );
    let trail = app
        .admin_get("/api/admin/audit?target_type=job&target_id=retention")
        .await;
    let ev: Vec<(String, String)> = events(&trail);
    assert_eq!(
        ev,
        vec![
            ("JOB_ENABLED".into(), "admin:web".into()),
            ("JOB_RUN".into(), "admin:web".into()),
            ("JOB_DISABLED".into(), "admin:web".into()),
        ]
    );
    app.stop().await;
}

/// A task an instance claimed at `now` and then vanished with (its lease runs an hour), set
/// up in `db` before the app under test starts, so that its workers cannot take the message
/// first. Its id.
pub(crate) async fn orphaned_task(db: &TestDb, now: i64) -> i64 {
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = assistd::store::Store::connect(&cfg.database).await.unwrap();
    store.migrate().await.unwrap();
    publish_agents(&store, &cfg).await.unwrap();
    let msg = NewMessage {
        reply_context: None,
        channel: "generic".into(),
        event_id: "e-orphan".into(),
        message_id: "m-orphan".into(),
        conversation_id: "c-orphan".into(),
        sender_id: "u".into(),
        sender_name: None,
        text: "hi".into(),
        trace_context: None,
    };
    let id = store
        .ingest_message(&msg, "default", now)
        .await
        .unwrap()
        .task_id;
    let claimed = store
        .claim_tasks("ghost-instance", 1, now + 3_600_000, now)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    store.close().await;
    id
}
