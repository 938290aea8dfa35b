//! PDF documents in knowledge bases (issue 34), on the database the suite runs on: PDFs
//! written by lopdf (the parser pdf-extract reads them with) through a multipart file, JSON
//! `content_base64`, the background ingest API and the CLI, each page a `Page N` section
//! that search results name; broken, fake, textless and oversized PDFs refused with nothing
//! written (or, in a job, failing alone). And the Debian reference cards (`debian-refcard`,
//! real PDFs made by pdfTeX and xdvipdfmx, English and Chinese), installed by `.ci/run`.

use base64::Engine as _;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::*;

/// A PDF whose pages hold these lines (Helvetica, one `Tj` per line), with an information
/// dictionary title when given.
fn pdf_of(pages: &[&[&str]], title: Option<&str>) -> Vec<u8> {
    use lopdf::Object;
    use lopdf::content::{Content, Operation};
    let contents = pages
        .iter()
        .map(|lines| {
            let mut operations = vec![
                Operation::new("BT", vec![]),
                Operation::new("Tf", vec!["F1".into(), 11.into()]),
                Operation::new("TL", vec![14.into()]),
                Operation::new("Td", vec![60.into(), 780.into()]),
            ];
            for line in *lines {
                operations.push(Operation::new("Tj", vec![Object::string_literal(*line)]));
                operations.push(Operation::new("T*", vec![]));
            }
            operations.push(Operation::new("ET", vec![]));
            Content { operations }.encode().unwrap()
        })
        .collect();
    pdf_with(contents, title)
}

/// A PDF whose pages have these content streams.
fn pdf_with(contents: Vec<Vec<u8>>, title: Option<&str>) -> Vec<u8> {
    use lopdf::{Document, Object, Stream, dictionary};
    let mut doc = Document::with_version("1.5");
    let pages_id = doc.new_object_id();
    let font = doc.add_object(dictionary! {
        "Type" => "Font", "Subtype" => "Type1", "BaseFont" => "Helvetica",
    });
    let resources = doc.add_object(dictionary! { "Font" => dictionary! { "F1" => font } });
    let mut kids = Vec::new();
    for content in contents {
        let contents = doc.add_object(Stream::new(dictionary! {}, content));
        let page = doc.add_object(dictionary! {
            "Type" => "Page", "Parent" => pages_id, "Contents" => contents,
        });
        kids.push(page.into());
    }
    let count = kids.len() as i64;
    doc.objects.insert(
        pages_id,
        Object::Dictionary(dictionary! {
            "Type" => "Pages", "Kids" => kids, "Count" => count, "Resources" => resources,
            "MediaBox" => vec![0.into(), 0.into(), 595.into(), 842.into()],
        }),
    );
    let catalog = doc.add_object(dictionary! { "Type" => "Catalog", "Pages" => pages_id });
    doc.trailer.set("Root", catalog);
    if let Some(title) = title {
        let info = doc.add_object(dictionary! { "Title" => lopdf::text_string(title) });
        doc.trailer.set("Info", info);
    }
    doc.compress();
    let mut bytes = Vec::new();
    doc.save_to(&mut bytes).unwrap();
    bytes
}

const PAGE_ONE: &[&str] = &[
    "Expense policy",
    "Employees may claim travel costs incurred on company business.",
    "Flights are booked through the travel portal.",
];
const PAGE_TWO: &[&str] = &[
    "Submitting claims",
    "Upload every receipt within thirty days of the trip.",
    "Claims above 5000 euros need the finance director.",
];

