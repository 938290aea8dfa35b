//! Stateful doubles of the platforms' message APIs, sends and edits together, held to what
//! each platform documents: a message can only be edited once it exists, by its id, in its
//! chat; an edit must carry what the platform requires; every answer is the platform's own
//! shape. Every test that sends through these platforms uses them (see `platform_api`,
//! `lark_api`, `matrix_homeserver`).
//!
//! Sources: Telegram Bot API (`sendMessage`, `editMessageText` and its "message is not
//! modified" refusal), Slack Web API (`chat.postMessage`, `chat.update` and their `no_text`,
//! `message_not_found`, `cant_update_message` errors; `conversations.history` and
//! `conversations.replies` with `include_all_metadata`), Lark Open API (reply to a message,
//! `PATCH /im/v1/messages/{id}`, which only updates cards sent as shared cards —
//! `config.update_multi`), Matrix client-server API (room send with transaction ids,
//! event replacements `m.replace` with `m.new_content`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use wiremock::{Request, Respond, ResponseTemplate};

/// One message a double holds: its chat, what it shows, and its kind.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub chat: String,
    pub content: Value,
    /// Lark: `interactive` or `text`; Matrix: the sender.
    pub kind: String,
}

#[derive(Default)]
pub(crate) struct Messages {
    next: u64,
    by_id: HashMap<String, Held>,
    /// Idempotency keys already used (Lark `uuid`, Matrix transaction ids) → message id.
    keys: HashMap<String, String>,
}

type Shared = Arc<Mutex<Messages>>;

fn body_of(request: &Request) -> Value {
    serde_json::from_slice(&request.body).unwrap_or(Value::Null)
}

