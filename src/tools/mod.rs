//! The tool registry: named HTTP calls declared in config, each with an argument schema and a
//! kind (read-only, compensable, irreversible). Owns argument validation, templating of the
//! request, the SSRF guard and the call itself; never decides retries or approval (the
//! workflow runner does, so both are journalled).

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::config::{HttpCallConfig, ToolConfig, ToolingConfig};

pub mod mcp;
pub mod schema;
mod ssrf;
pub mod task_tools;

use ssrf::PublicOnlyResolver;
pub use ssrf::is_internal;

/// A failed tool call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    pub message: String,
    /// Worth another try (network trouble, 5xx, 429); false for refused or invalid calls.
    pub retryable: bool,
}

impl ToolError {
    pub(crate) fn permanent(message: impl Into<String>) -> Self {
        ToolError {
            message: message.into(),
            retryable: false,
        }
    }
}

pub struct ToolRegistry {
    tools: BTreeMap<String, ToolConfig>,
    /// Each tool's compiled `args_schema`.
    schemas: BTreeMap<String, schema::ArgsSchema>,
    allowed_hosts: HashSet<String>,
    max_response_bytes: usize,
    /// For hosts on the allow list: ordinary resolution.
    open: reqwest::Client,
    /// For everyone else: the resolver drops loopback/link-local/private addresses.
    guarded: reqwest::Client,
    /// Tools of MCP servers, by `<server>.<tool>`.
    mcp: Option<Arc<mcp::McpTools>>,
}