async fn post_file(app: &TestApp, collection: &str, name: &str, bytes: Vec<u8>) -> (u16, Value) {
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(bytes)
            .file_name(name.to_string())
            .mime_str("application/octet-stream")
            .unwrap(),
    );
    let response = app
        .http
        .post(format!(
            "{}/api/admin/knowledge/{collection}/documents",
            app.addr
        ))
        .bearer_auth(ADMIN_TOKEN)
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn search(app: &TestApp, collection: &str, q: &str, k: usize) -> Value {
    let q: String = url::form_urlencoded::byte_serialize(q.as_bytes()).collect();
    let path = format!("/api/admin/knowledge/{collection}/search?q={q}&k={k}");
    let (status, body) = app.admin_call(Method::GET, &path, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

async fn document_count(app: &TestApp, collection: &str) -> i64 {
    let path = format!("/api/admin/knowledge/{collection}");
    let (_, shown) = app.admin_call(Method::GET, &path, None).await;
    shown["document_count"].as_i64().unwrap()
}

fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A PDF added as a multipart file (its type known by its name) and as JSON base64: its
/// pages are sections, a passage found on page 2 says so, its title comes from its metadata
/// (else its first line); what is not a readable PDF with text is refused, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdfs_are_read_page_by_page_and_bad_ones_refused() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.knowledge.max_document_bytes = 20_000;
        c.knowledge.pdf_max_pages = 3;
    })
    .await;
    let post = Method::POST;
    app.admin_call(
        post.clone(),
        "/api/admin/knowledge",
        Some(json!({"name": "policies"})),
    )
    .await;
    let policy = pdf_of(&[PAGE_ONE, PAGE_TWO], Some("Expense policy 2026"));
    let (status, added) = post_file(&app, "policies", "finance/expenses.pdf", policy).await;
    assert_eq!(status, 200, "{added}");
    assert_eq!(added["id"], "finance/expenses.pdf");
    assert_eq!(added["title"], "Expense policy 2026", "{added}");
    let found = search(&app, "policies", "receipt thirty days", 1).await;
    let best = &found["results"][0];
    assert_eq!(best["document_id"], "finance/expenses.pdf", "{found}");
    assert_eq!(best["heading"], "Page 2", "{found}");
    assert!(
        best["text"]
            .as_str()
            .unwrap()
            .contains("within thirty days"),
        "{found}"
    );
    let found = search(&app, "policies", "travel portal", 1).await;
    assert_eq!(found["results"][0]["heading"], "Page 1", "{found}");
    let (_, shown) = app
        .admin_call(Method::GET, "/api/admin/knowledge/policies", None)
        .await;
    assert_eq!(
        shown["documents"][0]["content_type"], "application/pdf",
        "{shown}"
    );

    // As JSON: no metadata title, so its first line.
    let untitled = pdf_of(&[PAGE_TWO], None);
    let doc = json!({"id": "claims", "content_type": "application/pdf",
                     "content_base64": base64(&untitled)});
    let path = "/api/admin/knowledge/policies/documents";
    let (status, added) = app.admin_call(post.clone(), path, Some(doc)).await;
    assert_eq!(status, 200, "{added}");
    assert_eq!(added["title"], "Submitting claims", "{added}");
    assert_eq!(document_count(&app, "policies").await, 2);

    let broken = b"%PDF-1.7\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\ntrailer".to_vec();
    let empty_page: &[&str] = &[];
    let refused: Vec<(Value, u16, &str)> = vec![
        (
            json!({"content_type": "application/pdf", "content_base64": base64(b"plain words")}),
            400,
            "not a PDF",
        ),
        (
            json!({"content_type": "application/pdf", "content_base64": base64(&broken)}),
            400,
            "could not be read",
        ),
        (
            json!({"content_type": "application/pdf",
                   "content_base64": base64(&pdf_of(&[empty_page], None))}),
            400,
            "no text layer",
        ),
        (
            json!({"content_type": "application/pdf",
                   "content_base64": base64(&pdf_of(&[PAGE_ONE; 4], None))}),
            400,
            "knowledge.pdf_max_pages",
        ),
        (
            json!({"content_type": "application/pdf",
                   "content_base64": base64(&[&b"%PDF-1.7 "[..], &[b' '; 20_000]].concat())}),
            413,
            "larger than 20000",
        ),
        (
            // A text position that is not a number: pdf-extract panics; caught.
            json!({"content_type": "application/pdf", "content_base64": base64(&pdf_with(
                vec![b"BT /F1 11 Tf /Oops 780 Td (x) Tj ET".to_vec()], None))}),
            400,
            "structure is broken",
        ),
        (
            json!({"content_type": "application/pdf", "content_base64": "not base64!"}),
            400,
            "not base64",
        ),
        (
            json!({"text": "words", "content_base64": base64(b"words")}),
            400,
            "not both",
        ),
    ];
    for (doc, want, says) in refused {
        let (status, body) = app.admin_call(post.clone(), path, Some(doc)).await;
        assert_eq!(status.as_u16(), want, "{body}");
        assert!(
            body["error"].as_str().unwrap().contains(says),
            "{says}: {body}"
        );
    }
    // A file part that is no PDF, by its name.
    let (status, body) = post_file(&app, "policies", "fake.pdf", b"<html>".to_vec()).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(document_count(&app, "policies").await, 2, "nothing written");
    app.stop().await;

    // A PDF that takes longer than `pdf_timeout_ms` to read is refused.
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.knowledge.pdf_timeout_ms = 1;
    })
    .await;
    app.admin_call(post, "/api/admin/knowledge", Some(json!({"name": "slow"})))
        .await;
    let long = pdf_of(&[PAGE_ONE; 300], None);
    let (status, body) = post_file(&app, "slow", "long.pdf", long).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("knowledge.pdf_timeout_ms"),
        "{body}"
    );
    assert_eq!(document_count(&app, "slow").await, 0);
    app.stop().await;
}

