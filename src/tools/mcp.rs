//! Tools from MCP servers (`[mcp_servers.<name>]`), through the official Rust SDK (`rmcp`):
//! over streamable HTTP or a child process on stdio, connected at start-up and again
//! whenever the connection is found closed (a server that restarted or a child that died);
//! the tools listed at start-up and on `notifications/tools/list_changed`, each as
//! `<server>.<tool>` with a kind from its annotations (or the config); and called with the
//! step's idempotency key in the request's `_meta` (`io.assistd/idempotency-key`).
//!
//! What a task may call is pinned in its agent version (`McpToolSpec`s, see
//! `TaskTools`); the live list here only says whether a pinned tool is still offered.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, ErrorCode, Implementation,
};
use rmcp::service::{NotificationContext, RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::{Value, json};

use crate::config::McpServerConfig;
use crate::definition::{McpToolSpec, ToolKind};

/// The meta key a server that honours it can drop a repeated call by.
pub const IDEMPOTENCY_META: &str = "io.assistd/idempotency-key";

/// How often closed connections are looked for and opened again.
const RECONNECT_EVERY: Duration = Duration::from_secs(5);

/// What assistd's environment a stdio server is given (with the server's own `env`).
pub const STDIO_ENV: [&str; 4] = ["PATH", "HOME", "LANG", "TMPDIR"];

type Client = RunningService<RoleClient, Handler>;

/// Receives the server's notifications: a changed tool list is relisted.
#[derive(Clone)]
struct Handler {
    server: String,
    changed: tokio::sync::mpsc::UnboundedSender<String>,
}

impl rmcp::ClientHandler for Handler {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("assistd", env!("CARGO_PKG_VERSION")),
        )
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        let _ = self.changed.send(self.server.clone());
    }
}

/// One configured server and its connection (absent while down).
struct Server {
    config: McpServerConfig,
    timeout: Duration,
    /// The URL's endpoint (no userinfo, query or fragment) or the program alone (not its
    /// arguments, which may carry a token), for logs, errors and the admin API.
    shown: String,
    client: tokio::sync::Mutex<Option<Arc<Client>>>,
    handler: Handler,
    scrubber: Arc<Scrubber>,
    /// The HTTP client for `url`: its resolver refuses internal addresses at every
    /// connection, unless the host is on `tooling.allowed_private_hosts`.
    http: Option<reqwest_mcp::Client>,
}

/// What text from or about one server must not carry: the values it is configured with that
/// are secret by nature (its bearer token, header and environment values, and the values of
/// `--name=value` arguments).
struct Scrubber(Vec<String>);

impl Scrubber {
    fn of(config: &McpServerConfig) -> Scrubber {
        let secrets = std::iter::once(config.bearer_token.as_str())
            .chain(config.headers.values().map(String::as_str))
            .chain(config.env.values().map(String::as_str))
            .chain(
                config
                    .command
                    .iter()
                    .skip(1)
                    .filter_map(|a| a.split_once('=').map(|(_, v)| v)),
            )
            .filter(|s| s.len() >= 6)
            .map(str::to_string)
            .collect();
        Scrubber(secrets)
    }

    /// `text` (an error, a line of the server's standard error) as fit to store, show, log
    /// or hand to a model: the server's secret values replaced, every URL cut to its
    /// endpoint, and redacted.
    fn scrub(&self, text: &str) -> String {
        // The known values first, whole, before the patterns cut the text around them.
        let mut out = std::borrow::Cow::Borrowed(text);
        for secret in &self.0 {
            if out.contains(secret.as_str()) {
                out = std::borrow::Cow::Owned(out.replace(secret.as_str(), "[secret]"));
            }
        }
        crate::redaction::outbound_text(&out)
    }

