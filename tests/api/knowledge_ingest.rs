//! Background ingest jobs (issue 34) through the admin API, on the database the suite runs
//! on: a batch committed whole and added by a worker with progress; a bad batch refused with
//! nothing written; a document that cannot be added failing alone; a stale claim writing
//! nothing; a job that never progresses given up where an admin sees it; and the real
//! binary SIGKILLed in the middle of a large batch, finishing after a restart on another
//! instance without one chunk twice.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::binary::{RealServer, server_envs};
use crate::helpers::*;
use assistd::domain::now_ms;

/// A document given to the store directly (no title or link).
fn item(doc_id: &str, content_type: &str, text: &str) -> assistd::store::knowledge_ingest::NewItem {
    assistd::store::knowledge_ingest::NewItem {
        doc_id: Some(doc_id.into()),
        title: None,
        source_url: None,
        content_type: content_type.into(),
        text: text.into(),
    }
}

/// The job `owner` claims now with a lease until `lease_until`: one there must be.
async fn claimed(
    store: &assistd::store::Store,
    owner: &str,
    lease_until: i64,
    now: i64,
) -> assistd::store::knowledge_ingest::IngestClaim {
    store
        .claim_ingest(owner, lease_until, now)
        .await
        .unwrap()
        .expect("a job to claim")
}

/// A document of `paragraphs` paragraphs whose words name it (`policy<n>`).
fn policy(n: usize, paragraphs: usize) -> Value {
    let mut text = format!("# Policy {n}\n\n");
    for p in 0..paragraphs {
        text.push_str(&format!(
            "Clause {p} of policy{n}: requests for item{n}x{p} go to the office that \
             handles them, with the form filled in and signed by a lead. Keep a copy \
             of what you send for a year, and ask the help desk when in doubt.\n\n"
        ));
    }
    json!({ "id": format!("policies/{n}.md"), "content_type": "text/markdown", "text": text })
}

async fn create(app: &TestApp, name: &str) {
    let (status, body) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge",
            Some(json!({ "name": name })),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
}