impl ToolRegistry {
    pub fn new(
        tools: &BTreeMap<String, ToolConfig>,
        tooling: &ToolingConfig,
    ) -> anyhow::Result<Self> {
        let open = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        // No proxy from HTTP(S)_PROXY: a proxy would resolve the name past the guard.
        let guarded = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(PublicOnlyResolver))
            .build()?;
        // A filter or method that does not exist fails here, at start, not in a task.
        let sample = crate::templating::tool_sample_context();
        let mut schemas = BTreeMap::new();
        for (name, tool) in tools {
            let calls =
                std::iter::once(("", tool.call())).chain(tool.undo.clone().map(|u| ("undo.", u)));
            for (prefix, call) in calls {
                crate::templating::dry_run_url(&call.url, &sample)
                    .map_err(|e| anyhow::anyhow!("tools.{name}.{prefix}url: {e}"))?;
                let templates = call
                    .headers
                    .iter()
                    .map(|(k, v)| (format!("headers.{k}"), v.clone()))
                    .chain(call.body.iter().map(|b| ("body".to_string(), b.clone())));
                for (field, text) in templates {
                    crate::templating::dry_run_template(&text, &sample)
                        .map_err(|e| anyhow::anyhow!("tools.{name}.{prefix}{field}: {e}"))?;
                }
            }
            let schema = schema::ArgsSchema::compile(&tool.args_schema)
                .map_err(|e| anyhow::anyhow!("tools.{name}.args_schema: {e}"))?;
            schemas.insert(name.clone(), schema);
        }
        Ok(ToolRegistry {
            schemas,
            tools: tools.clone(),
            allowed_hosts: tooling
                .allowed_private_hosts
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
            max_response_bytes: tooling.max_response_bytes,
            open,
            guarded,
            mcp: None,
        })
    }

    /// The SSRF guard for MCP servers, at start-up: each URL must be http(s), and its host
    /// (as named, and every address it resolves to now) not internal, unless the host is on
    /// `tooling.allowed_private_hosts`.
    pub async fn check_mcp_urls(
        &self,
        servers: &BTreeMap<String, crate::config::McpServerConfig>,
    ) -> anyhow::Result<()> {
        for (name, server) in servers.iter().filter(|(_, s)| !s.url.is_empty()) {
            let url = reqwest::Url::parse(&server.url)
                .map_err(|e| anyhow::anyhow!("mcp_servers.{name}.url is not a URL: {e}"))?;
            if !matches!(url.scheme(), "http" | "https") {
                anyhow::bail!("mcp_servers.{name}.url must be http or https");
            }
            let host = ssrf::host_of(&url);
            if self.allowed_hosts.contains(&host) {
                continue;
            }
            let port = url.port_or_known_default().unwrap_or(80);
            let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
                Ok(ip) => vec![ip],
                Err(_) => tokio::net::lookup_host((host.as_str(), port))
                    .await
                    .map_err(|e| anyhow::anyhow!("mcp_servers.{name}: cannot resolve {host}: {e}"))?
                    .map(|a| a.ip())
                    .collect(),
            };
            if let Some(ip) = addrs.into_iter().find(|ip| is_internal(*ip)) {
                anyhow::bail!(
                    "mcp_servers.{name}: refusing internal address {ip} of {host} (add the host \
                     to tooling.allowed_private_hosts)"
                );
            }
        }
        Ok(())
    }

    /// Adds the tools of connected MCP servers (a name taken by a configured tool is
    /// refused). Tasks see them through the specs pinned in
    /// their agent version (`resolve_mcp`, `TaskTools`).
    pub fn with_mcp(mut self, mcp: Arc<mcp::McpTools>) -> anyhow::Result<Self> {
        if let Some(taken) = self.tools.keys().find(|n| mcp.is_offered(n)) {
            anyhow::bail!("MCP tool `{taken}` has the name of a configured tool");
        }
        self.mcp = Some(mcp);
        Ok(self)
    }

    pub fn mcp(&self) -> Option<&Arc<mcp::McpTools>> {
        self.mcp.as_ref()
    }

    /// The MCP servers and their tools, for the admin API (`{"servers": []}` without any).
    pub fn mcp_servers(&self) -> Value {
        match &self.mcp {
            Some(m) => m.describe(),
            None => json!({ "servers": [] }),
        }
    }

    /// The MCP tools a workflow names (`tool` of tool nodes, `tools` of agent nodes, with
    /// `<server>.*` for all of a server's), as offered now, with their undo tools: what an
    /// agent version pins. Names that are not MCP tools are left to the workflow's checks.
    pub fn resolve_mcp(
        &self,
        workflow: Option<&Value>,
    ) -> BTreeMap<String, crate::definition::McpToolSpec> {
        let mut out = BTreeMap::new();
        let (Some(mcp), Some(workflow)) = (&self.mcp, workflow) else {
            return out;
        };
        let nodes = workflow["nodes"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let named = nodes.iter().flat_map(|n| {
            let one = n["tool"].as_str().into_iter();
            let many = n["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str);
            one.chain(many)
        });
        for name in named {
            let names = match name.strip_suffix(".*") {
                Some(server) => mcp.live_of(server),
                None => vec![name.to_string()],
            };
            for name in names {
                if let Some(spec) = mcp.live(&name) {
                    let undo = spec.undo.as_ref().map(|u| format!("{}.{u}", spec.server));
                    if let Some(undo) = undo.and_then(|u| mcp.live(&u).map(|s| (u, s))) {
                        out.insert(undo.0, undo.1);
                    }
                    out.insert(name, spec);
                }
            }
        }
        out
    }

    /// Whether `server` is a configured MCP server.
    pub fn is_mcp_server(&self, server: &str) -> bool {
        self.mcp.as_ref().is_some_and(|m| m.has_server(server))
    }

    pub fn get(&self, name: &str) -> Option<&ToolConfig> {
        self.tools.get(name)
    }

    /// Checks `args` against configured tool `name`'s `args_schema`.
    pub fn check_args(&self, name: &str, args: &Value) -> Result<(), String> {
        match self.schemas.get(name) {
            Some(schema) => schema.check(args),
            None => Err(format!("no tool named `{name}`")),
        }
    }

    /// Calls configured tool `name` with validated `args`, carrying `idempotency_key`.
    #[tracing::instrument(
        name = "tool",
        skip_all,
        fields(tool = %name, key = %idempotency_key, otel.kind = "client")
    )]
    pub async fn call(
        &self,
        name: &str,
        args: &Value,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        let tool = self
            .tools
            .get(name)
            .ok_or_else(|| ToolError::permanent(format!("no tool named `{name}`")))?;
        self.check_args(name, args)
            .map_err(|e| ToolError::permanent(format!("invalid arguments for `{name}`: {e}")))?;
        let context = json!({ "args": args });
        self.http(
            &tool.call(),
            &context,
            args,
            tool.timeout_secs,
            idempotency_key,
        )
        .await
    }

    /// Calls `tool` of MCP server `server` (a tool pinned in the task's agent version).
    #[tracing::instrument(
        name = "mcp_tool",
        skip_all,
        fields(server = %server, tool = %tool, key = %idempotency_key, otel.kind = "client")
    )]
    pub async fn call_mcp(
        &self,
        server: &str,
        tool: &str,
        args: &Value,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        let mcp = self.mcp.as_ref().ok_or_else(|| {
            ToolError::permanent(format!("MCP server `{server}` is not configured"))
        })?;
        mcp.call(server, tool, args, idempotency_key, self.max_response_bytes)
            .await
            .map_err(|e| ToolError {
                message: e.message,
                retryable: e.retryable,
            })
    }

    /// Runs the undo call of compensable tool `name` for a call that returned `result`.
    pub async fn undo(
        &self,
        name: &str,
        args: &Value,
        result: &Value,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        let tool = self
            .tools
            .get(name)
            .ok_or_else(|| ToolError::permanent(format!("no tool named `{name}`")))?;
        let undo = tool
            .undo
            .as_ref()
            .ok_or_else(|| ToolError::permanent(format!("tool `{name}` has no undo call")))?;
        let context = json!({ "args": args, "result": result });
        self.http(undo, &context, args, tool.timeout_secs, idempotency_key)
            .await
    }

    async fn http(
        &self,
        call: &HttpCallConfig,
        context: &Value,
        args: &Value,
        timeout_secs: u64,
        idempotency_key: &str,
    ) -> Result<Value, ToolError> {
        let url = tool_url(call, context)?;
        let client = self.client_for(&url)?;
        let method = reqwest::Method::from_bytes(call.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| ToolError::permanent(format!("bad HTTP method `{}`", call.method)))?;
        let mut request = client
            .request(method.clone(), url)
            .timeout(Duration::from_secs(timeout_secs))
            .header("idempotency-key", idempotency_key);
        if let Some(traceparent) = crate::telemetry::traceparent() {
            request = request.header("traceparent", traceparent);
        }
        for (name, value) in &call.headers {
            request = request.header(name.as_str(), render(value, context)?);
        }
        match &call.body {
            Some(template) => {
                request = request
                    .header("content-type", "application/json")
                    .body(render(template, context)?)
            }
            None if method != reqwest::Method::GET => request = request.json(args),
            None => {}
        }
        let response = request.send().await.map_err(|e| {
            let message = format!("tool call failed: {}", crate::redaction::http_error(e));
            // A refusal by the SSRF guard will not change on retry.
            let refused = message.contains("internal addresses");
            ToolError {
                message,
                retryable: !refused,
            }
        })?;
        let status = response.status();
        // Read as it streams in, up to the cap, and kept whole; past the cap the call fails
        // (a cut JSON body would be read as something else).
        let too_large = |seen: u64| {
            ToolError::permanent(format!(
                "tool response is larger than tooling.max_response_bytes ({} bytes; {seen} or \
                 more came): refused rather than cut",
                self.max_response_bytes
            ))
        };
        if let Some(length) = response.content_length()
            && length > self.max_response_bytes as u64
        {
            return Err(too_large(length));
        }
        let mut response = response;
        let mut bytes: Vec<u8> = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    bytes.extend_from_slice(&chunk);
                    if bytes.len() > self.max_response_bytes {
                        return Err(too_large(bytes.len() as u64));
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(ToolError {
                        message: format!(
                            "tool response unreadable: {}",
                            crate::redaction::http_error(e)
                        ),
                        retryable: true,
                    });
                }
            }
        }
        let body = &bytes[..];
        let value = serde_json::from_slice::<Value>(body)
            .unwrap_or_else(|_| json!({ "text": String::from_utf8_lossy(body) }));
        if !status.is_success() {
            return Err(ToolError {
                message: format!(
                    "tool answered HTTP {}: {}",
                    status.as_u16(),
                    crate::domain::truncate(&value.to_string(), 300)
                ),
                retryable: status.is_server_error() || status.as_u16() == 429,
            });
        }
        Ok(value)
    }

    /// The client allowed to reach `url`: IP literals are checked here, names by the
    /// guarded resolver, unless the host is on the allow list.
    fn client_for(&self, url: &reqwest::Url) -> Result<&reqwest::Client, ToolError> {
        if url.host_str().is_none() {
            return Err(ToolError::permanent("tool URL has no host"));
        }
        let host = ssrf::host_of(url);
        if self.allowed_hosts.contains(&host) {
            return Ok(&self.open);
        }
        if let Ok(ip) = host.parse::<IpAddr>()
            && is_internal(ip)
        {
            return Err(ToolError::permanent(format!(
                "refusing to call internal address {ip} (add it to tooling.allowed_private_hosts)"
            )));
        }
        Ok(&self.guarded)
    }
}

