//! Model clients: OpenAI-compatible chat completions, one client per configured provider.
//! The body sent is async-openai's typed request ([`ChatRequest::to_wire`]) and the answer is
//! read as its typed response, so a field the engine asks for cannot silently go missing on
//! the way out. Owns the HTTP call and the classification of its failures into the failure
//! taxonomy; never retries by itself (the engine decides, so retries are journalled and
//! bounded).

mod embed;
pub mod gate;
mod types;

pub use types::*;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_openai::types::chat as wire;

use crate::config::{LlmConfig, LlmProviderConfig};
use crate::domain::FailureType;

pub use wire::CreateChatCompletionRequest as WireRequest;

/// Longest provider error body kept in an error message.
const ERROR_BODY_LIMIT: usize = 500;

/// One provider's endpoint, credentials and defaults.
#[derive(Clone)]
pub struct OpenAiClient {
    http: reqwest::Client,
    endpoint: String,
    /// The provider's OpenAI-compatible `/embeddings` endpoint.
    embeddings_endpoint: String,
    api_key: String,
    api_key_header: String,
    headers: Vec<(String, String)>,
    query: Vec<(String, String)>,
    /// Model of agents that name none.
    pub model: String,
    /// The model's context window, in tokens.
    pub context_window: u32,
    /// Its limits in this instance: calls at once, and the pause after a 429.
    gate: Arc<gate::ProviderGate>,
}

