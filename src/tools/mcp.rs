//! Tools from MCP servers (`[mcp_servers.<name>]`), through the official Rust SDK (`rmcp`):
//! connected over streamable HTTP at start-up, their tools listed and registered as
//! `<server>.<tool>` with a kind from their annotations (or the config), and called with
//! the step's idempotency key in the request's `_meta` (`io.assistd/idempotency-key`).

use std::collections::BTreeMap;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::{Value, json};

use crate::config::{McpServerConfig, ToolConfig, ToolKind};

/// The meta key a server that honours it can drop a repeated call by.
pub const IDEMPOTENCY_META: &str = "io.assistd/idempotency-key";

type Client = RunningService<RoleClient, ClientConfig>;

/// The connected servers and the tools they offer.
pub struct McpTools {
    clients: BTreeMap<String, Client>,
    /// `<server>.<tool>` → (server, tool, its config as the runner sees it).
    pub tools: BTreeMap<String, (String, String, ToolConfig)>,
    timeouts: BTreeMap<String, Duration>,
    urls: BTreeMap<String, String>,
}

/// The kind of an MCP tool: the config's override, else its annotations — `readOnlyHint`
/// read-only; anything else irreversible (an approval first), since a server's hints are
/// claims, not guarantees, and an undo is not configured here yet.
pub fn kind_of(
    annotations: Option<&rmcp::model::ToolAnnotations>,
    over: Option<ToolKind>,
) -> ToolKind {
    if let Some(kind) = over {
        return kind;
    }
    match annotations.and_then(|a| a.read_only_hint) {
        Some(true) => ToolKind::ReadOnly,
        _ => ToolKind::Irreversible,
    }
}

impl McpTools {
    /// Connects to every server and lists its tools; an unreachable server or a refused
    /// listing stops the start-up, naming the server.
    pub async fn connect(servers: &BTreeMap<String, McpServerConfig>) -> anyhow::Result<McpTools> {
        let mut out = McpTools {
            clients: BTreeMap::new(),
            tools: BTreeMap::new(),
            timeouts: BTreeMap::new(),
            urls: BTreeMap::new(),
        };
        for (name, server) in servers {
            let mut config = StreamableHttpClientTransportConfig::with_uri(server.url.clone());
            if !server.bearer_token.is_empty() {
                config = config.auth_header(server.bearer_token.clone());
            }
            let transport = StreamableHttpClientTransport::from_config(config);
            let info = ClientConfig::new(
                ClientCapabilities::default(),
                Implementation::new("assistd", env!("CARGO_PKG_VERSION")),
            );
            let timeout = Duration::from_secs(server.timeout_secs.max(1));
            let client = tokio::time::timeout(timeout, info.serve(transport))
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "mcp_servers.{name}: no answer from {} in {timeout:?}",
                        server.url
                    )
                })?
                .map_err(|e| {
                    anyhow::anyhow!("mcp_servers.{name}: cannot connect to {}: {e}", server.url)
                })?;
            let listed = tokio::time::timeout(timeout, client.list_all_tools())
                .await
                .map_err(|_| anyhow::anyhow!("mcp_servers.{name}: tools/list timed out"))?
                .map_err(|e| anyhow::anyhow!("mcp_servers.{name}: tools/list failed: {e}"))?;
            for tool in listed {
                let tool_name = tool.name.to_string();
                if !server.tools.is_empty() && !server.tools.contains(&tool_name) {
                    continue;
                }
                let kind = kind_of(
                    tool.annotations.as_ref(),
                    server.kinds.get(&tool_name).copied(),
                );
                let config = ToolConfig {
                    kind,
                    description: tool.description.as_deref().unwrap_or("").to_string(),
                    method: "MCP".into(),
                    url: server.url.clone(),
                    headers: BTreeMap::new(),
                    body: None,
                    timeout_secs: server.timeout_secs,
                    args_schema: Value::Object((*tool.input_schema).clone()),
                    idempotent: Some(kind == ToolKind::ReadOnly),
                    undo: None,
                };
                out.tools.insert(
                    format!("{name}.{tool_name}"),
                    (name.clone(), tool_name, config),
                );
            }
            out.timeouts.insert(name.clone(), timeout);
            out.urls
                .insert(name.clone(), crate::redaction::redact(&server.url));
            out.clients.insert(name.clone(), client);
        }
        Ok(out)
    }

    /// Calls `tool` of `server` with `args`, carrying `idempotency_key` in `_meta`. A result
    /// with `isError` is a permanent failure the model sees; a protocol or transport failure
    /// is worth another try.
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        args: &Value,
        idempotency_key: &str,
    ) -> Result<Value, CallError> {
        let client = self.clients.get(server).ok_or_else(|| CallError {
            message: format!("MCP server `{server}` is not connected"),
            retryable: false,
        })?;
        let mut params = CallToolRequestParams::new(tool.to_string());
        params.arguments = args.as_object().cloned();
        let mut meta = rmcp::model::MetaObject::default();
        meta.0
            .insert(IDEMPOTENCY_META.into(), json!(idempotency_key));
        params.meta = Some(rmcp::model::RequestMetaObject(meta));
        let timeout = self
            .timeouts
            .get(server)
            .copied()
            .unwrap_or(Duration::from_secs(30));
        let result = tokio::time::timeout(timeout, client.call_tool(params))
            .await
            .map_err(|_| CallError {
                message: format!("{server}.{tool} timed out after {timeout:?}"),
                retryable: true,
            })?
            .map_err(|e| CallError {
                message: format!("{server}.{tool} failed: {e}"),
                retryable: true,
            })?;
        let text: Vec<String> = result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect();
        if result.is_error == Some(true) {
            return Err(CallError {
                message: format!("{server}.{tool} answered an error: {}", text.join("\n")),
                retryable: false,
            });
        }
        Ok(result
            .structured_content
            .unwrap_or_else(|| json!({ "text": text.join("\n") })))
    }
}

