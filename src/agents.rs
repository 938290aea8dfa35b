//! Agent versions published: what the config (or the versions API) declares as an
//! `AgentDefinition` (`definition/`), validated against the tools and model providers that
//! exist, and published as a new immutable version when it changed. Tasks carry the version
//! they were created for and run on a copy of it taken at claim.

use std::sync::Arc;

use serde_json::Value;

use crate::config::Config;
use crate::definition::workflow::Workflow;
use crate::definition::{AgentDefinition, AgentMode};
use crate::llm::ModelClients;
use crate::store::Store;
use crate::store::agents::Published;
use crate::tools::ToolRegistry;
use crate::tools::task_tools::TaskTools;

/// The most earlier messages an agent may give its model: each task reads them (one index
/// probe each) before its model call, and a model's context holds far fewer.
pub const MAX_HISTORY_MESSAGES: u32 = 1000;

/// Checks `definition` against the tools (`tools`) and model providers that exist; errors
/// name the field (and the node, for workflows).
pub fn validate(
    definition: &AgentDefinition,
    tools: &TaskTools,
    models: &ModelClients,
) -> Result<(), String> {
    if !models.has(&definition.provider) {
        return Err(format!(
            "provider `{}` is not configured (add [llm.providers.{}])",
            definition.provider, definition.provider
        ));
    }
    if !(0.0..=2.0).contains(&definition.temperature) {
        return Err("temperature must be between 0 and 2".into());
    }
    if definition.max_tokens == 0 {
        return Err("max_tokens must be greater than 0".into());
    }
    if definition.history_messages > MAX_HISTORY_MESSAGES {
        return Err(format!(
            "history_messages must be at most {MAX_HISTORY_MESSAGES}"
        ));
    }
    if definition.confirm_deadline_secs == 0 {
        return Err("confirm_deadline_secs must be greater than 0".into());
    }
    match (definition.mode, &definition.workflow) {
        (AgentMode::SingleTurn, Some(_)) => {
            Err("a single_turn agent has no workflow (set mode to workflow)".into())
        }
        (AgentMode::Workflow, None) => Err("a workflow agent needs a `workflow`".into()),
        (AgentMode::Workflow, Some(w)) => {
            check_knowledge(definition)?;
            Workflow::parse(w, tools, !definition.approvers.is_empty()).map(|_| ())
        }
        (AgentMode::SingleTurn, None) => check_knowledge(definition),
    }
}

/// Knowledge collections are named as collections are.
fn check_knowledge(definition: &AgentDefinition) -> Result<(), String> {
    match definition
        .knowledge
        .iter()
        .find(|n| !crate::domain::is_valid_name(n))
    {
        Some(bad) => Err(format!("knowledge: `{bad}` is not a collection name")),
        None => Ok(()),
    }
}

/// Validates `definition` and publishes it as agent `name`'s current version (a no-op when
/// it equals the current one).
pub async fn publish(
    store: &Store,
    tools: &Arc<ToolRegistry>,
    models: &ModelClients,
    name: &str,
    definition: &AgentDefinition,
) -> Result<Published, PublishError> {
    let mut definition = definition.clone();
    definition.mcp_tools = tools.resolve_mcp(definition.workflow.as_ref());
    let view = TaskTools::new(tools.clone(), &definition.mcp_tools)
        .map_err(PublishError::Invalid)?
        .with_knowledge(&definition.knowledge, usize::MAX, None);
    validate(&definition, &view, models).map_err(PublishError::Invalid)?;
    for name in &definition.knowledge {
        if store
            .collection(name)
            .await
            .map_err(PublishError::Store)?
            .is_none()
        {
            return Err(PublishError::Invalid(format!(
                "knowledge: there is no collection `{name}` (create it first)"
            )));
        }
    }
    let json =
        serde_json::to_string(&definition).map_err(|e| PublishError::Invalid(e.to_string()))?;
    store
        .publish_agent_version(name, definition.mode_str(), &json, crate::domain::now_ms())
        .await
        .map_err(PublishError::Store)
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Store(crate::store::StoreError),
}

/// Publishes every configured agent whose definition differs from its current version.
pub async fn publish_configured_agents(
    store: &Store,
    config: &Config,
    tools: &Arc<ToolRegistry>,
    models: &ModelClients,
) -> anyhow::Result<()> {
    for (name, agent) in &config.agents {
        let workflow = if agent.workflow_file.trim().is_empty() {
            None
        } else {
            let path = agent.workflow_file.trim();
            let text = std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("agents.{name}.workflow_file: cannot read {path}: {e}")
            })?;
            Some(serde_json::from_str::<Value>(&text).map_err(|e| {
                anyhow::anyhow!("agents.{name}.workflow_file: {path} is not JSON: {e}")
            })?)
        };
        let definition = agent.definition(workflow);
        let published = publish(store, tools, models, name, &definition)
            .await
            .map_err(|e| anyhow::anyhow!("agents.{name}: {e}"))?;
        if published.created {
            tracing::info!(agent = %name, version = published.version_no, "published agent version");
        }
    }
    Ok(())
}

/// Publishes again every agent whose current version pins MCP tools or names a whole
/// server, so new tasks see the servers' tool lists as they are now; running tasks keep the
/// version they were claimed with. A version that no longer validates (a tool it names is
/// gone) is kept as it is, with an error logged.
pub async fn republish_for_mcp(
    store: &Store,
    tools: &Arc<ToolRegistry>,
    models: &ModelClients,
) -> anyhow::Result<()> {
    for agent in store.list_agents().await? {
        let Some(current) = store.current_agent_version(&agent.name).await? else {
            continue;
        };
        let Ok(definition) = serde_json::from_str::<AgentDefinition>(&current.definition) else {
            continue;
        };
        let names_mcp = !definition.mcp_tools.is_empty()
            || !tools.resolve_mcp(definition.workflow.as_ref()).is_empty();
        if !names_mcp {
            continue;
        }
        match publish(store, tools, models, &agent.name, &definition).await {
            Ok(p) if p.created => {
                tracing::info!(agent = %agent.name, version = p.version_no, "MCP tools changed: published agent version");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!(agent = %agent.name, error = %e, "MCP tools changed: the agent's current version is kept");
            }
        }
    }
    Ok(())
}

/// Republishes on each change of the MCP servers' tool lists, until the registry is gone.
pub fn watch_mcp(store: Store, tools: &Arc<ToolRegistry>, models: Arc<ModelClients>) {
    let Some(mut changes) = tools.mcp().map(|m| m.changes()) else {
        return;
    };
    let weak = Arc::downgrade(tools);
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let Some(tools) = weak.upgrade() else { break };
            if let Err(e) = republish_for_mcp(&store, &tools, &models).await {
                tracing::error!(error = %e, "MCP tools changed: republishing failed");
            }
        }
    });
}