    /// An error of a call to the server, scrubbed.
    fn error_text(&self, e: &(dyn std::error::Error + 'static)) -> String {
        self.scrub(&crate::redaction::outbound_error(e))
    }
}

/// The configured servers, their connections and the tools they offer now.
pub struct McpTools {
    servers: BTreeMap<String, Server>,
    /// `<server>.<tool>` → its spec, as last listed.
    live: RwLock<BTreeMap<String, McpToolSpec>>,
    /// Bumped after each listing that changed `live`.
    changes: tokio::sync::watch::Sender<u64>,
}

/// The kind of an MCP tool: the config's override, else its annotations — `readOnlyHint`
/// read-only; `idempotentHint` without `destructiveHint` (which defaults to true) and with
/// an undo tool configured compensable; anything else irreversible (an approval first). A
/// server's hints are claims, not guarantees.
pub fn kind_of(
    annotations: Option<&rmcp::model::ToolAnnotations>,
    over: Option<ToolKind>,
    has_undo: bool,
) -> ToolKind {
    if let Some(kind) = over {
        return kind;
    }
    let Some(a) = annotations else {
        return ToolKind::Irreversible;
    };
    if a.read_only_hint == Some(true) {
        ToolKind::ReadOnly
    } else if a.idempotent_hint == Some(true) && a.destructive_hint == Some(false) && has_undo {
        ToolKind::Compensable
    } else {
        ToolKind::Irreversible
    }
}

/// Checks one server's config: exactly one transport, and undo tools only for tools that
/// can be compensable.
pub fn check_config(name: &str, server: &McpServerConfig) -> anyhow::Result<()> {
    match (server.url.is_empty(), server.command.is_empty()) {
        (true, true) => anyhow::bail!("mcp_servers.{name}: set `url` or `command`"),
        (false, false) => anyhow::bail!("mcp_servers.{name}: set `url` or `command`, not both"),
        _ => {}
    }
    if !server.command.is_empty() && (!server.bearer_token.is_empty() || !server.headers.is_empty())
    {
        anyhow::bail!("mcp_servers.{name}: `bearer_token` and `headers` apply to `url` only");
    }
    if server.url.is_empty() && server.command[0].trim().is_empty() {
        anyhow::bail!("mcp_servers.{name}.command: the program is empty");
    }
    for (tool, kind) in &server.kinds {
        if *kind == ToolKind::Compensable && !server.undo.contains_key(tool) {
            anyhow::bail!(
                "mcp_servers.{name}.kinds.{tool}: compensable needs an undo tool in \
                 [mcp_servers.{name}.undo]"
            );
        }
    }
    Ok(())
}

impl McpTools {
    /// Connects to every server and lists its tools; an unreachable server or a refused
    /// listing stops the start-up, naming the server. Watches for changed tool lists.
    pub async fn connect(
        configs: &BTreeMap<String, McpServerConfig>,
        allowed_private_hosts: &[String],
    ) -> anyhow::Result<Arc<Self>> {
        let (changed, mut changed_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut servers = BTreeMap::new();
        for (name, config) in configs {
            check_config(name, config)?;
            let shown = if config.url.is_empty() {
                config.command[0].clone()
            } else {
                crate::redaction::endpoint(&config.url)
            };
            let http = if config.url.is_empty() {
                None
            } else {
                Some(http_client(
                    &config.url,
                    allowed_private_hosts,
                    config.timeout_secs,
                )?)
            };
            servers.insert(
                name.clone(),
                Server {
                    http,
                    config: config.clone(),
                    timeout: Duration::from_secs(config.timeout_secs.max(1)),
                    shown,
                    scrubber: Arc::new(Scrubber::of(config)),
                    client: tokio::sync::Mutex::new(None),
                    handler: Handler {
                        server: name.clone(),
                        changed: changed.clone(),
                    },
                },
            );
        }
        let mcp = Arc::new(McpTools {
            servers,
            live: RwLock::new(BTreeMap::new()),
            changes: tokio::sync::watch::channel(0).0,
        });
        for name in mcp.servers.keys() {
            mcp.client(name)
                .await
                .map_err(|e| anyhow::anyhow!("mcp_servers.{name}: {e}"))?;
        }
        let weak = Arc::downgrade(&mcp);
        tokio::spawn(async move {
            while let Some(server) = changed_rx.recv().await {
                let Some(mcp) = weak.upgrade() else { break };
                tracing::info!(server = %server, "MCP tool list changed; listing again");
                let connected = mcp.servers[&server].client.lock().await.clone();
                if let Some(client) = connected
                    && let Err(e) = mcp.list(&server, &client).await
                {
                    tracing::warn!(server = %server, error = %e, "MCP tools/list failed");
                }
            }
        });
        // A connection that closed (a stdio child that died, a server gone) is opened again
        // here too, not only at the next call, so its notifications are heard meanwhile.
        let weak = Arc::downgrade(&mcp);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RECONNECT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(mcp) = weak.upgrade() else { break };
                for name in mcp.servers.keys() {
                    let slot = mcp.servers[name].client.lock().await.clone();
                    if slot.is_none_or(|c| c.is_transport_closed())
                        && let Err(e) = mcp.client(name).await
                    {
                        tracing::warn!(server = %name, error = %e, "MCP server unreachable");
                    }
                }
            }
        });
        Ok(mcp)
    }

    /// A receiver that sees each change of the tool lists.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The server's connection: the open one, or a new one (then its tools are listed
    /// again) when there is none or it was closed.
    async fn client(&self, name: &str) -> Result<Arc<Client>, String> {
        let server = self
            .servers
            .get(name)
            .ok_or_else(|| format!("no MCP server `{name}` is configured"))?;
        let mut slot = server.client.lock().await;
        if let Some(client) = slot.as_ref()
            && !client.is_transport_closed()
        {
            return Ok(client.clone());
        }
        if slot.take().is_some() {
            tracing::warn!(server = %name, "MCP connection closed; connecting again");
        }
        let client = Arc::new(open(server).await?);
        self.list(name, &client).await?;
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Lists `name`'s tools into the live list; bumps the change counter when it changed.
    async fn list(&self, name: &str, client: &Client) -> Result<(), String> {
        let server = &self.servers[name];
        let listed = tokio::time::timeout(server.timeout, client.list_all_tools())
            .await
            .map_err(|_| "tools/list timed out".to_string())?
            .map_err(|e| format!("tools/list failed: {}", server.scrubber.error_text(&e)))?;
        let config = &server.config;
        let offered: Vec<String> = listed.iter().map(|t| t.name.to_string()).collect();
        let mut specs = BTreeMap::new();
        for tool in listed {
            let tool_name = tool.name.to_string();
            // An undo tool is taken even when the allow list leaves it out.
            let wanted = config.tools.is_empty()
                || config.tools.contains(&tool_name)
                || config.undo.values().any(|u| u == &tool_name);
            if !wanted {
                continue;
            }
            let undo = config
                .undo
                .get(&tool_name)
                .filter(|u| offered.contains(u))
                .cloned();
            let kind = kind_of(
                tool.annotations.as_ref(),
                config.kinds.get(&tool_name).copied(),
                undo.is_some(),
            );
            specs.insert(
                format!("{name}.{tool_name}"),
                McpToolSpec {
                    server: name.to_string(),
                    tool: tool_name,
                    kind,
                    description: tool.description.as_deref().unwrap_or("").to_string(),
                    input_schema: Value::Object((*tool.input_schema).clone()),
                    undo: undo.filter(|_| kind == ToolKind::Compensable),
                },
            );
        }
        let mut live = self.live.write().expect("MCP tool list lock");
        let prefix = format!("{name}.");
        let before: BTreeMap<String, McpToolSpec> = live
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if before != specs {
            live.retain(|k, _| !k.starts_with(&prefix));
            live.extend(specs);
            drop(live);
            self.changes.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// The tool `<server>.<tool>` as offered now.
    pub fn live(&self, name: &str) -> Option<McpToolSpec> {
        self.live
            .read()
            .expect("MCP tool list lock")
            .get(name)
            .cloned()
    }

    /// Whether `<server>.<tool>` is offered now.
    pub fn is_offered(&self, name: &str) -> bool {
        self.live
            .read()
            .expect("MCP tool list lock")
            .contains_key(name)
    }

    /// The names of the tools `server` offers now.
    pub fn live_of(&self, server: &str) -> Vec<String> {
        let prefix = format!("{server}.");
        let live = self.live.read().expect("MCP tool list lock");
        live.keys()
            .filter(|k| k.starts_with(&prefix))
            .cloned()
            .collect()
    }

    pub fn has_server(&self, server: &str) -> bool {
        self.servers.contains_key(server)
    }

    /// Calls `tool` of `server` with `args`, carrying `idempotency_key` in `_meta`. A tool
    /// the server no longer offers is refused; a result with `isError`, or a request the
    /// server refused as invalid, is a permanent failure the model sees; a transport failure
    /// or another server error is worth another try (after connecting again).
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        args: &Value,
        idempotency_key: &str,
        max_bytes: usize,
    ) -> Result<Value, CallError> {
        let full = format!("{server}.{tool}");
        if !self.is_offered(&full) {
            return Err(CallError::permanent(format!(
                "MCP tool `{full}` is no longer offered by server `{server}`"
            )));
        }
        let client = self.client(server).await.map_err(|e| CallError {
            message: format!("MCP server `{server}`: {e}"),
            retryable: true,
        })?;
        let mut params = CallToolRequestParams::new(tool.to_string());
        params.arguments = args.as_object().cloned();
        let mut meta = rmcp::model::MetaObject::default();
        meta.0
            .insert(IDEMPOTENCY_META.into(), json!(idempotency_key));
        // The call's span, for a server that traces (SEP-414: W3C Trace Context in `_meta`).
        if let Some(traceparent) = crate::telemetry::traceparent() {
            meta.set_traceparent(traceparent);
        }
        params.meta = Some(rmcp::model::RequestMetaObject(meta));
        let timeout = self.servers[server].timeout;
        let result = match tokio::time::timeout(timeout, client.call_tool(params)).await {
            Err(_) => {
                return Err(CallError {
                    message: format!("{full} timed out after {timeout:?}"),
                    retryable: true,
                });
            }
            Ok(Err(e)) => return Err(self.classify(server, &full, e).await),
            Ok(Ok(result)) => result,
        };
        let text: Vec<String> = result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect();
        if result.is_error == Some(true) {
            return Err(CallError::permanent(format!(
                "{full} answered an error: {}",
                self.servers[server].scrubber.scrub(&text.join("\n"))
            )));
        }
        let value = result
            .structured_content
            .unwrap_or_else(|| json!({ "text": text.join("\n") }));
        let size = value.to_string().len();
        if size > max_bytes {
            return Err(CallError::permanent(format!(
                "{full} answered {size} bytes, more than tooling.max_response_bytes \
                 ({max_bytes}): refused rather than cut"
            )));
        }
        Ok(value)
    }

    /// What a failed request means: the server refusing the request itself is permanent;
    /// anything else may go better on another try, over a new connection where it closed.
    async fn classify(&self, server: &str, full: &str, e: ServiceError) -> CallError {
        match &e {
            ServiceError::McpError(data)
                if [
                    ErrorCode::INVALID_PARAMS,
                    ErrorCode::METHOD_NOT_FOUND,
                    ErrorCode::INVALID_REQUEST,
                    ErrorCode::PARSE_ERROR,
                ]
                .contains(&data.code) =>
            {
                CallError::permanent(format!(
                    "{full} was refused: {}",
                    self.servers[server].scrubber.scrub(&data.message)
                ))
            }
            ServiceError::McpError(data) => CallError {
                message: format!(
                    "{full} failed: {}",
                    self.servers[server].scrubber.scrub(&data.message)
                ),
                retryable: true,
            },
            _ => {
                // The connection is suspect: the next try opens a new one.
                self.servers[server].client.lock().await.take();
                CallError {
                    message: format!(
                        "{full} failed: {}",
                        self.servers[server].scrubber.error_text(&e)
                    ),
                    retryable: true,
                }
            }
        }
    }
}

/// Opens a connection to `server`, within its timeout.
async fn open(server: &Server) -> Result<Client, String> {
    let config = &server.config;
    let handler = server.handler.clone();
    let timeout = server.timeout;
    let served = if config.command.is_empty() {
        let mut http = StreamableHttpClientTransportConfig::with_uri(config.url.clone());
        if !config.bearer_token.is_empty() {
            http = http.auth_header(config.bearer_token.clone());
        }
        let mut headers = HashMap::new();
        for (name, value) in &config.headers {
            let name = axum::http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| format!("header `{name}`: {e}"))?;
            let value = axum::http::HeaderValue::from_str(value)
                .map_err(|e| format!("header `{name}`: {e}"))?;
            headers.insert(name, value);
        }
        let client = server.http.clone().ok_or("no HTTP client for a URL")?;
        let transport =
            StreamableHttpClientTransport::with_client(client, http.custom_headers(headers));
        tokio::time::timeout(timeout, handler.serve(transport)).await
    } else {
        let transport = spawn(server)?;
        tokio::time::timeout(timeout, handler.serve(transport)).await
    };
    served
        .map_err(|_| format!("no answer from {} in {timeout:?}", server.shown))?
        .map_err(|e| {
            format!(
                "cannot connect to {}: {}",
                server.shown,
                server.scrubber.error_text(&e)
            )
        })
}

