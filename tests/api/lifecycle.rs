//! Pause, unpause and restart from scratch, through the task API (issue 19, item 3).

use std::time::Duration;

use serde_json::Value;
use wiremock::MockServer;

use crate::helpers::*;
use crate::workflows::{calls_to, spawn_flow_on};

/// An `llm` step, then a read-only tool step, then the reply: two step boundaries.
const THINK_THEN_LOOK: &str = r#"{"start": "think", "nodes": [
  {"id": "think", "type": "llm", "prompt": "Think about: {{ message.text }}", "next": "look"},
  {"id": "look", "type": "tool", "tool": "lookup_a", "args": {"q": "x"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.think.text }} / {{ steps.look.value }}"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_task_pauses_at_its_next_step_boundary_and_unpauses_where_it_stopped() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("thought").delayed(Duration::from_millis(1500)))
        .mount(&model)
        .await;
    let flow = spawn_flow_on(THINK_THEN_LOOK, model, |_| {}).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-pause", 1, "the plan")).await).await;
    // The model call is in flight.
    while app.model.received_requests().await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = app.control(id, "pause").await;
    assert_eq!(resp.status(), 200);
    let task: Value = resp.json().await.unwrap();
    assert_eq!(task["status"], "RUNNING", "the call in flight is not cut");
    assert_eq!(task["pause_requested"], true);

    // The model step finishes and is recorded; the tool step never begins.
    let task = app.wait_task(id, WAIT, |t| t["status"] == "PAUSED").await;
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0]["status"], "SUCCEEDED");
    assert_eq!(task["owner"], Value::Null);
    assert_eq!(task["pause_requested"], false);
    let ev = audit_events(&task);
    assert!(ev.contains(&"TASK_PAUSE_REQUESTED"), "{ev:?}");
    assert!(ev.contains(&"TASK_PAUSED"), "{ev:?}");
    // Nobody claims a paused task; it is listed as PAUSED.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(calls_to(&flow.tools, "GET", "/tools/a").await, 0);
    assert_eq!(app.get_task(id).await["status"], "PAUSED");
    let listed: Value = app.list("status=PAUSED").await.json().await.unwrap();
    let ids: Vec<i64> = listed["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, vec![id]);
    assert_eq!(app.control(id, "restart").await.status(), 409);

    // Unpaused, it continues from the finished model step: no second model call.
    assert_eq!(app.control(id, "unpause").await.status(), 200);
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(app.model.received_requests().await.unwrap().len(), 1);
    assert_eq!(calls_to(&flow.tools, "GET", "/tools/a").await, 1);
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].1["text"], "thought / alpha");
    let unpause = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_UNPAUSED")
        .unwrap();
    assert_eq!(unpause["actor"], "admin:alice");
    // Unpausing a task that is not paused is a conflict.
    assert_eq!(app.control(id, "unpause").await.status(), 409);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_pending_task_is_never_claimed_until_unpaused() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("answer").delayed(Duration::from_millis(800)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let first = task_id_of(app.post_message(&message("c-pp", 1, "first")).await).await;
    let second = task_id_of(app.post_message(&message("c-pp", 2, "second")).await).await;
    assert_eq!(app.get_task(second).await["status"], "PENDING");
    let resp = app.control(second, "pause").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.json::<Value>().await.unwrap()["status"], "PAUSED");
    // Pausing again changes nothing.
    assert_eq!(app.control(second, "pause").await.status(), 200);
    app.wait_replied(first, WAIT).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(app.model.received_requests().await.unwrap().len(), 1);
    let task = app.get_task(second).await;
    assert_eq!(task["status"], "PAUSED");
    assert_eq!(task["steps"].as_array().unwrap().len(), 0);

    assert_eq!(app.control(second, "unpause").await.status(), 200);
    let task = app.wait_replied(second, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(app.replies().await.len(), 2);
    // A finished task cannot be paused; an unknown one is 404.
    assert_eq!(app.control(second, "pause").await.status(), 409);
    assert_eq!(app.control(999_999, "pause").await.status(), 404);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_task_restarts_from_scratch_under_a_new_key_keeping_the_old_steps() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("answer"))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-rs", 1, "again")).await).await;
    let first = app.wait_replied(id, WAIT).await;
    let old_key = first["steps"][0]["idempotency_key"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(first["restart_count"], 0);

    let resp = app.control(id, "restart").await;
    assert_eq!(resp.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "SUCCEEDED"
                && t["replies"].as_array().unwrap().len() == 2
                && t["replies"][1]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["restart_count"], 1);
    // A fresh journal, with new step keys; the old run kept and marked superseded.
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0]["step_no"], 1);
    let new_key = steps[0]["idempotency_key"].as_str().unwrap();
    assert_ne!(new_key, old_key);
    assert!(new_key.starts_with(&format!("{id}r1:1:")), "{new_key}");
    let superseded = task["superseded_steps"].as_array().unwrap();
    assert_eq!(superseded.len(), 1);
    assert_eq!(superseded[0]["idempotency_key"], old_key.as_str());
    assert_eq!(superseded[0]["restart_no"], 1);
    assert_eq!(superseded[0]["status"], "SUCCEEDED");
    assert_eq!(app.model.received_requests().await.unwrap().len(), 2);
    // One answer per run, each under its own key.
    let keys: Vec<String> = app.replies().await.into_iter().map(|r| r.0).collect();
    assert_eq!(
        keys,
        vec![format!("agent-task-{id}"), format!("agent-task-{id}-r1")]
    );
    let restarted = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_RESTARTED")
        .unwrap();
    assert_eq!(restarted["actor"], "admin:alice");
    assert!(
        restarted["summary"]
            .as_str()
            .unwrap()
            .contains("1 steps superseded"),
        "{restarted}"
    );

    // Issue 32: restarted twice more. SQLite gives a deleted step's id to the next step, and
    // the second restart used to answer 500 ("UNIQUE constraint failed:
    // agent_step_superseded.id").
    for n in 2..=3 {
        let resp = app.control(id, "restart").await;
        assert_eq!(
            resp.status(),
            200,
            "restart {n}: {}",
            resp.text().await.unwrap()
        );
        let task = app
            .wait_task(id, WAIT, |t| {
                t["status"] == "SUCCEEDED"
                    && t["replies"].as_array().unwrap().len() == n + 1
                    && t["replies"][n]["status"] == "SENT"
            })
            .await;
        assert_eq!(task["restart_count"], n);
        let superseded = task["superseded_steps"].as_array().unwrap();
        assert_eq!(superseded.len(), n, "{task:#}");
        let runs: Vec<i64> = superseded
            .iter()
            .map(|s| s["restart_no"].as_i64().unwrap())
            .collect();
        assert_eq!(runs, (1..=n as i64).collect::<Vec<_>>());
    }
    let keys: Vec<String> = app.replies().await.into_iter().map(|r| r.0).collect();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert_eq!(keys[3], format!("agent-task-{id}-r3"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_is_refused_while_a_task_runs_or_waits() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("late").delayed(Duration::from_millis(1500)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-rr", 1, "slow")).await).await;
    while app.model.received_requests().await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = app.control(id, "restart").await;
    assert_eq!(resp.status(), 409);
    let err: Value = resp.json().await.unwrap();
    assert!(err["error"].as_str().unwrap().contains("RUNNING"), "{err}");
    let task = app.wait_replied(id, WAIT).await;
    assert!(task["superseded_steps"].as_array().unwrap().is_empty());
    assert!(!audit_events(&task).contains(&"TASK_RESTARTED"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_workflow_asks_for_its_approval_again_and_runs_the_tool_under_a_new_key() {
    let flow = crate::workflows::spawn_flow(crate::workflows::NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-ra", 1, "pay up")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    app.wait_replied(id, WAIT).await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);

    assert_eq!(app.control(id, "restart").await.status(), 200);
    // The approval is asked again at the same step of the new run.
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let actions = task["pending_actions"].as_array().unwrap();
    assert_eq!(actions.len(), 2, "{actions:?}");
    assert_eq!(actions[0]["step_no"], actions[1]["step_no"]);
    assert_eq!(actions[1]["decision"], "PENDING");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 200);
    app.wait_task(id, WAIT, |t| {
        t["status"] == "SUCCEEDED" && t["replies"].as_array().unwrap().len() >= 3
    })
    .await;
    let keys: Vec<String> = flow
        .tools
        .received_requests()
        .await
        .unwrap()
        .iter()
        .filter(|r| r.url.path() == "/tools/notice")
        .map(|r| {
            r.headers
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1], "a restart calls its tools under new keys");
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_task_page_pauses_unpauses_and_restarts_with_csrf() {
    use crate::admin_pages::{browser, csrf_of, sign_in};
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("answer").delayed(Duration::from_millis(700)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let first = task_id_of(app.post_message(&message("c-web", 1, "one")).await).await;
    let second = task_id_of(app.post_message(&message("c-web", 2, "two")).await).await;
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let page = |id: i64| {
        let (http, cookie, addr) = (http.clone(), cookie.clone(), app.addr.clone());
        async move {
            http.get(format!("{addr}/admin/tasks/{id}"))
                .header("cookie", &cookie)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    let post = |id: i64, action: &'static str, csrf: String| {
        let (http, cookie, addr) = (http.clone(), cookie.clone(), app.addr.clone());
        async move {
            http.post(format!("{addr}/admin/tasks/{id}/{action}"))
                .header("cookie", &cookie)
                .form(&[("csrf", csrf)])
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let html = page(second).await;
    assert!(html.contains("id=\"pause\""), "{html}");
    let csrf = csrf_of(&html);
    assert_eq!(
        post(second, "pause", "0".repeat(64)).await,
        403,
        "CSRF required"
    );
    assert_eq!(app.get_task(second).await["status"], "PENDING");
    assert_eq!(post(second, "pause", csrf.clone()).await, 303);
    assert_eq!(app.get_task(second).await["status"], "PAUSED");
    let html = page(second).await;
    assert!(
        html.contains("id=\"unpause\"") && html.contains("TASK_PAUSED"),
        "{html}"
    );
    app.wait_replied(first, WAIT).await;
    assert_eq!(post(second, "unpause", csrf.clone()).await, 303);
    app.wait_replied(second, WAIT).await;
    let html = page(second).await;
    assert!(html.contains("id=\"restart\""), "{html}");
    assert_eq!(post(second, "restart", csrf).await, 303);
    let task = app
        .wait_task(second, WAIT, |t| {
            t["status"] == "SUCCEEDED" && t["replies"].as_array().unwrap().len() == 2
        })
        .await;
    let actors: Vec<(String, String)> = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| {
            ["TASK_PAUSED", "TASK_UNPAUSED", "TASK_RESTARTED"]
                .contains(&a["event"].as_str().unwrap())
        })
        .map(|a| {
            (
                a["event"].as_str().unwrap().into(),
                a["actor"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        actors,
        vec![
            ("TASK_PAUSED".into(), "admin:web".into()),
            ("TASK_UNPAUSED".into(), "admin:web".into()),
            ("TASK_RESTARTED".into(), "admin:web".into()),
        ]
    );
    assert!(page(second).await.contains("id=\"superseded\""));
    app.stop().await;
}

/// Issue 32: a pause that races a claim says what happened. The status read can be
/// overtaken by a claim (on PostgreSQL, a concurrent transaction): the pause used to be
/// answered and audited as done (TASK_PAUSED) while its update changed nothing and the
/// task ran on. Now the audit always matches what the task became: PAUSED with
/// TASK_PAUSED, or RUNNING with the pause asked (TASK_PAUSE_REQUESTED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_racing_a_claim_is_audited_as_what_happened() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.server.role = assistd::config::Role::Api;
    })
    .await;
    let store = app.store().clone();
    for n in 0..30 {
        let id = task_id_of(
            app.post_message(&message(&format!("race-{n}"), 1, "q"))
                .await,
        )
        .await;
        let now = assistd::domain::now_ms();
        let (claim, pause) = tokio::join!(
            store.claim_tasks("racer", 1, now + 60_000, now),
            store.pause_task(id, "admin:race", now)
        );
        claim.unwrap();
        assert_eq!(
            pause.unwrap(),
            assistd::store::tasks::Control::Done,
            "a PENDING or RUNNING task can always be paused"
        );
        let task = app.get_task(id).await;
        let events = audit_events(&task);
        match task["status"].as_str().unwrap() {
            "PAUSED" => assert!(events.contains(&"TASK_PAUSED"), "{events:?}"),
            "RUNNING" => {
                assert_eq!(task["pause_requested"], true, "{task:#}");
                assert!(events.contains(&"TASK_PAUSE_REQUESTED"), "{events:?}");
                assert!(!events.contains(&"TASK_PAUSED"), "{events:?}");
            }
            other => panic!("task {id} is {other}: {task:#}"),
        }
    }
    app.stop().await;
}
