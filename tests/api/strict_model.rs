//! The mock model every test uses: `POST /v1/chat/completions` held to the contract real
//! providers enforce. Sources: OpenAI's API reference for chat completions (request fields,
//! message roles, `tool_calls` / `tool` pairing, `tools` and `tool_choice`, the error body),
//! and llama.cpp's OpenAI-compatible server where it is stricter (it rejects `content: null`
//! on an assistant turn). A request that breaks the contract is answered 400 with an
//! OpenAI-style error, as a provider would, before the test's script sees it. The script's
//! answer is checked too: a call of a tool the request did not declare, a call under
//! `tool_choice: "none"`, or no call of a forced function is a bug in the test; it is answered
//! 500 with `strict model double:` in the body (and printed), so the test fails.
//!
//! Optionally the double has a context window (`with_context_window`): a request whose
//! messages (estimated at four bytes a token) plus `max_tokens` exceed it is refused 400 with
//! OpenAI's `context_length_exceeded` error, as llama.cpp's server refuses it.

use std::collections::HashSet;

use futures::StreamExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::method;
use wiremock::{Mock, Request, Respond, ResponseTemplate};

use crate::helpers::chat_path;

/// What a script answers; the double wraps it in a full chat-completion envelope.
#[derive(Debug, Clone)]
pub struct ModelReply {
    kind: ReplyKind,
    delay: Option<Duration>,
    headers: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
enum ReplyKind {
    Text {
        content: String,
        finish_reason: &'static str,
    },
    /// (name, JSON arguments) per call.
    Calls(Vec<(String, String)>),
    /// A non-2xx answer, as is.
    Error { status: u16, body: String },
}

impl ModelReply {
    pub fn text(content: impl Into<String>) -> ModelReply {
        Self::of(ReplyKind::Text {
            content: content.into(),
            finish_reason: "stop",
        })
    }

    /// One answer calling these tools, `(name, arguments)`, in order.
    pub fn calls<N: AsRef<str>>(calls: &[(N, Value)]) -> ModelReply {
        Self::of(ReplyKind::Calls(
            calls
                .iter()
                .map(|(n, a)| (n.as_ref().to_string(), a.to_string()))
                .collect(),
        ))
    }

    pub fn error(status: u16, body: impl Into<String>) -> ModelReply {
        Self::of(ReplyKind::Error {
            status,
            body: body.into(),
        })
    }

    pub fn delayed(mut self, delay: Duration) -> ModelReply {
        self.delay = Some(delay);
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> ModelReply {
        self.headers.push((name.into(), value.into()));
        self
    }

    fn of(kind: ReplyKind) -> ModelReply {
        ModelReply {
            kind,
            delay: None,
            headers: Vec::new(),
        }
    }
}

/// A test's model behaviour: given the request (checked already) and its JSON body, the answer.
pub trait ModelScript: Send + Sync + 'static {
    fn reply(&self, request: &Request, body: &Value) -> ModelReply;
}

impl<F> ModelScript for F
where
    F: Fn(&Value) -> ModelReply + Send + Sync + 'static,
{
    fn reply(&self, _request: &Request, body: &Value) -> ModelReply {
        self(body)
    }
}

/// The strict double around a script.
pub struct StrictModel<S> {
    script: S,
    context_window: Option<usize>,
    calls: AtomicU64,
    ignores_stream: bool,
}

impl<S: ModelScript> StrictModel<S> {
    pub fn new(script: S) -> Self {
        StrictModel {
            script,
            context_window: None,
            calls: AtomicU64::new(0),
            ignores_stream: false,
        }
    }

    /// Answers a streaming request with one ordinary completion (`application/json`), as
    /// some OpenAI-compatible gateways do: they ignore `stream`.
    pub fn ignoring_stream(mut self) -> Self {
        self.ignores_stream = true;
        self
    }