/// The HTTP client for an MCP server at `url`: no redirects, no proxy from the environment
/// (it would resolve the name past the guard), and a resolver that keeps public addresses
/// only, unless the host is allowed.
fn http_client(
    url: &str,
    allowed_private_hosts: &[String],
    timeout_secs: u64,
) -> anyhow::Result<reqwest_mcp::Client> {
    let host = reqwest::Url::parse(url)
        .map(|u| super::ssrf::host_of(&u))
        .unwrap_or_default();
    let builder = reqwest_mcp::Client::builder()
        .redirect(reqwest_mcp::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(timeout_secs.max(1)));
    let allowed = allowed_private_hosts
        .iter()
        .any(|h| h.eq_ignore_ascii_case(&host));
    let builder = if allowed {
        builder
    } else {
        builder
            .no_proxy()
            .dns_resolver(Arc::new(super::ssrf::PublicOnlyResolver))
    };
    Ok(builder.build()?)
}

/// Starts a stdio server: its program from the config, an environment of `STDIO_ENV` and
/// its own `env` only, its standard error logged line by line.
fn spawn(server: &Server) -> Result<TokioChildProcess, String> {
    let (name, config) = (&server.handler.server, &server.config);
    let mut command = tokio::process::Command::new(&config.command[0]);
    command.args(&config.command[1..]).env_clear();
    for key in STDIO_ENV {
        if let Some(value) = std::env::var_os(key) {
            command.env(key, value);
        }
    }
    command.envs(&config.env).kill_on_drop(true);
    let (transport, stderr) = TokioChildProcess::builder(command)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!(
                "cannot start `{}`: {}",
                server.shown,
                server.scrubber.error_text(&e)
            )
        })?;
    if let Some(stderr) = stderr {
        let name = name.to_string();
        // Its lines are scrubbed like any text about the server: a server that prints its
        // token or a URL with one puts neither in the log.
        let scrub = server.scrubber.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::info!(server = %name, "mcp server: {}", scrub.scrub(&line));
            }
        });
    }
    Ok(transport)
}