impl McpTools {
    /// The servers, whether each is still connected, and their tools with the kind assistd
    /// gives them (`GET /api/admin/mcp`).
    pub fn describe(&self) -> Value {
        let servers: Vec<Value> = self
            .clients
            .iter()
            .map(|(name, client)| {
                let tools: Vec<Value> = self
                    .tools
                    .iter()
                    .filter(|(_, (server, _, _))| server == name)
                    .map(|(full, (_, tool, config))| {
                        json!({
                            "name": full,
                            "tool": tool,
                            "kind": config.kind,
                            "description": config.description,
                        })
                    })
                    .collect();
                json!({
                    "name": name,
                    "url": self.urls.get(name),
                    "connected": !client.is_transport_closed(),
                    "tools": tools,
                })
            })
            .collect();
        json!({ "servers": servers })
    }
}

/// A failed MCP call: why, and whether another try may go better.
#[derive(Debug)]
pub struct CallError {
    pub message: String,
    pub retryable: bool,
}

/// The function name a model is offered for tool `name`: `<server>.<tool>` becomes
/// `<server>__<tool>` (function names allow letters, digits, `_` and `-` only).
pub fn function_name(name: &str) -> String {
    name.replace('.', "__")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::ToolAnnotations;

    #[test]
    fn kinds_come_from_read_only_hints_or_the_config() {
        let mut read_only = ToolAnnotations::default();
        read_only.read_only_hint = Some(true);
        let mut destructive = ToolAnnotations::default();
        destructive.destructive_hint = Some(true);
        let mut idempotent = ToolAnnotations::default();
        idempotent.idempotent_hint = Some(true);
        idempotent.destructive_hint = Some(false);
        assert_eq!(kind_of(Some(&read_only), None), ToolKind::ReadOnly);
        assert_eq!(kind_of(Some(&destructive), None), ToolKind::Irreversible);
        // No undo is configurable yet: an idempotent, non-destructive tool still asks.
        assert_eq!(kind_of(Some(&idempotent), None), ToolKind::Irreversible);
        assert_eq!(kind_of(None, None), ToolKind::Irreversible);
        assert_eq!(
            kind_of(Some(&destructive), Some(ToolKind::ReadOnly)),
            ToolKind::ReadOnly
        );
        assert_eq!(function_name("desk.lookup"), "desk__lookup");
    }
}