/// The visible text of a message in Telegram's HTML parse mode (Bot API, "Formatting
/// options", HTML style), or why Telegram refuses it: only the tags it lists (`b`, `strong`,
/// `i`, `em`, `u`, `ins`, `s`, `strike`, `del`, `span class="tg-spoiler"`, `tg-spoiler`, `a
/// href`, `code`, `pre`, `blockquote`, `tg-emoji`), each closed in order; every `<`, `>` and
/// `&` that is not part of a tag or an entity must be written as an entity, and only `&lt;`,
/// `&gt;`, `&amp;`, `&quot;` and numeric entities are known.
pub(crate) fn telegram_html_entities(text: &str) -> Result<String, String> {
    const TAGS: [&str; 15] = [
        "b",
        "strong",
        "i",
        "em",
        "u",
        "ins",
        "s",
        "strike",
        "del",
        "span",
        "tg-spoiler",
        "a",
        "code",
        "pre",
        "blockquote",
    ];
    let mut visible = String::new();
    let mut open: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        let at = text.len() - rest.len();
        match c {
            '<' => {
                let end = rest
                    .find('>')
                    .ok_or(format!("unclosed start tag at byte offset {at}"))?;
                let tag = &rest[1..end];
                if let Some(name) = tag.strip_prefix('/') {
                    let name = name.trim().to_lowercase();
                    match open.pop() {
                        Some(top) if top == name => {}
                        Some(top) => {
                            return Err(format!(
                                "Can't find end tag corresponding to start tag \"{top}\""
                            ));
                        }
                        None => return Err(format!("Unexpected end tag at byte offset {at}")),
                    }
                } else {
                    let name = tag.split_whitespace().next().unwrap_or("").to_lowercase();
                    if !TAGS.contains(&name.as_str()) && name != "tg-emoji" {
                        return Err(format!(
                            "Unsupported start tag \"{name}\" at byte offset {at}"
                        ));
                    }
                    open.push(name);
                }
                rest = &rest[end + 1..];
            }
            '>' => return Err(format!("character '>' is reserved at byte offset {at}")),
            '&' => {
                let end = rest
                    .find(';')
                    .filter(|e| *e <= 10)
                    .ok_or(format!("character '&' is reserved at byte offset {at}"))?;
                let decoded = match &rest[1..end] {
                    "lt" => '<',
                    "gt" => '>',
                    "amp" => '&',
                    "quot" => '"',
                    numeric if numeric.starts_with('#') => {
                        let n = numeric[1..]
                            .strip_prefix(['x', 'X'])
                            .map(|h| u32::from_str_radix(h, 16))
                            .unwrap_or_else(|| numeric[1..].parse());
                        n.ok()
                            .and_then(char::from_u32)
                            .ok_or(format!("bad numeric entity at byte offset {at}"))?
                    }
                    other => {
                        return Err(format!(
                            "Unsupported HTML entity \"&{other};\" at byte offset {at}"
                        ));
                    }
                };
                visible.push(decoded);
                rest = &rest[end + 1..];
            }
            c => {
                visible.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    match open.pop() {
        Some(top) => Err(format!(
            "Can't find end tag corresponding to start tag \"{top}\""
        )),
        None => Ok(visible),
    }
}

/// Telegram `sendMessage` and `editMessageText` on one message store; ids start at 99.
#[derive(Clone, Default)]
pub(crate) struct TelegramMessages(Shared);

impl Respond for TelegramMessages {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body = body_of(request);
        let refuse = |description: &str| {
            ResponseTemplate::new(400).set_body_json(json!({
                "ok": false, "error_code": 400, "description": format!("Bad Request: {description}")
            }))
        };
        let chat = match &body["chat_id"] {
            Value::String(s) if !s.is_empty() => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => return refuse("chat not found"),
        };
        let Some(text) = body["text"].as_str().filter(|t| !t.trim().is_empty()) else {
            return refuse("message text is empty");
        };
        let visible = match body["parse_mode"].as_str() {
            None => text.to_string(),
            Some("HTML") => match telegram_html_entities(text) {
                Ok(visible) => visible,
                Err(e) => return refuse(&format!("can't parse entities: {e}")),
            },
            Some(other) => return refuse(&format!("unsupported parse_mode {other}")),
        };
        // "1-4096 characters after entities parsing", counted as UTF-16 code units.
        if visible.encode_utf16().count() > 4096 {
            return refuse(if request.url.path().ends_with("/editMessageText") {
                "MESSAGE_TOO_LONG"
            } else {
                "message is too long"
            });
        }
        let shown =
            json!({ "text": text, "reply_markup": body["reply_markup"], "visible": visible });
        let mut messages = self.0.lock().unwrap();
        let id = if request.url.path().ends_with("/editMessageText") {
            let id = match &body["message_id"] {
                Value::Number(n) => n.to_string(),
                _ => return refuse("message identifier is not specified"),
            };
            match messages.by_id.get_mut(&id) {
                Some(held) if held.chat == chat => {
                    if held.content == shown {
                        return refuse(
                            "message is not modified: specified new message content and reply markup of the message are exactly the same as a current content and reply markup of the message",
                        );
                    }
                    held.content = shown;
                }
                _ => return refuse("message to edit not found"),
            }
            id
        } else {
            let id = (99 + messages.next).to_string();
            messages.next += 1;
            messages.by_id.insert(
                id.clone(),
                Held {
                    chat: chat.clone(),
                    content: shown,
                    kind: "text".into(),
                },
            );
            id
        };
        ResponseTemplate::new(200).set_body_json(json!({"ok": true, "result": {
            "message_id": id.parse::<i64>().unwrap(), "date": 1,
            "chat": {"id": chat.parse::<i64>().unwrap_or(0), "type": "group"}, "text": text
        }}))
    }
}

/// Slack `chat.postMessage` and `chat.update` on one message store (`ts` 1700.000N).
#[derive(Clone, Default)]
pub(crate) struct SlackMessages(Shared);

impl SlackMessages {
    /// A user deletes the message `ts`.
    pub(crate) fn delete(&self, ts: &str) {
        self.0.lock().unwrap().by_id.remove(ts);
    }
}

impl Respond for SlackMessages {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let error =
            |e: &str| ResponseTemplate::new(200).set_body_json(json!({"ok": false, "error": e}));
        let authed = request
            .headers
            .get("authorization")
            .is_some_and(|v| v.to_str().unwrap_or("").starts_with("Bearer xoxb-"));
        if !authed {
            return error("not_authed");
        }
        if request.method.as_str() == "GET" {
            return self.read(request);
        }
        let body = body_of(request);
        let Some(channel) = body["channel"].as_str().filter(|c| !c.is_empty()) else {
            return error("channel_not_found");
        };
        let text = body["text"].as_str().unwrap_or("");
        let blocks_ok = body["blocks"].as_array().is_some_and(|b| !b.is_empty());
        if text.is_empty() && !blocks_ok {
            return error("no_text");
        }
        // chat.postMessage: messages over 40,000 characters are refused (`msg_too_long`);
        // a section block's text holds at most 3,000.
        if text.chars().count() > 40_000 {
            return error("msg_too_long");
        }
        let long_section = body["blocks"].as_array().is_some_and(|blocks| {
            blocks.iter().any(|b| {
                b["text"]["text"]
                    .as_str()
                    .is_some_and(|t| t.chars().count() > 3000)
            })
        });
        if long_section {
            return error("invalid_blocks");
        }
        let mut shown = json!({ "text": text, "blocks": body["blocks"] });
        let mut messages = self.0.lock().unwrap();
        let ts = if request.url.path() == "/chat.update" {
            let Some(ts) = body["ts"].as_str() else {
                return error("message_not_found");
            };
            match messages.by_id.get_mut(ts) {
                Some(held) if held.chat == channel => {
                    // An update keeps the message's thread and its metadata unless given.
                    for kept in ["thread_ts", "metadata"] {
                        shown[kept] = body.get(kept).unwrap_or(&held.content[kept]).clone();
                    }
                    held.content = shown
                }
                Some(_) => return error("cant_update_message"),
                None => return error("message_not_found"),
            }
            ts.to_string()
        } else {
            messages.next += 1;
            let ts = format!("1700.{:04}", messages.next);
            shown["thread_ts"] = body["thread_ts"].clone();
            shown["metadata"] = body["metadata"].clone();
            messages.by_id.insert(
                ts.clone(),
                Held {
                    chat: channel.to_string(),
                    content: shown,
                    kind: "text".into(),
                },
            );
            ts
        };
        ResponseTemplate::new(200).set_body_json(
            json!({"ok": true, "channel": channel, "ts": ts, "message": {"text": text, "ts": ts}}),
        )
    }
}

