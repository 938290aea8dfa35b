//! A long single-turn conversation carries its history summary over: a message whose
//! exchanges outgrow the history budget folds the older ones into a summary (its journalled
//! `summary` step records the newest message it covers), and the next messages reuse it until the exchanges since no longer fit beside it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use assistd::domain::now_ms;
use serde_json::Value;
use wiremock::MockServer;

use crate::helpers::*;

/// About 200 bytes, 70 tokens by assistd's estimate.
fn question(n: u32) -> String {
    format!(
        "question {n}: {}",
        "how did the quarter go for the northern region? ".repeat(4)
    )
}

/// The newest `question N` a summary request's transcript holds.
fn newest_question(transcript: &str) -> u32 {
    transcript
        .lines()
        .filter_map(|l| l.strip_prefix("user: question "))
        .filter_map(|l| l.split(':').next()?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// Summaries name the newest question they cover; answers are about 200 bytes; the chat call
/// for question 7 is refused once with 401 (for good: AUTH_FAILED) when `refuse_seven` is set.
fn script(refuse_seven: Arc<AtomicBool>) -> impl Fn(&Value) -> ModelReply {
    move |body: &Value| {
        let messages = body["messages"].as_array().unwrap();
        let first = messages[1]["content"].as_str().unwrap_or("");
        if first.starts_with("Conversation so far:") || first.starts_with("Summary so far:") {
            return ModelReply::text(format!("summary up to question {}", newest_question(first)));
        }
        let asked = messages.last().unwrap()["content"].as_str().unwrap();
        let n = asked
            .split(':')
            .next()
            .unwrap()
            .trim_start_matches("question ");
        if n == "7" && refuse_seven.swap(false, Ordering::SeqCst) {
            return ModelReply::error(401, r#"{"error":{"message":"invalid api key"}}"#);
        }
        ModelReply::text(format!(
            "answer to question {n}: {}",
            "the numbers look steady. ".repeat(7)
        ))
    }
}

async fn step_names(app: &TestApp, task: i64) -> Vec<String> {
    let steps = app.store().task_steps(task).await.unwrap();
    steps.into_iter().map(|s| s.tool_name).collect()
}

/// What a chat request gives after its system prompt: each message up to its first colon.
fn heads(body: &Value) -> Vec<&str> {
    body["messages"].as_array().unwrap()[1..]
        .iter()
        .map(|m| m["content"].as_str().unwrap().split(':').next().unwrap())
        .collect()
}

/// The summary a message after all of task `task`'s conversation would carry over (the
/// store's look-up, over the whole conversation): its text, and whether it covers through
/// task `through`'s message.
async fn kept(app: &TestApp, task: i64, through: i64) -> Option<(String, bool)> {
    let store = app.store();
    let row = store.task(task).await.unwrap().unwrap();
    let (output, covered) = store
        .conversation_summary(&row.channel, &row.conversation_id, (0, i64::MAX), 0)
        .await
        .unwrap()?;
    let answer: Value = serde_json::from_str(&output).unwrap();
    let through = store.task(through).await.unwrap().unwrap().message_id;
    Some((answer["content"].as_str()?.to_string(), covered == through))
}

/// The carried summary a chat request gives, if any.
fn summary_given(body: &Value) -> Option<&str> {
    body["messages"][1]["content"]
        .as_str()?
        .strip_prefix("Summary of the earlier conversation:\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversation_carries_its_summary_over_and_refolds_only_when_needed() {
    let model = MockServer::start().await;
    let refuse_seven = Arc::new(AtomicBool::new(true));
    strict_mock(StrictModel::new(script(refuse_seven.clone())))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        // An exchange is ~140 tokens: two fit, a third does not.
        c.context.history_token_budget = 300;
        c.context.recent_after_summary_percent = 50;
    })
    .await;
    let mut tasks = Vec::new();
    for n in 1..=6 {
        let id = task_id_of(app.post_message(&message("cs", n, &question(n))).await).await;
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(task["status"], "SUCCEEDED", "message {n}");
        tasks.push(id);
    }
    let mut names = Vec::new();
    for id in &tasks {
        names.push(step_names(&app, *id).await.join("+"));
    }
    // Message 3 folds exchanges 1–2; 4 carries that over; 5 folds 3–4 after it; 6 carries.
    assert_eq!(
        names,
        [
            "chat",
            "chat",
            "summary+chat",
            "chat",
            "summary+chat",
            "chat"
        ]
    );
    let bodies = model_bodies(&app.model).await;
    assert_eq!(bodies.len(), 8, "8 model calls for 6 messages (10 before)");
    // The fourth's chat: the third's summary, then the exchanges since, in full.
    assert_eq!(summary_given(&bodies[4]), Some("summary up to question 2"));
    assert_eq!(
        heads(&bodies[4]),
        [
            "Summary of the earlier conversation",
            "question 3",
            "answer to question 3",
            "question 4"
        ]
    );
    // The fifth folds exchanges 3–4 after the summary so far.
    let fifth_summary = bodies[5]["messages"][1]["content"].as_str().unwrap();
    assert!(
        fifth_summary.starts_with(
            "Summary so far:\nsummary up to question 2\n\nConversation since:\nuser: question 3"
        ),
        "{}",
        fifth_summary.chars().take(120).collect::<String>()
    );
    assert_eq!(summary_given(&bodies[7]), Some("summary up to question 4"));
    // The summary is read from the step that made it, which names the newest message
    // it covers (the fifth's summary, through the fourth message); the task keeps no copy.
    let fifth = app.get_task(tasks[4]).await;
    assert_eq!(fifth["steps"][0]["tool"], "summary");
    assert_eq!(fifth["context_summary"], Value::Null);
    let summary = Some(("summary up to question 4".to_string(), true));
    assert_eq!(kept(&app, tasks[5], tasks[3]).await, summary);

    // The seventh folds 5–6, then its chat call fails for good; resumed, it reuses its
    // journalled summary (not its own kept one as an earlier task's) and asks only the chat.
    let seventh = task_id_of(app.post_message(&message("cs", 7, &question(7))).await).await;
    let failed = app.wait_replied(seventh, WAIT).await;
    assert_eq!(failed["failure_type"], "AUTH_FAILED");
    let summary = Some(("summary up to question 6".to_string(), true));
    assert_eq!(kept(&app, seventh, tasks[5]).await, summary);
    assert_eq!(app.control(seventh, "resume").await.status(), 200);
    app.wait_task(seventh, WAIT, |t| {
        t["status"] == "SUCCEEDED" && t["reply"]["status"] == "SENT"
    })
    .await;
    assert_eq!(step_names(&app, seventh).await, ["summary", "chat"]);
    let bodies = model_bodies(&app.model).await;
    assert_eq!(bodies.len(), 11, "summary, refused chat, chat");
    assert_eq!(summary_given(&bodies[10]), Some("summary up to question 6"));
    assert_eq!(heads(&bodies[10])[1..], ["question 7"]);
    // The eighth carries the seventh's over.
    let eighth = task_id_of(app.post_message(&message("cs", 8, &question(8))).await).await;
    app.wait_replied(eighth, WAIT).await;
    let bodies = model_bodies(&app.model).await;
    assert_eq!(bodies.len(), 12);
    assert_eq!(summary_given(&bodies[11]), Some("summary up to question 6"));

    // Retention empties the finished tasks' steps, summaries too: nothing is carried over.
    let now = now_ms();
    app.store().purge_finished(now + 1, 100, now).await.unwrap();
    assert_eq!(kept(&app, seventh, seventh).await, None);
    let ninth = task_id_of(app.post_message(&message("cs", 9, &question(9))).await).await;
    app.wait_replied(ninth, WAIT).await;
    let bodies = model_bodies(&app.model).await;
    assert!(
        bodies[12..]
            .iter()
            .all(|b| !b.to_string().contains("summary up to")),
        "a purged summary was given"
    );
    app.stop().await;
}

/// A summary the model refuses (401 for the summary calls alone): the answer is given the
/// newest exchanges that fit the whole budget, as before summaries were carried over, not
/// only the share kept after a fold; nothing is kept on the task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_refused_leaves_the_newest_exchanges_that_fit_the_whole_budget() {
    let model = MockServer::start().await;
    let answers = script(Arc::new(AtomicBool::new(false)));
    strict_mock(StrictModel::new(move |body: &Value| {
        let first = body["messages"][1]["content"].as_str().unwrap_or("");
        if first.starts_with("Conversation so far:") {
            return ModelReply::error(401, r#"{"error":{"message":"no summaries here"}}"#);
        }
        answers(body)
    }))
    .mount(&model)
    .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.context.history_token_budget = 300;
    })
    .await;
    let mut last = 0;
    for n in 1..=3 {
        last = task_id_of(
            app.post_message(&message("cs-refused", n, &question(n)))
                .await,
        )
        .await;
        assert_eq!(app.wait_replied(last, WAIT).await["status"], "SUCCEEDED");
    }
    let steps = app.store().task_steps(last).await.unwrap();
    let kinds: Vec<(&str, &str)> = steps
        .iter()
        .map(|s| (s.tool_name.as_str(), s.status.as_str()))
        .collect();
    assert_eq!(kinds, [("summary", "FAILED"), ("chat", "SUCCEEDED")]);
    let chat = model_bodies(&app.model).await.pop().unwrap();
    assert_eq!(
        heads(&chat),
        [
            "answer to question 1",
            "question 2",
            "answer to question 2",
            "question 3"
        ]
    );
    assert_eq!(kept(&app, last, last).await, None);
    app.stop().await;
}

/// A summary whose journalled output is kept by reference (`step_blob`, over
/// `journal.inline_max_bytes`) is carried over all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_kept_as_a_blob_is_carried_over() {
    let model = MockServer::start().await;
    strict_mock(StrictModel::new(script(Arc::new(AtomicBool::new(false)))))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.context.history_token_budget = 300;
        c.journal.inline_max_bytes = 16;
    })
    .await;
    let mut tasks = Vec::new();
    for n in 1..=4 {
        let id = task_id_of(app.post_message(&message("cs-blob", n, &question(n))).await).await;
        assert_eq!(app.wait_replied(id, WAIT).await["status"], "SUCCEEDED");
        tasks.push(id);
    }
    // The third folds; its summary step's output is a blob; the fourth carries it over.
    assert!(app.store().blob_count(tasks[2]).await.unwrap() >= 2);
    assert_eq!(step_names(&app, tasks[2]).await, ["summary", "chat"]);
    assert_eq!(step_names(&app, tasks[3]).await, ["chat"]);
    let bodies = model_bodies(&app.model).await;
    assert_eq!(bodies.len(), 5, "chat, chat, summary + chat, chat");
    assert_eq!(summary_given(&bodies[4]), Some("summary up to question 2"));
    app.stop().await;
}
