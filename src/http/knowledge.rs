//! The knowledge-base admin API (docs/knowledge.md): collections, their documents, and the
//! search agents use, all behind the admin token.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Multipart, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;
use super::tasks::AdminAuth;
use crate::domain::{AuditEvent, AuditTarget};
use crate::knowledge::{Body, ContentType, Document, KnowledgeError};
use crate::store::knowledge::{Collection, CollectionRow, DocumentRow};

pub fn router(max_document_bytes: usize) -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/api/admin/knowledge", get(list).post(create))
        .route("/api/admin/knowledge/{name}", get(show))
        .route("/api/admin/knowledge/{name}/documents", post(add))
        .route(
            "/api/admin/knowledge/{name}/documents/{*id}",
            delete(remove),
        )
        .route("/api/admin/knowledge/{name}/search", get(search))
        .route("/admin/knowledge", get(collections_page))
        .route("/admin/knowledge/{name}", get(collection_page))
        .route("/admin/knowledge/{name}/search", post(search_page))
        // A document's text, its JSON escaping and the other fields; the text's own limit
        // is checked with a clear error (413) once it is read.
        .layer(DefaultBodyLimit::max(
            max_document_bytes
                .saturating_mul(2)
                .saturating_add(64 * 1024),
        ))
}

impl From<KnowledgeError> for ApiError {
    fn from(e: KnowledgeError) -> Self {
        match e {
            KnowledgeError::Invalid(m) => ApiError::BadRequest(m),
            KnowledgeError::TooLarge(_, max) => ApiError::PayloadTooLarge(max),
            KnowledgeError::Embedding { message, .. } => ApiError::Unavailable(message),
            KnowledgeError::Store(e) => e.into(),
        }
    }
}

fn collection_json(row: &CollectionRow) -> Value {
    let c = &row.collection;
    json!({
        "name": c.name,
        "documents": row.documents,
        "chunks": row.chunks,
        "chunk_chars": c.chunk_chars,
        "overlap_chars": c.overlap_chars,
        "embedding": c.embedding_provider.as_ref().map(|p| json!({
            "provider": if p.is_empty() { "default" } else { p.as_str() },
            "model": c.embedding_model,
        })),
        "created_at": c.created_at,
    })
}

fn no_collection(name: &str) -> ApiError {
    ApiError::NotFound(format!("no knowledge collection `{name}`"))
}

/// Collection `name`, for adding to or searching it.
pub(super) async fn collection(svc: &ApiContext, name: &str) -> Result<Collection, ApiError> {
    svc.store
        .collection(name)
        .await?
        .ok_or_else(|| no_collection(name))
}

/// Collection `name` with its counts, for showing it.
async fn summary(svc: &ApiContext, name: &str) -> Result<CollectionRow, ApiError> {
    svc.store
        .collection_summary(name)
        .await?
        .ok_or_else(|| no_collection(name))
}

