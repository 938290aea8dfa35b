//! Model clients. Today: any OpenAI-compatible `POST {base_url}/chat/completions`.
//! Owns the HTTP call and the classification of its failures into the failure taxonomy;
//! never retries by itself (the engine decides, so retries are journalled and bounded).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::LlmConfig;
use crate::domain::FailureType;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Calls the assistant asked for (assistant messages of a tool-calling loop).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Which call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// An OpenAI-style function call requested by the model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text, as the model produced it.
    #[serde(default)]
    pub arguments: String,
}

fn function_type() -> String {
    "function".into()
}

/// One model call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub temperature: f64,
    pub max_tokens: u32,
    /// OpenAI-style `tools` (function declarations) the model may call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatResponse {
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
}

/// A failed model call, classified.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{failure_type}: {message}")]
pub struct LlmError {
    pub failure_type: FailureType,
    pub message: String,
    /// The provider's `Retry-After`, when it sent one.
    pub retry_after: Option<Duration>,
}

impl LlmError {
    fn new(failure_type: FailureType, message: impl Into<String>) -> Self {
        LlmError {
            failure_type,
            message: message.into(),
            retry_after: None,
        }
    }
}

/// Longest provider error body kept in an error message.
const ERROR_BODY_LIMIT: usize = 500;

#[derive(Clone)]
pub struct OpenAiClient {
    http: reqwest::Client,
    endpoint: String,
    api_key: String,
}

impl OpenAiClient {
    pub fn new(config: &LlmConfig) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.timeout_secs))
            .connect_timeout(Duration::from_secs(config.timeout_secs.min(10)))
            .build()?;
        Ok(OpenAiClient {
            http,
            endpoint: format!("{}/chat/completions", config.base_url.trim_end_matches('/')),
            api_key: config.api_key.clone(),
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// One chat completion. `idempotency_key` (the step's key) is sent as `Idempotency-Key`
    /// so a provider or proxy that honours it can drop a repeat after a crash.
    #[tracing::instrument(skip_all, fields(model = %request.model))]
    pub async fn chat(
        &self,
        request: &ChatRequest,
        idempotency_key: &str,
    ) -> Result<ChatResponse, LlmError> {
        let mut call = self
            .http
            .post(&self.endpoint)
            .json(&json!({
                "model": request.model,
                "messages": request.messages,
                "temperature": request.temperature,
                "max_tokens": request.max_tokens,
                "stream": false,
            }))
            .header("idempotency-key", idempotency_key);
        if !self.api_key.is_empty() {
            call = call.bearer_auth(&self.api_key);
        }
        let started = std::time::Instant::now();
        let response = call.send().await.map_err(classify_transport);
        crate::metrics::MODEL_CALL_SECONDS.observe(started.elapsed());
        let response = response?;
        let status = response.status();
        let retry_after = parse_retry_after(response.headers());
        let body = response.text().await.map_err(classify_transport)?;
        if !status.is_success() {
            let mut err = classify_status(status.as_u16(), &body);
            err.retry_after = retry_after;
            return Err(err);
        }
        parse_completion(&body)
    }
}

fn classify_transport(e: reqwest::Error) -> LlmError {
    if e.is_timeout() {
        LlmError::new(FailureType::Timeout, format!("model call timed out: {e}"))
    } else if e.is_connect() {
        LlmError::new(
            FailureType::ProviderError,
            format!("model endpoint unreachable (check llm.base_url): {e}"),
        )
    } else {
        LlmError::new(
            FailureType::ProviderError,
            format!("model call failed: {e}"),
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
        500..=599 => FailureType::ProviderError,
        400 | 413 | 422
            if lower.contains("context_length")
                || lower.contains("context length")
                || lower.contains("maximum context")
                || lower.contains("too many tokens") =>
        {
            FailureType::ContextTooLong
        }
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

fn parse_retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let value = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    let secs: f64 = value.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

fn parse_completion(body: &str) -> Result<ChatResponse, LlmError> {
    #[derive(Deserialize)]
    struct Completion {
        choices: Vec<Choice>,
        usage: Option<Usage>,
    }
    #[derive(Deserialize)]
    struct Choice {
        message: Option<Message>,
        finish_reason: Option<String>,
    }
    #[derive(Deserialize)]
    struct Message {
        content: Option<String>,
        #[serde(default)]
        tool_calls: Vec<ToolCall>,
    }
    #[derive(Deserialize)]
    struct Usage {
        prompt_tokens: Option<i64>,
        completion_tokens: Option<i64>,
    }
    let completion: Completion = serde_json::from_str(body).map_err(|e| {
        LlmError::new(
            FailureType::InvalidResponse,
            format!("model response is not a chat completion: {e}"),
        )
    })?;
    let choice = completion.choices.into_iter().next().ok_or_else(|| {
        LlmError::new(
            FailureType::InvalidResponse,
            "model response has no choices",
        )
    })?;
    if choice.finish_reason.as_deref() == Some("content_filter") {
        return Err(LlmError::new(
            FailureType::ContentFiltered,
            "the model's content filter stopped the answer",
        ));
    }
    let message = choice.message.ok_or_else(|| {
        LlmError::new(
            FailureType::InvalidResponse,
            "model response has no message",
        )
    })?;
    let content = message.content.unwrap_or_default();
    if content.trim().is_empty() && message.tool_calls.is_empty() {
        return Err(LlmError::new(
            FailureType::InvalidResponse,
            "model answer is empty",
        ));
    }
    Ok(ChatResponse {
        content,
        tool_calls: message.tool_calls,
        finish_reason: choice.finish_reason,
        prompt_tokens: completion.usage.as_ref().and_then(|u| u.prompt_tokens),
        completion_tokens: completion.usage.as_ref().and_then(|u| u.completion_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn completion_parsing() {
        let ok = parse_completion(
            r#"{"choices":[{"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
        )
        .unwrap();
        assert_eq!(ok.content, "hi");
        assert_eq!(ok.prompt_tokens, Some(3));
        assert_eq!(
            parse_completion("nope").unwrap_err().failure_type,
            FailureType::InvalidResponse
        );
        assert_eq!(
            parse_completion(r#"{"choices":[]}"#)
                .unwrap_err()
                .failure_type,
            FailureType::InvalidResponse
        );
    }
}