impl OpenAiClient {
    /// The client of one provider; `pause_max` caps the pause after a 429
    /// (`llm.retry_after_max_secs`).
    pub fn new(config: &LlmProviderConfig, pause_max: Duration) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.timeout_secs))
            .connect_timeout(Duration::from_secs(config.timeout_secs.min(10)))
            .build()?;
        Ok(OpenAiClient {
            http,
            endpoint: format!("{}/chat/completions", config.base_url.trim_end_matches('/')),
            embeddings_endpoint: format!("{}/embeddings", config.base_url.trim_end_matches('/')),
            api_key: config.api_key.clone(),
            api_key_header: config.api_key_header.clone(),
            headers: config
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            query: config
                .query
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            model: config.model.clone(),
            context_window: config.context_window,
            gate: Arc::new(gate::ProviderGate::new(config.max_concurrency, pause_max)),
        })
    }

    /// The provider's limits in this instance.
    pub fn gate(&self) -> &Arc<gate::ProviderGate> {
        &self.gate
    }

    /// The chat endpoint as anyone may see it: scheme, host, port and path (the configured
    /// base URL may carry `user:password@` or a key in its query).
    pub fn endpoint(&self) -> String {
        crate::redaction::endpoint(&self.endpoint)
    }

    /// One chat completion with the body `request` (see [`ChatRequest::to_wire`]).
    /// `idempotency_key` (the step's key) is sent as `Idempotency-Key` so a provider or proxy
    /// that honours it can drop a repeat after a crash.
    #[tracing::instrument(skip_all, fields(model = %request.model, otel.kind = "client"))]
    pub async fn chat(
        &self,
        request: &WireRequest,
        idempotency_key: &str,
    ) -> Result<ChatResponse, LlmError> {
        let _slot = self.gate.call_slot().await;
        let response = self.post(request, idempotency_key).await?;
        let body = response.text().await.map_err(classify_transport)?;
        parse_completion(&body)
    }

    /// One chat completion streamed (`stream: true`, with the usage chunk): `on_text` is
    /// given the answer so far each time a chunk adds to it, and the whole answer is
    /// returned as [`ChatResponse`] once the stream ends with `[DONE]`. For calls that
    /// offer no tools: a streamed tool call is an INVALID_RESPONSE.
    #[tracing::instrument(skip_all, fields(model = %request.model, otel.kind = "client"))]
    pub async fn chat_stream(
        &self,
        request: &WireRequest,
        idempotency_key: &str,
        on_text: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<ChatResponse, LlmError> {
        use eventsource_stream::Eventsource;
        use futures_util::StreamExt;
        let invalid = |m: String| LlmError::new(FailureType::InvalidResponse, m);
        let mut request = request.clone();
        request.stream = Some(true);
        request.stream_options = Some(wire::ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        });
        // Held until the stream ends: a streamed answer is a call in flight all along.
        let _slot = self.gate.call_slot().await;
        let response = self.post(&request, idempotency_key).await?;
        // Some OpenAI-compatible gateways ignore `stream` and answer with one completion:
        // the Content-Type says which it is, and a whole answer is shown at once.
        let streamed = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_none_or(|v| v.trim_start().starts_with("text/event-stream"));
        if !streamed {
            let body = response.text().await.map_err(classify_transport)?;
            let answer = parse_completion(&body)?;
            if !answer.tool_calls.is_empty() {
                return Err(invalid(
                    "the model answered with a tool call, but no tools were offered".into(),
                ));
            }
            if !answer.content.is_empty() {
                on_text(&answer.content);
            }
            return Ok(answer);
        }
        let mut events = response.bytes_stream().eventsource();
        let mut answer = ChatResponse {
            content: String::new(),
            tool_calls: Vec::new(),
            finish_reason: None,
            prompt_tokens: None,
            completion_tokens: None,
        };
        let mut done = false;
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| match e {
                eventsource_stream::EventStreamError::Transport(e) => classify_transport(e),
                other => invalid(format!("model stream unreadable: {other}")),
            })?;
            if event.data.trim() == "[DONE]" {
                done = true;
                break;
            }
            let chunk: wire::CreateChatCompletionStreamResponse = serde_json::from_str(&event.data)
                .map_err(|e| {
                    let data = crate::domain::truncate(&event.data, ERROR_BODY_LIMIT);
                    LlmError::new(
                        FailureType::ProviderError,
                        format!("model stream sent something other than a chunk ({e}): {data}"),
                    )
                })?;
            if let Some(usage) = chunk.usage {
                answer.prompt_tokens = Some(i64::from(usage.prompt_tokens));
                answer.completion_tokens = Some(i64::from(usage.completion_tokens));
            }
            let Some(choice) = chunk.choices.into_iter().find(|c| c.index == 0) else {
                continue;
            };
            if choice.delta.tool_calls.is_some() {
                return Err(invalid(
                    "the model streamed a tool call, but no tools were offered".into(),
                ));
            }
            if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                answer.content.push_str(&text);
                on_text(&answer.content);
            }
            if let Some(reason) = choice.finish_reason {
                if reason == wire::FinishReason::ContentFilter {
                    return Err(LlmError::new(
                        FailureType::ContentFiltered,
                        "the model's content filter stopped the answer",
                    ));
                }
                answer.finish_reason = Some(finish_reason_str(reason).to_string());
            }
        }
        if !done {
            return Err(LlmError::new(
                FailureType::ProviderError,
                "the model's stream ended before [DONE]",
            ));
        }
        Ok(answer)
    }

    /// Sends `request` with the provider's credentials; the response when it is a 2xx.
    async fn post(
        &self,
        request: &WireRequest,
        idempotency_key: &str,
    ) -> Result<reqwest::Response, LlmError> {
        self.post_to(&self.endpoint, request, idempotency_key).await
    }

    /// Sends `request` as JSON to `url` with the provider's credentials; the response when
    /// it is a 2xx, else the failure classified.
    async fn post_to(
        &self,
        url: &str,
        request: &impl serde::Serialize,
        idempotency_key: &str,
    ) -> Result<reqwest::Response, LlmError> {
        let body = serde_json::to_vec(request).map_err(|e| {
            LlmError::new(
                FailureType::Unknown,
                format!("request not serialisable: {e}"),
            )
        })?;
        let mut call = self
            .http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        if !idempotency_key.is_empty() {
            call = call.header("idempotency-key", idempotency_key);
        }
        // The call's span, for a provider or proxy that traces (W3C Trace Context).
        if let Some(traceparent) = crate::telemetry::traceparent() {
            call = call.header("traceparent", traceparent);
        }
        if !self.query.is_empty() {
            call = call.query(&self.query);
        }
        for (name, value) in &self.headers {
            call = call.header(name, value);
        }
        if !self.api_key.is_empty() {
            call = if self.api_key_header.is_empty() {
                call.bearer_auth(&self.api_key)
            } else {
                call.header(&self.api_key_header, &self.api_key)
            };
        }
        let started = std::time::Instant::now();
        let response = call.send().await.map_err(classify_transport);
        crate::metrics::MODEL_CALL_SECONDS.observe(started.elapsed());
        let response = response?;
        let status = response.status();
        if !status.is_success() {
            let retry_after =
                crate::backoff::retry_after(response.headers(), std::time::SystemTime::now());
            let body = response.text().await.map_err(classify_transport)?;
            let mut err = classify_status(status.as_u16(), &body);
            err.retry_after = retry_after;
            if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
                // The provider is at its limit: every call to it waits, not only this one.
                self.gate.refused(retry_after);
            }
            return Err(err);
        }
        Ok(response)
    }
}

