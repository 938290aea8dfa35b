//! The agent definition: what an agent version holds (`AgentDefinition`, stored as JSON in
//! `agent_version.definition` and copied into a task at its first claim), with its defaults,
//! the workflow format it may carry (`workflow`), the MCP tools pinned into it and the tool
//! kinds. One home, below the engine and the config: the engine runs a definition, the
//! config's `[agents.<name>]` sections are read into one, `agents.rs` validates and
//! publishes them, `store/agents.rs` keeps their versions. It uses nothing of the crate but
//! the template checker.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod workflow;

/// What an agent version holds; stored as JSON in `agent_version.definition` and copied
/// into the task when it is claimed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentDefinition {
    pub mode: AgentMode,
    pub system_prompt: String,
    /// Empty = the configured `llm.model` at run time.
    #[serde(default)]
    pub model: String,
    /// A `[llm.providers.<name>]` entry; empty = `[llm]`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider: String,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "default_history")]
    pub history_messages: u32,
    /// The workflow of a `workflow` agent (docs/workflows.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvers: Vec<String>,
    #[serde(default = "default_deadline")]
    pub confirm_deadline_secs: u64,
    /// Sent when the model answers nothing; empty = the task fails.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub fallback_text: String,
    /// Knowledge collections the agent answers from (single-turn) or searches (workflows:
    /// the `knowledge.search` tool and `retrieve` nodes); docs/knowledge.md.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub knowledge: Vec<String>,
    /// The placeholder of a slow run (`replies.placeholder` when absent; "" = none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placeholder: Option<String>,
    /// The MCP tools the workflow names, as their servers offered them when this version
    /// was published (filled in by `publish`, never taken from a request).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mcp_tools: BTreeMap<String, McpToolSpec>,
}

pub(crate) fn default_temperature() -> f64 {
    0.2
}
pub(crate) fn default_max_tokens() -> u32 {
    1024
}
pub(crate) fn default_history() -> u32 {
    20
}
pub(crate) fn default_deadline() -> u64 {
    3600
}

impl AgentDefinition {
    /// The TEXT of the mode column.
    pub fn mode_str(&self) -> &'static str {
        match self.mode {
            AgentMode::SingleTurn => "single_turn",
            AgentMode::Workflow => "workflow",
        }
    }
}

/// How an agent answers: one model call, or a workflow (docs/workflows.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentMode {
    #[default]
    SingleTurn,
    Workflow,
}

/// What a tool does to the world, which decides its retries, compensation and approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    /// Reads only: retried, and safe to repeat after a crash.
    ReadOnly,
    /// Changes something but declares how to undo it (saga compensation).
    Compensable,
    /// Cannot be undone: runs only after a human approves.
    Irreversible,
}

/// One MCP tool as a task sees it: pinned into the agent version when it is published, so
/// a running task keeps the schema and kind it started with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpToolSpec {
    pub server: String,
    pub tool: String,
    pub kind: ToolKind,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    pub input_schema: Value,
    /// The server's tool that undoes this one (compensable tools only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<String>,
}

/// The built-in tool that searches an agent's knowledge collections (docs/knowledge.md).
pub const KNOWLEDGE_SEARCH: &str = "knowledge.search";

/// The tools a workflow may name, as the publishing side knows them (the configured tools
/// and the MCP tools pinned into the version).
pub trait ToolCatalog {
    /// Whether a tool of this name exists.
    fn has(&self, name: &str) -> bool;
    /// An agent node's tool names with `<server>.*` replaced by the server's tools.
    fn expand(&self, names: &[String]) -> Result<Vec<String>, String>;
}
