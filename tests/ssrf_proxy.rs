//! Issue 17, item 13: the SSRF guard resolves a tool's host itself and drops internal
//! addresses; an `HTTP(S)_PROXY` from the environment would resolve the name past it. This
//! test sets the proxy variables, which every client built in the process reads, so it is a
//! test binary of its own (one test, one process).

use std::collections::BTreeMap;

use assistd::config::{ToolConfig, ToolingConfig};
use assistd::tools::ToolRegistry;
use serde_json::json;
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::test]
async fn the_guarded_tool_client_ignores_the_proxy_environment() {
    // A proxy on this machine that would happily fetch anything for us.
    let proxy = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"via": "proxy"})))
        .mount(&proxy)
        .await;
    // SAFETY: this binary runs this one test; nothing else reads the environment meanwhile.
    unsafe {
        std::env::set_var("HTTP_PROXY", proxy.uri());
        std::env::set_var("http_proxy", proxy.uri());
        std::env::remove_var("NO_PROXY");
        std::env::remove_var("no_proxy");
    }
    // `localhost` is a name, so the guarded client (not the IP-literal check) handles it; it
    // resolves to loopback, which the guard refuses, unless a proxy resolves it instead.
    let tool: ToolConfig = toml::from_str(
        "kind = \"read_only\"\nmethod = \"GET\"\nurl = \"http://localhost:9/admin\"\n",
    )
    .unwrap();
    let tooling = ToolingConfig {
        allowed_private_hosts: Vec::new(),
        max_response_bytes: 1000,
        read_only_attempts: 1,
        retry_backoff_base_ms: 1,
        retry_backoff_max_ms: 1,
    };
    let registry = ToolRegistry::new(&BTreeMap::from([("t".to_string(), tool)]), &tooling).unwrap();
    let err = registry.call("t", &json!({}), "k").await.unwrap_err();
    assert!(err.message.contains("internal"), "{}", err.message);
    assert!(
        proxy.received_requests().await.unwrap().is_empty(),
        "the request went out through the proxy"
    );
}