/// The configured providers: the default one (`[llm]`) and the named ones
/// (`[llm.providers.<name>]`) that agents choose with `provider`.
pub struct ModelClients {
    default: OpenAiClient,
    named: BTreeMap<String, OpenAiClient>,
}

impl ModelClients {
    pub fn new(config: &LlmConfig) -> anyhow::Result<Self> {
        let pause_max = Duration::from_secs(config.retry_after_max_secs);
        let named = config
            .providers
            .iter()
            .map(|(name, p)| Ok((name.clone(), OpenAiClient::new(p, pause_max)?)))
            .collect::<anyhow::Result<_>>()?;
        Ok(ModelClients {
            default: OpenAiClient::new(&config.default_provider(), pause_max)?,
            named,
        })
    }

    /// Provider `name`; the empty name is the default one.
    pub fn provider(&self, name: &str) -> Option<&OpenAiClient> {
        if name.is_empty() {
            Some(&self.default)
        } else {
            self.named.get(name)
        }
    }

    pub fn default_provider(&self) -> &OpenAiClient {
        &self.default
    }

    pub fn has(&self, name: &str) -> bool {
        self.provider(name).is_some()
    }

    /// Every provider with its name (`""` for `[llm]`).
    fn all(&self) -> impl Iterator<Item = (&str, &OpenAiClient)> {
        std::iter::once(("", &self.default)).chain(self.named.iter().map(|(n, c)| (n.as_str(), c)))
    }

    /// How a claim of up to `want` tasks respects the providers' limits at `now`
    /// ([`gate::claim_plan`]).
    pub fn claim_plan(
        &self,
        want: usize,
        now: i64,
    ) -> Option<Vec<(crate::store::tasks::ProviderFilter, usize)>> {
        gate::claim_plan(self.all().map(|(n, c)| (n, &*c.gate)), want, now)
    }
}

fn classify_transport(e: reqwest::Error) -> LlmError {
    let (timeout, connect) = (e.is_timeout(), e.is_connect());
    // Without the URL: it may carry credentials (an Azure key in the query, a token in a path).
    let text = crate::redaction::http_error(e);
    if timeout {
        LlmError::new(
            FailureType::Timeout,
            format!("model call timed out: {text}"),
        )
    } else if connect {
        LlmError::new(
            FailureType::ProviderError,
            format!("model endpoint unreachable (check the provider's base_url): {text}"),
        )
    } else {
        LlmError::new(
            FailureType::ProviderError,
            format!("model call failed: {text}"),
        )
    }
}