async fn list(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
) -> Result<Json<Value>, ApiError> {
    let all = svc.store.collections().await?;
    Ok(Json(json!({
        "collections": all.iter().map(collection_json).collect::<Vec<_>>(),
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewCollection {
    name: String,
    /// `default` (`[llm]`) or a `[llm.providers]` name: the collection's chunks and
    /// questions are embedded by it, and search fuses words and meaning.
    embedding_provider: Option<String>,
    embedding_model: Option<String>,
}

/// Creates a collection with the configured chunking; 201, or 200 when it exists already.
async fn create(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    body: Result<Json<NewCollection>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(body) = body.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    if !crate::domain::is_valid_name(&body.name) {
        return Err(ApiError::BadRequest(
            "collection names are 1 to 64 letters, digits, '-' or '_'".into(),
        ));
    }
    let (chunk, overlap) = svc.config.knowledge.chunking(None);
    let declared = crate::config::CollectionConfig {
        embedding_provider: body.embedding_provider.clone(),
        embedding_model: body.embedding_model.clone(),
        ..Default::default()
    };
    let embedding = crate::knowledge::embedding_of(&declared);
    if let Some(e) = &embedding
        && !svc.llm.has(&e.provider)
    {
        return Err(ApiError::BadRequest(format!(
            "`embedding_provider`: no provider `{}` (use `default` for [llm] or a name of [llm.providers])",
            body.embedding_provider.as_deref().unwrap_or("")
        )));
    }
    let created = svc
        .store
        .create_collection(
            &body.name,
            chunk as i64,
            overlap as i64,
            embedding.as_ref(),
            crate::domain::now_ms(),
        )
        .await?;
    let row = summary(&svc, &body.name).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(collection_json(&row))))
}

async fn show(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let (ingest, row, documents) = with_ingest_state(&svc, &name).await?;
    let mut out = collection_json(&row);
    out["documents"] = json!(
        documents
            .iter()
            .map(|d| json!({
                "id": d.doc_id,
                "title": d.title,
                "source_url": d.source_url,
                "content_type": d.content_type,
                "bytes": d.bytes,
                "chunks": d.chunks,
                "updated_at": d.updated_at,
            }))
            .collect::<Vec<_>>()
    );
    out["document_count"] = json!(row.documents);
    out["ingest"] = ingest;
    Ok(Json(out))
}

/// A document as JSON, or as multipart form fields (the body as a `file` part).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewDocument {
    id: Option<String>,
    title: Option<String>,
    source_url: Option<String>,
    content_type: Option<String>,
    text: Option<String>,
    /// The file's bytes in base64 (a PDF; any format may come so).
    content_base64: Option<String>,
    /// A multipart `file` part's bytes.
    #[serde(skip)]
    file: Option<Vec<u8>>,
}

async fn from_multipart(mut form: Multipart) -> Result<NewDocument, ApiError> {
    let mut doc = NewDocument::default();
    let bad = |e: axum::extract::multipart::MultipartError| ApiError::BadRequest(e.body_text());
    while let Some(field) = form.next_field().await.map_err(bad)? {
        let name = field.name().unwrap_or("").to_string();
        if name == "file" {
            if doc.content_type.is_none() {
                let by_name = field
                    .file_name()
                    .map(|f| ContentType::of_path(std::path::Path::new(f)).as_str());
                doc.content_type = field
                    .content_type()
                    .map(str::to_string)
                    .filter(|t| ContentType::parse(Some(t)).is_ok())
                    .or(by_name.map(str::to_string));
            }
            if doc.title.is_none() && doc.id.is_none() {
                doc.id = field.file_name().map(str::to_string);
            }
            doc.file = Some(field.bytes().await.map_err(bad)?.to_vec());
            continue;
        }
        let value = field.text().await.map_err(bad)?;
        let slot = match name.as_str() {
            "id" => &mut doc.id,
            "title" => &mut doc.title,
            "source_url" => &mut doc.source_url,
            "content_type" => &mut doc.content_type,
            "text" => &mut doc.text,
            other => {
                return Err(ApiError::BadRequest(format!(
                    "unknown field `{other}` (expected file, id, title, source_url, content_type)"
                )));
            }
        };
        *slot = Some(value);
    }
    Ok(doc)
}

/// Adds (or replaces) one document: JSON `{"text" | "content_base64", "id"?, "title"?,
/// "source_url"?, "content_type"?}` or multipart with a `file` part and the same optional
/// fields.
async fn add(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    request: axum::extract::Request,
) -> Result<Json<Value>, ApiError> {
    let row = collection(&svc, &name).await?;
    let kind = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let doc: NewDocument = if kind.starts_with("multipart/form-data") {
        let form = <Multipart as axum::extract::FromRequest<()>>::from_request(request, &())
            .await
            .map_err(|e| ApiError::BadRequest(e.body_text()))?;
        from_multipart(form).await?
    } else {
        let Json(doc) =
            <Json<NewDocument> as axum::extract::FromRequest<()>>::from_request(request, &())
                .await
                .map_err(|e| ApiError::BadRequest(e.body_text()))?;
        doc
    };
    let content_type = ContentType::parse(doc.content_type.as_deref())?;
    let body = match doc.file {
        Some(_) if doc.text.is_some() || doc.content_base64.is_some() => {
            return Err(ApiError::BadRequest(
                "give a `file` part or `text`, not both".into(),
            ));
        }
        Some(bytes) => Body::Bytes(bytes),
        None => Body::of(content_type, doc.text, doc.content_base64.as_deref())?,
    };
    let read = body.read(content_type, &svc.config.knowledge).await?;
    let document = Document {
        id: doc.id.as_deref(),
        title: doc.title.as_deref().or(read.title.as_deref()),
        source_url: doc.source_url.as_deref(),
        content_type,
        text: &read.text,
    };
    let done =
        crate::knowledge::ingest(&svc.knowledge, &row, document, crate::domain::now_ms()).await?;
    tracing::info!(collection = %name, id = %done.id, chunks = done.chunks, outcome = done.outcome.as_str(), "knowledge document put");
    if done.outcome != crate::store::knowledge::PutOutcome::Unchanged {
        let summary = format!(
            "document `{}` {} ({} chunks)",
            done.id,
            done.outcome.as_str(),
            done.chunks
        );
        audit(
            &svc,
            &name,
            AuditEvent::KnowledgeDocumentPut,
            "admin:api",
            &summary,
        )
        .await?;
    }
    Ok(Json(json!({
        "id": done.id,
        "title": done.title,
        "chunks": done.chunks,
        "status": done.outcome.as_str(),
    })))
}

async fn remove(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path((name, id)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let row = collection(&svc, &name).await?;
    if svc.store.delete_document(row.id, &id).await? {
        let summary = format!("document `{id}` deleted");
        audit(
            &svc,
            &name,
            AuditEvent::KnowledgeDocumentDeleted,
            "admin:api",
            &summary,
        )
        .await?;
        Ok(Json(json!({ "deleted": id })))
    } else {
        Err(ApiError::NotFound(format!(
            "no document `{id}` in `{name}`"
        )))
    }
}

#[derive(Deserialize)]
struct SearchQuery {
    q: Option<String>,
    k: Option<usize>,
}

async fn search(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
    query: Result<Query<SearchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let q = query.q.unwrap_or_default();
    if q.trim().is_empty() {
        return Err(ApiError::BadRequest("`q` is required".into()));
    }
    if q.len() > 4096 {
        return Err(ApiError::BadRequest(
            "`q` may have at most 4096 bytes".into(),
        ));
    }
    let max = svc.config.knowledge.max_results;
    let k = query.k.unwrap_or(5);
    if k == 0 || k > max {
        return Err(ApiError::BadRequest(format!(
            "`k` must be between 1 and {max} (knowledge.max_results)"
        )));
    }
    let row = collection(&svc, &name).await?;
    let found = svc.knowledge.search(&row, &q, k).await?;
    Ok(Json(json!({
        "results": found.hits.iter().map(hit_json).collect::<Vec<_>>(),
        "ranking": found.ranking,
        "note": found.note,
        "words": {
            "searched": found.searched,
            "left_out": found.left_out,
            "all_required": found.all_required,
        },
    })))
}

/// An audit row about collection `name`, by `actor`.
pub(super) async fn audit(
    svc: &ApiContext,
    name: &str,
    event: AuditEvent,
    actor: &str,
    summary: &str,
) -> Result<(), ApiError> {
    let target = Some(AuditTarget::Knowledge(name.to_string()));
    let now = crate::domain::now_ms();
    Ok(svc
        .store
        .audit(None, target, event, actor, summary, false, now)
        .await?)
}

fn hit_json(h: &crate::store::knowledge::Hit) -> Value {
    json!({
        "document_id": h.doc_id,
        "title": h.title,
        "heading": h.heading,
        "source_url": h.source_url,
        "score": h.score,
        "text": h.text,
    })
}

/// The admin page listing the collections.
async fn collections_page(
    admin: super::pages::AdminPage,
    State(svc): State<Arc<ApiContext>>,
) -> Result<axum::response::Response, ApiError> {
    let all = svc.store.collections().await?;
    Ok(super::pages::render(
        "knowledge.html",
        json!({ "collections": all.iter().map(collection_json).collect::<Vec<_>>(), "csrf": admin.csrf }),
    ))
}

/// A collection's page: its documents, and (after a search) the ranked passages.
async fn collection_view(
    svc: &ApiContext,
    admin: &super::pages::AdminPage,
    name: &str,
    searched: Option<(&str, Vec<Value>)>,
) -> Result<axum::response::Response, ApiError> {
    let (ingest, row, documents) = with_ingest_state(svc, name).await?;
    let (q, results) = match searched {
        Some((q, results)) => (Some(q.to_string()), Some(results)),
        None => (None, None),
    };
    Ok(super::pages::render(
        "collection.html",
        json!({
            "c": collection_json(&row),
            "documents": documents.iter().map(|d| json!({
                "id": d.doc_id, "title": d.title, "source_url": d.source_url,
                "content_type": d.content_type, "bytes": d.bytes, "chunks": d.chunks,
                "updated_at": d.updated_at,
            })).collect::<Vec<_>>(),
            "ingest": ingest,
            "q": q,
            "results": results,
            "k": svc.config.knowledge.top_k,
            "csrf": admin.csrf,
        }),
    ))
}

async fn collection_page(
    admin: super::pages::AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
) -> Result<axum::response::Response, ApiError> {
    collection_view(&svc, &admin, &name, None).await
}

/// Tries a question (CSRF-checked, audited): the passages an agent would get, with scores.
async fn search_page(
    admin: super::pages::AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
    axum::Form(form): axum::Form<std::collections::HashMap<String, String>>,
) -> Result<axum::response::Response, ApiError> {
    super::pages::check_csrf(&admin, &form)?;
    let q = form.get("q").map(|q| q.trim()).unwrap_or("");
    if q.is_empty() || q.len() > 4096 {
        return Err(ApiError::BadRequest(
            "the question must have 1 to 4096 bytes".into(),
        ));
    }
    let row = collection(&svc, &name).await?;
    let hits = svc
        .knowledge
        .search(&row, q, svc.config.knowledge.top_k)
        .await?
        .hits;
    let summary = format!(
        "searched `{}`: {} passages",
        q.chars().take(200).collect::<String>(),
        hits.len()
    );
    audit(
        &svc,
        &name,
        AuditEvent::KnowledgeSearched,
        "admin:web",
        &summary,
    )
    .await?;
    let results = hits.iter().map(hit_json).collect();
    collection_view(&svc, &admin, &name, Some((q, results))).await
}

/// Failed documents listed with a job.
const FAILURES_SHOWN: i64 = 20;

/// A job as JSON, with its first failed documents.
pub(super) async fn ingest_json(
    svc: &ApiContext,
    row: &crate::store::knowledge_ingest::IngestRow,
) -> Result<Value, ApiError> {
    let failures = if row.failed > 0 {
        svc.store.ingest_failures(row.id, FAILURES_SHOWN).await?
    } else {
        Vec::new()
    };
    Ok(json!({
        "id": row.id,
        "state": row.state,
        "documents": row.documents,
        "done": row.done,
        "failed": row.failed,
        "chunks": row.chunks,
        "error": row.error,
        "failures": failures.iter().map(|f| json!({
            "position": f.position, "id": f.doc_id, "error": f.error,
        })).collect::<Vec<_>>(),
        "actor": row.actor,
        "created_at": row.created_at,
        "finished_at": row.finished_at,
    }))
}

/// Collection `name`'s ingest state, then its counts and documents, read in that order:
/// a job shown ended has every document it wrote in the counts and the list beside it
/// (read the other way round, a document committed between the reads was missing from a
/// listing that already said `idle`).
async fn with_ingest_state(
    svc: &ApiContext,
    name: &str,
) -> Result<(Value, CollectionRow, Vec<DocumentRow>), ApiError> {
    let id = collection(svc, name).await?.id;
    let ingest = ingest_state(svc, id).await?;
    let row = summary(svc, name).await?;
    let documents = svc.store.documents(row.collection.id).await?;
    Ok((ingest, row, documents))
}

/// The collection's ingest state: `queued` or `running` with the job's progress while one
/// is open, else `idle` with the last job (and its error or failed documents), if any.
async fn ingest_state(svc: &ApiContext, collection_id: i64) -> Result<Value, ApiError> {
    let Some(row) = svc.store.latest_ingest(collection_id).await? else {
        return Ok(json!({ "state": "idle" }));
    };
    let job = ingest_json(svc, &row).await?;
    Ok(match row.state.as_str() {
        "queued" | "running" => json!({ "state": row.state, "job": job }),
        _ => json!({ "state": "idle", "last": job }),
    })
}