/// A batch with PDFs in base64: a broken one is accepted (its header is right) and fails
/// alone in the job with its reason; one that is no PDF at all refuses the batch whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdfs_in_a_background_job_are_read_by_the_worker() {
    let app = TestApp::spawn().await;
    app.admin_call(
        Method::POST,
        "/api/admin/knowledge",
        Some(json!({"name": "policies"})),
    )
    .await;
    let path = "/api/admin/knowledge/policies/ingest";
    let fake = json!({"documents": [
        {"id": "a", "text": "Plain words."},
        {"id": "b", "content_type": "application/pdf", "content_base64": base64(b"<html>")},
    ]});
    let (status, body) = app.admin_call(Method::POST, path, Some(fake)).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("documents[1]: "),
        "{body}"
    );
    let batch = json!({"documents": [
        {"id": "policy.pdf", "content_type": "application/pdf",
         "content_base64": base64(&pdf_of(&[PAGE_ONE, PAGE_TWO], Some("Expense policy")))},
        {"id": "broken.pdf", "content_type": "application/pdf",
         "content_base64": base64(b"%PDF-1.4\nnothing else")},
        {"id": "notes.md", "content_type": "text/markdown",
         "content_base64": base64("# Notes\n\nMeeting rooms are booked in the calendar.".as_bytes())},
    ]});
    let (status, job) = app.admin_call(Method::POST, path, Some(batch)).await;
    assert_eq!(status, 202, "{job}");
    let job_path = format!("{path}/{}", job["id"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let job = loop {
        let (_, job) = app.admin_call(Method::GET, &job_path, None).await;
        if job["state"] == "done" || job["state"] == "failed" {
            break job;
        }
        assert!(std::time::Instant::now() < deadline, "{job}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(job["state"], "done", "{job}");
    assert_eq!(job["done"], 2, "{job}");
    assert_eq!(job["failed"], 1, "{job}");
    assert_eq!(job["failures"][0]["id"], "broken.pdf", "{job}");
    assert!(
        job["failures"][0]["error"]
            .as_str()
            .unwrap()
            .contains("could not be read"),
        "{job}"
    );
    let found = search(&app, "policies", "receipt thirty days", 1).await;
    assert_eq!(found["results"][0]["document_id"], "policy.pdf", "{found}");
    assert_eq!(found["results"][0]["heading"], "Page 2", "{found}");
    assert_eq!(found["results"][0]["title"], "Expense policy", "{found}");
    app.stop().await;
}

/// The Debian reference card (`debian-refcard`: two A4 pages, English by pdfTeX, Chinese by
/// xdvipdfmx) added with the real binary's `assistd knowledge add`, then asked in both
/// languages: the right card and page first.
#[cfg_attr(
    not(assistd_has_corpora),
    ignore = "the corpora from Debian: apt-get install python3.11-doc debian-reference-zh-cn debian-refcard"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debian_reference_cards_are_found_by_page() {
    use std::io::Read as _;
    let dir = tempfile::tempdir().unwrap();
    for lang in ["en", "zh_CN"] {
        let gz = format!("/usr/share/doc/debian-refcard/refcard-{lang}-a4.pdf.gz");
        let mut pdf = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap())
            .read_to_end(&mut pdf)
            .unwrap();
        std::fs::write(dir.path().join(format!("refcard-{lang}.pdf")), pdf).unwrap();
    }
    let app = TestApp::spawn().await;
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_assistd"))
        .args(["knowledge", "add", "cards"])
        .arg(dir.path())
        .env("ASSISTD_DATABASE__URL", &app.db.url)
        .env("ASSISTD_LOG__LEVEL", "warn")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{out}");
    assert!(out.contains("cards: 2 added"), "{out}");
    let (_, shown) = app
        .admin_call(Method::GET, "/api/admin/knowledge/cards", None)
        .await;
    let titles: Vec<&str> = shown["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["title"].as_str().unwrap())
        .collect();
    assert!(titles.contains(&"Debian Reference Card"), "{shown}");
    // (question, card, page): each answer is on one page of one card.
    let questions = [
        (
            "How do I restart a service daemon?",
            "refcard-en.pdf",
            "Page 2",
        ),
        (
            "Which package does a file belong to?",
            "refcard-en.pdf",
            "Page 2",
        ),
        (
            "Where do I download CD images of the installer?",
            "refcard-en.pdf",
            "Page 1",
        ),
        (
            "How do I write my package selections to a file?",
            "refcard-en.pdf",
            "Page 1",
        ),
        (
            "如何重新启动系统守护进程服务？",
            "refcard-zh_CN.pdf",
            "Page 2",
        ),
        ("怎样创建到文件的软链接？", "refcard-zh_CN.pdf", "Page 2"),
        (
            "在哪里找到邮件列表和在线文档？",
            "refcard-zh_CN.pdf",
            "Page 1",
        ),
    ];
    for (question, card, page) in questions {
        let found = search(&app, "cards", question, 3).await;
        let best = &found["results"][0];
        assert_eq!(
            (best["document_id"].as_str(), best["heading"].as_str()),
            (Some(card), Some(page)),
            "{question}: {found:#}"
        );
    }
    app.stop().await;
}
