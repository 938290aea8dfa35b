//! How a question's words are searched for in a large collection (issue 34): words held by
//! too many chunks are left out (they rank little and would have every chunk ranked), the
//! rarest searched first within `knowledge.max_ranked_chunks`, and a question of common
//! words only needs them all in one passage, of the first `common_only_candidates` chunks.
//! The API shows what was searched.

use reqwest::Method;
use serde_json::{Value, json};

use crate::helpers::*;

async fn search(app: &TestApp, q: &str) -> Value {
    let q: String = url::form_urlencoded::byte_serialize(q.as_bytes()).collect();
    let (status, body) = app
        .admin_call(
            Method::GET,
            &format!("/api/admin/knowledge/handbook/search?q={q}&k=5"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn common_words_are_left_out_and_a_question_of_common_words_needs_them_all() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        // Twelve one-chunk documents stand for a large collection.
        c.knowledge.max_ranked_chunks = 4;
        c.knowledge.common_term_share = 0.5;
        c.knowledge.common_only_candidates = 3;
        c.knowledge
            .collections
            .insert("handbook".into(), Default::default());
    })
    .await;
    for n in 0..12 {
        // Every document says "policy"; most say "company"; one says "laptop", two "desk".
        let mut text = format!("Policy number {n} of the company.");
        if n == 3 {
            text = format!("Policy number {n}: a laptop for everyone.");
        }
        if n == 5 || n == 6 {
            text.push_str(" Ask the help desk.");
        }
        let (status, body) = app
            .admin_call(
                Method::POST,
                "/api/admin/knowledge/handbook/documents",
                Some(json!({"id": format!("p{n}"), "text": text})),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    // PostgreSQL counts a collection's words in the background after a search finds its
    // counts older than its documents (SQLite reads them from FTS5 at once).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let found = loop {
        let found = search(&app, "company policy laptop").await;
        if found["words"]["left_out"] != json!([]) || std::time::Instant::now() > deadline {
            break found;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(found["words"]["searched"], json!(["laptop"]), "{found}");
    assert_eq!(
        found["words"]["left_out"],
        json!(["company", "policy"]),
        "{found}"
    );
    assert_eq!(found["words"]["all_required"], false);
    assert_eq!(found["results"][0]["document_id"], "p3", "{found}");
    assert_eq!(found["results"].as_array().unwrap().len(), 1);
    // The rarest first, within the budget: "desk" (2) and "laptop" (1) both fit in 4.
    let found = search(&app, "laptop desk company").await;
    assert_eq!(
        found["words"]["searched"],
        json!(["laptop", "desk"]),
        "{found}"
    );
    // Common words only: a passage needs them all, and only the first three chunks that hold
    // them are ranked (by id on SQLite, in storage order on PostgreSQL: the same here, each
    // document written once).
    let found = search(&app, "company policy").await;
    assert_eq!(found["words"]["all_required"], true, "{found}");
    let ids: Vec<&str> = found["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["document_id"].as_str().unwrap())
        .collect();
    let mut ids = ids;
    ids.sort();
    assert_eq!(ids, ["p0", "p1", "p2"], "{found}");
    app.stop().await;
}