impl SlackMessages {
    /// `conversations.history` (a channel's top-level messages, newest first) and
    /// `conversations.replies` (a thread's messages, oldest first; `ts` is required and
    /// names the thread's parent) over the messages the bot posted, each with its
    /// `metadata` only under `include_all_metadata=true`, at most `limit` (history: 100 by
    /// default, 999 at most; replies: 1,000).
    fn read(&self, request: &Request) -> ResponseTemplate {
        let error =
            |e: &str| ResponseTemplate::new(200).set_body_json(json!({"ok": false, "error": e}));
        let query: HashMap<String, String> = request.url.query_pairs().into_owned().collect();
        let Some(channel) = query.get("channel").filter(|c| !c.is_empty()) else {
            return error("channel_not_found");
        };
        let metadata = query.get("include_all_metadata").map(String::as_str) == Some("true");
        let replies = request.url.path() == "/conversations.replies";
        let thread = query.get("ts").cloned().unwrap_or_default();
        if replies && thread.is_empty() {
            return error("thread_not_found");
        }
        let (default, max) = if replies { (1000, 1000) } else { (100, 999) };
        let limit = query
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .unwrap_or(default)
            .min(max);
        let held = self.0.lock().unwrap();
        let mut found: Vec<(&String, &Held)> = held
            .by_id
            .iter()
            .filter(|(ts, m)| {
                let parent = m.content["thread_ts"].as_str();
                m.chat == *channel
                    && if replies {
                        **ts == thread || parent == Some(thread.as_str())
                    } else {
                        parent.is_none()
                    }
            })
            .collect();
        found.sort_by(|a, b| a.0.cmp(b.0));
        if !replies {
            found.reverse();
        }
        let messages: Vec<Value> = found
            .into_iter()
            .take(limit)
            .map(|(ts, m)| {
                let mut message = json!({"type": "message", "ts": ts, "text": m.content["text"]});
                if let Some(parent) = m.content["thread_ts"].as_str() {
                    message["thread_ts"] = json!(parent);
                }
                if metadata && m.content["metadata"].is_object() {
                    message["metadata"] = m.content["metadata"].clone();
                }
                message
            })
            .collect();
        ResponseTemplate::new(200)
            .set_body_json(json!({"ok": true, "messages": messages, "has_more": false}))
    }
}

