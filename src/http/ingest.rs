//! Background ingest jobs over HTTP (docs/knowledge.md): a batch of documents is checked
//! whole (one bad document refuses the batch, nothing written), committed as a job, and
//! answered 202 at once; a worker adds the documents, and the collection reports progress.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;

use super::context::ApiContext;
use super::error::ApiError;
use super::knowledge::{audit, collection, ingest_json};
use super::tasks::AdminAuth;
use crate::domain::AuditEvent;
use crate::knowledge::{Body, ContentType, Document, KnowledgeError};
use crate::store::knowledge_ingest::NewItem;

pub fn router(max_bytes: usize) -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/api/admin/knowledge/{name}/ingest", post(submit))
        .route("/api/admin/knowledge/{name}/ingest/{id}", get(show))
        .layer(DefaultBodyLimit::max(max_bytes))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch {
    documents: Vec<Item>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Item {
    id: Option<String>,
    title: Option<String>,
    source_url: Option<String>,
    content_type: Option<String>,
    text: Option<String>,
    content_base64: Option<String>,
}

/// Checks each document as the worker will (so a batch with a bad one is refused whole).
/// A PDF is checked for its header and size here and read by the worker, which keeps it
/// in base64 meanwhile (a PDF that cannot be read fails alone in the job).
fn checked(svc: &ApiContext, n: usize, item: Item) -> Result<NewItem, ApiError> {
    let at = |e: KnowledgeError| match ApiError::from(e) {
        ApiError::BadRequest(m) => ApiError::BadRequest(format!("documents[{n}]: {m}")),
        other => other,
    };
    let config = &svc.config.knowledge;
    let content_type = ContentType::parse(item.content_type.as_deref()).map_err(at)?;
    let body = Body::of(content_type, item.text, item.content_base64.as_deref()).map_err(at)?;
    let text = match body {
        Body::Text(text) => text,
        Body::Bytes(bytes) if content_type.is_binary() => {
            crate::knowledge::pdf::check(&bytes, config.max_document_bytes).map_err(at)?;
            item.content_base64.unwrap_or_default()
        }
        Body::Bytes(bytes) => crate::knowledge::utf8_text(bytes).map_err(at)?,
    };
    let doc = Document {
        id: item.id.as_deref(),
        title: item.title.as_deref(),
        source_url: item.source_url.as_deref(),
        content_type,
        text: &text,
    };
    if content_type.is_binary() {
        crate::knowledge::check_fields(&doc).map_err(at)?;
    } else {
        crate::knowledge::check(&doc, config).map_err(at)?;
    }
    Ok(NewItem {
        doc_id: item.id,
        title: item.title,
        source_url: item.source_url,
        content_type: content_type.as_str().to_string(),
        text,
    })
}

/// `POST /api/admin/knowledge/{name}/ingest` with `{"documents": [{"text", "id"?, …}]}`:
/// 202 with the job, whose documents a worker adds in the background.
async fn submit(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
    body: Result<Json<Batch>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(batch) = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::PayloadTooLarge(svc.config.knowledge.ingest_max_bytes)
        }
        _ => ApiError::BadRequest(e.body_text()),
    })?;
    let max = svc.config.knowledge.ingest_max_documents;
    if batch.documents.is_empty() || batch.documents.len() > max {
        return Err(ApiError::BadRequest(format!(
            "`documents` must hold 1 to {max} documents (knowledge.ingest_max_documents)"
        )));
    }
    let row = collection(&svc, &name).await?;
    let items = batch
        .documents
        .into_iter()
        .enumerate()
        .map(|(n, item)| checked(&svc, n, item))
        .collect::<Result<Vec<_>, _>>()?;
    let now = crate::domain::now_ms();
    let id = svc
        .store
        .create_ingest(row.id, &items, "admin:api", now)
        .await?;
    svc.wake.knowledge.notify_one();
    tracing::info!(collection = %name, ingest = id, documents = items.len(), "knowledge ingest queued");
    let summary = format!("ingest {id} queued: {} documents", items.len());
    audit(
        &svc,
        &name,
        AuditEvent::KnowledgeIngestQueued,
        "admin:api",
        &summary,
    )
    .await?;
    let job = svc
        .store
        .ingest(row.id, id)
        .await?
        .ok_or(crate::store::StoreError::NotFound)?;
    Ok((StatusCode::ACCEPTED, Json(ingest_json(&svc, &job).await?)))
}

async fn show(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path((name, id)): Path<(String, i64)>,
) -> Result<Json<Value>, ApiError> {
    let row = collection(&svc, &name).await?;
    let job = svc
        .store
        .ingest(row.id, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no ingest job {id} in `{name}`")))?;
    Ok(Json(ingest_json(&svc, &job).await?))
}
