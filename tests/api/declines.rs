//! A rejected or expired approval undoes the task's earlier compensable steps (saga) before
//! the task is cancelled, and the chat is told once (issue 19, item 4).

use std::time::Duration;

use serde_json::Value;

use crate::helpers::*;
use crate::workflows::{calls_to, spawn_flow_with};

/// A compensable reservation, then an irreversible notice that needs approval.
const RESERVE_THEN_NOTICE: &str = r#"{"start": "reserve", "nodes": [
  {"id": "reserve", "type": "tool", "tool": "reserve", "args": {"item": "{{ message.text }}"}, "next": "notice"},
  {"id": "notice", "type": "tool", "tool": "send_notice", "args": {"text": "{{ message.text }}"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "reserved {{ steps.reserve.id }}, notice {{ steps.notice.status }}"}]}"#;

fn step_statuses(task: &Value) -> Vec<(String, String)> {
    task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["tool"].as_str().unwrap().to_string(),
                s["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_undoes_the_earlier_compensable_steps_and_tells_the_chat_once() {
    let flow = spawn_flow_with(RESERVE_THEN_NOTICE, |c| c.scheduler.enabled = false).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-rej", 1, "room 7")).await).await;
    app.wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/reserve").await, 1);
    assert_eq!(app.confirm(id, "reject", "alice").await.status(), 200);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "CANCELLED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["failure_type"], "CANCELLED");
    assert_eq!(
        calls_to(&flow.tools, "DELETE", "/tools/reserve/").await,
        1,
        "the reservation is undone"
    );
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    let steps = step_statuses(&task);
    assert_eq!(
        steps[0],
        ("reserve".into(), "COMPENSATED".into()),
        "{steps:?}"
    );
    assert_eq!(steps[1].1, "FAILED");
    assert!(
        steps
            .iter()
            .any(|(t, s)| t == "undo:reserve" && s == "SUCCEEDED")
    );
    assert_eq!(task["pending_actions"][0]["decision"], "REJECTED");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 2, "the card, then one notice: {replies:?}");
    assert_eq!(replies[1].0, format!("agent-task-{id}"));
    assert!(
        replies[1].1["text"]
            .as_str()
            .unwrap()
            .contains("alice rejected"),
        "{replies:?}"
    );
    let events = audit_events(&task);
    assert!(events.contains(&"TASK_REJECTED") && events.contains(&"STEP_COMPENSATED"));
    assert_eq!(*events.last().unwrap(), "REPLY_SENT");
    // A late approval changes nothing.
    assert_eq!(app.confirm(id, "approve", "alice").await.status(), 409);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_approval_undoes_the_earlier_compensable_steps_and_tells_the_chat_once() {
    let flow = spawn_flow_with(RESERVE_THEN_NOTICE, |c| c.scheduler.enabled = false).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("c-exp", 1, "room 8")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "WAITING_HUMAN_CONFIRM")
        .await;
    let now = task["confirm_deadline"].as_i64().unwrap() + 1;
    let run = assistd::scheduler::confirm_timeout(&app.jobs, 500, now)
        .await
        .unwrap();
    assert_eq!(run.affected, 1);
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "CANCELLED" && t["reply"]["status"] == "SENT"
        })
        .await;
    assert_eq!(task["failure_type"], "TIMEOUT");
    assert_eq!(calls_to(&flow.tools, "DELETE", "/tools/reserve/").await, 1);
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);
    assert_eq!(step_statuses(&task)[0].1, "COMPENSATED");
    assert_eq!(task["pending_actions"][0]["decision"], "EXPIRED");
    // A second scan finds nothing more to do.
    let again = assistd::scheduler::confirm_timeout(&app.jobs, 500, now + 1)
        .await
        .unwrap();
    assert_eq!(again.affected, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert!(
        replies[1].1["text"].as_str().unwrap().contains("in time"),
        "{replies:?}"
    );
    let timeout = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_TIMEOUT_CANCELLED")
        .cloned()
        .unwrap();
    assert_eq!(timeout["risk_flag"], true);
    flow.app.stop().await;
}
