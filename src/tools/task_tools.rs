//! The tools one task may use: the configured ones, and the MCP tools pinned in its agent
//! version (their schemas and kinds as they were when the version was published), so a
//! running task does not change under a server's update. Publishing validates a workflow
//! through the same view.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::mcp::function_name;
use super::schema::ArgsSchema;
use super::{ToolError, ToolRegistry};
use crate::config::ToolConfig;
use crate::definition::{McpToolSpec, ToolKind};

pub struct TaskTools {
    registry: Arc<ToolRegistry>,
    /// `<server>.<tool>` → the pinned spec, as a tool config, and its compiled schema.
    mcp: BTreeMap<String, (McpToolSpec, ToolConfig, ArgsSchema)>,
    /// `knowledge.search`, for agents that name knowledge collections.
    knowledge: Option<(ToolConfig, ArgsSchema, Option<SearchFn>)>,
}

pub use crate::definition::KNOWLEDGE_SEARCH;

/// What `knowledge.search` runs: its checked arguments in, its result out.
pub type SearchFn = Arc<
    dyn Fn(Value) -> std::pin::Pin<Box<dyn Future<Output = Result<Value, ToolError>> + Send>>
        + Send
        + Sync,
>;

impl TaskTools {
    /// The view over `registry` with `pinned` MCP tools; a pinned schema that does not
    /// compile is refused.
    pub fn new(
        registry: Arc<ToolRegistry>,
        pinned: &BTreeMap<String, McpToolSpec>,
    ) -> Result<TaskTools, String> {
        let mut mcp = BTreeMap::new();
        for (name, spec) in pinned {
            let schema = ArgsSchema::compile(&spec.input_schema)
                .map_err(|e| format!("MCP tool `{name}`: input schema: {e}"))?;
            let config = ToolConfig {
                kind: spec.kind,
                description: spec.description.clone(),
                method: "MCP".into(),
                url: String::new(),
                headers: BTreeMap::new(),
                body: None,
                timeout_secs: 0,
                args_schema: spec.input_schema.clone(),
                idempotent: Some(spec.kind == ToolKind::ReadOnly),
                undo: None,
            };
            mcp.insert(name.clone(), (spec.clone(), config, schema));
        }
        Ok(TaskTools {
            registry,
            mcp,
            knowledge: None,
        })
    }

