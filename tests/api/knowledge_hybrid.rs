//! Dense vectors (issue 34), through HTTP on the suite's database, against the strict
//! embeddings double: a question that shares no word with its answer is found by meaning
//! in a hybrid collection and not by words alone; an agent answers from it with the source
//! cited; a provider refusing for a while is retried like a model call; a provider that
//! keeps failing is reported where an admin sees it, with nothing half-written, and search
//! goes on by words.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::*;
use crate::strict_embeddings::EmbeddingsDouble;

const EXPENSES: &str = "# Expense claims\n\nCosts of a business trip are reimbursed when you submit the receipts within 15 days.";
const LEAVE: &str =
    "# Annual leave\n\nYou have 25 days of holiday a year; ask your lead before you book.";
const LAPTOP: &str =
    "# Equipment\n\nEvery employee gets a laptop; report broken hardware to the IT desk.";
const QUESTION: &str = "How do I get my money back after a journey?";

/// An app whose `[llm]` provider also embeds (through `double`), with collections
/// `handbook` (hybrid) and `plain` (words only), both holding the three documents.
async fn spawn(double: EmbeddingsDouble, tweak: impl FnOnce(&mut assistd::Config)) -> TestApp {
    let model = wiremock::MockServer::start().await;
    double.mock().mount(&model).await;
    crate::strict_model::model_mock(|body: &Value| {
        let given = body["messages"].as_array().unwrap();
        let passages = given[given.len() - 2]["content"].as_str().unwrap_or("");
        assert!(passages.contains("[1] Expense claims"), "{passages}");
        crate::strict_model::ModelReply::text("Submit the receipts within 15 days [1].")
    })
    .mount(&model)
    .await;
    TestApp::spawn_with(model, accepting_receiver().await, |c| {
        let hybrid = assistd::config::CollectionConfig {
            embedding_provider: Some("default".into()),
            embedding_model: Some("text-embedding-3-small".into()),
            ..Default::default()
        };
        c.knowledge.collections.insert("handbook".into(), hybrid);
        c.knowledge
            .collections
            .insert("plain".into(), Default::default());
        c.agents.get_mut("default").unwrap().knowledge = vec!["handbook".into()];
        tweak(c);
    })
    .await
}

async fn put_all(app: &TestApp, collection: &str) -> Vec<(StatusCode, Value)> {
    let mut out = Vec::new();
    for (id, text) in [("expenses", EXPENSES), ("leave", LEAVE), ("laptop", LAPTOP)] {
        out.push(
            app.admin_call(
                Method::POST,
                &format!("/api/admin/knowledge/{collection}/documents"),
                Some(json!({"id": id, "content_type": "text/markdown", "text": text})),
            )
            .await,
        );
    }
    out
}

