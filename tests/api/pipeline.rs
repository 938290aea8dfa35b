//! Message in → exactly one answer out.

use std::time::Duration;

use serde_json::Value;
use wiremock::MockServer;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_gets_exactly_one_reply() {
    let app = TestApp::spawn().await;
    let resp = app
        .post_message(&message("conv-a", 1, "What is the capital of France?"))
        .await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["duplicate"], false);
    let id = body["task_id"].as_i64().unwrap();

    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(task["agent"]["name"], "default");
    assert_eq!(task["agent"]["version"], 1);
    assert_eq!(task["result"], "answer to: What is the capital of France?");
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(task["current_step"], 1);
    assert_eq!(steps[0]["status"], "SUCCEEDED");
    assert_eq!(steps[0]["idempotency_key"], format!("{id}:1:chat"));
    // The usage the model reported (the double counts the prompt it was sent).
    assert!(
        steps[0]["tokens_in"].as_i64().is_some_and(|n| n > 0),
        "{:#}",
        steps[0]
    );
    assert_eq!(steps[0]["tokens_out"], 7);
    let events = audit_events(&task);
    assert_eq!(
        events,
        [
            "TASK_CREATED",
            "TASK_RUNNING",
            "TASK_SUCCEEDED",
            "REPLY_SENT"
        ]
    );
    assert_eq!(task["reply"]["idempotency_key"], format!("agent-task-{id}"));

    // Give a duplicate send the time to show up before counting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    let (key, reply) = &replies[0];
    assert_eq!(key, &format!("agent-task-{id}"));
    assert_eq!(reply["task_id"], id);
    assert_eq!(reply["conversation_id"], "conv-a");
    assert_eq!(reply["in_reply_to"], "msg-conv-a-1");
    assert_eq!(reply["type"], "text");
    assert_eq!(reply["text"], "answer to: What is the capital of France?");

    // The model got the agent's system prompt and the question.
    let calls = app.model.received_requests().await.unwrap();
    assert_eq!(calls.len(), 1);
    let sent: Value = serde_json::from_slice(&calls[0].body).unwrap();
    assert_eq!(sent["model"], "test-model");
    assert_eq!(sent["messages"][0]["role"], "system");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_signed_like_inbound_webhooks() {
    let app = TestApp::spawn().await;
    let id = task_id_of(app.post_message(&message("conv-sig", 1, "hi")).await).await;
    app.wait_replied(id, WAIT).await;
    let req = &app.receiver.received_requests().await.unwrap()[0];
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
    let now = assistd::domain::now_ms() / 1000;
    assistd::channels::generic::verify(SECRET, Some(ts), Some(sig), &req.body, now, 300)
        .expect("reply signature verifies with the shared secret");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn card_answers_go_out_as_cards() {
    let model = MockServer::start().await;
    let card =
        r#"{"card_type":"knowledge_answer","title":"Paris","answer":"Paris is the capital."}"#;
    model_mock(move |_: &Value| ModelReply::text(card))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("conv-card", 1, "capital?")).await).await;
    app.wait_replied(id, WAIT).await;
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].1["type"], "card");
    assert_eq!(replies[0].1["card"]["card_type"], "knowledge_answer");
    assert_eq!(replies[0].1["text"], "Paris is the capital.");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_concurrent_deliveries_make_one_task_and_one_reply() {
    let app = TestApp::spawn().await;
    let body = message("conv-dup", 1, "hello?");
    let posts = (0..5).map(|_| app.post_message(&body));
    let responses = futures::future::join_all(posts).await;
    let mut ids = Vec::new();
    let mut fresh = 0;
    for resp in responses {
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        ids.push(v["task_id"].as_i64().unwrap());
        if v["duplicate"] == false {
            fresh += 1;
        }
    }
    assert_eq!(fresh, 1, "exactly one delivery creates the task");
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    app.wait_replied(ids[0], WAIT).await;
    // A later retry by the platform, after the answer went out, is still a duplicate.
    let again: Value = app.post_message(&body).await.json().await.unwrap();
    assert_eq!(again["duplicate"], true);
    assert_eq!(again["task_id"], ids[0]);
    // Same message id under a new event id is the same message too.
    let mut other_event = body.clone();
    other_event["event_id"] = "evt-retry-with-new-id".into();
    let again: Value = app.post_message(&other_event).await.json().await.unwrap();
    assert_eq!(again["duplicate"], true);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(app.replies().await.len(), 1);
    assert_eq!(app.store().intake_row_counts().await.unwrap().1, 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_one_conversation_are_answered_in_order_one_at_a_time() {
    let model = MockServer::start().await;
    model_mock(|body: &Value| echo(body).delayed(Duration::from_millis(300)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.push(
            task_id_of(
                app.post_message(&message("conv-order", n, &format!("question {n}")))
                    .await,
            )
            .await,
        );
    }
    // Another conversation is not held up by this one.
    let other = task_id_of(
        app.post_message(&message("conv-other", 1, "unrelated"))
            .await,
    )
    .await;
    let mut tasks = Vec::new();
    for id in &ids {
        tasks.push(app.wait_replied(*id, WAIT).await);
    }
    app.wait_replied(other, WAIT).await;
    // Audit ids follow commit order: each task was claimed after the previous one finished.
    let audit_id = |t: &Value, event: &str| {
        t["audit"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["event"] == event)
            .unwrap()["id"]
            .as_i64()
            .unwrap()
    };
    for pair in tasks.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            audit_id(b, "TASK_RUNNING") > audit_id(a, "TASK_SUCCEEDED"),
            "task {} started before task {} finished",
            b["id"],
            a["id"]
        );
    }
    let replies: Vec<String> = app
        .replies()
        .await
        .into_iter()
        .filter(|(_, r)| r["conversation_id"] == "conv-order")
        .map(|(_, r)| r["in_reply_to"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        replies,
        ["msg-conv-order-1", "msg-conv-order-2", "msg-conv-order-3"]
    );
    // The third question was asked with the first two exchanges as history.
    let calls = app.model.received_requests().await.unwrap();
    let third = calls
        .iter()
        .map(|c| serde_json::from_slice::<Value>(&c.body).unwrap())
        .find(|b| b["messages"].as_array().unwrap().last().unwrap()["content"] == "question 3")
        .unwrap();
    let contents: Vec<&str> = third["messages"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        contents,
        [
            "question 1",
            "answer to: question 1",
            "question 2",
            "answer to: question 2",
            "question 3"
        ]
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_over_the_token_budget_is_summarised_first() {
    let model = echo_model().await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.context.history_token_budget = 60;
    })
    .await;
    let mut last = 0;
    for n in 1..=3 {
        let text = format!("question {n} {}", "x".repeat(190));
        last = task_id_of(app.post_message(&message("conv-long", n, &text)).await).await;
        app.wait_replied(last, WAIT).await;
    }
    let first = app.get_task(last - 2).await;
    assert_eq!(
        first["steps"].as_array().unwrap().len(),
        1,
        "short history: one call"
    );
    let task = app.get_task(last).await;
    let names: Vec<&str> = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["tool"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["summary", "chat"]);
    assert_eq!(
        task["steps"][1]["idempotency_key"],
        format!("{last}:2:chat")
    );
    let calls = app.model.received_requests().await.unwrap();
    let chat: Value = serde_json::from_slice(&calls.last().unwrap().body).unwrap();
    let messages = chat["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "system, summary, question: {chat:#}");
    assert!(
        messages[1]["content"]
            .as_str()
            .unwrap()
            .starts_with("Summary of the earlier conversation")
    );
    assert!(
        messages[1]["content"]
            .as_str()
            .unwrap()
            .contains("question 1"),
        "the summary covers the first exchange"
    );
    assert!(
        messages[2]["content"]
            .as_str()
            .unwrap()
            .starts_with("question 3")
    );
    app.stop().await;
}

/// A model call longer than the lease: the heartbeat (group-committed on SQLite) renews the
/// lease every third of it, so the task is never taken back by a claim, and the model is
/// called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_call_longer_than_the_lease_keeps_its_task() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text("slow answer").delayed(Duration::from_millis(3_500)))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.worker.lease_secs = 1;
        c.worker.poll_interval_ms = 100;
    })
    .await;
    let id = task_id_of(
        app.post_message(&message("slow", 1, "take your time"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED");
    assert_eq!(task["claim_count"], 1, "the lease never lapsed: {task}");
    assert_eq!(app.model.received_requests().await.unwrap().len(), 1);
    app.stop().await;
}
