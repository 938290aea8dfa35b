//! What a finished task says in the chat: the model's answer as text or card, or a short
//! failure notice. Both go out as the task's one outbox reply.

use serde_json::{Value, json};

use crate::domain::{FailureType, ReplyType};

/// Card types the model may answer with instead of plain text.
pub const CARD_TYPES: &[&str] = &["knowledge_answer", "agent_result"];

/// The text a model answer gives the chat: its content, or the agent's `fallback_text` when
/// the content is empty. An empty answer without a fallback is an INVALID_RESPONSE failure,
/// never an empty chat message.
pub fn answer_text(
    answer: &crate::llm::ChatResponse,
    fallback: &str,
) -> Result<String, (FailureType, String)> {
    if !answer.content.trim().is_empty() {
        return Ok(answer.content.clone());
    }
    if !fallback.trim().is_empty() {
        return Ok(fallback.to_string());
    }
    Err((
        FailureType::InvalidResponse,
        if answer.truncated() {
            "the model used all of max_tokens before it answered (raise the agent's max_tokens)"
                .into()
        } else {
            "the model's answer was empty (set the agent's fallback_text to answer something instead)"
                .into()
        },
    ))
}

/// Reads a model answer: a JSON object with a known `card_type` (optionally inside a
/// Markdown json code fence) is a card, anything else is text. Returns the reply type and the outbox
/// content `{"text": ..., "card": ...}`; cards always carry a text fallback.
pub fn compose_answer(answer: &str) -> (ReplyType, Value) {
    if let Some(card) = parse_card(answer) {
        let fallback = ["text", "summary", "answer", "title"]
            .iter()
            .find_map(|k| card.get(*k).and_then(Value::as_str))
            .map(str::to_string)
            .unwrap_or_else(|| answer.trim().to_string());
        return (ReplyType::Card, json!({ "text": fallback, "card": card }));
    }
    (ReplyType::Text, json!({ "text": answer.trim() }))
}

fn parse_card(answer: &str) -> Option<Value> {
    let trimmed = answer.trim();
    let body = trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|rest| rest.trim_end().strip_suffix("```"))
        .unwrap_or(trimmed)
        .trim();
    if !body.starts_with('{') {
        return None;
    }
    let value: Value = serde_json::from_str(body).ok()?;
    let card_type = value.get("card_type")?.as_str()?;
    CARD_TYPES.contains(&card_type).then_some(value)
}

/// The failure notice for a task, from the `replies.failure_notice` template.
pub fn failure_notice(template: &str, task_id: i64, failure_type: FailureType) -> Value {
    let text = template
        .replace("{task_id}", &task_id.to_string())
        .replace("{failure_type}", failure_type.as_str());
    json!({ "text": text })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_and_text() {
        let (t, c) = compose_answer("  hello ");
        assert_eq!(t, ReplyType::Text);
        assert_eq!(c["text"], "hello");
        let (t, c) = compose_answer(r#"{"card_type":"knowledge_answer","title":"T","answer":"A"}"#);
        assert_eq!(t, ReplyType::Card);
        assert_eq!(c["text"], "A");
        assert_eq!(c["card"]["title"], "T");
        let (t, _) =
            compose_answer("```json\n{\"card_type\":\"agent_result\",\"summary\":\"s\"}\n```");
        assert_eq!(t, ReplyType::Card);
        let (t, _) = compose_answer(r#"{"card_type":"other"}"#);
        assert_eq!(t, ReplyType::Text);
    }
}