/// The collection's ingest state once it is idle again (its last job), within `wait`.
async fn idle_ingest(addr: &str, name: &str, wait: Duration) -> Value {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + wait;
    loop {
        let body: Value = http
            .get(format!("{addr}/api/admin/knowledge/{name}"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if body["ingest"]["state"] == "idle" && !body["ingest"]["last"].is_null() {
            return body;
        }
        assert!(Instant::now() < deadline, "ingest never ended: {body:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Chunks as the chunk table holds them, and how many (document, position) pairs are
/// held more than once.
async fn chunk_rows(store: &assistd::store::Store) -> (i64, i64) {
    let total = "SELECT COUNT(*) FROM knowledge_chunk";
    let doubled = "SELECT COUNT(*) FROM (SELECT document_id, position FROM knowledge_chunk \
                   GROUP BY document_id, position HAVING COUNT(*) > 1) d";
    match store {
        assistd::store::Store::Sqlite(pool, _) => (
            sqlx::query_scalar(total).fetch_one(pool).await.unwrap(),
            sqlx::query_scalar(doubled).fetch_one(pool).await.unwrap(),
        ),
        assistd::store::Store::Postgres(pool) => (
            sqlx::query_scalar(total).fetch_one(pool).await.unwrap(),
            sqlx::query_scalar(doubled).fetch_one(pool).await.unwrap(),
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_added_in_the_background_with_progress_and_failures_alone() {
    let app = TestApp::spawn().await;
    create(&app, "handbook").await;
    let mut documents: Vec<Value> = (0..12).map(|n| policy(n, 3)).collect();
    // Passes the request's checks, but holds no text to search once read: fails alone.
    documents.push(json!({
        "id": "empty-page.html",
        "content_type": "text/html",
        "text": "<html><head><script>var x = 1;</script></head><body><div></div></body></html>"
    }));
    let (status, job) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/ingest",
            Some(json!({ "documents": documents })),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    assert_eq!(job["documents"], 13);
    let id = job["id"].as_i64().unwrap();

    let body = idle_ingest(&app.addr, "handbook", Duration::from_secs(30)).await;
    let last = &body["ingest"]["last"];
    assert_eq!(last["id"], id);
    assert_eq!(last["state"], "done", "{body:#}");
    assert_eq!(
        (last["done"].as_i64(), last["failed"].as_i64()),
        (Some(12), Some(1))
    );
    assert_eq!(last["failures"][0]["id"], "empty-page.html");
    assert!(
        last["failures"][0]["error"]
            .as_str()
            .unwrap()
            .contains("no text"),
        "{last:#}"
    );
    assert_eq!(body["document_count"], 12);
    assert_eq!(
        last["chunks"], body["chunks"],
        "the job counted what it wrote"
    );
    let (rows, doubled) = chunk_rows(app.store()).await;
    assert_eq!((rows, doubled), (body["chunks"].as_i64().unwrap(), 0));
    assert_eq!(
        app.search_ids("handbook", "item7x2", 1).await,
        ["policies/7.md"]
    );

    // The job as its own resource.
    let (status, shown) = app
        .admin_call(
            Method::GET,
            &format!("/api/admin/knowledge/handbook/ingest/{id}"),
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(shown["state"], "done");

    // The page shows the last job and its failed document.
    use crate::admin_pages::{browser, page_of, sign_in};
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let page = page_of(&app, &http, &cookie, "/admin/knowledge/handbook").await;
    assert!(
        page.contains("last job") && page.contains("empty-page.html"),
        "{page}"
    );
    // The same batch again: nothing changes, and the job says so.
    let (status, again) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/ingest",
            Some(json!({ "documents": (0..12).map(|n| policy(n, 3)).collect::<Vec<_>>() })),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{again}");
    let body = idle_ingest(&app.addr, "handbook", Duration::from_secs(30)).await;
    assert_eq!(body["ingest"]["last"]["id"], again["id"]);
    assert_eq!(body["ingest"]["last"]["done"], 12);
    assert_eq!(chunk_rows(app.store()).await, (rows, 0));

    let (_, events) = app
        .admin_call(
            Method::GET,
            "/api/admin/audit?target_type=knowledge&target_id=handbook",
            None,
        )
        .await;
    let seen: Vec<&str> = events["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert!(seen.contains(&"KNOWLEDGE_INGEST_QUEUED"), "{seen:?}");
    assert!(seen.contains(&"KNOWLEDGE_INGEST_FINISHED"), "{seen:?}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_batch_is_refused_whole_with_nothing_written() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.knowledge.ingest_max_documents = 3;
        c.knowledge.ingest_max_bytes = 64 * 1024;
    })
    .await;
    create(&app, "handbook").await;
    let path = "/api/admin/knowledge/handbook/ingest";
    let cases = [
        (
            json!({ "documents": [policy(1, 1), { "id": "x", "text": "  " }] }),
            400,
            "documents[1]",
        ),
        (
            json!({ "documents": [policy(1, 1), { "title": "no text" }] }),
            400,
            "documents[1]: `text`",
        ),
        (
            json!({ "documents": [{ "text": "a", "content_type": "application/pdf" }] }),
            400,
            "documents[0]",
        ),
        (
            json!({ "documents": [{ "text": "a", "source_url": "file:///etc/passwd" }] }),
            400,
            "source_url",
        ),
        (json!({ "documents": [] }), 400, "ingest_max_documents"),
        (
            json!({ "documents": (0..4).map(|n| policy(n, 1)).collect::<Vec<_>>() }),
            400,
            "ingest_max_documents",
        ),
        (
            json!({ "documents": [policy(1, 1)], "extra": 1 }),
            400,
            "extra",
        ),
        (json!({ "documents": [policy(1, 600)] }), 413, ""),
    ];
    for (body, status, says) in cases {
        let (got, answer) = app.admin_call(Method::POST, path, Some(body)).await;
        assert_eq!(got.as_u16(), status, "{answer}");
        assert!(answer.to_string().contains(says), "{says}: {answer}");
    }
    let (status, _) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/nope/ingest",
            Some(json!({ "documents": [policy(1, 1)] })),
        )
        .await;
    assert_eq!(status, 404);
    let unauthorized = app
        .http
        .post(format!("{}{path}", app.addr))
        .json(&json!({ "documents": [policy(1, 1)] }))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), 401);
    let (_, body) = app
        .admin_call(Method::GET, "/api/admin/knowledge/handbook", None)
        .await;
    assert_eq!(
        body["ingest"],
        json!({ "state": "idle" }),
        "no job was written"
    );
    assert_eq!(body["document_count"], 0);
    app.stop().await;
}

/// A claim taken over by another instance writes nothing more: its document, its item and
/// the job's progress are one transaction, fenced by the claim's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_claim_writes_nothing() {
    use assistd::store::knowledge_ingest::IngestStep;
    let (db, store) = crate::conformance::fresh_store().await;
    store
        .create_collection("c", 1200, 200, None, 1)
        .await
        .unwrap();
    let collection = store.collection("c").await.unwrap().unwrap();
    let job = store
        .create_ingest(
            collection.id,
            &[item("a", "text/plain", "alpha beta")],
            "test",
            1,
        )
        .await
        .unwrap();
    let now = now_ms();
    let first = claimed(&store, "one", now - 1, now).await;
    // Its lease ran out (it was set in the past): another instance takes the job.
    let second = claimed(&store, "two", now + 60_000, now).await;
    assert_eq!(second.id, job);
    assert!(second.version > first.version);
    let pending = store.pending_items(job, 10).await.unwrap();
    let ready = assistd::knowledge::prepare(
        &test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply").knowledge,
        &collection,
        assistd::knowledge::Document {
            id: pending[0].doc_id.as_deref(),
            title: None,
            source_url: None,
            content_type: assistd::knowledge::ContentType::Text,
            text: &pending[0].text,
        },
    )
    .unwrap();
    let step = |owner: &'static str, version| IngestStep {
        job_id: job,
        owner,
        version,
        item_id: pending[0].id,
        lease_until: now + 60_000,
    };
    let stale = store
        .put_document_in(
            collection.id,
            &ready.document(),
            &ready.chunks,
            Some(&step("one", first.version)),
            now,
        )
        .await
        .unwrap();
    assert_eq!(stale, None, "the old claim is fenced off");
    assert_eq!(chunk_rows(&store).await, (0, 0));
    assert!(
        !store
            .fail_item(&step("one", first.version), "late", now)
            .await
            .unwrap()
    );
    let held = store
        .put_document_in(
            collection.id,
            &ready.document(),
            &ready.chunks,
            Some(&step("two", second.version)),
            now,
        )
        .await
        .unwrap();
    assert!(held.is_some());
    assert!(
        store
            .finish_ingest(&second, "two", None, now)
            .await
            .unwrap()
    );
    let row = store.ingest(collection.id, job).await.unwrap().unwrap();
    assert_eq!((row.state.as_str(), row.done, row.failed), ("done", 1, 0));
    store.close().await;
    db.drop_db().await;
}

/// A collection's jobs run in the order they were submitted: a later job is not taken while
/// an earlier one of its collection is open, even when the earlier one is held by a live
/// claim, so a document given again later is never overwritten by its older text; another
/// collection's job is not held up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collections_jobs_run_in_the_order_they_were_submitted() {
    let (db, store) = crate::conformance::fresh_store().await;
    for name in ["c", "d"] {
        store
            .create_collection(name, 1200, 200, None, 1)
            .await
            .unwrap();
    }
    let c = store.collection("c").await.unwrap().unwrap();
    let d = store.collection("d").await.unwrap().unwrap();
    let item = |text: &str| item("a", "text/plain", text);
    let old = store
        .create_ingest(c.id, &[item("old text")], "test", 1)
        .await
        .unwrap();
    let new = store
        .create_ingest(c.id, &[item("new text")], "test", 2)
        .await
        .unwrap();
    let other = store
        .create_ingest(d.id, &[item("other text")], "test", 3)
        .await
        .unwrap();
    let now = now_ms();
    // A worker that died holding the old job (its lease ran out): the old job is taken
    // again before the newer one, although the newer one was never claimed.
    let dead = claimed(&store, "dead", now - 1, now).await;
    assert_eq!(dead.id, old);
    let live = claimed(&store, "one", now + 60_000, now).await;
    assert_eq!(live.id, old, "the earlier job is resumed first");
    // While it is held, the collection's newer job waits; the other collection's does not.
    let next = claimed(&store, "two", now + 60_000, now).await;
    assert_eq!(next.id, other);
    assert!(
        store
            .claim_ingest("three", now + 60_000, now)
            .await
            .unwrap()
            .is_none(),
        "a collection's later job is not taken while its earlier one is open"
    );
    // The old job's document fails (so the job can end); then the newer job is taken.
    let pending = store.pending_items(old, 10).await.unwrap();
    let step = assistd::store::knowledge_ingest::IngestStep {
        job_id: old,
        owner: "one",
        version: live.version,
        item_id: pending[0].id,
        lease_until: now + 60_000,
    };
    assert!(store.fail_item(&step, "test", now).await.unwrap());
    assert!(store.finish_ingest(&live, "one", None, now).await.unwrap());
    let after = claimed(&store, "three", now + 60_000, now).await;
    assert_eq!(after.id, new);
    store.close().await;
    db.drop_db().await;
}

/// A job that is claimed again and again without adding a document (a document that kills
/// the worker each time) is given up after `knowledge.ingest_max_claims`, audited as a
/// risk and shown with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_never_progresses_is_given_up_where_an_admin_sees_it() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.knowledge.ingest_max_claims = 3;
        c.knowledge.ingest_poll_ms = 600_000;
    })
    .await;
    create(&app, "handbook").await;
    let store = app.store();
    let collection = store.collection("handbook").await.unwrap().unwrap();
    let item = item(
        "crashes.md",
        "text/markdown",
        "# Crashes\n\nthe worker dies on this one",
    );
    let job = store
        .create_ingest(collection.id, &[item], "admin:api", now_ms())
        .await
        .unwrap();
    // Three workers took it and died (their leases already over), none adding anything.
    // This instance's worker looks only when woken (its poll is long).
    for n in 0..3 {
        let now = now_ms();
        let claim = store
            .claim_ingest(&format!("dead-{n}"), now - 1, now)
            .await
            .unwrap();
        assert_eq!(claim.unwrap().claims, n + 1);
    }
    // A batch submitted here wakes the worker: it gives the old job up, then adds this one.
    let (status, next) = app
        .admin_call(
            Method::POST,
            "/api/admin/knowledge/handbook/ingest",
            Some(json!({ "documents": [policy(1, 1)] })),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{next}");
    let body = idle_ingest(&app.addr, "handbook", Duration::from_secs(30)).await;
    assert_eq!(body["ingest"]["last"]["id"], next["id"]);
    assert_eq!(body["ingest"]["last"]["state"], "done");
    let (_, given_up) = app
        .admin_call(
            Method::GET,
            &format!("/api/admin/knowledge/handbook/ingest/{job}"),
            None,
        )
        .await;
    assert_eq!(given_up["state"], "failed", "{given_up:#}");
    assert!(
        given_up["error"]
            .as_str()
            .unwrap()
            .contains("ingest_max_claims"),
        "{given_up:#}"
    );
    let (_, events) = app
        .admin_call(
            Method::GET,
            "/api/admin/audit?target_type=knowledge&target_id=handbook",
            None,
        )
        .await;
    let failed = events["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "KNOWLEDGE_INGEST_FAILED")
        .unwrap_or_else(|| panic!("{events:#}"));
    assert_eq!(failed["risk_flag"], true, "{failed}");
    app.stop().await;
}

/// The real binary, SIGKILLed while it adds a large batch; another instance started after it
/// goes on once the lease has run out, and every document ends up with its chunks once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_large_ingest_resumes_without_duplicate_chunks() {
    const DOCUMENTS: usize = 400;
    let db = TestDb::new().await;
    let workdir = tempfile::tempdir().unwrap();
    let env_of = |instance: &str| {
        server_envs(
            &db,
            "http://127.0.0.1:9",
            "http://127.0.0.1:9",
            &[
                ("ASSISTD_WORKER__INSTANCE_ID", instance),
                ("ASSISTD_KNOWLEDGE__INGEST_LEASE_SECS", "2"),
                ("ASSISTD_KNOWLEDGE__INGEST_POLL_MS", "100"),
            ],
        )
    };
    let server = RealServer::start(&env_of("first"), workdir.path()).await;
    let http = reqwest::Client::new();
    let created = http
        .post(format!("{}/api/admin/knowledge", server.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "name": "big" }))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let documents: Vec<Value> = (0..DOCUMENTS).map(|n| policy(n, 12)).collect();
    let accepted = http
        .post(format!("{}/api/admin/knowledge/big/ingest", server.addr))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "documents": documents }))
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status(), 202);
    // Killed part-way: some documents in, many still pending.
    let deadline = Instant::now() + Duration::from_secs(60);
    let done_at_kill = loop {
        let body = server.admin_json("/api/admin/knowledge/big").await;
        let done = body["ingest"]["job"]["done"].as_i64().unwrap_or(0);
        if done >= 20 {
            break done;
        }
        assert!(Instant::now() < deadline, "ingest never started: {body:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    server.kill();
    println!("SIGKILL after {done_at_kill} of {DOCUMENTS} documents");
    let server = RealServer::start(&env_of("second"), workdir.path()).await;
    let body = idle_ingest(&server.addr, "big", Duration::from_secs(180)).await;
    let last = &body["ingest"]["last"];
    assert_eq!(last["state"], "done", "{last:#}");
    assert!(
        done_at_kill < DOCUMENTS as i64,
        "the kill came after the end; make the batch larger"
    );
    // On a mismatch the job's whole state (with its failed documents' errors) and the
    // second server's log say why.
    if last["done"] != DOCUMENTS || last["failed"] != 0 || body["document_count"] != DOCUMENTS {
        panic!(
            "{done_at_kill} documents in at the kill, then: {body:#}\nsecond server's log:\n{}",
            std::fs::read_to_string(workdir.path().join("assistd.log")).unwrap_or_default()
        );
    }
    let config = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = assistd::store::Store::connect(&config.database)
        .await
        .unwrap();
    let (rows, doubled) = chunk_rows(&store).await;
    assert_eq!(doubled, 0, "no chunk twice");
    assert_eq!(
        rows,
        body["chunks"].as_i64().unwrap(),
        "every document's chunks, once"
    );
    assert_eq!(
        rows,
        last["chunks"].as_i64().unwrap(),
        "progress counted each write once"
    );
    store.close().await;
    assert_eq!(server.terminate(), Some(0));
    db.drop_db().await;
}
