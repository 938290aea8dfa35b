//! The events of a Matrix transaction as assistd reads them: questions with how they call
//! on the bot (mentions, replies, threads), invites, membership changes, reactions and typed
//! decisions.

use serde_json::Value;

use crate::channels::platform::Refused;
use crate::domain::{CardAction, NewMessage};

pub const CHANNEL: &str = "matrix";

/// One event of a transaction that concerns assistd.
#[derive(Debug, Clone)]
pub enum MatrixEvent {
    /// A text message, with how it calls on the bot as far as the event itself tells.
    Message { message: NewMessage, cue: Cue },
    /// The bot was invited to this room; `direct_with`: the inviter, when the invite marks
    /// the room a direct chat (`is_direct`).
    Invite {
        room: String,
        direct_with: Option<String>,
    },
    /// Someone joined, left or was invited to this room: what is known of its members is
    /// stale.
    Members(String),
    /// `approve 7.3` / `reject 7.3` sent by an approver.
    Decision(CardAction),
    /// A ✅ / ❌ (or 👍 / 👎) reaction by `approver` to the event `target`.
    Reaction {
        approver: String,
        approve: bool,
        target: String,
    },
}

/// How a message calls on the bot, as its event tells: a mention (`m.mentions.user_ids`,
/// the bot's ID in the body, or a pill to it in `formatted_body`), and the event it
/// replies to (`m.in_reply_to`), which may be one of the bot's.
#[derive(Debug, Clone, Default)]
pub struct Cue {
    pub mentioned: bool,
    pub in_reply_to: Option<String>,
    /// The thread the message is in (`m.thread`'s root event).
    pub thread: Option<String>,
}

/// The approval a reaction key stands for, if any.
fn reaction_decision(key: &str) -> Option<bool> {
    // Clients add a variation selector (U+FE0F) to some emoji; compare without it.
    match key.trim_end_matches('\u{fe0f}') {
        "✅" | "✔" | "👍" => Some(true),
        "❌" | "✖" | "👎" => Some(false),
        _ => None,
    }
}

/// Whether a message's content mentions `bot`: intentional mentions (`m.mentions`, client-
/// server API v1.7), the bot's user ID in the plain body, or a pill (a matrix.to link) to
/// it in the HTML body (`body` without a reply's quoted fallback, the HTML after its
/// `<mx-reply>`).
fn mentions(content: &Value, body: &str, bot: &str) -> bool {
    let pill = |html: &str| {
        html.contains(&format!("matrix.to/#/{bot}"))
            || html.contains(&format!("matrix.to/#/{}", bot.replacen('@', "%40", 1)))
    };
    content["m.mentions"]["user_ids"]
        .as_array()
        .is_some_and(|ids| ids.iter().any(|id| id == bot))
        || body.contains(bot)
        || content["formatted_body"]
            .as_str()
            .map(|html| html.split("</mx-reply>").last().unwrap_or(html))
            .is_some_and(pill)
}

/// The text without the name it opens with when it addresses the bot: clients write a
/// mention as the bot's display name (`assistd: …`), which is the pill's text in the HTML
/// body, or else most often the localpart of its ID.
fn without_address(body: &str, content: &Value, bot: &str) -> String {
    let body = body.trim_start_matches([':', ',', ' ']);
    let localpart = bot.trim_start_matches('@').split(':').next().unwrap_or("");
    let pill = content["formatted_body"].as_str().and_then(|html| {
        let link = html
            .find(&format!("matrix.to/#/{bot}"))
            .or_else(|| html.find(&format!("matrix.to/#/{}", bot.replacen('@', "%40", 1))))?;
        let rest = &html[link..];
        let start = rest.find('>')? + 1;
        let end = rest.find("</a>")?;
        (start <= end).then(|| rest[start..end].trim().to_string())
    });
    for name in pill.iter().map(String::as_str).chain([localpart]) {
        if name.is_empty() {
            continue;
        }
        let head: String = body.chars().take(name.chars().count()).collect();
        if head.to_lowercase() == name.to_lowercase() {
            let rest = &body[head.len()..];
            if rest.starts_with([':', ',', '：', '，']) {
                return rest
                    .trim_start_matches([':', ',', ' ', '：', '，'])
                    .trim()
                    .to_string();
            }
        }
    }
    body.trim().to_string()
}

/// A reply's own text: without the quoted fallback (`> <@user> …` lines and the blank line
/// after them) that clients put before a rich reply.
fn without_reply_fallback(body: &str) -> &str {
    if !body.starts_with('>') {
        return body;
    }
    match body.find("\n\n") {
        Some(end) if body[..end].lines().all(|l| l.starts_with('>')) => &body[end + 2..],
        _ => body,
    }
}

/// Parses a verified transaction body.
pub fn parse(body: &[u8], bot_user_id: &str) -> Result<Vec<MatrixEvent>, Refused> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Refused::BadRequest(format!("body is not valid JSON: {e}")))?;
    let events = v["events"]
        .as_array()
        .ok_or_else(|| Refused::BadRequest("missing array field `events`".into()))?;
    let mut out = Vec::new();
    for event in events {
        let room = event["room_id"].as_str().unwrap_or("");
        match event["type"].as_str() {
            Some("m.room.member")
                if event["state_key"].as_str() == Some(bot_user_id)
                    && event["content"]["membership"].as_str() == Some("invite") =>
            {
                let direct_with = (event["content"]["is_direct"] == true)
                    .then(|| event["sender"].as_str().map(str::to_string))
                    .flatten();
                out.push(MatrixEvent::Invite {
                    room: room.to_string(),
                    direct_with,
                });
            }
            Some("m.room.member") if !room.is_empty() => {
                out.push(MatrixEvent::Members(room.to_string()));
            }
            Some("m.reaction") => {
                let sender = event["sender"].as_str().unwrap_or("");
                let relates = &event["content"]["m.relates_to"];
                let target = relates["event_id"].as_str().unwrap_or("");
                if sender.is_empty()
                    || sender == bot_user_id
                    || target.is_empty()
                    || relates["rel_type"].as_str() != Some("m.annotation")
                {
                    continue;
                }
                if let Some(approve) = relates["key"].as_str().and_then(reaction_decision) {
                    out.push(MatrixEvent::Reaction {
                        approver: sender.to_string(),
                        approve,
                        target: target.to_string(),
                    });
                }
            }
            Some("m.room.message") => out.extend(message_event(event, room, bot_user_id)),
            _ => {}
        }
    }
    Ok(out)
}