impl McpTools {
    /// The servers, whether each is connected now, and their tools with the kind assistd
    /// gives them (`GET /api/admin/mcp`).
    pub fn describe(&self) -> Value {
        let live = self.live.read().expect("MCP tool list lock").clone();
        let mut servers = Vec::new();
        for (name, server) in &self.servers {
            // Not waited on: a connection being opened (up to `timeout_secs`) shows as not
            // connected rather than holding the admin API up.
            let connected = server
                .client
                .try_lock()
                .is_ok_and(|slot| slot.as_ref().is_some_and(|c| !c.is_transport_closed()));
            let tools: Vec<Value> = live
                .iter()
                .filter(|(_, spec)| &spec.server == name)
                .map(|(full, spec)| {
                    json!({
                        "name": full,
                        "tool": spec.tool,
                        "kind": spec.kind,
                        "undo": spec.undo,
                        "description": spec.description,
                    })
                })
                .collect();
            servers.push(json!({
                "name": name,
                "transport": if server.config.command.is_empty() { "streamable_http" } else { "stdio" },
                "url": if server.config.command.is_empty() { Some(&server.shown) } else { None },
                "command": server.config.command.first(),
                "connected": connected,
                "tools": tools,
            }));
        }
        json!({ "servers": servers })
    }
}

