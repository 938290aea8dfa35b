//! What the bot knows of its rooms: whether a room is a direct chat or a group, whether an
//! event is one of its own, and its `m.direct` account data, read from the homeserver as
//! the application service's bot and kept a while.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::events::Cue;
use crate::channels::platform::{Addressing, Conversation, GroupReply, Scope, question};
use crate::domain::NewMessage;

/// What the bot knows of its rooms' kinds: whether each is a direct chat (at most two
/// joined members and listed in the bot's `m.direct` account data), read from the
/// homeserver and kept for `channels.matrix.room_kind_ttl_s`, forgotten sooner when a
/// membership event of the room arrives.
#[derive(Default)]
struct RoomKinds {
    rooms: std::sync::Mutex<HashMap<String, (bool, Instant)>>,
    direct: std::sync::Mutex<Option<(HashSet<String>, Instant)>>,
}

impl RoomKinds {
    fn room(&self, room: &str, ttl: Duration) -> Option<bool> {
        let rooms = self.rooms.lock().unwrap_or_else(|p| p.into_inner());
        rooms
            .get(room)
            .filter(|(_, at)| at.elapsed() < ttl)
            .map(|(direct, _)| *direct)
    }

    fn remember(&self, room: &str, direct: bool) {
        let mut rooms = self.rooms.lock().unwrap_or_else(|p| p.into_inner());
        if rooms.len() > 10_000 {
            rooms.clear();
        }
        rooms.insert(room.to_string(), (direct, Instant::now()));
    }

    fn forget(&self, room: &str) {
        self.rooms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(room);
    }

    fn direct_rooms(&self, ttl: Duration) -> Option<HashSet<String>> {
        let direct = self.direct.lock().unwrap_or_else(|p| p.into_inner());
        direct
            .as_ref()
            .filter(|(_, at)| at.elapsed() < ttl)
            .map(|(rooms, _)| rooms.clone())
    }

    fn set_direct_rooms(&self, rooms: Option<HashSet<String>>) {
        *self.direct.lock().unwrap_or_else(|p| p.into_inner()) = rooms.map(|r| (r, Instant::now()));
    }
}

/// The homeserver as the bot asks it about rooms, and what it answered.
pub(super) struct Rooms {
    http: reqwest::Client,
    /// The homeserver's URL without a trailing `/`.
    homeserver: String,
    as_token: String,
    bot_user_id: String,
    group_reply: GroupReply,
    prefixes: Vec<String>,
    scope: Scope,
    /// How long an answer about a room is kept.
    ttl: Duration,
    kinds: RoomKinds,
}

/// A path segment, percent-encoded.
pub(super) fn encode(segment: &str) -> String {
    url::form_urlencoded::byte_serialize(segment.as_bytes()).collect()
}

impl Rooms {
    /// The rooms of the bot `bot_user_id` on `homeserver`, answering as `manners` (group
    /// reply, prefixes, conversation scope) say, what is learnt kept for `ttl`.
    pub(super) fn new(
        http: reqwest::Client,
        homeserver: &str,
        as_token: &str,
        bot_user_id: &str,
        manners: (GroupReply, &[String], Scope),
        ttl: Duration,
    ) -> Self {
        Rooms {
            http,
            homeserver: homeserver.to_string(),
            as_token: as_token.to_string(),
            bot_user_id: bot_user_id.to_string(),
            group_reply: manners.0,
            prefixes: manners.1.to_vec(),
            scope: manners.2,
            ttl,
            kinds: RoomKinds::default(),
        }
    }

    /// Forgets what was said about `room` (a membership change, an invite).
    pub(super) fn forget(&self, room: &str) {
        self.kinds.forget(room);
    }

    /// A client-server API `GET` as the bot: `Ok(None)` when the homeserver answers 404
    /// (`M_NOT_FOUND`), an error in words (no token in it) when it cannot be read.
    async fn get_json(&self, path: &str) -> Result<Option<Value>, String> {
        let response = self
            .http
            .get(format!("{}{path}", self.homeserver))
            .bearer_auth(&self.as_token)
            .send()
            .await
            .map_err(|e| crate::redaction::http_error(e).to_string())?;
        let status = response.status();
        if status.as_u16() == 404 {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(format!("HTTP {}", status.as_u16()));
        }
        response
            .json()
            .await
            .map(Some)
            .map_err(|e| format!("unreadable answer: {}", crate::redaction::http_error(e)))
    }