/// Lark's rich text (`post`) content: `{"<locale>": {"title"?, "content": [[{"tag": …}]]}}`,
/// tags `text`, `a`, `at`, `img`, `media`, `emotion`, `hr`, `code_block` and `md` (Markdown,
/// which Lark renders), each paragraph an array of elements.
fn lark_post_valid(content: &Value) -> bool {
    const TAGS: [&str; 9] = [
        "text",
        "a",
        "at",
        "img",
        "media",
        "emotion",
        "hr",
        "code_block",
        "md",
    ];
    let Some(locales) = content.as_object().filter(|o| !o.is_empty()) else {
        return false;
    };
    locales.values().all(|locale| {
        locale["content"].as_array().is_some_and(|paragraphs| {
            paragraphs.iter().all(|p| {
                p.as_array().is_some_and(|elements| {
                    elements.iter().all(|e| {
                        e["tag"].as_str().is_some_and(|t| TAGS.contains(&t))
                            && (e["tag"] != "md" || e["text"].is_string())
                    })
                })
            })
        })
    })
}

/// Lark: replies to a message (`POST /im/v1/messages/{id}/reply`, `uuid` dropping a repeat
/// within the hour, an optional boolean `reply_in_thread`), getting one (`GET
/// /im/v1/messages/{id}`, its sender the app) and card updates (`PATCH /im/v1/messages/{id}`), ids `om_<n>`.
#[derive(Clone, Default)]
pub(crate) struct LarkMessages(Shared);

impl Respond for LarkMessages {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let refuse = |code: i64, msg: &str| {
            ResponseTemplate::new(400).set_body_json(json!({"code": code, "msg": msg}))
        };
        let authed = request
            .headers
            .get("authorization")
            .is_some_and(|v| v.to_str().unwrap_or("") == "Bearer t-abc");
        if !authed {
            return ResponseTemplate::new(400)
                .set_body_json(json!({"code": 99991663, "msg": "Invalid access token"}));
        }
        if request.method.as_str() == "GET" {
            // Get a message: the app's own messages, as sent through this double.
            let id = request.url.path().rsplit('/').next().unwrap_or("");
            let messages = self.0.lock().unwrap();
            return match messages.by_id.get(id) {
                Some(held) => ResponseTemplate::new(200).set_body_json(json!({
                    "code": 0, "msg": "success", "data": {"items": [{
                        "message_id": id, "msg_type": held.kind,
                        "sender": {"id": "cli_x", "id_type": "app_id", "sender_type": "app"},
                        "body": {"content": held.content.to_string()}}]}})),
                None => refuse(230011, "the message was not found"),
            };
        }
        let body = body_of(request);
        // A card's request body holds at most 30 KB, a text or post message's 150 KB.
        let card = body["msg_type"] == "interactive" || request.method.as_str() == "PATCH";
        let max = if card { 30 * 1024 } else { 150 * 1024 };
        if request.body.len() > max {
            return refuse(230025, "the message content exceeds the length limit");
        }
        let Some(content) = body["content"]
            .as_str()
            .and_then(|c| serde_json::from_str::<Value>(c).ok())
        else {
            return refuse(230001, "content is not a JSON string");
        };
        let path = request.url.path();
        let mut messages = self.0.lock().unwrap();
        if request.method.as_str() == "PATCH" {
            let id = path.rsplit('/').next().unwrap_or("");
            let Some(held) = messages.by_id.get_mut(id) else {
                return refuse(230011, "the message was not found");
            };
            if held.kind != "interactive" {
                return refuse(230001, "only cards can be updated with PATCH");
            }
            if held.content["config"]["update_multi"] != true
                || content["config"]["update_multi"] != true
            {
                return refuse(
                    230099,
                    "only shared cards (config.update_multi) can be updated",
                );
            }
            held.content = content;
            return ResponseTemplate::new(200)
                .set_body_json(json!({"code": 0, "msg": "success", "data": {}}));
        }
        let Some(msg_type) = body["msg_type"].as_str() else {
            return refuse(230001, "msg_type is required");
        };
        if !["text", "post", "interactive"].contains(&msg_type) {
            return refuse(230001, "unsupported msg_type");
        }
        if body["uuid"]
            .as_str()
            .is_some_and(|u| u.chars().count() > 50)
        {
            return refuse(230001, "uuid is longer than 50 characters");
        }
        // A post: locales, each with `content`, paragraphs of elements with a known `tag`.
        if body["msg_type"] == "post" && !lark_post_valid(&content) {
            return refuse(230001, "invalid message content");
        }
        // `reply_in_thread`: an optional boolean (reply in the message's thread, opening one).
        if body.get("reply_in_thread").is_some_and(|v| !v.is_boolean()) {
            return refuse(230001, "reply_in_thread must be a boolean");
        }
        let uuid = body["uuid"].as_str().map(str::to_string);
        let id = match uuid.as_ref().and_then(|u| messages.keys.get(u)) {
            Some(id) => id.clone(),
            None => {
                messages.next += 1;
                let id = format!("om_{}", messages.next);
                let parent = path.split('/').nth(5).unwrap_or("").to_string();
                messages.by_id.insert(
                    id.clone(),
                    Held {
                        chat: parent,
                        content,
                        kind: msg_type.to_string(),
                    },
                );
                if let Some(u) = uuid {
                    messages.keys.insert(u, id.clone());
                }
                id
            }
        };
        ResponseTemplate::new(200)
            .set_body_json(json!({"code": 0, "msg": "success", "data": {"message_id": id}}))
    }
}