/// A failed MCP call: why, and whether another try may go better.
#[derive(Debug)]
pub struct CallError {
    pub message: String,
    pub retryable: bool,
}

impl CallError {
    fn permanent(message: String) -> Self {
        CallError {
            message,
            retryable: false,
        }
    }
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
    fn kinds_come_from_hints_the_undo_or_the_config() {
        let mut read_only = ToolAnnotations::default();
        read_only.read_only_hint = Some(true);
        let mut destructive = ToolAnnotations::default();
        destructive.destructive_hint = Some(true);
        let mut idempotent = ToolAnnotations::default();
        idempotent.idempotent_hint = Some(true);
        idempotent.destructive_hint = Some(false);
        let mut idempotent_unsaid = ToolAnnotations::default();
        idempotent_unsaid.idempotent_hint = Some(true);
        assert_eq!(kind_of(Some(&read_only), None, false), ToolKind::ReadOnly);
        assert_eq!(
            kind_of(Some(&destructive), None, true),
            ToolKind::Irreversible
        );
        // Idempotent and not destructive: compensable with an undo, else it asks first.
        assert_eq!(
            kind_of(Some(&idempotent), None, true),
            ToolKind::Compensable
        );
        assert_eq!(
            kind_of(Some(&idempotent), None, false),
            ToolKind::Irreversible
        );
        // destructiveHint defaults to true.
        assert_eq!(
            kind_of(Some(&idempotent_unsaid), None, true),
            ToolKind::Irreversible
        );
        assert_eq!(kind_of(None, None, true), ToolKind::Irreversible);
        assert_eq!(
            kind_of(Some(&destructive), Some(ToolKind::ReadOnly), false),
            ToolKind::ReadOnly
        );
        assert_eq!(function_name("desk.lookup"), "desk__lookup");
    }