fn classify_status(status: u16, body: &str) -> LlmError {
    let snippet = crate::domain::truncate(body.trim(), ERROR_BODY_LIMIT);
    let lower = body.to_ascii_lowercase();
    let failure_type = match status {
        429 => FailureType::RateLimited,
        401 | 403 => FailureType::AuthFailed,
        408 | 504 => FailureType::Timeout,
        // llama.cpp's server answers 500 for a prompt over its context window.
        400 | 413 | 422 | 500
            if lower.contains("context_length")
                || lower.contains("context length")
                || lower.contains("maximum context")
                || lower.contains("context window")
                || lower.contains("exceed_context_size")
                || lower.contains("too many tokens") =>
        {
            FailureType::ContextTooLong
        }
        500..=599 => FailureType::ProviderError,
        400 if lower.contains("content_filter") || lower.contains("content management policy") => {
            FailureType::ContentFiltered
        }
        _ => FailureType::Unknown,
    };
    LlmError::new(
        failure_type,
        format!("model answered HTTP {status}: {snippet}"),
    )
}

fn finish_reason_str(reason: wire::FinishReason) -> &'static str {
    match reason {
        wire::FinishReason::Stop => "stop",
        wire::FinishReason::Length => "length",
        wire::FinishReason::ToolCalls => "tool_calls",
        wire::FinishReason::ContentFilter => "content_filter",
        wire::FinishReason::FunctionCall => "function_call",
    }
}