/// Matrix room sends (`PUT /rooms/{room}/send/m.room.message/{txnId}`): a repeated
/// transaction id answers the first event, an `m.replace` must name an event of the same
/// room and sender and carry `m.new_content`; event ids `$e<n>`.
#[derive(Clone, Default)]
pub(crate) struct MatrixRoomSends(Shared);

impl Respond for MatrixRoomSends {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let refuse = |status: u16, errcode: &str, error: &str| {
            ResponseTemplate::new(status).set_body_json(json!({"errcode": errcode, "error": error}))
        };
        let token = request
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if token != "Bearer as-token" {
            return refuse(401, "M_UNKNOWN_TOKEN", "unknown token");
        }
        let path = request.url.path().to_string();
        let mut parts = path.split('/');
        let room = parts.nth(5).unwrap_or("").to_string();
        let txn = path.rsplit('/').next().unwrap_or("").to_string();
        let body = body_of(request);
        // An event's JSON holds at most 65,536 bytes (client-server API, "Size limits");
        // the room send's content is the bulk of it.
        if request.body.len() > 65_536 - 512 {
            return refuse(413, "M_TOO_LARGE", "event too large");
        }
        let well_formed = |c: &Value| c["msgtype"].is_string() && c["body"].is_string();
        if !well_formed(&body) {
            return refuse(400, "M_BAD_JSON", "msgtype and body are required");
        }
        let mut messages = self.0.lock().unwrap();
        if let Some(id) = messages.keys.get(&format!("{token}/{txn}")) {
            return ResponseTemplate::new(200).set_body_json(json!({"event_id": id}));
        }
        if body["m.relates_to"]["rel_type"] == "m.replace" {
            let target = body["m.relates_to"]["event_id"].as_str().unwrap_or("");
            match messages.by_id.get(target) {
                Some(held) if held.chat == room && held.kind == token => {}
                Some(_) => {
                    return refuse(
                        400,
                        "M_BAD_JSON",
                        "an edit must be of the sender's own event in the room",
                    );
                }
                None => return refuse(400, "M_BAD_JSON", "the replaced event is unknown"),
            }
            if !well_formed(&body["m.new_content"]) {
                return refuse(
                    400,
                    "M_BAD_JSON",
                    "an edit needs m.new_content with msgtype and body",
                );
            }
            let new = body["m.new_content"].clone();
            if let Some(held) = messages.by_id.get_mut(target) {
                held.content = new;
            }
        }
        messages.next += 1;
        let id = format!("$e{}", messages.next);
        let edit = body["m.relates_to"]["rel_type"] == "m.replace";
        if !edit {
            messages.by_id.insert(
                id.clone(),
                Held {
                    chat: room,
                    content: body,
                    kind: token.clone(),
                },
            );
        }
        messages.keys.insert(format!("{token}/{txn}"), id.clone());
        ResponseTemplate::new(200).set_body_json(json!({"event_id": id}))
    }
}

/// A path segment as the client encoded it, decoded.
fn decoded(segment: &str) -> String {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8_lossy()
        .into_owned()
}

/// What a Matrix homeserver knows of rooms and of the bot's account data, for the
/// application service acting as the bot (`as-token`, user `@assistd:hs`): `GET
/// /rooms/{room}/joined_members` (403 `M_FORBIDDEN` unless the bot has joined), `GET`/`PUT
/// /user/{user}/account_data/m.direct` (404 `M_NOT_FOUND` until set; only the bot's own),
/// `POST /rooms/{room}/join` (403 unless the bot was invited), `GET /rooms/{room}/event/
/// {id}` (the bot's sent events, from the room-send double; 404 `M_NOT_FOUND` otherwise).
/// Client-server API v1.x, "Rooms: joined_members", "Client config", "Room membership",
/// "Getting events for a room".
#[derive(Clone)]
pub(crate) struct MatrixRooms {
    state: Arc<Mutex<RoomState>>,
    sent: Shared,
}

