//! The agent versions API: publish immutable versions and read them back.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use super::context::ApiContext;
use super::error::ApiError;
use super::tasks::AdminAuth;
use crate::agents::{PublishError, publish};
use crate::definition::AgentDefinition;
use crate::store::agents::AgentVersionRow;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/api/agents", get(list_agents))
        .route("/api/agents/{name}/versions", post(publish_version))
        .route("/api/agents/{name}/versions/{n}", get(get_version))
}

fn version_json(v: &AgentVersionRow) -> Value {
    json!({
        "agent": v.agent_name,
        "version": v.version_no,
        "version_id": v.id,
        "mode": v.mode,
        "definition": serde_json::from_str::<Value>(&v.definition).unwrap_or(Value::Null),
        "created_at": v.created_at,
    })
}

async fn list_agents(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
) -> Result<Json<Value>, ApiError> {
    let agents = svc.store.list_agents().await?;
    Ok(Json(json!({
        "agents": agents.iter().map(|a| json!({
            "name": a.name,
            "current_version": a.current_version,
            "versions": a.versions,
            "updated_at": a.updated_at,
        })).collect::<Vec<_>>(),
    })))
}

fn valid_name(name: &str) -> Result<(), ApiError> {
    if crate::domain::is_valid_name(name) {
        Ok(())
    } else {
        Err(ApiError::BadRequest(
            "agent names are 1 to 64 letters, digits, '-' or '_'".into(),
        ))
    }
}

/// Publishes the body (an agent definition, see docs/workflows.md) as a new immutable
/// version; the same definition as the current version is a no-op (`created: false`).
async fn publish_version(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(name): Path<String>,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    valid_name(&name)?;
    let Json(body) = body.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let definition: AgentDefinition = serde_json::from_value(body)
        .map_err(|e| ApiError::BadRequest(format!("agent definition: {e}")))?;
    let published = publish(&svc.store, &svc.tools, &svc.llm, &name, &definition)
        .await
        .map_err(|e| match e {
            PublishError::Invalid(msg) => ApiError::BadRequest(msg),
            PublishError::Store(s) => s.into(),
        })?;
    tracing::info!(agent = %name, version = published.version_no, created = published.created, "agent version published via API");
    let version = svc
        .store
        .agent_version(published.version_id)
        .await?
        .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("published version vanished")))?;
    let mut out = version_json(&version);
    out["created"] = json!(published.created);
    Ok(Json(out))
}

async fn get_version(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path((name, n)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let n: i64 = n
        .parse()
        .map_err(|_| ApiError::BadRequest("version must be an integer".into()))?;
    let version = svc
        .store
        .agent_version_by_no(&name, n)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("agent {name} has no version {n}")))?;
    Ok(Json(version_json(&version)))
}