fn parse_completion(body: &str) -> Result<ChatResponse, LlmError> {
    let invalid = |m: String| LlmError::new(FailureType::InvalidResponse, m);
    let completion: wire::CreateChatCompletionResponse = serde_json::from_str(body)
        .map_err(|e| invalid(format!("model response is not a chat completion: {e}")))?;
    let usage = completion.usage;
    let choice = completion
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| invalid("model response has no choices".into()))?;
    let finish_reason = choice.finish_reason.map(finish_reason_str);
    if choice.finish_reason == Some(wire::FinishReason::ContentFilter) {
        return Err(LlmError::new(
            FailureType::ContentFiltered,
            "the model's content filter stopped the answer",
        ));
    }
    let message = choice.message;
    let mut tool_calls = Vec::new();
    for call in message.tool_calls.unwrap_or_default() {
        match call {
            wire::ChatCompletionMessageToolCalls::Function(f) => tool_calls.push(ToolCall {
                id: f.id,
                kind: function_type(),
                function: FunctionCall {
                    name: f.function.name,
                    arguments: f.function.arguments,
                },
            }),
            wire::ChatCompletionMessageToolCalls::Custom(c) => {
                return Err(invalid(format!(
                    "model called custom tool `{}`, but only functions were offered",
                    c.custom_tool.name
                )));
            }
        }
    }
    // An empty answer is an answer: the engine decides what the chat gets for it.
    let content = message.content.unwrap_or_default();
    Ok(ChatResponse {
        content,
        tool_calls,
        finish_reason: finish_reason.map(str::to_string),
        prompt_tokens: usage.as_ref().map(|u| i64::from(u.prompt_tokens)),
        completion_tokens: usage.as_ref().map(|u| i64::from(u.completion_tokens)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn statuses_map_to_failure_types() {
        assert_eq!(
            classify_status(429, "").failure_type,
            FailureType::RateLimited
        );
        assert_eq!(
            classify_status(401, "").failure_type,
            FailureType::AuthFailed
        );
        assert_eq!(
            classify_status(503, "").failure_type,
            FailureType::ProviderError
        );
        assert_eq!(
            classify_status(400, r#"{"error":{"code":"context_length_exceeded"}}"#).failure_type,
            FailureType::ContextTooLong
        );
        assert_eq!(classify_status(404, "").failure_type, FailureType::Unknown);
    }

    #[test]
    fn a_request_is_journalled_with_its_model_first_and_nothing_else_changed() {
        let body = json!({
            "messages": [{"role": "user", "content": "问 \"quoted\" \\ text"}],
            "model": "a \"model\"",
            "max_tokens": 8,
            "temperature": 0.2,
            "stream": false
        });
        let text = journal_text(&body);
        assert!(text.starts_with(r#"{"model":"a \"model\"","#), "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), body);
        // Without a model, or not an object: as serde_json writes it.
        for other in [json!({"messages": []}), json!([1, 2]), Value::Null] {
            assert_eq!(journal_text(&other), other.to_string());
        }
        assert_eq!(journal_text(&json!({"model": "m"})), r#"{"model":"m"}"#);
    }

    fn completion(message: Value, finish: &str) -> String {
        json!({
            "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        })
        .to_string()
    }

    #[test]
    fn completion_parsing() {
        let ok = parse_completion(&completion(
            json!({"role": "assistant", "content": "hi"}),
            "stop",
        ))
        .unwrap();
        assert_eq!(ok.content, "hi");
        assert_eq!(ok.prompt_tokens, Some(3));
        let calls = parse_completion(&completion(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "t", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "u", "arguments": "{\"x\":1}"}}
            ]}),
            "tool_calls",
        ))
        .unwrap();
        assert_eq!(calls.tool_calls.len(), 2);
        assert_eq!(calls.tool_calls[1].function.name, "u");
        assert_eq!(
            parse_completion("nope").unwrap_err().failure_type,
            FailureType::InvalidResponse
        );
        assert_eq!(
            parse_completion(
                r#"{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[]}"#
            )
            .unwrap_err()
            .failure_type,
            FailureType::InvalidResponse
        );
        let cut = parse_completion(&completion(
            json!({"role": "assistant", "content": ""}),
            "length",
        ))
        .unwrap();
        assert!(cut.truncated() && cut.content.is_empty());
    }

    #[test]
    fn the_budget_leaves_room_for_the_answer_and_the_system_prompt() {
        // A 512-token model answering in up to 128 tokens, with a 30-byte system prompt.
        let system = "x".repeat(30);
        assert_eq!(history_budget(3000, 512, 128, &system), 512 - 128 - 14);
        assert_eq!(history_budget(100, 512, 128, &system), 100);
        assert_eq!(history_budget(3000, 100, 128, &system), 0);
    }

    #[test]
    fn the_wire_request_carries_tools_choice_and_empty_assistant_content() {
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![
                ChatMessage::user("q"),
                ChatMessage::assistant_calls(
                    "",
                    vec![ToolCall {
                        id: "c1".into(),
                        kind: function_type(),
                        function: FunctionCall {
                            name: "t".into(),
                            arguments: "{}".into(),
                        },
                    }],
                ),
                ChatMessage::tool_result("c1", "{\"ok\":true}"),
            ],
            temperature: 0.2,
            max_tokens: 64,
            tools: vec![ToolSpec {
                name: "t".into(),
                description: "a tool".into(),
                parameters: json!({"type": "object"}),
            }],
            tool_choice: Some(ToolChoice::Function("t".into())),
        };
        let body = wire_json(&request.to_wire());
        assert_eq!(body["tools"][0]["type"], "function");
        assert_eq!(body["tools"][0]["function"]["name"], "t");
        assert_eq!(body["tools"][0]["function"]["parameters"]["type"], "object");
        assert_eq!(body["tool_choice"]["function"]["name"], "t");
        assert_eq!(body["messages"][1]["content"], "");
        assert_eq!(body["messages"][1]["tool_calls"][0]["id"], "c1");
        assert_eq!(body["messages"][2]["tool_call_id"], "c1");
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["temperature"], 0.2);
        assert_eq!(body["stream"], false);
        // No tools: neither `tools` nor `tool_choice` is sent.
        let plain = ChatRequest {
            tools: Vec::new(),
            ..request
        };
        let body = wire_json(&plain.to_wire());
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
    }
}