    /// Refuses requests over `tokens`, as a server started with that context size does.
    pub fn with_context_window(mut self, tokens: usize) -> Self {
        self.context_window = Some(tokens);
        self
    }
}

/// A mock of the chat endpoint answering through the strict double; mount it like any mock.
pub fn model_mock(script: impl ModelScript) -> Mock {
    strict_mock(StrictModel::new(script))
}

pub fn strict_mock<S: ModelScript>(model: StrictModel<S>) -> Mock {
    Mock::given(method("POST"))
        .and(chat_path())
        .respond_with(model)
}

fn refuse(message: String) -> ResponseTemplate {
    ResponseTemplate::new(400).set_body_json(json!({
        "error": { "message": message, "type": "invalid_request_error", "param": null, "code": null }
    }))
}

fn script_bug(message: String) -> ResponseTemplate {
    eprintln!("strict model double: {message}");
    ResponseTemplate::new(500).set_body_string(format!("strict model double: {message}"))
}

const KNOWN_FIELDS: &[&str] = &[
    "model",
    "messages",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "stop",
    "n",
    "seed",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
];

/// The request checks; `Err` is the provider's 400 message.
pub fn check_request(body: &Value) -> Result<(), String> {
    let object = body.as_object().ok_or("the body must be a JSON object")?;
    for key in object.keys() {
        if !KNOWN_FIELDS.contains(&key.as_str()) {
            return Err(format!("Unrecognized request argument supplied: {key}"));
        }
    }
    match body.get("model").and_then(Value::as_str) {
        Some(m) if !m.is_empty() => {}
        _ => return Err("you must provide a model parameter".into()),
    }
    let streams = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("Invalid type for 'stream': {other}")),
    };
    if let Some(options) = body.get("stream_options").filter(|o| !o.is_null()) {
        if !streams {
            return Err(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.".into(),
            );
        }
        let known = options.as_object().is_some_and(|o| {
            o.iter().all(|(k, v)| {
                ["include_usage", "include_obfuscation"].contains(&k.as_str()) && v.is_boolean()
            })
        });
        if !known {
            return Err(format!("Invalid 'stream_options': {options}"));
        }
    }
    if let Some(t) = body.get("temperature") {
        match t.as_f64() {
            Some(t) if (0.0..=2.0).contains(&t) => {}
            _ => return Err(format!("Invalid 'temperature': {t}")),
        }
    }
    if let Some(n) = body.get("max_tokens")
        && n.as_u64().is_none_or(|n| n == 0)
    {
        return Err(format!("Invalid 'max_tokens': {n}"));
    }
    let declared = check_tools(body)?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or("'messages' must be a non-empty array")?;
    // Calls of the latest assistant turn still waiting for their `tool` message.
    let mut open: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "tool" && !open.is_empty() {
            return Err(format!(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                open.join(", ")
            ));
        }
        match m.get("content") {
            Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(Value::Null) | None => {
                return Err(format!(
                    "messages[{i}].content must be a string (llama.cpp's server refuses null)"
                ));
            }
            Some(other) => {
                return Err(format!("Invalid type for 'messages[{i}].content': {other}"));
            }
        }
        match role {
            "system" | "developer" | "user" => {}
            "assistant" => {
                if let Some(calls) = m.get("tool_calls") {
                    let calls = calls.as_array().filter(|c| !c.is_empty()).ok_or(format!(
                        "messages[{i}].tool_calls must be a non-empty array"
                    ))?;
                    for (j, c) in calls.iter().enumerate() {
                        let id = c.get("id").and_then(Value::as_str).unwrap_or("");
                        let name = c.pointer("/function/name").and_then(Value::as_str);
                        let args = c.pointer("/function/arguments").and_then(Value::as_str);
                        if id.is_empty()
                            || c.get("type").and_then(Value::as_str) != Some("function")
                            || name.is_none()
                            || args.is_none()
                        {
                            return Err(format!(
                                "messages[{i}].tool_calls[{j}] needs id, type 'function', function.name and function.arguments (a string)"
                            ));
                        }
                        open.push(id.to_string());
                    }
                }
            }
            "tool" => {
                let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
                match open.iter().position(|o| o == id) {
                    Some(p) => {
                        open.remove(p);
                    }
                    None => {
                        return Err(format!(
                            "Invalid parameter: messages[{i}] with role 'tool' must be a response to a preceeding message with 'tool_calls' (tool_call_id `{id}`)"
                        ));
                    }
                }
            }
            other => {
                return Err(format!(
                    "Invalid value: '{other}'. Supported values are: 'system', 'assistant', 'user', 'tool', and 'developer'."
                ));
            }
        }
    }
    if !open.is_empty() {
        return Err(format!(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
            open.join(", ")
        ));
    }
    if let Some(choice) = body.get("tool_choice") {
        if declared.is_empty() {
            return Err("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.".into());
        }
        match choice {
            Value::String(s) if ["none", "auto", "required"].contains(&s.as_str()) => {}
            Value::Object(_) if choice.get("type").and_then(Value::as_str) == Some("function") => {
                let name = choice
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if !declared.contains(name) {
                    return Err(format!(
                        "Invalid 'tool_choice': function `{name}` is not among the declared tools"
                    ));
                }
            }
            other => return Err(format!("Invalid value for 'tool_choice': {other}")),
        }
    }
    Ok(())
}