#[derive(Default)]
struct RoomState {
    /// Room → joined members.
    joined: HashMap<String, Vec<String>>,
    /// Room → invited, not yet joined.
    invited: HashMap<String, Vec<String>>,
    direct: Option<Value>,
}

pub(crate) const MATRIX_BOT: &str = "@assistd:hs";

impl MatrixRooms {
    pub(crate) fn new(sends: &MatrixRoomSends) -> Self {
        MatrixRooms {
            state: Arc::default(),
            sent: sends.0.clone(),
        }
    }

    /// A room the bot has joined with `members`, marked direct with `direct_with`.
    pub(crate) fn room(&self, room: &str, members: &[&str], direct_with: Option<&str>) {
        let mut state = self.state.lock().unwrap();
        let mut joined: Vec<String> = members.iter().map(|m| m.to_string()).collect();
        joined.push(MATRIX_BOT.into());
        state.joined.insert(room.into(), joined);
        if let Some(with) = direct_with {
            let direct = state.direct.get_or_insert_with(|| json!({}));
            let rooms = direct[with].as_array().cloned().unwrap_or_default();
            direct[with] = Value::Array(rooms.into_iter().chain([json!(room)]).collect());
        }
    }

    /// A room `members` are in, to which the bot is invited.
    pub(crate) fn invite(&self, room: &str, members: &[&str]) {
        let mut state = self.state.lock().unwrap();
        state
            .joined
            .insert(room.into(), members.iter().map(|m| m.to_string()).collect());
        state.invited.insert(room.into(), vec![MATRIX_BOT.into()]);
    }

    pub(crate) fn join(&self, room: &str, user: &str) {
        let mut state = self.state.lock().unwrap();
        state
            .joined
            .entry(room.into())
            .or_default()
            .push(user.into());
    }

    /// The bot's `m.direct` account data.
    pub(crate) fn direct(&self) -> Value {
        self.state
            .lock()
            .unwrap()
            .direct
            .clone()
            .unwrap_or(Value::Null)
    }
}

impl Respond for MatrixRooms {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let refuse = |status: u16, errcode: &str, error: &str| {
            ResponseTemplate::new(status).set_body_json(json!({"errcode": errcode, "error": error}))
        };
        if request
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            != Some("Bearer as-token")
        {
            return refuse(401, "M_UNKNOWN_TOKEN", "unknown token");
        }
        let segments: Vec<String> = request.url.path().split('/').map(decoded).collect();
        let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
        let method = request.method.as_str();
        let mut state = self.state.lock().unwrap();
        match (method, &segments[..]) {
            (
                "GET",
                [
                    "",
                    "_matrix",
                    "client",
                    "v3",
                    "rooms",
                    room,
                    "joined_members",
                ],
            ) => match state.joined.get(*room) {
                Some(members) if members.iter().any(|m| m == MATRIX_BOT) => {
                    let joined: serde_json::Map<String, Value> = members
                        .iter()
                        .map(|m| (m.clone(), json!({"display_name": null, "avatar_url": null})))
                        .collect();
                    ResponseTemplate::new(200).set_body_json(json!({ "joined": joined }))
                }
                _ => refuse(403, "M_FORBIDDEN", "You aren't a member of the room"),
            },
            ("POST", ["", "_matrix", "client", "v3", "rooms", room, "join"]) => {
                let invited = state
                    .invited
                    .get(*room)
                    .is_some_and(|users| users.iter().any(|u| u == MATRIX_BOT));
                if !invited {
                    return refuse(403, "M_FORBIDDEN", "You are not invited to this room.");
                }
                state.invited.remove(*room);
                state
                    .joined
                    .entry(room.to_string())
                    .or_default()
                    .push(MATRIX_BOT.into());
                ResponseTemplate::new(200).set_body_json(json!({ "room_id": room }))
            }
            (
                _,
                [
                    "",
                    "_matrix",
                    "client",
                    "v3",
                    "user",
                    user,
                    "account_data",
                    "m.direct",
                ],
            ) => {
                if *user != MATRIX_BOT {
                    return refuse(
                        403,
                        "M_FORBIDDEN",
                        "Cannot get account data for other users.",
                    );
                }
                match method {
                    "GET" => match &state.direct {
                        Some(direct) => ResponseTemplate::new(200).set_body_json(direct),
                        None => refuse(404, "M_NOT_FOUND", "Account data not found"),
                    },
                    "PUT" => {
                        let body = body_of(request);
                        if !body.is_object() {
                            return refuse(400, "M_NOT_JSON", "Content must be a JSON object.");
                        }
                        state.direct = Some(body);
                        ResponseTemplate::new(200).set_body_json(json!({}))
                    }
                    _ => refuse(405, "M_UNRECOGNIZED", "Unrecognized request"),
                }
            }
            (
                "GET",
                [
                    "",
                    "_matrix",
                    "client",
                    "v3",
                    "rooms",
                    room,
                    "event",
                    event_id,
                ],
            ) => {
                let sent = self.sent.lock().unwrap();
                match sent.by_id.get(*event_id) {
                    Some(held) if decoded(&held.chat) == *room => ResponseTemplate::new(200)
                        .set_body_json(json!({
                            "type": "m.room.message", "room_id": room, "event_id": event_id,
                            "sender": MATRIX_BOT, "content": held.content,
                        })),
                    _ => refuse(404, "M_NOT_FOUND", "Event not found."),
                }
            }
            _ => refuse(404, "M_UNRECOGNIZED", "Unrecognized request"),
        }
    }
}

