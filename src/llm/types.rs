//! The model-facing types: messages, tool calls and specs, the request the engine builds
//! (sent as async-openai's typed request), the answer it reads, the failure of a call, and
//! the token estimates that fit a history to a context window.

use std::time::Duration;

use async_openai::types::chat as wire;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::FailureType;

use wire::CreateChatCompletionRequest as WireRequest;

/// Who speaks a message.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// Calls the assistant asked for (assistant messages of a tool-calling loop).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Which call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// The assistant turn that asked for `calls`, as it must be sent back before their
    /// results.
    pub fn assistant_calls(content: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        ChatMessage {
            tool_calls: calls,
            ..Self::new(Role::Assistant, content)
        }
    }

    /// The result of call `call_id`.
    pub fn tool_result(call_id: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            tool_call_id: Some(call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    fn to_wire(&self) -> wire::ChatCompletionRequestMessage {
        use wire::ChatCompletionRequestMessage as M;
        let text = self.content.clone();
        match self.role {
            Role::System => M::System(wire::ChatCompletionRequestSystemMessage {
                content: wire::ChatCompletionRequestSystemMessageContent::Text(text),
                name: None,
            }),
            Role::User => M::User(wire::ChatCompletionRequestUserMessage {
                content: wire::ChatCompletionRequestUserMessageContent::Text(text),
                name: None,
            }),
            // Content is always sent, "" beside tool calls: OpenAI accepts null there, but
            // llama.cpp's server (and other OpenAI-compatible ones) reject it.
            Role::Assistant => M::Assistant(wire::ChatCompletionRequestAssistantMessage {
                content: Some(wire::ChatCompletionRequestAssistantMessageContent::Text(
                    text,
                )),
                tool_calls: (!self.tool_calls.is_empty()).then(|| {
                    self.tool_calls
                        .iter()
                        .map(|c| {
                            wire::ChatCompletionMessageToolCalls::Function(
                                wire::ChatCompletionMessageToolCall {
                                    id: c.id.clone(),
                                    function: wire::FunctionCall {
                                        name: c.function.name.clone(),
                                        arguments: c.function.arguments.clone(),
                                    },
                                },
                            )
                        })
                        .collect()
                }),
                ..Default::default()
            }),
            Role::Tool => M::Tool(wire::ChatCompletionRequestToolMessage {
                content: wire::ChatCompletionRequestToolMessageContent::Text(text),
                tool_call_id: self.tool_call_id.clone().unwrap_or_default(),
            }),
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

pub(super) fn function_type() -> String {
    "function".into()
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: Value,
}

/// Whether and which tool the model must call (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    Required,
    None,
    /// This function, by name.
    Function(String),
}

impl ToolChoice {
    /// Reads a workflow node's `tool_choice`: `auto`, `required`, `none` or a tool name.
    pub fn parse(text: &str) -> ToolChoice {
        match text {
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            "none" => ToolChoice::None,
            name => ToolChoice::Function(name.to_string()),
        }
    }

    fn to_wire(&self) -> wire::ChatCompletionToolChoiceOption {
        use wire::{ChatCompletionToolChoiceOption as C, ToolChoiceOptions as O};
        match self {
            ToolChoice::Auto => C::Mode(O::Auto),
            ToolChoice::Required => C::Mode(O::Required),
            ToolChoice::None => C::Mode(O::None),
            ToolChoice::Function(name) => C::Function(wire::ChatCompletionNamedToolChoice {
                function: wire::FunctionName { name: name.clone() },
            }),
        }
    }
}

/// One model call, as the engine builds it.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub temperature: f64,
    pub max_tokens: u32,
    /// Functions the model may call; sent as OpenAI `tools`.
    pub tools: Vec<ToolSpec>,
    /// Sent only with tools (providers refuse a `tool_choice` without `tools`).
    pub tool_choice: Option<ToolChoice>,
}

/// `request` as the JSON sent (numbers as written: the typed request holds temperature as
/// an f32, which a direct conversion would widen to 0.20000000298023224).
pub fn wire_json(request: &WireRequest) -> Value {
    serde_json::to_vec(request)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or(Value::Null)
}

/// A model call's request as the step journal keeps it (`agent_step.input`): `body`'s JSON
/// with `model` as its first member, so the rollups read the model from the text's first
/// bytes (`store::rollups::step_model`, migration 0038) instead of parsing a prompt that
/// grows with the conversation. The same members and values as the body sent; only their
/// order differs, which JSON gives no meaning.
pub fn journal_text(body: &Value) -> String {
    let (Value::Object(members), Some(model)) = (body, body.get("model")) else {
        return body.to_string();
    };
    let mut text = format!("{{\"model\":{model}");
    for (name, value) in members.iter().filter(|(name, _)| *name != "model") {
        text.push(',');
        text.push_str(&Value::from(name.as_str()).to_string());
        text.push(':');
        text.push_str(&value.to_string());
    }
    text.push('}');
    text
}

impl ChatRequest {
    /// The request body exactly as it is sent (journalled through `journal_text`).
    pub fn to_wire(&self) -> WireRequest {
        let tools: Vec<wire::ChatCompletionTools> = self
            .tools
            .iter()
            .map(|t| {
                wire::ChatCompletionTools::Function(wire::ChatCompletionTool {
                    function: wire::FunctionObject {
                        name: t.name.clone(),
                        description: (!t.description.is_empty()).then(|| t.description.clone()),
                        parameters: Some(t.parameters.clone()),
                        strict: None,
                    },
                })
            })
            .collect();
        let has_tools = !tools.is_empty();
        // `max_tokens` rather than `max_completion_tokens`: llama.cpp, vLLM, Ollama and most
        // OpenAI-compatible servers read only the former; OpenAI still accepts it.
        #[allow(deprecated)]
        WireRequest {
            model: self.model.clone(),
            messages: self.messages.iter().map(ChatMessage::to_wire).collect(),
            temperature: Some(self.temperature as f32),
            max_tokens: Some(self.max_tokens),
            stream: Some(false),
            tool_choice: if has_tools {
                self.tool_choice.as_ref().map(ToolChoice::to_wire)
            } else {
                None
            },
            tools: has_tools.then_some(tools),
            ..Default::default()
        }
    }
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

impl ChatResponse {
    /// The answer was cut at `max_tokens`.
    pub fn truncated(&self) -> bool {
        self.finish_reason.as_deref() == Some("length")
    }
}

/// Tokens of `text` as the history budget counts them: a byte in three (no tokenizer here;
/// English runs about four characters a token, CJK three bytes a character) plus the few
/// tokens a chat template adds around each message.
pub fn estimate_tokens(text: &str) -> usize {
    text.len() / 3 + 4
}

/// The history budget: `context.history_token_budget`, or less when the model's context
/// window leaves less room after the answer (`max_tokens`) and the system prompt.
pub fn history_budget(
    configured: usize,
    context_window: u32,
    max_tokens: u32,
    system: &str,
) -> usize {
    let room = (context_window as usize)
        .saturating_sub(max_tokens as usize)
        .saturating_sub(estimate_tokens(system));
    configured.min(room)
}

/// Tokens of a message as the budget counts them: its content and the calls it asks for.
pub fn message_tokens(message: &ChatMessage) -> usize {
    estimate_tokens(&message.content)
        + message
            .tool_calls
            .iter()
            .map(|c| estimate_tokens(&c.function.name) + estimate_tokens(&c.function.arguments))
            .sum::<usize>()
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
    pub(super) fn new(failure_type: FailureType, message: impl Into<String>) -> Self {
        LlmError {
            failure_type,
            message: message.into(),
            retry_after: None,
        }
    }
}