/// Renders a `{{ ... }}` template; plain strings pass through unchanged.
pub fn render(template: &str, context: &Value) -> Result<String, ToolError> {
    crate::templating::render(template, context)
        .map_err(|e| ToolError::permanent(format!("template `{template}`: {e}")))
}

/// The URL a call of `call` goes to, rendered over `context`; an error shows the configured
/// URL only as its endpoint (its query may hold a key).
fn tool_url(call: &HttpCallConfig, context: &Value) -> Result<reqwest::Url, ToolError> {
    let url = crate::templating::render_url(&call.url, context).map_err(|e| {
        let shown = crate::redaction::endpoint(&call.url);
        ToolError::permanent(format!("tool URL `{shown}`: {e}"))
    })?;
    let url = reqwest::Url::parse(&url).map_err(|e| {
        let shown = crate::redaction::endpoints_only(&url).into_owned();
        ToolError::permanent(format!("tool URL `{shown}` is invalid: {e}"))
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(ToolError::permanent("tool URLs must be http or https"));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_ranges() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "100.64.0.1",
            // Attack forms (issue 17, item 13): the internal address inside an IPv6 one, and
            // ranges that are not private but not public either.
            "::127.0.0.1",
            "::10.0.0.1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "2002:c0a8:101::1",
            "198.18.0.1",
            "198.19.255.255",
            "240.0.0.1",
            "255.255.255.254",
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "2606:4700::1111",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "198.20.0.1",
        ] {
            assert!(!is_internal(ip.parse().unwrap()), "{ip}");
        }
    }

    fn registry(url: &str, allowed: &[&str]) -> ToolRegistry {
        let tool: ToolConfig = toml::from_str(&format!(
            "kind = \"read_only\"\nmethod = \"GET\"\nurl = \"{url}\"\n"
        ))
        .unwrap();
        let tooling = ToolingConfig {
            allowed_private_hosts: allowed.iter().map(|s| s.to_string()).collect(),
            max_response_bytes: 1000,
            read_only_attempts: 1,
            retry_backoff_base_ms: 1,
            retry_backoff_max_ms: 1,
        };
        ToolRegistry::new(&BTreeMap::from([("t".to_string(), tool)]), &tooling).unwrap()
    }

    /// Attack (issue 17, item 13): a tool host that never ends its response. Reading stops
    /// at the cap, so the call returns at once instead of buffering until the timeout, and
    /// it fails (issue 19: a cut body is never passed on as if it were the response).
    #[tokio::test]
    async fn an_endless_tool_response_is_refused_at_the_cap() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 1024];
            let _ = socket.read(&mut request).await;
            let head =
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let chunk = format!("{:x}\r\n{}\r\n", 512, "x".repeat(512));
            while socket.write_all(chunk.as_bytes()).await.is_ok() {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
        // Buffering the whole body would run into the tool's timeout and fail the call.
        let err = registry(&format!("http://127.0.0.1:{port}/x"), &["127.0.0.1"])
            .call("t", &json!({}), "k")
            .await
            .unwrap_err();
        assert!(
            err.message.contains("tooling.max_response_bytes"),
            "{}",
            err.message
        );
        assert!(!err.retryable);
    }

    /// A response up to the cap is kept whole, JSON intact.
    #[tokio::test]
    async fn a_response_up_to_the_cap_is_kept_whole() {
        use wiremock::{Mock, MockServer, ResponseTemplate, matchers::method};
        let server = MockServer::start().await;
        let items: Vec<String> = (0..80).map(|i| format!("{i:08}")).collect();
        let body = json!({ "items": items });
        assert!(body.to_string().len() <= 1000);
        Mock::given(method("GET"))
            .respond_with(ResponseTemplate::new(200).set_body_json(body.clone()))
            .mount(&server)
            .await;
        let out = registry(&format!("{}/x", server.uri()), &["127.0.0.1"])
            .call("t", &json!({}), "k")
            .await
            .unwrap();
        assert_eq!(out, body);
    }

    #[tokio::test]
    async fn internal_addresses_are_refused_unless_allowed() {
        use wiremock::{Mock, MockServer, ResponseTemplate, matchers::method};
        let server = MockServer::start().await;
        Mock::given(method("GET"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!({"ok": true})))
            .mount(&server)
            .await;
        let port = server.address().port();
        for url in [
            format!("http://127.0.0.1:{port}/x"),
            format!("http://localhost:{port}/x"),
            format!("http://[::1]:{port}/x"),
        ] {
            let err = registry(&url, &[])
                .call("t", &json!({}), "k")
                .await
                .unwrap_err();
            assert!(
                err.message.contains("internal") || err.message.contains("127.0.0.1"),
                "{url}: {err}"
            );
        }
        assert!(
            server.received_requests().await.unwrap().is_empty(),
            "nothing reached the server"
        );
        let ok = registry(&format!("http://127.0.0.1:{port}/x"), &["127.0.0.1"])
            .call("t", &json!({}), "key-1")
            .await
            .unwrap();
        assert_eq!(ok["ok"], true);
        let req = &server.received_requests().await.unwrap()[0];
        assert_eq!(req.headers.get("idempotency-key").unwrap(), "key-1");
    }

    #[test]
    fn templates_render_over_args() {
        let ctx = json!({"args": {"id": "T-1"}});
        assert_eq!(
            render("https://x/t/{{ args.id }}", &ctx).unwrap(),
            "https://x/t/T-1"
        );
        assert_eq!(render("plain", &ctx).unwrap(), "plain");
        assert!(render("{{ args.missing }}", &ctx).is_err());
    }
}
