//! The tool registry: named HTTP calls declared in config, each with an argument schema and a
//! kind (read-only, compensable, irreversible). Owns argument validation, templating of the
//! request, the SSRF guard and the call itself; never decides retries or approval (the
//! workflow runner does, so both are journalled).

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::config::{HttpCallConfig, ToolConfig, ToolingConfig};

pub mod schema;

/// A failed tool call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    pub message: String,
    /// Worth another try (network trouble, 5xx, 429); false for refused or invalid calls.
    pub retryable: bool,
}

impl ToolError {
    fn permanent(message: impl Into<String>) -> Self {
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
}

impl ToolRegistry {
    pub fn new(
        tools: &BTreeMap<String, ToolConfig>,
        tooling: &ToolingConfig,
    ) -> anyhow::Result<Self> {
        let open = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let guarded = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
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
        })
    }

    pub fn get(&self, name: &str) -> Option<&ToolConfig> {
        self.tools.get(name)
    }

    /// Checks `args` against tool `name`'s `args_schema`.
    pub fn check_args(&self, name: &str, args: &Value) -> Result<(), String> {
        match self.schemas.get(name) {
            Some(schema) => schema.check(args),
            None => Err(format!("no tool named `{name}`")),
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tools.keys()
    }

    /// The functions offered to the model for `names`, for an agent loop.
    pub fn function_specs(&self, names: &[String]) -> Vec<crate::llm::ToolSpec> {
        names
            .iter()
            .filter_map(|n| self.tools.get(n).map(|t| (n, t)))
            .map(|(name, tool)| crate::llm::ToolSpec {
                name: name.clone(),
                description: tool.description.clone(),
                parameters: tool.args_schema.clone(),
            })
            .collect()
    }

    /// Calls tool `name` with validated `args`, carrying `idempotency_key`.
    #[tracing::instrument(skip_all, fields(tool = %name, key = %idempotency_key))]
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
        let url = crate::templating::render_url(&call.url, context)
            .map_err(|e| ToolError::permanent(format!("tool URL `{}`: {e}", call.url)))?;
        let url = reqwest::Url::parse(&url)
            .map_err(|e| ToolError::permanent(format!("tool URL `{url}` is invalid: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ToolError::permanent("tool URLs must be http or https"));
        }
        let client = self.client_for(&url)?;
        let method = reqwest::Method::from_bytes(call.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| ToolError::permanent(format!("bad HTTP method `{}`", call.method)))?;
        let mut request = client
            .request(method.clone(), url)
            .timeout(Duration::from_secs(timeout_secs))
            .header("idempotency-key", idempotency_key);
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
        let bytes = response.bytes().await.map_err(|e| ToolError {
            message: format!(
                "tool response unreadable: {}",
                crate::redaction::http_error(e)
            ),
            retryable: true,
        })?;
        let body = &bytes[..bytes.len().min(self.max_response_bytes)];
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
        let host = url
            .host_str()
            .ok_or_else(|| ToolError::permanent("tool URL has no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
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

/// Loopback, link-local, private, unique-local, unspecified, multicast or broadcast.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.octets()[0] == 0
                // 100.64.0.0/10, carrier-grade NAT
                || (v4.octets()[0] == 100 && (v4.octets()[1] & 0xc0) == 64)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_internal(IpAddr::V4(v4));
            }
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unique_local()
                || v6.is_unicast_link_local()
        }
    }
}

/// Resolves names and keeps only public addresses, so a tool cannot be pointed at the
/// internal network through DNS.
struct PublicOnlyResolver;

impl reqwest::dns::Resolve for PublicOnlyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let host = name.as_str().to_string();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| !is_internal(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(format!(
                    "{host} resolves only to internal addresses (add it to tooling.allowed_private_hosts)"
                )
                .into());
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
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
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111"] {
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