/// Slack `assistant.threads.setStatus`: a bot token, `channel_id`, `thread_ts` and a
/// `status` string (empty clears it) are required; otherwise `invalid_arguments`.
pub(crate) struct SlackAssistantStatus;

impl Respond for SlackAssistantStatus {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let authed = request
            .headers
            .get("authorization")
            .is_some_and(|v| v.to_str().unwrap_or("").starts_with("Bearer xoxb-"));
        let body = body_of(request);
        let ok = authed
            && body["channel_id"].as_str().is_some_and(|c| !c.is_empty())
            && body["thread_ts"].as_str().is_some_and(|t| !t.is_empty())
            && body["status"].is_string();
        let answer = if !authed {
            json!({"ok": false, "error": "not_authed"})
        } else if ok {
            json!({"ok": true})
        } else {
            json!({"ok": false, "error": "invalid_arguments"})
        };
        ResponseTemplate::new(200).set_body_json(answer)
    }
}

/// DingTalk card instances: `POST /v1.0/card/instances/createAndDeliver` (a template, a new
/// `outTrackId`, an open space `dtv1.card//IM_GROUP.<cid>` or `dtv1.card//IM_ROBOT.<user>`
/// with its deliver model, string card parameters) and `PUT /v1.0/card/instances` of an
/// existing `outTrackId`; the app's token in `x-acs-dingtalk-access-token`.
#[derive(Clone, Default)]
pub(crate) struct DingTalkCards(Shared);