/// The event an `m.room.message` is for assistd: a question (with its cue), a typed
/// decision, or nothing (the bot's own, a notice, an edit, an empty text).
fn message_event(event: &Value, room: &str, bot_user_id: &str) -> Option<MatrixEvent> {
    let sender = event["sender"].as_str().unwrap_or("");
    let event_id = event["event_id"].as_str().unwrap_or("");
    let content = &event["content"];
    if sender.is_empty() || sender == bot_user_id || event_id.is_empty() || room.is_empty() {
        return None;
    }
    // Notices are what bots send; only a person's text is a question.
    if content["msgtype"].as_str() != Some("m.text") {
        return None;
    }
    // An edit (`m.replace`) arrives as a new `m.room.message`: it is not a new
    // question.
    if content["m.relates_to"]["rel_type"] == "m.replace" || content.get("m.new_content").is_some()
    {
        return None;
    }
    let relates = &content["m.relates_to"];
    let in_reply_to = relates["m.in_reply_to"]["event_id"]
        .as_str()
        .map(str::to_string);
    let thread = (relates["rel_type"] == "m.thread")
        .then(|| relates["event_id"].as_str().map(str::to_string))
        .flatten();
    // In a thread, `m.in_reply_to` is a real reply only when the client does
    // not mark it as the thread's fallback.
    let in_reply_to = in_reply_to
        .filter(|_| thread.is_none() || relates["is_falling_back"].as_bool() != Some(true));
    let body = content["body"].as_str().unwrap_or("");
    let body = if in_reply_to.is_some() {
        without_reply_fallback(body)
    } else {
        body
    };
    let text = without_address(&body.replace(bot_user_id, ""), content, bot_user_id);
    if text.is_empty() {
        return None;
    }
    if let Some((approve, request)) = crate::channels::platform::parse_decision_command(&text) {
        return Some(MatrixEvent::Decision(CardAction {
            request,
            approve,
            approver: sender.to_string(),
        }));
    }
    Some(MatrixEvent::Message {
        cue: Cue {
            mentioned: mentions(content, body, bot_user_id),
            in_reply_to,
            thread,
        },
        message: NewMessage {
            reply_context: None,
            channel: CHANNEL.into(),
            event_id: event_id.to_string(),
            message_id: event_id.to_string(),
            conversation_id: room.to_string(),
            sender_id: sender.to_string(),
            sender_name: None,
            text,
            trace_context: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mentions_replies_and_members() {
        let body = br#"{"events": [
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m1", "content": {"msgtype": "m.text", "body": "bot: hi", "m.mentions": {"user_ids": ["@bot:hs"]}}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m2", "content": {"msgtype": "m.text", "body": "bot: hi", "format": "org.matrix.custom.html", "formatted_body": "<a href=\"https://matrix.to/#/%40bot:hs\">bot</a>: hi"}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m3", "content": {"msgtype": "m.text", "body": "> <@bot:hs> the office is on floor 3\n\nand the canteen?", "m.relates_to": {"m.in_reply_to": {"event_id": "$a1"}}}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m4", "content": {"msgtype": "m.text", "body": "lunch?"}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m5", "content": {"msgtype": "m.notice", "body": "a bot's notice"}},
            {"type": "m.room.message", "room_id": "!g:hs", "sender": "@ada:hs", "event_id": "$m6", "content": {"msgtype": "m.text", "body": "* lunch!", "m.new_content": {"msgtype": "m.text", "body": "lunch!"}, "m.relates_to": {"rel_type": "m.replace", "event_id": "$m4"}}},
            {"type": "m.room.member", "room_id": "!g:hs", "sender": "@bob:hs", "state_key": "@bob:hs", "event_id": "$j", "content": {"membership": "join"}},
            {"type": "m.room.member", "room_id": "!dm:hs", "sender": "@ada:hs", "state_key": "@bot:hs", "event_id": "$i", "content": {"membership": "invite", "is_direct": true}}
        ]}"#;
        let events = parse(body, "@bot:hs").unwrap();
        let cues: Vec<(String, bool, Option<String>)> = events
            .iter()
            .filter_map(|e| match e {
                MatrixEvent::Message { message, cue } => {
                    Some((message.text.clone(), cue.mentioned, cue.in_reply_to.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            cues,
            vec![
                ("hi".into(), true, None),
                ("hi".into(), true, None),
                ("and the canteen?".into(), false, Some("$a1".into())),
                ("lunch?".into(), false, None),
            ],
            "notices and edits are no questions; a reply loses its quoted fallback"
        );
        assert!(matches!(&events[4], MatrixEvent::Members(r) if r == "!g:hs"));
        assert!(matches!(
            &events[5],
            MatrixEvent::Invite { room, direct_with: Some(with) } if room == "!dm:hs" && with == "@ada:hs"
        ));
    }
}
