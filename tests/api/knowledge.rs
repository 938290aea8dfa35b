//! Knowledge bases through the admin API (issue 34), on the database the suite runs on:
//! collections, documents added as JSON and as multipart files (text, Markdown, HTML),
//! re-added unchanged or changed, deleted, and searched in English and Chinese; bad input is
//! refused with nothing written.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::*;

impl TestApp {
    pub(crate) async fn admin_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.addr))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    async fn put_doc(&self, collection: &str, doc: Value) -> (StatusCode, Value) {
        let path = format!("/api/admin/knowledge/{collection}/documents");
        self.admin_call(reqwest::Method::POST, &path, Some(doc))
            .await
    }

    async fn delete_doc(&self, collection: &str, id: &str) -> StatusCode {
        let path = format!("/api/admin/knowledge/{collection}/documents/{id}");
        self.admin_call(reqwest::Method::DELETE, &path, None)
            .await
            .0
    }

    /// The document ids a search returns, best first.
    pub(crate) async fn search_ids(&self, collection: &str, q: &str, k: usize) -> Vec<String> {
        let q: String = url::form_urlencoded::byte_serialize(q.as_bytes()).collect();
        let path = format!("/api/admin/knowledge/{collection}/search?q={q}&k={k}");
        let (status, body) = self.admin_call(reqwest::Method::GET, &path, None).await;
        assert_eq!(status, 200, "{body}");
        body["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["document_id"].as_str().unwrap().to_string())
            .collect()
    }
}

const TRAVEL: &str = "# Travel policy\n\nBook flights and hotels through the travel portal at least two weeks ahead.\n\n## Flights\n\nEconomy class for flights under six hours; business class above.\n\n## Hotels\n\nHotels up to 150 euros a night in most cities.";
const LEAVE: &str =
    "# Leave\n\nAnnual leave is 25 days. Ask your lead in the HR tool before you book any holiday.";
