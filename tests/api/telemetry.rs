//! OpenTelemetry traces over OTLP/HTTP (`[telemetry]`, issue 23), with the real binary and
//! a collector stand-in that decodes what it is sent with the OTLP protobuf definitions
//! (`opentelemetry-proto`) and refuses what a collector refuses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message;

use crate::binary::{RealServer, server_envs};
use crate::helpers::*;

/// One span as the collector got it; ids in lower-case hex.
#[derive(Debug, Clone)]
pub struct Got {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent: String,
    pub attributes: HashMap<String, String>,
    pub service: String,
}

/// An OTLP/HTTP trace receiver on 127.0.0.1: `POST /v1/traces` with a protobuf
/// `ExportTraceServiceRequest` (anything else is refused: 415 for another content type, 400
/// for a body that does not decode or a span id of the wrong length).
pub struct Collector {
    pub url: String,
    spans: Arc<Mutex<Vec<Got>>>,
    /// Every export request as decoded, whole (events, statuses, resource): for searching.
    raw: Arc<Mutex<String>>,
    stop: tokio::sync::oneshot::Sender<()>,
}

fn text(value: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(n)) => n.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attributes(list: &[KeyValue]) -> HashMap<String, String> {
    list.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What the receiver makes of one export request.
fn decode(headers: &HeaderMap, body: &[u8]) -> Result<(Vec<Got>, String), (StatusCode, String)> {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type != "application/x-protobuf" {
        return Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("content type `{content_type}`"),
        ));
    }
    let request = ExportTraceServiceRequest::decode(body)
        .map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    let raw = format!("{request:?}");
    let mut got = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .and_then(|a| a.get("service.name").cloned())
            .unwrap_or_default();
        for span in resource.scope_spans.into_iter().flat_map(|s| s.spans) {
            let bad = span.trace_id.len() != 16
                || span.span_id.len() != 8
                || !(span.parent_span_id.is_empty() || span.parent_span_id.len() == 8);
            if bad {
                return Err((StatusCode::BAD_REQUEST, format!("bad ids in {span:?}")));
            }
            got.push(Got {
                name: span.name.clone(),
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent: hex(&span.parent_span_id),
                attributes: attributes(&span.attributes),
                service: service.clone(),
            });
        }
    }
    Ok((got, raw))
}

