//! Issue 32, part 2: a decision applies only to what the approver saw. Reject card 1,
//! restart the task, approve the old card 1: before, the API answered 200 and the
//! irreversible tool ran for the new run, which the approver never saw. Now every path
//! (card action, chat command, admin API) names the request — task, run, step and a digest
//! of the arguments shown — and a decision for any other is refused, told and audited.

use serde_json::{Value, json};

use crate::helpers::*;
use crate::workflows::{NOTICE, calls_to, spawn_flow};

fn denials(task: &Value) -> Vec<String> {
    audit_of(task, "CONFIRM_DENIED")
        .iter()
        .map(|a| a["summary"].as_str().unwrap().to_string())
        .collect()
}

/// The open request's token, once the task waits for a decision on run `run`.
async fn open_request(app: &TestApp, id: i64, run: i64) -> String {
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "WAITING_HUMAN_CONFIRM"
                && t["pending_actions"].as_array().is_some_and(|a| {
                    a.iter()
                        .any(|p| p["decision"] == "PENDING" && p["run"] == run)
                })
        })
        .await;
    task["pending_actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["decision"] == "PENDING")
        .unwrap()["request"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_card_cannot_approve_a_restarted_run_on_the_generic_channel() {
    let flow = spawn_flow(NOTICE).await;
    let app = &flow.app;
    let id = task_id_of(
        app.post_message(&message("stale", 1, "terminate contract 7"))
            .await,
    )
    .await;
    app.wait_task(id, WAIT, |t| {
        t["status"] == "WAITING_HUMAN_CONFIRM" && t["reply"]["status"] == "SENT"
    })
    .await;
    // Card 1, as the chat got it.
    let cards: Vec<Value> = app
        .replies()
        .await
        .into_iter()
        .map(|r| r.1)
        .filter(|b| b["card"]["card_type"] == "approval_request")
        .collect();
    let card1 = cards[0]["card"]["actions"][0]["value"]["request"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(card1, open_request(app, id, 0).await);

    assert_eq!(
        app.post_action(id, &card1, "reject", "alice")
            .await
            .status(),
        200
    );
    app.wait_task(id, WAIT, |t| t["status"] == "CANCELLED")
        .await;
    assert_eq!(app.control(id, "restart").await.status(), 200);
    let card2 = open_request(app, id, 1).await;
    assert_ne!(card1, card2);

    // Approve on the old card 1: refused, told, audited; the tool does not run.
    let old = app.post_action(id, &card1, "approve", "alice").await;
    assert_eq!(old.status(), 409);
    let said: Value = old.json().await.unwrap();
    assert!(
        said["error"].as_str().unwrap().contains("restarted"),
        "{said}"
    );
    // A forged value: the open request's run and step, another digest.
    let forged = format!("{}.{}", card2.rsplit_once('.').unwrap().0, "0123456789ab");
    let resp = app.post_action(id, &forged, "approve", "alice").await;
    assert_eq!(resp.status(), 409);
    let said: Value = resp.json().await.unwrap();
    assert!(
        said["error"].as_str().unwrap().contains("arguments"),
        "{said}"
    );
    // The admin API naming the old request is refused the same way.
    let api = app
        .http
        .post(format!("{}/api/tasks/{id}/confirm", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"decision": "approve", "approver": "alice", "request": card1}))
        .send()
        .await
        .unwrap();
    assert_eq!(api.status(), 409);

    let task = app.get_task(id).await;
    assert_eq!(task["status"], "WAITING_HUMAN_CONFIRM");
    let denied = denials(&task);
    assert_eq!(denied.len(), 3, "{denied:?}");
    assert!(denied[0].contains("restarted"), "{denied:?}");
    assert!(denied[1].contains("arguments"), "{denied:?}");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);

    // The card of this run approves.
    assert_eq!(
        app.post_action(id, &card2, "approve", "alice")
            .await
            .status(),
        200
    );
    let task = app
        .wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(task["result"], "notice sent");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    // A decided card decides nothing more, and says so.
    let again = app.post_action(id, &card2, "approve", "alice").await;
    assert_eq!(again.status(), 409);
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    flow.app.stop().await;
}

/// The same sequence on Matrix, deciding by the command the card shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_command_cannot_approve_a_restarted_run_on_matrix() {
    let (_hs, flow, id, body) = crate::platforms::matrix::matrix_waiting_for_approval().await;
    let app = &flow.app;
    let card1 = body["org.assistd.approval"]["request"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        body["body"]
            .as_str()
            .unwrap()
            .contains(&format!("approve {card1}")),
        "{body}"
    );
    let command = |n: u32, text: String| {
        json!([{"type": "m.room.message", "room_id": "!r:hs", "sender": "@boss:hs",
            "event_id": format!("$cmd{n}"), "content": {"msgtype": "m.text", "body": text}}])
    };
    assert_eq!(
        app.matrix_txn("s1", command(1, format!("reject {card1}")))
            .await
            .status(),
        200
    );
    app.wait_task(id, WAIT, |t| t["status"] == "CANCELLED")
        .await;
    assert_eq!(app.control(id, "restart").await.status(), 200);
    let card2 = open_request(app, id, 1).await;
    assert_ne!(card1, card2);

    let resp = app
        .matrix_txn("s2", command(2, format!("approve {card1}")))
        .await;
    assert_eq!(resp.status(), 200);
    let task = app.get_task(id).await;
    assert_eq!(task["status"], "WAITING_HUMAN_CONFIRM");
    let denied = denials(&task);
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert!(denied[0].contains("restarted"), "{denied:?}");
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 0);

    assert_eq!(
        app.matrix_txn("s3", command(3, format!("approve {card2}")))
            .await
            .status(),
        200
    );
    app.wait_task(id, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    assert_eq!(calls_to(&flow.tools, "POST", "/tools/notice").await, 1);
    flow.app.stop().await;
}