const EXPENSES_ZH: &str = "# 报销制度\n\n员工因公出差产生的费用可以申请报销。请在出差结束后十五天内通过财务系统提交报销单，并附上发票。\n\n## 审批\n\n报销单由直属经理审批，超过五千元需要财务总监审批。";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_are_added_searched_replaced_and_deleted() {
    let app = TestApp::spawn().await;
    let post = reqwest::Method::POST;
    let (status, created) = app
        .admin_call(
            post.clone(),
            "/api/admin/knowledge",
            Some(json!({"name": "handbook"})),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["chunk_chars"], 1200);
    let (again, _) = app
        .admin_call(
            post.clone(),
            "/api/admin/knowledge",
            Some(json!({"name": "handbook"})),
        )
        .await;
    assert_eq!(again, 200, "creating it again is no error");

    let (status, added) = app
        .put_doc(
            "handbook",
            json!({"id": "travel", "content_type": "text/markdown", "text": TRAVEL,
                   "source_url": "https://intranet.example/travel"}),
        )
        .await;
    assert_eq!(status, 200, "{added}");
    assert_eq!(added["status"], "added");
    assert_eq!(added["title"], "Travel policy");
    let (_, leave) = app
        .put_doc(
            "handbook",
            json!({"id": "leave", "content_type": "text/markdown", "text": LEAVE}),
        )
        .await;
    assert_eq!(leave["status"], "added");
    // Without an id, the document is named by its content's hash.
    let (_, zh) = app
        .put_doc(
            "handbook",
            json!({"content_type": "text/markdown", "text": EXPENSES_ZH}),
        )
        .await;
    let zh_id = zh["id"].as_str().unwrap().to_string();
    assert!(zh_id.starts_with("sha256:"), "{zh}");
    assert_eq!(zh["title"], "报销制度");

    // Ranking: the passage that answers comes first, in English and in Chinese.
    assert_eq!(
        app.search_ids("handbook", "which class for long flights?", 3)
            .await[0],
        "travel"
    );
    assert_eq!(
        app.search_ids("handbook", "how many days of annual leave", 3)
            .await[0],
        "leave"
    );
    // Results are chunks: both sections of the Chinese document, and nothing else.
    let zh_hits = app.search_ids("handbook", "怎么申请报销？", 3).await;
    assert!(
        !zh_hits.is_empty() && zh_hits.iter().all(|id| *id == zh_id),
        "{zh_hits:?}"
    );
    assert_eq!(
        app.search_ids("handbook", "报销单谁审批", 3).await[0],
        zh_id
    );
    let q = url::form_urlencoded::byte_serialize("hotel price per night".as_bytes())
        .collect::<String>();
    let (_, found) = app
        .admin_call(
            reqwest::Method::GET,
            &format!("/api/admin/knowledge/handbook/search?q={q}&k=1"),
            None,
        )
        .await;
    let top = &found["results"][0];
    assert_eq!(top["heading"], "Travel policy > Hotels", "{found}");
    assert_eq!(top["source_url"], "https://intranet.example/travel");
    assert!(top["text"].as_str().unwrap().contains("150 euros"));
    assert!(top["score"].as_f64().unwrap() > 0.0);

    // The same content again costs nothing; a changed one replaces its chunks.
    let (_, same) = app
        .put_doc(
            "handbook",
            json!({"id": "leave", "content_type": "text/markdown", "text": LEAVE}),
        )
        .await;
    assert_eq!(same["status"], "unchanged");
    let changed = LEAVE
        .replace("25 days", "30 days")
        .replace("HR tool", "staff portal");
    let (_, replaced) = app
        .put_doc(
            "handbook",
            json!({"id": "leave", "content_type": "text/markdown", "text": changed}),
        )
        .await;
    assert_eq!(replaced["status"], "replaced");
    assert!(
        app.search_ids("handbook", "HR tool", 5).await.is_empty(),
        "the old chunks are gone"
    );
    assert_eq!(
        app.search_ids("handbook", "staff portal", 5).await[0],
        "leave"
    );

    let (_, shown) = app
        .admin_call(reqwest::Method::GET, "/api/admin/knowledge/handbook", None)
        .await;
    assert_eq!(shown["document_count"], 3, "{shown}");
    assert_eq!(shown["ingest"]["state"], "idle");
    let ids: Vec<&str> = shown["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["leave", zh_id.as_str(), "travel"]);

    let status = app.delete_doc("handbook", "leave").await;
    assert_eq!(status, 200);
    assert!(
        app.search_ids("handbook", "annual leave", 5)
            .await
            .is_empty()
    );
    let status = app.delete_doc("handbook", "leave").await;
    assert_eq!(status, 404);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_come_as_multipart_and_html_keeps_its_headings() {
    let app = TestApp::spawn().await;
    app.admin_call(
        reqwest::Method::POST,
        "/api/admin/knowledge",
        Some(json!({"name": "docs"})),
    )
    .await;
    let html = "<html><body><nav>Home | About</nav><h1>VPN setup</h1><p>Install the client from the portal.</p><h2>Linux</h2><p>Use <code>openconnect</code> with the company gateway.</p></body></html>";
    let form = reqwest::multipart::Form::new()
        .text("source_url", "https://intranet.example/vpn")
        .part(
            "file",
            reqwest::multipart::Part::text(html)
                .file_name("guides/vpn.html")
                .mime_str("text/html")
                .unwrap(),
        );
    let response = app
        .http
        .post(format!("{}/api/admin/knowledge/docs/documents", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let added: Value = response.json().await.unwrap();
    assert_eq!(added["id"], "guides/vpn.html", "{added}");
    assert_eq!(added["title"], "VPN setup");
    let q: String = url::form_urlencoded::byte_serialize("openconnect linux".as_bytes()).collect();
    let (_, found) = app
        .admin_call(
            reqwest::Method::GET,
            &format!("/api/admin/knowledge/docs/search?q={q}&k=1"),
            None,
        )
        .await;
    assert_eq!(
        found["results"][0]["heading"], "VPN setup > Linux",
        "{found}"
    );
    assert_eq!(found["results"][0]["document_id"], "guides/vpn.html");
    // A path-like id is deleted by its path.
    let status = app.delete_doc("docs", "guides/vpn.html").await;
    assert_eq!(status, 200);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_documents_and_searches_are_refused_with_nothing_written() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.knowledge.max_document_bytes = 1000;
    })
    .await;
    let post = reqwest::Method::POST;
    for name in ["", "has space", "a/b", &"x".repeat(65)] {
        let (status, _) = app
            .admin_call(
                post.clone(),
                "/api/admin/knowledge",
                Some(json!({"name": name})),
            )
            .await;
        assert_eq!(status, 400, "{name:?}");
    }
    let (status, _) = app.put_doc("nowhere", json!({"text": "hello"})).await;
    assert_eq!(status, 404);
    app.admin_call(
        post.clone(),
        "/api/admin/knowledge",
        Some(json!({"name": "kb"})),
    )
    .await;
    let refused = [
        (json!({"text": "x".repeat(1001)}), 413),
        (json!({"text": "   "}), 400),
        (json!({"title": "no text"}), 400),
        (
            json!({"text": "hello", "content_type": "application/pdf"}),
            400,
        ),
        (
            json!({"text": "hello", "source_url": "javascript:alert(1)"}),
            400,
        ),
        (json!({"text": "hello", "id": "a\u{0}b"}), 400),
        (json!({"text": "hello", "colour": "blue"}), 400),
    ];
    for (doc, want) in refused {
        let (status, body) = app.put_doc("kb", doc.clone()).await;
        assert_eq!(status.as_u16(), want, "{doc}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }
    let (_, shown) = app
        .admin_call(reqwest::Method::GET, "/api/admin/knowledge/kb", None)
        .await;
    assert_eq!(shown["document_count"], 0, "nothing written: {shown}");
    for query in ["", "?q=", "?q=x&k=0", "?q=x&k=51", "?q=x&k=many"] {
        let (status, _) = app
            .admin_call(
                reqwest::Method::GET,
                &format!("/api/admin/knowledge/kb/search{query}"),
                None,
            )
            .await;
        assert_eq!(status, 400, "{query}");
    }
    // Only the admin token opens it.
    let response = app
        .http
        .get(format!("{}/api/admin/knowledge", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    app.stop().await;
}

/// A single-turn agent with `knowledge = ["handbook"]`: the question's passages are found
/// (a journalled `knowledge.search` step the task page shows), given to the model numbered
/// before the question, and the answer goes out as a `knowledge_answer` card whose sources
/// are the passages it cites; a question nothing in the collection answers gets
/// `knowledge.unknown_answer` without the model being asked. Chinese too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_answers_from_its_collection_with_cited_sources() {
    use crate::strict_model::{ModelReply, model_mock};
    let model = wiremock::MockServer::start().await;
    model_mock(|body: &Value| {
        let messages = body["messages"].as_array().unwrap();
        let given = messages[messages.len() - 2]["content"]
            .as_str()
            .unwrap_or("");
        // The model cites the passage that names the thing asked about.
        let cite = |word: &str| {
            given
                .split("\n[")
                .skip(1)
                .find(|p| p.contains(word))
                .and_then(|p| p.split(']').next())
                .map(|n| format!("[{n}]"))
                .unwrap_or_default()
        };
        let question = crate::helpers::last_content(body);
        ModelReply::text(if question.contains("flight") {
            format!("Business class above six hours {}.", cite("Economy class"))
        } else {
            format!("提交报销单并附上发票 {}。", cite("发票"))
        })
    })
    .mount(&model)
    .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.knowledge
            .collections
            .insert("handbook".into(), Default::default());
        c.agents.get_mut("default").unwrap().knowledge = vec!["handbook".into()];
    })
    .await;
    for doc in [
        json!({"id": "travel", "content_type": "text/markdown", "text": TRAVEL,
               "source_url": "https://intranet.example/travel"}),
        json!({"id": "leave", "content_type": "text/markdown", "text": LEAVE}),
        json!({"id": "expenses", "content_type": "text/markdown", "text": EXPENSES_ZH}),
    ] {
        let (status, body) = app.put_doc("handbook", doc).await;
        assert_eq!(status, 200, "{body}");
    }

    let id = task_id_of(
        app.post_message(&message("kb-1", 1, "which class for long flights?"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    let (_, reply) = app.replies().await.remove(0);
    assert_eq!(reply["type"], "card", "{reply}");
    let card = &reply["card"];
    assert_eq!(card["card_type"], "knowledge_answer");
    assert!(
        card["answer"]
            .as_str()
            .unwrap()
            .starts_with("Business class above six hours [1]"),
        "{card}"
    );
    let sources = card["sources"].as_array().unwrap();
    assert_eq!(sources.len(), 1, "only the cited passage: {card}");
    assert_eq!(sources[0]["document_id"], "travel");
    assert_eq!(sources[0]["heading"], "Travel policy > Flights");
    assert_eq!(sources[0]["url"], "https://intranet.example/travel");
    assert!(
        reply["text"].as_str().unwrap().contains("Sources:\n[1] Travel policy — Travel policy > Flights (https://intranet.example/travel)"),
        "the text fallback lists the sources: {reply}"
    );
    // The task shows what was retrieved: the journalled search step, then the model call.
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps[0]["tool"], "knowledge.search", "{task:#}");
    assert!(
        steps[0]["output"]
            .as_str()
            .unwrap()
            .contains("\"document_id\":\"travel\"")
    );
    assert_eq!(steps[1]["tool"], "chat");
    {
        use crate::admin_pages::{browser, page_of, sign_in};
        let http = browser();
        let cookie = sign_in(&app, &http).await;
        let page = page_of(&app, &http, &cookie, &format!("/admin/tasks/{id}")).await;
        let table = page
            .split("id=\"passages\"")
            .nth(1)
            .expect("a passages table");
        assert!(
            table.contains("intranet.example") && table.contains("Economy class"),
            "the task page shows the passages retrieved: {page}"
        );
    }
    let asked = model_bodies(&app.model).await;
    let given = asked[0]["messages"].as_array().unwrap();
    let passages = given[given.len() - 2]["content"].as_str().unwrap();
    assert!(
        passages.starts_with("Answer the next question from these passages"),
        "{passages}"
    );
    assert!(
        passages.contains("[1] Travel policy — Travel policy > Flights"),
        "{passages}"
    );

    // Chinese.
    let id = task_id_of(
        app.post_message(&message("kb-2", 1, "怎么申请报销？"))
            .await,
    )
    .await;
    app.wait_replied(id, WAIT).await;
    let replies = app.replies().await;
    let zh = &replies.last().unwrap().1;
    assert_eq!(zh["card"]["sources"][0]["document_id"], "expenses", "{zh}");
    assert!(
        zh["card"]["answer"].as_str().unwrap().contains("发票 [1]"),
        "{zh}"
    );

    // Nothing answers: said so, the model not asked.
    let before = model_bodies(&app.model).await.len();
    let id = task_id_of(
        app.post_message(&message("kb-3", 1, "zebra quantum saxophone"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED");
    let replies = app.replies().await;
    assert_eq!(
        replies.last().unwrap().1["text"],
        "I could not find this in the documents I can search."
    );
    assert_eq!(
        model_bodies(&app.model).await.len(),
        before,
        "the model was not asked"
    );
    app.stop().await;
}

/// An agent cannot name a collection that does not exist, nor use knowledge in a workflow
/// (not built yet): its version is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_naming_a_missing_collection_is_refused() {
    let app = TestApp::spawn().await;
    let (status, body) = app
        .admin_call(
            reqwest::Method::POST,
            "/api/agents/helper/versions",
            Some(json!({"mode": "single_turn", "system_prompt": "Help.", "knowledge": ["nope"]})),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("no collection `nope`"),
        "{body}"
    );
    app.stop().await;
}

/// `assistd knowledge add <name> <folder>` with the real binary: the folder is walked, each
/// file added under its path below the folder (a file that is not UTF-8 fails alone and the
/// exit code says so), and adding the folder again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_adds_a_folder_and_adding_it_again_changes_nothing() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("policies/travel")).unwrap();
    std::fs::write(dir.path().join("policies/travel/flights.md"), TRAVEL).unwrap();
    std::fs::write(dir.path().join("leave.txt"), LEAVE).unwrap();
    std::fs::write(dir.path().join("报销.md"), EXPENSES_ZH).unwrap();
    std::fs::write(dir.path().join("image.png"), [0x89, b'P', b'N', b'G']).unwrap();
    let run = |paths: Vec<std::path::PathBuf>| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_assistd"))
            .arg("knowledge")
            .arg("add")
            .arg("handbook")
            .args(paths)
            .env("ASSISTD_DATABASE__URL", &db.url)
            .env("ASSISTD_LOG__LEVEL", "warn")
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let (code, out) = run(vec![dir.path().to_path_buf()]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("policies/travel/flights.md: added"), "{out}");
    assert!(
        out.contains("handbook: 3 added, 0 replaced, 0 unchanged, 0 failed"),
        "{out}"
    );
    let (code, out) = run(vec![dir.path().to_path_buf()]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("0 added, 0 replaced, 3 unchanged"), "{out}");
    // A file given by name that is not text fails alone.
    std::fs::write(dir.path().join("bad.md"), [0xff, 0xfe, 0x00]).unwrap();
    let (code, out) = run(vec![dir.path().join("bad.md")]);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("failed: the file is not UTF-8 text"), "{out}");

    let config = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = assistd::store::Store::connect(&config.database)
        .await
        .unwrap();
    let collection = store.collection("handbook").await.unwrap().unwrap();
    let ids: Vec<String> = store
        .documents(collection.id)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.doc_id)
        .collect();
    assert_eq!(ids, ["leave.txt", "policies/travel/flights.md", "报销.md"]);
    let hits = assistd::knowledge::search_words(&store, &collection, "怎么申请报销", 1)
        .await
        .unwrap();
    assert_eq!(hits[0].doc_id, "报销.md");
    store.close().await;
    db.drop_db().await;
}

/// The admin pages: the collections with their counts, a collection's documents, and a
/// question tried on it (CSRF-checked) showing the ranked passages with their scores; the
/// search, like adding and deleting documents, is audited under the collection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_see_collections_and_try_questions_on_their_pages() {
    use crate::admin_pages::{browser, csrf_of, page_of, sign_in};
    let app = TestApp::spawn().await;
    app.admin_call(
        reqwest::Method::POST,
        "/api/admin/knowledge",
        Some(json!({"name": "handbook"})),
    )
    .await;
    for doc in [
        json!({"id": "travel", "content_type": "text/markdown", "text": TRAVEL,
               "source_url": "https://intranet.example/travel"}),
        json!({"id": "leave", "content_type": "text/markdown", "text": LEAVE}),
    ] {
        app.put_doc("handbook", doc).await;
    }
    assert_eq!(app.delete_doc("handbook", "leave").await, 200);
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let list = page_of(&app, &http, &cookie, "/admin/knowledge").await;
    assert!(
        list.contains("href=\"/admin/knowledge/handbook\""),
        "{list}"
    );
    let page = page_of(&app, &http, &cookie, "/admin/knowledge/handbook").await;
    assert!(
        page.contains("Travel policy") && page.contains("intranet.example"),
        "{page}"
    );
    let csrf = csrf_of(&page);
    let search = |csrf: String| {
        http.post(format!("{}/admin/knowledge/handbook/search", app.addr))
            .header("cookie", &cookie)
            .form(&[("csrf", csrf), ("q", "hotel price per night".into())])
            .send()
    };
    assert_eq!(
        search("0".repeat(64)).await.unwrap().status(),
        403,
        "a forged form"
    );
    let answered = search(csrf).await.unwrap();
    assert_eq!(answered.status(), 200);
    let html = answered.text().await.unwrap();
    let results = &html[html.find("id=\"results\"").expect("a results table")..];
    assert!(results.contains("Travel policy &gt; Hotels"), "{results}");
    assert!(results.contains("class=\"score\""), "{results}");

    let (_, events) = app
        .admin_call(
            reqwest::Method::GET,
            "/api/admin/audit?target_type=knowledge&target_id=handbook",
            None,
        )
        .await;
    let seen: Vec<&str> = events["audit"]
        .as_array()
        .unwrap_or_else(|| panic!("{events}"))
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    for event in [
        "KNOWLEDGE_DOCUMENT_PUT",
        "KNOWLEDGE_DOCUMENT_DELETED",
        "KNOWLEDGE_SEARCHED",
    ] {
        assert!(seen.contains(&event), "{event} in {seen:?}");
    }
    app.stop().await;
}