impl Respond for DingTalkCards {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let refuse = |code: &str, message: &str| {
            ResponseTemplate::new(400).set_body_json(json!({"code": code, "message": message}))
        };
        let authed = request
            .headers
            .get("x-acs-dingtalk-access-token")
            .is_some_and(|v| v.to_str().unwrap_or("") == "dt-token");
        if !authed {
            return ResponseTemplate::new(401).set_body_json(
                json!({"code": "InvalidAuthentication", "message": "token invalid"}),
            );
        }
        let body = body_of(request);
        let params = &body["cardData"]["cardParamMap"];
        if !params
            .as_object()
            .is_some_and(|p| p.values().all(Value::is_string))
        {
            return refuse(
                "param.invalid",
                "cardData.cardParamMap must map names to strings",
            );
        }
        let Some(track) = body["outTrackId"].as_str().filter(|t| !t.is_empty()) else {
            return refuse("param.invalid", "outTrackId is required");
        };
        let mut cards = self.0.lock().unwrap();
        if request.method.as_str() == "PUT" {
            let Some(held) = cards.by_id.get_mut(track) else {
                return refuse("param.cardNotExist", "no card with this outTrackId");
            };
            for (k, v) in params.as_object().unwrap() {
                held.content[k] = v.clone();
            }
            return ResponseTemplate::new(200)
                .set_body_json(json!({"success": true, "result": true}));
        }
        if body["cardTemplateId"].as_str().is_none_or(str::is_empty) {
            return refuse("param.invalid", "cardTemplateId is required");
        }
        if cards.by_id.contains_key(track) {
            return refuse("param.outTrackIdExist", "outTrackId already used");
        }
        let space = body["openSpaceId"].as_str().unwrap_or("");
        let (kind, delivered) = if let Some(cid) = space.strip_prefix("dtv1.card//IM_GROUP.") {
            let ok = body["imGroupOpenDeliverModel"]["robotCode"].is_string() && !cid.is_empty();
            ("IM_GROUP", ok)
        } else if let Some(user) = space.strip_prefix("dtv1.card//IM_ROBOT.") {
            let ok = body["imRobotOpenDeliverModel"]["robotCode"].is_string()
                && body["imRobotOpenDeliverModel"]["spaceType"] == "IM_ROBOT"
                && !user.is_empty();
            ("IM_ROBOT", ok)
        } else {
            return refuse(
                "param.invalid",
                "openSpaceId must be dtv1.card//IM_GROUP.* or IM_ROBOT.*",
            );
        };
        if !delivered {
            return refuse(
                "param.invalid",
                "the deliver model of the open space is missing",
            );
        }
        cards.by_id.insert(
            track.to_string(),
            Held {
                chat: space.to_string(),
                content: params.clone(),
                kind: kind.into(),
            },
        );
        ResponseTemplate::new(200).set_body_json(json!({"success": true, "result": {
            "outTrackId": track,
            "deliverResults": [{"spaceType": kind, "spaceId": space, "success": true}]
        }}))
    }
}

/// A send API that takes a text of bounded length, as a `text` message (`text.content`) or
/// a `markdown` one (`markdown_text`; DingTalk's also needs a `markdown.title`), and
/// answers `ok`, over the bound `refusal`, and `invalid` for a message without its text.
/// WeCom's `message/send` (text and markdown `content`: "最长不超过2048个字节", UTF-8 bytes;
/// WeCom cuts a longer one, and the double refuses it with 45002 "content size out of
/// limit" so that a cut answer cannot pass unseen), DingTalk's session webhook (2,000
/// characters a message, as DingTalk's own connector splits them; markdown `title` and
/// `text` required).
#[derive(Clone)]
pub(crate) struct TextLengthLimit {
    pub markdown_text: &'static str,
    pub markdown_title: Option<&'static str>,
    pub max: usize,
    /// Count UTF-8 bytes (else characters).
    pub bytes: bool,
    pub ok: Value,
    pub refusal: Value,
    pub invalid: Value,
}

impl TextLengthLimit {
    pub(crate) fn wecom() -> Self {
        TextLengthLimit {
            markdown_text: "/markdown/content",
            markdown_title: None,
            max: 2048,
            bytes: true,
            ok: json!({"errcode": 0, "errmsg": "ok", "msgid": "m-1"}),
            refusal: json!({"errcode": 45002, "errmsg": "content size out of limit"}),
            invalid: json!({"errcode": 44004, "errmsg": "empty content"}),
        }
    }

    pub(crate) fn dingtalk_session() -> Self {
        TextLengthLimit {
            markdown_text: "/markdown/text",
            markdown_title: Some("/markdown/title"),
            max: 2000,
            bytes: false,
            ok: json!({"errcode": 0, "errmsg": "ok"}),
            refusal: json!({"errcode": 460101, "errmsg": "message too long"}),
            invalid: json!({"errcode": 40035, "errmsg": "缺少参数 json"}),
        }
    }
}

impl Respond for TextLengthLimit {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body = body_of(request);
        let field = |pointer: &str| {
            body.pointer(pointer)
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
        };
        let text = match body["msgtype"].as_str() {
            Some("text") => field("/text/content"),
            Some("markdown") => field(self.markdown_text)
                .filter(|_| self.markdown_title.is_none_or(|t| field(t).is_some())),
            // Cards and other kinds are not this double's.
            _ => Some(""),
        };
        let Some(text) = text else {
            return ResponseTemplate::new(200).set_body_json(self.invalid.clone());
        };
        let length = if self.bytes {
            text.len()
        } else {
            text.chars().count()
        };
        let answer = if length > self.max {
            &self.refusal
        } else {
            &self.ok
        };
        ResponseTemplate::new(200).set_body_json(answer.clone())
    }
}