async fn search(app: &TestApp, collection: &str, q: &str) -> Value {
    let q: String = url::form_urlencoded::byte_serialize(q.as_bytes()).collect();
    let (status, body) = app
        .admin_call(
            Method::GET,
            &format!("/api/admin/knowledge/{collection}/search?q={q}&k=3"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meaning_finds_what_words_miss_and_the_agent_cites_it() {
    let double = EmbeddingsDouble::new();
    let calls = double.calls.clone();
    let app = spawn(double, |_| {}).await;
    for collection in ["handbook", "plain"] {
        for (status, body) in put_all(&app, collection).await {
            assert_eq!(status, 200, "{body}");
        }
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "one /embeddings call per hybrid document"
    );
    // Adding the same documents again embeds nothing, one by one or as a job.
    put_all(&app, "handbook").await;
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let batch: Vec<Value> = [("expenses", EXPENSES), ("leave", LEAVE), ("laptop", LAPTOP)]
        .iter()
        .map(|(id, text)| json!({"id": id, "content_type": "text/markdown", "text": text}))
        .collect();
    let (status, job) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/ingest",
            Some(json!({ "documents": batch })),
        )
        .await;
    assert_eq!(status, 202, "{job}");
    let path = format!("/api/admin/knowledge/handbook/ingest/{}", job["id"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, job) = app.admin_call(Method::GET, &path, None).await;
        if job["state"] == "done" {
            assert_eq!(job["done"], 3, "{job}");
            break;
        }
        assert!(Instant::now() < deadline, "{job}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "the job embedded nothing again"
    );

    let words = search(&app, "plain", QUESTION).await;
    assert_eq!(words["ranking"], "lexical");
    assert!(
        !words["results"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["document_id"] == "expenses"),
        "no word of the question is in the answer: {words}"
    );
    let both = search(&app, "handbook", QUESTION).await;
    assert_eq!(both["ranking"], "hybrid", "{both}");
    assert_eq!(both["results"][0]["document_id"], "expenses", "{both}");
    // A change is seen by the next search (the vectors are read again).
    let (status, _) = app
        .admin_call(
            Method::DELETE,
            "/api/admin/knowledge/handbook/documents/expenses",
            None,
        )
        .await;
    assert_eq!(status, 200);
    let after = search(&app, "handbook", QUESTION).await;
    assert!(
        !after["results"].to_string().contains("expenses"),
        "{after}"
    );
    put_all(&app, "handbook").await;

    let id = task_id_of(app.post_message(&message("kb-dense", 1, QUESTION)).await).await;
    app.wait_replied(id, WAIT).await;
    let (_, reply) = app.replies().await.remove(0);
    assert_eq!(reply["card"]["card_type"], "knowledge_answer", "{reply}");
    assert_eq!(
        reply["card"]["sources"][0]["document_id"], "expenses",
        "{reply}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_at_its_limit_is_waited_out_like_a_model() {
    let double = EmbeddingsDouble::new().failing_first(2, 429);
    let calls = double.calls.clone();
    let app = spawn(double, |_| {}).await;
    let (status, body) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/documents",
            Some(json!({"id": "expenses", "text": EXPENSES})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "two refusals, then the answer"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_provider_is_reported_and_nothing_is_half_written() {
    // Refuses the key every time: not worth retrying.
    let app = spawn(EmbeddingsDouble::new().failing_first(u64::MAX, 401), |c| {
        c.llm.api_key = "sk-test-embedding-key-123456".into();
    })
    .await;
    let results = put_all(&app, "handbook").await;
    let (status, body) = &results[0];
    assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let said = body.to_string();
    assert!(said.contains("AUTH_FAILED"), "{said}");
    assert!(!said.contains("sk-test-embedding-key"), "{said}");
    let (_, shown) = app
        .admin_call(Method::GET, "/api/admin/knowledge/handbook", None)
        .await;
    assert_eq!(shown["document_count"], 0, "nothing written: {shown}");
    // Search goes on by words, and says why.
    put_all(&app, "plain").await;
    let found = search(&app, "handbook", "receipts").await;
    assert_eq!(found["ranking"], "lexical");
    assert!(
        found["note"].as_str().unwrap().contains("AUTH_FAILED"),
        "{found}"
    );
    // In a background job, each document fails alone with the reason.
    let (status, job) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/ingest",
            Some(json!({"documents": [{"id": "leave", "text": LEAVE}]})),
        )
        .await;
    assert_eq!(status, 202, "{job}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let last = loop {
        let (_, shown) = app
            .admin_call(Method::GET, "/api/admin/knowledge/handbook", None)
            .await;
        if shown["ingest"]["state"] == "idle" && !shown["ingest"]["last"].is_null() {
            break shown["ingest"]["last"].clone();
        }
        assert!(Instant::now() < deadline, "{shown}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (last["done"].as_i64(), last["failed"].as_i64()),
        (Some(0), Some(1)),
        "{last}"
    );
    assert!(
        last["failures"][0]["error"]
            .as_str()
            .unwrap()
            .contains("AUTH_FAILED"),
        "{last}"
    );
    app.stop().await;
}

/// A provider that is down (5xx after every retry) leaves the job's document pending for a
/// later claim; after `knowledge.ingest_max_claims` claims without progress the job is
/// failed with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_stays_down_fails_the_job_after_its_claims() {
    let app = spawn(EmbeddingsDouble::new().failing_first(u64::MAX, 503), |c| {
        c.llm.retry.provider_error.max_attempts = 2;
        c.knowledge.ingest_lease_secs = 1;
        c.knowledge.ingest_max_claims = 2;
        c.knowledge.ingest_poll_ms = 100;
    })
    .await;
    let (status, job) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/ingest",
            Some(json!({"documents": [{"id": "leave", "text": LEAVE}]})),
        )
        .await;
    assert_eq!(status, 202, "{job}");
    let path = format!("/api/admin/knowledge/handbook/ingest/{}", job["id"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let job = loop {
        let (_, job) = app.admin_call(Method::GET, &path, None).await;
        if job["state"] == "failed" || job["state"] == "done" {
            break job;
        }
        assert!(Instant::now() < deadline, "{job}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(job["state"], "failed", "{job}");
    assert!(
        job["error"].as_str().unwrap().contains("ingest_max_claims"),
        "{job}"
    );
    assert_eq!(job["done"], 0);
    app.stop().await;
}
