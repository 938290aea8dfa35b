//! The chat console: a browser page that is a channel like the others. Its messages go
//! through intake, tasks and the outbox; its "send" is the outbox row itself, which the page
//! reads back.

use crate::domain::NewMessage;

pub const CHANNEL: &str = "console";
/// Longest console message, in bytes.
pub const MAX_TEXT: usize = 8000;

/// A console message; the error names the bad field.
pub fn message(conversation_id: &str, text: &str) -> Result<NewMessage, String> {
    let conversation_id = conversation_id.trim();
    if conversation_id.is_empty() || conversation_id.len() > 64 {
        return Err("field `conversation_id` must be 1 to 64 characters".into());
    }
    let text = text.trim();
    if text.is_empty() {
        return Err("field `text` must not be empty".into());
    }
    if text.len() > MAX_TEXT {
        return Err(format!("field `text` is longer than {MAX_TEXT} bytes"));
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    Ok(NewMessage {
        channel: CHANNEL.into(),
        event_id: id.clone(),
        message_id: id,
        conversation_id: conversation_id.to_string(),
        sender_id: "console".into(),
        sender_name: Some("console".into()),
        text: text.to_string(),
        reply_context: None,
        trace_context: None,
    })
}