/// Checks `tools`; returns the declared function names.
fn check_tools(body: &Value) -> Result<HashSet<String>, String> {
    let mut names = HashSet::new();
    let Some(tools) = body.get("tools") else {
        return Ok(names);
    };
    let tools = tools.as_array().ok_or("'tools' must be an array")?;
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(format!("tools[{i}].type must be 'function'"));
        }
        let name = t
            .pointer("/function/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(format!(
                "Invalid 'tools[{i}].function.name': string does not match pattern ^[a-zA-Z0-9_-]{{1,64}}$"
            ));
        }
        if t.pointer("/function/description")
            .is_some_and(|d| !d.is_string())
        {
            return Err(format!("tools[{i}].function.description must be a string"));
        }
        if t.pointer("/function/parameters")
            .is_some_and(|p| !p.is_object())
        {
            return Err(format!(
                "tools[{i}].function.parameters must be a JSON Schema object"
            ));
        }
        if !names.insert(name.to_string()) {
            return Err(format!("tools: duplicate function name `{name}`"));
        }
    }
    Ok(names)
}

/// The script's calls against what the request allowed; `Err` is the test's bug.
fn check_calls(body: &Value, calls: &[(String, String)]) -> Result<(), String> {
    let declared = check_tools(body).unwrap_or_default();
    for (name, args) in calls {
        if !declared.contains(name) {
            return Err(format!(
                "the script called `{name}`, which the request did not declare (declared: {declared:?})"
            ));
        }
        if serde_json::from_str::<Value>(args).is_err() {
            return Err(format!("the script's arguments for `{name}` are not JSON"));
        }
    }
    match body.get("tool_choice") {
        Some(Value::String(s)) if s == "none" && !calls.is_empty() => {
            Err("the script called a tool under tool_choice \"none\"".into())
        }
        Some(Value::String(s)) if s == "required" && calls.is_empty() => {
            Err("the script answered without a call under tool_choice \"required\"".into())
        }
        Some(Value::Object(_)) => {
            let forced = body
                .pointer("/tool_choice/function/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            if calls.is_empty() || calls.iter().any(|(n, _)| n != forced) {
                Err(format!(
                    "the script did not call only `{forced}`, which tool_choice forced"
                ))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

/// Prompt size as the double counts it (a token per four bytes, plus a few per message).
fn prompt_tokens(body: &Value) -> usize {
    body["messages"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .map(|m| m.to_string().len() / 4 + 4)
                .sum::<usize>()
        })
        .unwrap_or(0)
}

impl<S: ModelScript> Respond for StrictModel<S> {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = match serde_json::from_slice(&request.body) {
            Ok(v) => v,
            Err(e) => {
                return refuse(format!(
                    "We could not parse the JSON body of your request: {e}"
                ));
            }
        };
        if let Err(message) = check_request(&body) {
            return refuse(message);
        }
        let prompt = prompt_tokens(&body);
        if let Some(window) = self.context_window {
            let answer = body["max_tokens"].as_u64().unwrap_or(0) as usize;
            if prompt + answer > window {
                return ResponseTemplate::new(400).set_body_json(json!({
                    "error": {
                        "message": format!("This model's maximum context length is {window} tokens. However, you requested {} tokens ({prompt} in the messages, {answer} in the completion). Please reduce the length of the messages or completion.", prompt + answer),
                        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"
                    }
                }));
            }
        }
        let reply = self.script.reply(request, &body);
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let (message, finish_reason) = match &reply.kind {
            ReplyKind::Error { status, body } => {
                let mut t = ResponseTemplate::new(*status).set_body_string(body.clone());
                for (k, v) in &reply.headers {
                    t = t.insert_header(k.as_str(), v.as_str());
                }
                return match reply.delay {
                    Some(d) => t.set_delay(d),
                    None => t,
                };
            }
            ReplyKind::Text {
                content,
                finish_reason,
            } => {
                if let Err(bug) = check_calls(&body, &[]) {
                    return script_bug(bug);
                }
                (
                    json!({ "role": "assistant", "content": content }),
                    *finish_reason,
                )
            }
            ReplyKind::Calls(calls) => {
                if let Err(bug) = check_calls(&body, calls) {
                    return script_bug(bug);
                }
                let calls: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, (name, args))| {
                        json!({ "id": format!("call_{n}_{i}"), "type": "function",
                                "function": { "name": name, "arguments": args } })
                    })
                    .collect();
                // OpenAI sends null content beside tool calls.
                (
                    json!({ "role": "assistant", "content": null, "tool_calls": calls }),
                    "tool_calls",
                )
            }
        };
        let mut t = if body["stream"] == true && !self.ignores_stream {
            ResponseTemplate::new(200).set_body_raw(
                sse_body(&body, n, &message, finish_reason, prompt, None).concat(),
                "text/event-stream",
            )
        } else {
            ResponseTemplate::new(200).set_body_json(json!({
            "id": format!("chatcmpl-{n}"),
            "object": "chat.completion",
            "created": 1_700_000_000u32,
            "model": body["model"],
            "choices": [{ "index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason }],
            "usage": { "prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7 }
        }))
        };
        for (k, v) in &reply.headers {
            t = t.insert_header(k.as_str(), v.as_str());
        }
        match reply.delay {
            Some(d) => t.set_delay(d),
            None => t,
        }
    }
}

/// A streamed answer as OpenAI sends it: `chat.completion.chunk` events, the first with the
/// role, the text in pieces of about `piece` bytes (words, by default), tool calls whole,
/// then the finish reason, the usage chunk (empty `choices`) when
/// `stream_options.include_usage` asked for it, and `data: [DONE]`. One string per event.
pub fn sse_body(
    body: &Value,
    n: u64,
    message: &Value,
    finish_reason: &str,
    prompt: usize,
    piece: Option<usize>,
) -> Vec<String> {
    let chunk = |choices: Value, usage: Value| {
        let c = json!({
            "id": format!("chatcmpl-{n}"), "object": "chat.completion.chunk",
            "created": 1_700_000_000u32, "model": body["model"], "choices": choices, "usage": usage
        });
        format!("data: {c}\n\n")
    };
    let mut events = vec![chunk(
        json!([{ "index": 0, "delta": { "role": "assistant", "content": "" }, "finish_reason": null }]),
        Value::Null,
    )];
    let text = message["content"].as_str().unwrap_or("");
    let mut pieces: Vec<String> = Vec::new();
    match piece {
        Some(size) => {
            let mut current = String::new();
            for ch in text.chars() {
                current.push(ch);
                if current.len() >= size {
                    pieces.push(std::mem::take(&mut current));
                }
            }
            if !current.is_empty() {
                pieces.push(current);
            }
        }
        None => pieces.extend(text.split_inclusive(' ').map(str::to_string)),
    }
    for p in pieces {
        events.push(chunk(
            json!([{ "index": 0, "delta": { "content": p }, "finish_reason": null }]),
            Value::Null,
        ));
    }
    if let Some(calls) = message["tool_calls"].as_array() {
        let deltas: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut c = c.clone();
                c["index"] = json!(i);
                c
            })
            .collect();
        events.push(chunk(
            json!([{ "index": 0, "delta": { "tool_calls": deltas }, "finish_reason": null }]),
            Value::Null,
        ));
    }
    events.push(chunk(
        json!([{ "index": 0, "delta": {}, "finish_reason": finish_reason }]),
        Value::Null,
    ));
    if body.pointer("/stream_options/include_usage") == Some(&json!(true)) {
        events.push(chunk(
            json!([]),
            json!({ "prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7 }),
        ));
    }
    events.push("data: [DONE]\n\n".to_string());
    events
}

/// A model that streams its answer over time (wiremock answers at once): a server on
/// 127.0.0.1 holding requests to the same contract (`check_request`), answering every
/// chat with `text`, one piece of `piece` bytes every `every`. Non-streamed requests get
/// the whole answer after the same total time. Stops when dropped.
pub struct SlowStreamingModel {
    pub uri: String,
    pub calls: std::sync::Arc<AtomicU64>,
    server: tokio::task::JoinHandle<()>,
}

impl SlowStreamingModel {
    pub async fn start(text: &str, piece: usize, every: Duration) -> SlowStreamingModel {
        use axum::response::IntoResponse;
        let calls = std::sync::Arc::new(AtomicU64::new(0));
        let text = text.to_string();
        let counter = calls.clone();
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(move |raw: axum::body::Bytes| {
                let (text, counter) = (text.clone(), counter.clone());
                async move {
                    let body = match contract_body(&raw) {
                        Ok(body) => body,
                        Err(refused) => return *refused,
                    };
                    let n = counter.fetch_add(1, Ordering::SeqCst);
                    let message = json!({ "role": "assistant", "content": text });
                    let prompt = prompt_tokens(&body);
                    let events = sse_body(&body, n, &message, "stop", prompt, Some(piece));
                    if body["stream"] != true {
                        tokio::time::sleep(every * events.len() as u32).await;
                        return axum::Json(json!({
                            "id": format!("chatcmpl-{n}"), "object": "chat.completion",
                            "created": 1_700_000_000u32, "model": body["model"],
                            "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }],
                            "usage": { "prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7 }
                        }))
                        .into_response();
                    }
                    let stream = futures::stream::iter(events).then(move |e| async move {
                        tokio::time::sleep(every).await;
                        Ok::<_, std::convert::Infallible>(e)
                    });
                    axum::response::Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(axum::body::Body::from_stream(stream))
                        .unwrap()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.ok();
        });
        SlowStreamingModel { uri, calls, server }
    }
}

impl Drop for SlowStreamingModel {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A provider with limits, as real ones have (OpenAI's and Azure's documented behaviour: a
/// request over the limit is refused with 429 and a `Retry-After`): a server on 127.0.0.1
/// holding requests to the same contract (`check_request`), answering each chat after
/// `latency` with `answer to: <last message>` (streamed when the request asks), and refusing with 429
/// (`Retry-After: 1`, OpenAI's `rate_limit_exceeded` body) every request above `limit` in
/// flight at once, and every request until `refuse_until`. Counts what it answered and what
/// it refused, and the most requests it had in flight. Stops when dropped.
pub struct LimitedModel {
    pub uri: String,
    pub answered: std::sync::Arc<AtomicU64>,
    pub refused: std::sync::Arc<AtomicU64>,
    pub most_in_flight: std::sync::Arc<AtomicU64>,
    server: tokio::task::JoinHandle<()>,
}

impl LimitedModel {
    pub async fn start(
        limit: u64,
        latency: Duration,
        refuse_until: Option<std::time::Instant>,
    ) -> LimitedModel {
        use axum::response::IntoResponse;
        let counters: [std::sync::Arc<AtomicU64>; 4] = Default::default();
        let [answered, refused, most, in_flight] = counters.clone();
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(move |raw: axum::body::Bytes| {
                let (answered, refused, most, in_flight) =
                    (answered.clone(), refused.clone(), most.clone(), in_flight.clone());
                async move {
                    let body = match contract_body(&raw) {
                        Ok(body) => body,
                        Err(refused) => return *refused,
                    };
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    let over = now > limit
                        || refuse_until.is_some_and(|t| std::time::Instant::now() < t);
                    if over {
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        refused.fetch_add(1, Ordering::SeqCst);
                        return (
                            axum::http::StatusCode::TOO_MANY_REQUESTS,
                            [("retry-after", "1")],
                            axum::Json(json!({"error": {
                                "message": "Rate limit reached: too many requests at once",
                                "type": "requests", "param": null, "code": "rate_limit_exceeded"}})),
                        )
                            .into_response();
                    }
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(latency).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let n = answered.fetch_add(1, Ordering::SeqCst);
                    let message = json!({
                        "role": "assistant",
                        "content": format!("answer to: {}", last_content(&body))
                    });
                    let prompt = prompt_tokens(&body);
                    // Streamed when asked, as a provider does.
                    if body["stream"] == true {
                        let events = sse_body(&body, n, &message, "stop", prompt, None);
                        return (
                            [("content-type", "text/event-stream")],
                            events.concat(),
                        )
                            .into_response();
                    }
                    axum::Json(json!({
                        "id": format!("chatcmpl-{n}"), "object": "chat.completion",
                        "created": 1_700_000_000u32, "model": body["model"],
                        "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }],
                        "usage": { "prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7 }
                    }))
                    .into_response()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.ok();
        });
        let [answered, refused, most_in_flight, _] = counters;
        LimitedModel {
            uri,
            answered,
            refused,
            most_in_flight,
            server,
        }
    }
}

impl Drop for LimitedModel {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The request body as the doubles served over axum read it: JSON held to the contract
/// (`check_request`), or the 400 a provider answers.
fn contract_body(raw: &[u8]) -> Result<Value, Box<axum::response::Response>> {
    use axum::response::IntoResponse;
    let refuse = |message: String| {
        Box::new(
            (
                axum::http::StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": {"message": message, "type": "invalid_request_error"}})),
            )
                .into_response(),
        )
    };
    let body: Value = serde_json::from_slice(raw).map_err(|e| refuse(e.to_string()))?;
    check_request(&body).map_err(refuse)?;
    Ok(body)
}

/// The content of a chat request's last message (`""` when it has none).
pub fn last_content(body: &Value) -> String {
    body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string()
}