    #[test]
    fn a_server_needs_one_transport_and_compensable_needs_an_undo() {
        let mut c = McpServerConfig::default();
        assert!(check_config("s", &c).is_err());
        c.url = "http://x/mcp".into();
        c.command = vec!["python3".into()];
        assert!(check_config("s", &c).is_err());
        c.url.clear();
        assert!(check_config("s", &c).is_ok());
        c.bearer_token = "t".into();
        assert!(check_config("s", &c).is_err());
        c.bearer_token.clear();
        c.kinds.insert("create".into(), ToolKind::Compensable);
        let e = check_config("s", &c).unwrap_err().to_string();
        assert!(e.contains("mcp_servers.s.kinds.create"), "{e}");
        c.undo.insert("create".into(), "delete".into());
        assert!(check_config("s", &c).is_ok());
    }

    /// Attack: an MCP URL whose name resolves to an internal address at connection time
    /// (not only at start-up) is refused by the client rmcp is given; the server is never
    /// reached. On the allow list it is.
    #[tokio::test]
    async fn the_mcp_http_client_refuses_internal_addresses_at_each_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!(
            "http://localhost:{}/mcp",
            listener.local_addr().unwrap().port()
        );
        let err = http_client(&url, &[], 2)
            .unwrap()
            .get(&url)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .unwrap_err();
        let chain = format!("{err:?}");
        assert!(chain.contains("internal addresses"), "{chain}");
        assert!(listener.accept().is_err(), "the server was contacted");
        let _ = http_client(&url, &["localhost".into()], 2)
            .unwrap()
            .get(&url)
            .timeout(Duration::from_millis(300))
            .send()
            .await;
        assert!(
            listener.accept().is_ok(),
            "allowed: the server is contacted"
        );
    }
}