impl Collector {
    pub async fn start() -> Collector {
        let spans: Arc<Mutex<Vec<Got>>> = Arc::default();
        let raw: Arc<Mutex<String>> = Arc::default();
        let (kept, kept_raw) = (spans.clone(), raw.clone());
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let (kept, kept_raw) = (kept.clone(), kept_raw.clone());
                async move {
                    match decode(&headers, &body) {
                        Ok((got, raw)) => {
                            kept.lock().unwrap().extend(got);
                            kept_raw.lock().unwrap().push_str(&raw);
                            let answer = ExportTraceServiceResponse::default().encode_to_vec();
                            (
                                StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                answer,
                            )
                        }
                        Err((status, why)) => {
                            (status, [("content-type", "text/plain")], why.into_bytes())
                        }
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Collector {
            url,
            spans,
            raw,
            stop,
        }
    }

    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Everything exported so far, as decoded (span events included).
    pub fn raw(&self) -> String {
        self.raw.lock().unwrap().clone()
    }

    pub fn stop(self) {
        let _ = self.stop.send(());
    }
}

/// The stand-in refuses what a collector refuses, so spans it shows were sent right.
#[tokio::test]
async fn the_collector_stand_in_refuses_what_a_collector_refuses() {
    let collector = Collector::start().await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/traces", collector.url);
    let json = http
        .post(&url)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(json.status(), 415);
    let junk = http
        .post(&url)
        .header("content-type", "application/x-protobuf")
        .body(vec![0xff, 0xff, 0xff])
        .send()
        .await
        .unwrap();
    assert_eq!(junk.status(), 400);
    assert!(collector.spans().is_empty());
    collector.stop();
}

async fn wait_for_replies(receiver: &wiremock::MockServer, n: usize) {
    let deadline = Instant::now() + WAIT;
    while received_replies(receiver).await.len() < n {
        assert!(Instant::now() < deadline, "no reply from the binary");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A message's whole way is one trace: the webhook continues the caller's `traceparent`,
/// and intake, the claim, the step, the model call and the delivery follow it across the
/// database, each span with the task id; the model is told the model call's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_one_trace_from_webhook_to_delivery() {
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let collector = Collector::start().await;
    let db = TestDb::new().await;
    let workdir = tempfile::tempdir().unwrap();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[
            ("ASSISTD_TELEMETRY__OTLP_ENDPOINT", &collector.url),
            ("ASSISTD_TELEMETRY__SERVICE_NAME", "assistd-under-test"),
        ],
    );
    let server = RealServer::start(&envs, workdir.path()).await;
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let resp = server
        .post_message_with(
            &message("otel", 1, "trace me"),
            &[(
                "traceparent",
                &format!("00-{caller_trace}-{caller_span}-01"),
            )],
        )
        .await;
    let id = task_id_of(resp).await.to_string();
    // A malformed traceparent is ignored: that message starts a trace of its own.
    let junk = server
        .post_message_with(&message("otel", 2, "junk"), &[("traceparent", "00-zz-1")])
        .await;
    let junk_id = task_id_of(junk).await.to_string();
    // Attack (issue 32): an unverified caller's traceparent is not continued: a request with
    // a bad signature exports no span in the trace it names.
    let forged_trace = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e";
    let unverified = reqwest::Client::new()
        .post(format!("{}/webhooks/generic", server.addr))
        .header(
            "traceparent",
            format!("00-{forged_trace}-00f067aa0ba902b7-01"),
        )
        .header(
            "X-Assistd-Timestamp",
            (assistd::domain::now_ms() / 1000).to_string(),
        )
        .header("X-Assistd-Signature", "v1=00")
        .body(serde_json::to_vec(&message("otel", 3, "forged")).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(unverified.status(), 401);
    wait_for_replies(&receiver, 2).await;
    // SIGTERM flushes the spans still buffered.
    assert_eq!(server.terminate(), Some(0));

    let spans = collector.spans();
    assert!(
        spans.iter().all(|s| s.trace_id != forged_trace),
        "an unverified caller chose a trace: {spans:#?}"
    );
    let junk_webhook = spans
        .iter()
        .find(|s| s.name == "webhook" && s.attributes.get("task_id") == Some(&junk_id))
        .unwrap_or_else(|| panic!("{spans:#?}"));
    assert!(junk_webhook.parent.is_empty(), "{junk_webhook:?}");
    assert_ne!(junk_webhook.trace_id, caller_trace);
    let named = |name: &str| -> Got {
        spans
            .iter()
            .find(|s| s.name == name && s.trace_id == caller_trace)
            .unwrap_or_else(|| panic!("no `{name}` span in {spans:#?}"))
            .clone()
    };
    let by_id: HashMap<&str, &Got> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let parent_name = |s: &Got| by_id.get(s.parent.as_str()).map(|p| p.name.clone());
    let webhook = named("webhook");
    assert_eq!(
        webhook.parent, caller_span,
        "the caller's span is the parent"
    );
    for name in ["webhook", "intake", "claim", "step", "chat", "reply"] {
        let span = named(name);
        assert_eq!(span.trace_id, caller_trace, "`{name}` is in another trace");
        assert_eq!(span.service, "assistd-under-test");
        if name != "chat" {
            assert_eq!(span.attributes.get("task_id"), Some(&id), "{span:?}");
        }
    }
    assert_eq!(parent_name(&named("intake")).as_deref(), Some("webhook"));
    // The claim and the delivery continue the trace from what intake stored.
    assert_eq!(parent_name(&named("claim")).as_deref(), Some("intake"));
    assert_eq!(parent_name(&named("reply")).as_deref(), Some("intake"));
    assert_eq!(parent_name(&named("step")).as_deref(), Some("claim"));
    let chat = named("chat");
    assert_eq!(parent_name(&chat).as_deref(), Some("step"));

    // The model was told the model call's span.
    let calls = model.received_requests().await.unwrap();
    let traceparent = calls[0].headers["traceparent"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        traceparent,
        format!("00-{caller_trace}-{}-01", chat.span_id),
        "{chat:?}"
    );
    collector.stop();
    db.drop_db().await;
}

/// A collector that is down costs the chat user nothing: the message is answered, and the
/// process still stops cleanly (the export gives up after its timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_does_not_hold_up_answers_or_shutdown() {
    // Issue 32: the endpoint's credentials and the exporter's header reach no log line,
    // the exporter's own error lines included.
    const PASS: &str = "OTLPPASSsecret4771";
    const HEADER: &str = "OTLPHEADERsecret4772";
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let db = TestDb::new().await;
    let workdir = tempfile::tempdir().unwrap();
    let closed = format!(
        "http://otel:{PASS}@127.0.0.1:{}",
        crate::binary::free_port()
    );
    let config = workdir.path().join("otel.toml");
    std::fs::write(
        &config,
        format!("[telemetry.headers]\nx-collector-key = \"{HEADER}\"\n"),
    )
    .unwrap();
    let config = config.display().to_string();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[
            ("ASSISTD_CONFIG", &config),
            ("ASSISTD_TELEMETRY__OTLP_ENDPOINT", &closed),
            ("ASSISTD_TELEMETRY__EXPORT_TIMEOUT_SECS", "1"),
            // Every line the exporter and its HTTP client write, too.
            ("ASSISTD_LOG__LEVEL", "debug"),
        ],
    );
    let server = RealServer::start(&envs, workdir.path()).await;
    let resp = server.post_message(&message("otel-down", 1, "hi")).await;
    task_id_of(resp).await;
    wait_for_replies(&receiver, 1).await;
    assert_eq!(server.terminate(), Some(0));
    let log = std::fs::read_to_string(workdir.path().join("assistd.log")).unwrap();
    for secret in [PASS, HEADER] {
        assert!(!log.contains(secret), "the log holds {secret}: {log}");
    }
    db.drop_db().await;
}

/// A bad endpoint or timeout is refused at start-up, naming the key.
#[test]
fn bad_telemetry_settings_are_refused_naming_the_key() {
    let load = |pairs: &[(&str, &str)]| {
        let env: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assistd::config::Config::load_with_env(None, env)
    };
    assert!(
        load(&[]).unwrap().telemetry.otlp_endpoint.is_empty(),
        "off by default"
    );
    let err = load(&[("ASSISTD_TELEMETRY__OTLP_ENDPOINT", "collector:4318")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("telemetry.otlp_endpoint"), "{err}");
    let err = load(&[
        ("ASSISTD_TELEMETRY__OTLP_ENDPOINT", "http://collector:4318"),
        ("ASSISTD_TELEMETRY__EXPORT_TIMEOUT_SECS", "0"),
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("telemetry.export_timeout_secs"), "{err}");
    assert_eq!(
        assistd::telemetry::traces_url("http://c:4318/"),
        "http://c:4318/v1/traces"
    );
    assert_eq!(
        assistd::telemetry::traces_url("http://c:4318/v1/traces"),
        "http://c:4318/v1/traces"
    );
}

/// The `traceparent` of each request in `requests`: (trace id, parent span id).
fn traceparents(requests: &[wiremock::Request]) -> Vec<(String, String)> {
    requests
        .iter()
        .map(|r| {
            let value = r
                .headers
                .get("traceparent")
                .unwrap_or_else(|| panic!("no traceparent on {}", r.url))
                .to_str()
                .unwrap();
            let parts: Vec<&str> = value.split('-').collect();
            assert_eq!(
                (parts.len(), parts[0], parts[3]),
                (4, "00", "01"),
                "{value}"
            );
            (parts[1].to_string(), parts[2].to_string())
        })
        .collect()
}

/// The workflow of [`every_model_and_tool_call_carries_its_span`]: an agent loop over
/// three HTTP tools, then a call of the FastMCP server's `desk.lookup`.
const LOOP_THEN_MCP: &str = r#"{"start": "loop", "nodes": [
  {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["lookup_a", "lookup_b", "lookup_c"], "max_steps": 6, "next": "desk"},
  {"id": "desk", "type": "tool", "tool": "desk.lookup", "args": {"ticket": "T-1"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#;

/// A workflow: every model call, HTTP tool call and MCP tool call names its own span (a
/// `chat`, `tool` or `mcp_tool` span under a `step` of the task's claim) in the message's
/// trace: the first two in a `traceparent` header, the MCP call in `_meta` (SEP-414), as
/// the reference MCP SDK's server reads it.
#[cfg_attr(
    not(assistd_has_mcp),
    ignore = "needs the MCP SDK (pip install 'mcp>=1.9,<2'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_model_and_tool_call_carries_its_span() {
    use crate::workflows::{ToolScriptModel, overlay, tool_server};
    let mcp = crate::mcp::McpServer::start().await;
    let model = wiremock::MockServer::start().await;
    model_mock(ToolScriptModel::default()).mount(&model).await;
    let tools = tool_server().await;
    let receiver = accepting_receiver().await;
    let collector = Collector::start().await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let wf = dir.path().join("flow.json");
    std::fs::write(&wf, LOOP_THEN_MCP).unwrap();
    let config = dir.path().join("overlay.toml");
    let toml = format!("{}\n{}", overlay(&tools.uri(), &wf), mcp.toml());
    std::fs::write(&config, toml).unwrap();
    let config = config.display().to_string();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[
            ("ASSISTD_CONFIG", &config),
            ("ASSISTD_TELEMETRY__OTLP_ENDPOINT", &collector.url),
        ],
    );
    let server = RealServer::start(&envs, dir.path()).await;
    let id = task_id_of(server.post_message(&message("otel-wf", 1, "look up")).await)
        .await
        .to_string();
    wait_for_replies(&receiver, 1).await;
    assert_eq!(server.terminate(), Some(0));

    let spans = collector.spans();
    let by_id: HashMap<&str, &Got> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let trace = &spans
        .iter()
        .find(|s| s.name == "webhook")
        .unwrap_or_else(|| panic!("{spans:#?}"))
        .trace_id;
    let model_calls = traceparents(&model.received_requests().await.unwrap());
    let tool_calls = traceparents(&tools.received_requests().await.unwrap());
    let mcp_calls: Vec<(String, String)> = mcp
        .calls()
        .iter()
        .map(|line| {
            let value = line
                .split(" traceparent=")
                .nth(1)
                .unwrap_or_else(|| panic!("no traceparent in _meta: {line}"));
            let parts: Vec<&str> = value.split('-').collect();
            (parts[1].to_string(), parts[2].to_string())
        })
        .collect();
    assert!(!model_calls.is_empty());
    assert_eq!(
        tool_calls.len(),
        3,
        "lookup_a, lookup_b and lookup_c, once each"
    );
    assert_eq!(mcp_calls.len(), 1, "{:?}", mcp.calls());
    for (calls, kind) in [
        (&model_calls, "chat"),
        (&tool_calls, "tool"),
        (&mcp_calls, "mcp_tool"),
    ] {
        for (trace_id, span_id) in calls {
            assert_eq!(trace_id, trace, "a {kind} call outside the message's trace");
            let span = by_id
                .get(span_id.as_str())
                .unwrap_or_else(|| panic!("the {kind} call names span {span_id}, never exported"));
            assert_eq!(span.name, kind);
            let step = by_id[span.parent.as_str()];
            assert_eq!(step.name, "step");
            assert_eq!(step.attributes["task_id"], id);
            assert_eq!(by_id[step.parent.as_str()].name, "claim");
        }
    }
    collector.stop();
    db.drop_db().await;
}

/// Issue 32, part 3, with the real binary: a tool whose URL holds credentials and a key in
/// its query fails, with traces exported to a collector that needs a header of its own. Its
/// error reaches neither the log nor any exported span (the events of the spans included)
/// with a secret, nor does the collector's header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_call_puts_no_secret_in_the_log_or_the_exported_spans() {
    use crate::workflows::{overlay, tool_server};
    const PASS: &str = "SPANPASSsecret4751";
    const QUERY: &str = "SPANQUERYsecret4752";
    const OTLP: &str = "OTLPHEADERsecret4753";
    let model = echo_model().await;
    let tools = tool_server().await;
    let receiver = accepting_receiver().await;
    let collector = Collector::start().await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let wf = dir.path().join("flow.json");
    std::fs::write(
        &wf,
        r#"{"start": "look", "nodes": [
  {"id": "look", "type": "tool", "tool": "lookup_a", "args": {"q": "x"}, "next": "done"},
  {"id": "done", "type": "reply", "text": "{{ steps.look.value }}"}]}"#,
    )
    .unwrap();
    let leaky = format!("http://tooluser:{PASS}@127.0.0.1:9/tools/a?token={QUERY}");
    let toml = overlay(&tools.uri(), &wf).replace(&format!("{}/tools/a", tools.uri()), &leaky)
        + &format!("\n[telemetry.headers]\nx-collector-key = \"{OTLP}\"\n");
    assert!(toml.contains(QUERY));
    let config = dir.path().join("overlay.toml");
    std::fs::write(&config, toml).unwrap();
    let config = config.display().to_string();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[
            ("ASSISTD_CONFIG", &config),
            ("ASSISTD_TELEMETRY__OTLP_ENDPOINT", &collector.url),
            ("ASSISTD_TOOLING__RETRY_BACKOFF_BASE_MS", "20"),
            ("ASSISTD_TOOLING__RETRY_BACKOFF_MAX_MS", "50"),
        ],
    );
    let server = RealServer::start(&envs, dir.path()).await;
    let id = task_id_of(server.post_message(&message("otel-leak", 1, "look")).await).await;
    wait_for_replies(&receiver, 1).await;
    let task = server.admin_json(&format!("/api/tasks/{id}")).await;
    assert_eq!(task["status"], "FAILED", "{task:#}");
    assert_eq!(server.terminate(), Some(0));
    let spans = collector.raw();
    assert!(spans.contains("tool"), "spans were exported");
    let log = std::fs::read_to_string(dir.path().join("assistd.log")).unwrap();
    assert!(
        log.contains("tool call failed"),
        "the failure was logged: {log}"
    );
    for secret in [PASS, QUERY, OTLP] {
        assert!(!spans.contains(secret), "an exported span holds {secret}");
        assert!(!log.contains(secret), "the log holds {secret}");
        assert!(
            !task.to_string().contains(secret),
            "the task shows {secret}"
        );
    }
    collector.stop();
    db.drop_db().await;
}
