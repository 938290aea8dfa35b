//! Admin control of tasks: cancel, resume, list.

use std::time::Duration;

use serde_json::Value;
use wiremock::MockServer;

use crate::helpers::*;

impl TestApp {
    pub async fn control(&self, id: i64, action: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/api/tasks/{id}/{action}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .header("X-Assistd-Actor", "alice")
            .send()
            .await
            .unwrap()
    }

    pub async fn list(&self, query: &str) -> reqwest::Response {
        self.http
            .get(format!("{}/api/tasks?{query}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
    }
}

async fn slow_model(delay: Duration) -> MockServer {
    let model = MockServer::start().await;
    model_mock(move |_: &Value| ModelReply::text("late answer").delayed(delay))
        .mount(&model)
        .await;
    model
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_running_task_stops_it_and_sends_one_notice() {
    let app = TestApp::spawn_with(
        slow_model(Duration::from_secs(3)).await,
        accepting_receiver().await,
        |_| {},
    )
    .await;
    let id = task_id_of(app.post_message(&message("c-cancel", 1, "slow one")).await).await;
    app.wait_task(id, WAIT, |t| {
        t["status"] == "RUNNING" && t["steps"][0]["status"] == "PENDING"
    })
    .await;
    // The model call is in flight.
    while app.model.received_requests().await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = app.control(id, "cancel").await;
    assert_eq!(resp.status(), 200);
    let task: Value = resp.json().await.unwrap();
    assert_eq!(task["status"], "CANCELLED");
    assert_eq!(task["failure_type"], "CANCELLED");
    let task = app.wait_replied(id, WAIT).await;
    let cancel = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_CANCELLED")
        .unwrap();
    assert_eq!(cancel["actor"], "admin:alice");
    // The model's late answer never reaches the chat.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].0, format!("agent-task-{id}"));
    assert!(replies[0].1["text"].as_str().unwrap().contains("cancelled"));
    assert_eq!(app.get_task(id).await["status"], "CANCELLED");
    // Cancelling again, or resuming a cancelled-by-admin task, is a conflict.
    assert_eq!(app.control(id, "cancel").await.status(), 409);
    let resp = app.control(id, "resume").await;
    assert_eq!(resp.status(), 409);
    let err: Value = resp.json().await.unwrap();
    assert!(
        err["error"].as_str().unwrap().contains("CANCELLED"),
        "{err}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_pending_task_means_it_never_runs() {
    let app = TestApp::spawn_with(
        slow_model(Duration::from_millis(800)).await,
        accepting_receiver().await,
        |_| {},
    )
    .await;
    let first = task_id_of(app.post_message(&message("c-pend", 1, "first")).await).await;
    let second = task_id_of(app.post_message(&message("c-pend", 2, "second")).await).await;
    assert_eq!(app.get_task(second).await["status"], "PENDING");
    assert_eq!(app.control(second, "cancel").await.status(), 200);
    app.wait_replied(first, WAIT).await;
    app.wait_replied(second, WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        app.model.received_requests().await.unwrap().len(),
        1,
        "only the first task called the model"
    );
    assert_eq!(
        app.get_task(second).await["steps"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_resumes_and_answers_under_a_new_key() {
    let model = model_failing_first(1, "").await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-resume", 1, "again")).await).await;
    let failed = app.wait_replied(id, WAIT).await;
    assert_eq!(failed["failure_type"], "AUTH_FAILED");
    assert_eq!(app.control(id, "resume").await.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["resume_count"], 1);
    assert_eq!(task["retry_count"], 1);
    assert_eq!(
        task["steps"].as_array().unwrap().len(),
        1,
        "the same journalled step was re-run"
    );
    assert_eq!(task["steps"][0]["status"], "SUCCEEDED");
    assert_eq!(task["steps"][0]["attempts"], 2);
    let events = audit_events(&task);
    assert!(events.contains(&"TASK_RESUMED"), "{events:?}");
    let replies = app.replies().await;
    let keys: Vec<&str> = replies.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [format!("agent-task-{id}"), format!("agent-task-{id}-r1")]
    );
    assert_eq!(replies[1].1["text"], "answer to: again");
    // A succeeded task cannot be resumed.
    assert_eq!(app.control(id, "resume").await.status(), 409);
    assert_eq!(app.control(999_999, "resume").await.status(), 404);
    app.stop().await;
}

/// A pause asked while a run was going, which then failed before it reached a step boundary,
/// is stale once the task has failed: the run an admin resumes is not paused by it (seen in
/// the rollups test's random mix, where such a resumed task stayed PAUSED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_asked_of_a_failed_run_does_not_pause_its_resumed_run() {
    let model = model_failing_first(1, "").await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(
        app.post_message(&message("c-stale-pause", 1, "again"))
            .await,
    )
    .await;
    app.wait_replied(id, WAIT).await;
    // The pause request the failed run left behind (the pause endpoint refuses a finished
    // task; the request was made while it ran).
    let stale = "UPDATE agent_task SET pause_requested = 1 WHERE id = $1";
    match app.store() {
        assistd::store::Store::Sqlite(pool, _) => {
            sqlx::query(stale).bind(id).execute(pool).await.unwrap();
        }
        assistd::store::Store::Postgres(pool) => {
            sqlx::query(stale).bind(id).execute(pool).await.unwrap();
        }
    }
    assert_eq!(app.control(id, "resume").await.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "SUCCEEDED" || t["status"] == "PAUSED"
        })
        .await;
    assert_eq!(task["status"], "SUCCEEDED", "{task}");
    assert_eq!(task["pause_requested"], false);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_can_be_listed_by_status_and_conversation() {
    let app = TestApp::spawn().await;
    let a = task_id_of(app.post_message(&message("list-a", 1, "one")).await).await;
    let b = task_id_of(app.post_message(&message("list-b", 1, "two")).await).await;
    app.wait_replied(a, WAIT).await;
    app.wait_replied(b, WAIT).await;
    let all: Value = app
        .list("status=succeeded&limit=10")
        .await
        .json()
        .await
        .unwrap();
    let ids: Vec<i64> = all["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [b, a]);
    let one: Value = app.list("conversation=list-a").await.json().await.unwrap();
    assert_eq!(one["tasks"].as_array().unwrap().len(), 1);
    assert_eq!(one["tasks"][0]["id"], a);
    assert_eq!(app.list("status=BOGUS").await.status(), 400);
    assert_eq!(app.list("limit=0").await.status(), 400);
    assert_eq!(app.list("limit=lots").await.status(), 400);
    let unauth = app
        .http
        .get(format!("{}/api/tasks", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(unauth.status(), 401);
    app.stop().await;
}
