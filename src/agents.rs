//! Agent definitions: what the config declares, and publishing a changed declaration as a
//! new immutable version at start-up. Tasks carry the version they were created for.

use serde::{Deserialize, Serialize};

use crate::config::{AgentConfig, AgentMode, Config};
use crate::store::Store;

/// What an agent version holds; stored as JSON in `agent_version.definition` and copied
/// into the task when it is claimed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentDefinition {
    pub mode: AgentMode,
    pub system_prompt: String,
    /// Empty = the configured `llm.model` at run time.
    pub model: String,
    pub temperature: f64,
    pub max_tokens: u32,
    pub history_messages: u32,
}

impl From<&AgentConfig> for AgentDefinition {
    fn from(c: &AgentConfig) -> Self {
        AgentDefinition {
            mode: c.mode,
            system_prompt: c.system_prompt.clone(),
            model: c.model.clone(),
            temperature: c.temperature,
            max_tokens: c.max_tokens,
            history_messages: c.history_messages,
        }
    }
}

/// Publishes every configured agent whose definition differs from its current version.
pub async fn publish_configured_agents(store: &Store, config: &Config) -> anyhow::Result<()> {
    for (name, agent) in &config.agents {
        let definition = AgentDefinition::from(agent);
        let json = serde_json::to_string(&definition)?;
        let mode = serde_json::to_value(definition.mode)?;
        let published = store
            .publish_agent_version(
                name,
                mode.as_str().unwrap_or("single_turn"),
                &json,
                crate::domain::now_ms(),
            )
            .await?;
        if published.created {
            tracing::info!(agent = %name, version = published.version_no, "published agent version");
        }
    }
    Ok(())
}