    /// Offers `knowledge.search` over `collections` (read-only; `k` up to `max_k`), run by
    /// `search` (`None` when only checking a workflow). No collections: not offered.
    pub fn with_knowledge(
        mut self,
        collections: &[String],
        max_k: usize,
        search: Option<SearchFn>,
    ) -> TaskTools {
        if collections.is_empty() {
            return self;
        }
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 4096,
                          "description": "what to look for, in the words the documents would use"},
                "collection": {"type": "string", "enum": collections,
                               "description": "one collection to search (all when absent)"},
                "k": {"type": "integer", "minimum": 1, "maximum": max_k.max(1),
                      "description": "how many passages (knowledge.top_k when absent)"},
            },
            "required": ["query"],
            "additionalProperties": false,
        });
        let config = ToolConfig {
            kind: ToolKind::ReadOnly,
            description: "Searches the organisation's documents and returns the best \
                          passages, numbered, with their titles and links."
                .into(),
            method: "BUILTIN".into(),
            url: String::new(),
            headers: BTreeMap::new(),
            body: None,
            timeout_secs: 0,
            args_schema: schema.clone(),
            idempotent: Some(true),
            undo: None,
        };
        // A schema built here always compiles.
        if let Ok(compiled) = ArgsSchema::compile(&schema) {
            self.knowledge = Some((config, compiled, search));
        }
        self
    }

    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// Tool `name`: a pinned MCP tool, else a configured one.
    pub fn get(&self, name: &str) -> Option<&ToolConfig> {
        if name == KNOWLEDGE_SEARCH {
            return self.knowledge.as_ref().map(|(config, _, _)| config);
        }
        match self.mcp.get(name) {
            Some((_, config, _)) => Some(config),
            None => self.registry.get(name),
        }
    }

    /// An agent node's tool names with `<server>.*` replaced by the server's pinned tools
    /// (none when `server` is no MCP server); other names as they are.
    pub fn expand(&self, names: &[String]) -> Result<Vec<String>, String> {
        let mut out: Vec<String> = Vec::new();
        for name in names {
            match name.strip_suffix(".*") {
                Some(server) => {
                    if !self.registry.is_mcp_server(server) {
                        return Err(format!("`{name}`: no MCP server `{server}` is configured"));
                    }
                    let tools: Vec<String> = self
                        .mcp
                        .iter()
                        .filter(|(_, (spec, _, _))| spec.server == server)
                        .map(|(n, _)| n.clone())
                        .collect();
                    if tools.is_empty() {
                        return Err(format!("`{name}`: server `{server}` offers no tools"));
                    }
                    for tool in tools {
                        if !out.contains(&tool) {
                            out.push(tool);
                        }
                    }
                }
                None if !out.contains(name) => out.push(name.clone()),
                None => {}
            }
        }
        Ok(out)
    }

    /// Checks `args` against tool `name`'s schema.
    pub fn check_args(&self, name: &str, args: &Value) -> Result<(), String> {
        if let (KNOWLEDGE_SEARCH, Some((_, schema, _))) = (name, &self.knowledge) {
            return schema.check(args);
        }
        match self.mcp.get(name) {
            Some((_, _, schema)) => schema.check(args),
            None => self.registry.check_args(name, args),
        }
    }

    /// The functions offered to the model for `names`, for an agent loop.
    pub fn function_specs(&self, names: &[String]) -> Vec<crate::llm::ToolSpec> {
        names
            .iter()
            .filter_map(|n| self.get(n).map(|t| (n, t)))
            .map(|(name, tool)| crate::llm::ToolSpec {
                name: function_name(name),
                description: tool.description.clone(),
                parameters: tool.args_schema.clone(),
            })
            .collect()
    }

    /// Calls tool `name` with `args`, carrying `idempotency_key`.
    pub async fn call(
        &self,
        name: &str,
        args: &Value,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        if let (KNOWLEDGE_SEARCH, Some((_, schema, search))) = (name, &self.knowledge) {
            schema.check(args).map_err(|e| {
                ToolError::permanent(format!("invalid arguments for `{name}`: {e}"))
            })?;
            let search = search
                .as_ref()
                .ok_or_else(|| ToolError::permanent("knowledge.search is not wired here"))?;
            return search(args.clone()).await;
        }
        let Some((spec, _, schema)) = self.mcp.get(name) else {
            return self.registry.call(name, args, idempotency_key).await;
        };
        schema
            .check(args)
            .map_err(|e| ToolError::permanent(format!("invalid arguments for `{name}`: {e}")))?;
        self.registry
            .call_mcp(&spec.server, &spec.tool, args, idempotency_key)
            .await
    }

    /// Runs the undo of compensable tool `name` for a call with `args` that returned
    /// `result`. An MCP undo tool gets the original arguments with the result's fields
    /// over them, kept to the properties its schema names (when it names any).
    pub async fn undo(
        &self,
        name: &str,
        args: &Value,
        result: &Value,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        let Some((spec, _, _)) = self.mcp.get(name) else {
            return self
                .registry
                .undo(name, args, result, idempotency_key)
                .await;
        };
        let undo = spec
            .undo
            .as_ref()
            .ok_or_else(|| ToolError::permanent(format!("tool `{name}` has no undo tool")))?;
        let undo_name = format!("{}.{undo}", spec.server);
        let (undo_spec, _, _) = self.mcp.get(&undo_name).ok_or_else(|| {
            ToolError::permanent(format!("undo tool `{undo_name}` is not pinned"))
        })?;
        let undo_args = undo_arguments(args, result, &undo_spec.input_schema);
        self.call(&undo_name, &undo_args, idempotency_key).await
    }
}

impl crate::definition::ToolCatalog for TaskTools {
    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn expand(&self, names: &[String]) -> Result<Vec<String>, String> {
        TaskTools::expand(self, names)
    }
}

/// The original arguments with the result's fields over them, kept to the properties the
/// undo tool's schema names (all of them when it names none).
fn undo_arguments(args: &Value, result: &Value, undo_schema: &Value) -> Value {
    let mut merged: Map<String, Value> = args.as_object().cloned().unwrap_or_default();
    if let Some(fields) = result.as_object() {
        merged.extend(fields.clone());
    }
    if let Some(properties) = undo_schema["properties"].as_object() {
        merged.retain(|k, _| properties.contains_key(k));
    }
    Value::Object(merged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn undo_arguments_take_the_result_over_the_args_within_the_schema() {
        let schema = json!({"type": "object", "properties": {"id": {"type": "string"}}});
        assert_eq!(
            undo_arguments(
                &json!({"title": "x", "id": "old"}),
                &json!({"id": "T-1", "url": "u"}),
                &schema
            ),
            json!({"id": "T-1"})
        );
        assert_eq!(
            undo_arguments(&json!({"a": 1}), &json!("text"), &json!({"type": "object"})),
            json!({"a": 1})
        );
    }
}