    /// The rooms the bot's `m.direct` account data lists (user ID → room IDs), fresh.
    async fn read_direct(&self) -> Result<(Value, HashSet<String>), String> {
        let path = format!(
            "/_matrix/client/v3/user/{}/account_data/m.direct",
            encode(&self.bot_user_id)
        );
        let data = self
            .get_json(&path)
            .await
            .map_err(|e| format!("reading m.direct: {e}"))?
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}));
        let rooms = data
            .as_object()
            .into_iter()
            .flat_map(|o| o.values())
            .filter_map(Value::as_array)
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect();
        Ok((data, rooms))
    }

    fn room_ttl(&self) -> Duration {
        self.ttl
    }

    /// Whether `room` is a direct chat: at most two joined members (the bot and one
    /// person) and marked direct in the bot's `m.direct`; anything else is a group.
    async fn is_direct(&self, room: &str) -> Result<bool, String> {
        let ttl = self.room_ttl();
        if let Some(direct) = self.kinds.room(room, ttl) {
            return Ok(direct);
        }
        let path = format!("/_matrix/client/v3/rooms/{}/joined_members", encode(room));
        let members = self
            .get_json(&path)
            .await
            .map_err(|e| format!("reading the members of {room}: {e}"))?
            .and_then(|v| v["joined"].as_object().map(|j| j.len()))
            .ok_or_else(|| format!("reading the members of {room}: no `joined` map"))?;
        // A room missing from a kept `m.direct` list is looked up afresh: another
        // instance may have accepted its invite since.
        let direct = members <= 2
            && match self.kinds.direct_rooms(ttl) {
                Some(rooms) if rooms.contains(room) => true,
                _ => {
                    let (_, rooms) = self.read_direct().await?;
                    let direct = rooms.contains(room);
                    self.kinds.set_direct_rooms(Some(rooms));
                    direct
                }
            };
        self.kinds.remember(room, direct);
        Ok(direct)
    }

    /// Whether the event `event_id` of `room` was sent by the bot.
    async fn sent_by_bot(&self, room: &str, event_id: &str) -> Result<bool, String> {
        let path = format!(
            "/_matrix/client/v3/rooms/{}/event/{}",
            encode(room),
            encode(event_id)
        );
        let event = self
            .get_json(&path)
            .await
            .map_err(|e| format!("reading the replied-to event: {e}"))?;
        Ok(event.is_some_and(|e| e["sender"] == self.bot_user_id.as_str()))
    }

    /// The message as a question for the bot (a prefix removed), in the conversation its
    /// scope gives, or (`Err`) a room message not addressed to it, in the room's. The homeserver is asked
    /// what the room is only when the event itself does not settle it.
    pub(super) async fn question(
        &self,
        mut message: NewMessage,
        cue: Cue,
    ) -> Result<Result<NewMessage, NewMessage>, String> {
        let room = message.conversation_id.clone();
        let group = Addressing {
            group: true,
            mentioned: cue.mentioned,
            reply_to_bot: false,
        };
        let ask =
            |addressing| question(self.group_reply, &self.prefixes, addressing, &message.text);
        let mut direct = None;
        let text = match ask(group) {
            Some(text) => Some(text),
            None if self.is_direct(&room).await? => {
                direct = Some(true);
                ask(Addressing::default())
            }
            None => {
                direct = Some(false);
                match (&cue.in_reply_to, self.group_reply) {
                    (Some(target), GroupReply::Mention)
                        if self.sent_by_bot(&room, target).await? =>
                    {
                        ask(Addressing {
                            reply_to_bot: true,
                            ..group
                        })
                    }
                    _ => None,
                }
            }
        };
        let Some(text) = text else {
            return Ok(Err(message));
        };
        let scope = self.scope;
        let group = match (scope, direct) {
            (Scope::Chat, _) => false,
            (_, Some(direct)) => !direct,
            // A question either way: when the homeserver cannot say what the room is, it
            // is taken as a group (a thread of its own, no member's history mixed in).
            (_, None) => match self.is_direct(&room).await {
                Ok(direct) => !direct,
                Err(e) => {
                    tracing::warn!(room, error = %e, "matrix: room kind unknown; taken as a group");
                    true
                }
            },
        };
        // A question outside a thread opens one (the answer is sent into it).
        let thread = cue.thread.as_deref().unwrap_or(&message.message_id);
        message.conversation_id =
            Conversation::scoped(scope, group, &room, Some(thread), &message.sender_id).key();
        message.text = text;
        Ok(Ok(message))
    }

    /// Adds `room` to the bot's `m.direct` account data under `with`, as clients do for
    /// a direct chat they join. Best effort.
    pub(super) async fn mark_direct(&self, room: &str, with: &str) -> Result<(), String> {
        let (mut data, _) = self.read_direct().await?;
        let rooms = data[with].as_array().cloned().unwrap_or_default();
        if rooms.iter().any(|r| r == room) {
            return Ok(());
        }
        let mut rooms = rooms;
        rooms.push(json!(room));
        data[with] = Value::Array(rooms);
        let response = self
            .http
            .put(format!(
                "{}/_matrix/client/v3/user/{}/account_data/m.direct",
                self.homeserver,
                encode(&self.bot_user_id)
            ))
            .bearer_auth(&self.as_token)
            .json(&data)
            .send()
            .await
            .map_err(|e| crate::redaction::http_error(e).to_string())?;
        self.kinds.set_direct_rooms(None);
        self.kinds.forget(room);
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("HTTP {}", response.status().as_u16()))
        }
    }

    /// Joins a room the bot was invited to, best effort.
    pub(super) async fn join(&self, room: &str) {
        let result = self
            .http
            .post(format!(
                "{}/_matrix/client/v3/rooms/{}/join",
                self.homeserver,
                encode(room)
            ))
            .bearer_auth(&self.as_token)
            .json(&json!({}))
            .send()
            .await;
        match result {
            Ok(r) if r.status().is_success() => tracing::info!(room, "joined room"),
            Ok(r) => tracing::warn!(room, status = r.status().as_u16(), "could not join room"),
            Err(e) => tracing::warn!(room, error = %e, "could not join room"),
        }
    }
}
