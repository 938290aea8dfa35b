//! The shape every chat platform has: `Platform` (verify and parse an inbound request, send a
//! reply, its pace and resend risk), the inbound request as a platform sees it, what it asks
//! of assistd, and the helpers the platforms share (token cache, chat pacer, typed approval
//! commands). A platform file imports this one and `domain`, never the store or the engine.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use super::conversation::{Conversation, Scope};
use super::parts::TextLimit;
use crate::domain::{CardAction, NewMessage, ReplyRow};

/// A boxed future, so that `Platform` can be used as `dyn Platform`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One inbound HTTP request to `/webhooks/<platform>[/<rest>]`, as the platform sees it.
pub struct InboundRequest<'a> {
    /// `GET`, `POST` or `PUT`.
    pub method: &'a str,
    /// What follows `/webhooks/<platform>`: empty, or e.g. `actions`, `card`,
    /// `transactions/<txn>`.
    pub rest: &'a str,
    pub headers: &'a http::HeaderMap,
    /// The raw query string.
    pub query: Option<&'a str>,
    /// The raw body, already within `server.body_limit_bytes`.
    pub body: &'a [u8],
    pub now_ms: i64,
}

impl InboundRequest<'_> {
    /// The path this request took among the platform's `paths` (each a `rest`), when its
    /// method is `method`; otherwise the 404 of a path the platform does not serve.
    pub fn route(&self, method: &str, paths: &[&'static str]) -> Result<&'static str, Refused> {
        paths
            .iter()
            .find(|p| self.method == method && **p == self.rest)
            .copied()
            .ok_or_else(no_route)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// A query parameter, decoded.
    pub fn query_param(&self, name: &str) -> Option<String> {
        url::form_urlencoded::parse(self.query.unwrap_or("").as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    }
}

/// What a verified request asks, and what must hold in the database before it is done.
pub struct Parsed {
    pub items: Vec<Inbound>,
    /// A key the request is done at most once under (checked by the webhook layer).
    pub once: Option<Once>,
    /// A transaction of events (Matrix): its messages commit together, one that intake
    /// cannot take is skipped rather than failing the rest, and the answer is `answer`.
    pub transaction: bool,
    /// A fixed answer instead of the outcome of the one item (WeCom: empty; Matrix: `{}`).
    pub answer: Option<Fixed>,
    /// Verified, but refused for its content: reported after the `once` check, so that a
    /// replayed signature is refused as a replay whatever body it came with.
    pub refused: Option<Refused>,
}

impl Parsed {
    /// One item, answered with its outcome.
    pub fn one(item: Inbound) -> Parsed {
        Parsed {
            items: vec![item],
            once: None,
            transaction: false,
            answer: None,
            refused: None,
        }
    }
}

/// A fixed answer to a platform: status, content type, body.
#[derive(Debug, Clone)]
pub struct Fixed {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

/// How a request is kept to once.
#[derive(Debug, Clone)]
pub enum Once {
    /// DingTalk: the sign covers only the timestamp, so a timestamp/sign pair (`pair`) is
    /// good only for the body it first came with (`body`); keys kept under `namespace`.
    SignedPair {
        namespace: &'static str,
        pair: String,
        body: String,
    },
    /// Matrix: a transaction id; a repeated one is answered without doing anything, and it
    /// is recorded once all its events were handled.
    Transaction { namespace: &'static str, id: String },
}

/// What an inbound platform request asks of assistd, once verified and parsed.
#[derive(Debug, Clone)]
pub enum Inbound {
    /// A chat message for intake.
    Message(NewMessage),
    /// A reaction by `approver` to the platform message `target` (Matrix ✅/❌): a decision
    /// when `target` is an approval request assistd sent.
    Reaction {
        approver: String,
        approve: bool,
        target: String,
    },
    /// The bot was invited to a room (Matrix); `direct_with`: the inviter, when the invite
    /// marks the room a direct chat (`is_direct`).
    Invite {
        room: String,
        direct_with: Option<String>,
    },
    /// An approval decision from a card button; `ack` identifies the platform callback
    /// to acknowledge (Telegram's callback query id), when there is one.
    Action {
        action: CardAction,
        ack: Option<String>,
        /// Answer with the task's state (the generic API) rather than the outcome in words.
        with_task: bool,
    },
    /// A group message not addressed to the bot (its conversation: the chat): acknowledged,
    /// and kept as context for the chat's next question when the platform keeps some
    /// (`Platform::group_context`).
    Chatter(NewMessage),
    /// A handshake answered directly (URL verification).
    Respond(Fixed),
    /// Verified but nothing to do (the bot's own message, an edit, an unknown event).
    Ignore(&'static str),
}

/// A request refused before anything is written: 401 (verification), 400 (malformed), or
/// an answer in the platform's own error format.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Refused {
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("refused with {}", .0.status)]
    Answer(Fixed),
}

/// An approval typed (or sent by a card button) as a chat message, for platforms whose
/// cards cannot call back: `approve <request>` / `reject <request>` (and 同意 / 拒绝), the
/// request as the card shows it (`ApprovalRef::token`: task, step, run and digest, e.g.
/// `7.3.0.5f1d2a9c0b7e`). Returns (approve, the request named).
pub fn parse_decision_command(text: &str) -> Option<(bool, crate::domain::ApprovalRef)> {
    let mut words = text.split_whitespace();
    let approve = match words.next()?.to_lowercase().as_str() {
        "approve" | "同意" => true,
        "reject" | "拒绝" => false,
        _ => return None,
    };
    let request = crate::domain::ApprovalRef::parse_token(words.next()?)?;
    if words.next().is_some() {
        return None;
    }
    Some((approve, request))
}

/// When the bot answers in a group chat (`channels.<platform>.group_reply`); direct chats
/// are always answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupReply {
    /// A message that mentions the bot, replies to one of its messages, or starts with one
    /// of `prefixes`.
    #[default]
    Mention,
    /// Only a message that starts with one of `prefixes`.
    Prefix,
    /// Every message.
    All,
}

/// Where a message was written and whether it calls on the bot, as its platform tells.
#[derive(Debug, Clone, Copy, Default)]
pub struct Addressing {
    /// Written in a group chat (a channel, a room, a group), not a direct chat.
    pub group: bool,
    /// It mentions the bot.
    pub mentioned: bool,
    /// It replies to one of the bot's messages.
    pub reply_to_bot: bool,
}

/// The text of a message that is a question for the bot: in a direct chat always, in a
/// group as `group_reply` says (a matching prefix removed from the text); `None`: a group
/// message not addressed to the bot, which is acknowledged and creates no task.
pub fn question(
    group_reply: GroupReply,
    prefixes: &[String],
    addressing: Addressing,
    text: &str,
) -> Option<String> {
    let prefixed = prefixes
        .iter()
        .filter(|p| !p.trim().is_empty())
        .find_map(|p| text.trim_start().strip_prefix(p.trim()))
        .map(|rest| {
            rest.trim_start_matches([':', ',', ' ', '，', '：'])
                .trim()
                .to_string()
        });
    if !addressing.group {
        return Some(prefixed.unwrap_or_else(|| text.to_string()));
    }
    match group_reply {
        GroupReply::All => Some(prefixed.unwrap_or_else(|| text.to_string())),
        GroupReply::Prefix => prefixed,
        GroupReply::Mention => prefixed.or_else(|| {
            (addressing.mentioned || addressing.reply_to_bot).then(|| text.to_string())
        }),
    }
}

/// A group message (the platform's event `event_id`) by `sender` in `chat` that is not
/// addressed to the bot: acknowledged, and kept as the chat's context where the platform
/// keeps some (once per event, however often the platform delivers it).
pub fn chatter(
    (channel, event_id): (&str, &str),
    chat: &str,
    sender: (&str, Option<&str>),
    text: &str,
) -> Inbound {
    Inbound::Chatter(NewMessage {
        channel: channel.to_string(),
        event_id: event_id.to_string(),
        message_id: String::new(),
        conversation_id: chat.to_string(),
        sender_id: sender.0.to_string(),
        sender_name: sender.1.map(str::to_string),
        text: text.to_string(),
        reply_context: None,
        trace_context: None,
    })
}

/// Per-chat send pacing for platforms that limit sends per chat (Lark 5/s, Telegram and
/// Slack about 1/s). Each (channel, chat) has the time its next send may start; a reply
/// that comes earlier is deferred to that time instead of being sent into a 429. The pace
/// is kept per instance; across instances the platform's 429 and Retry-After still apply.
#[derive(Default)]
pub struct ChatPacer(std::sync::Mutex<std::collections::HashMap<(String, String), i64>>);

impl ChatPacer {
    /// Takes a send slot for the chat at `now` (ms) with `interval_ms` between sends: `Ok`
    /// to send now, or `Err(at)` with the time to come back.
    pub fn admit(&self, channel: &str, chat: &str, interval_ms: u64, now: i64) -> Result<(), i64> {
        if interval_ms == 0 {
            return Ok(());
        }
        let mut next = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Forget chats that have been quiet for a while, so the map stays small.
        if next.len() > 10_000 {
            next.retain(|_, at| *at > now);
        }
        let key = (channel.to_string(), chat.to_string());
        match next.get(&key) {
            Some(&at) if at > now => Err(at),
            _ => {
                next.insert(key, now + interval_ms as i64);
                Ok(())
            }
        }
    }
}

/// A platform access token fetched on demand and kept until a minute before it expires.
#[derive(Default)]
pub struct TokenCache(std::sync::Mutex<Option<(String, std::time::Instant)>>);

impl TokenCache {
    /// The cached token, or a new one from `fetch` (which returns it with its lifetime in
    /// seconds).
    pub async fn get<F, Fut>(&self, fetch: F) -> Result<String, DeliveryError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(String, u64), DeliveryError>>,
    {
        let cached = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some((token, until)) = cached
            && std::time::Instant::now() < until
        {
            return Ok(token);
        }
        let (token, ttl) = fetch().await?;
        let until = std::time::Instant::now() + Duration::from_secs(ttl.saturating_sub(60));
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((token.clone(), until));
        Ok(token)
    }

    /// The cached token, or one fetched with `request` (`what` names the endpoint in
    /// errors): the JSON answer's `answer.token` field, valid for its `answer.expires_in`
    /// seconds (two hours when absent), unless `answer.ok` calls the answer a refusal.
    pub async fn fetch_json(
        &self,
        what: &str,
        request: impl FnOnce() -> reqwest::RequestBuilder,
        answer: TokenAnswer,
    ) -> Result<String, DeliveryError> {
        let http_error = |stage: &str, e: reqwest::Error| {
            DeliveryError::retry(format!(
                "{what} {stage}: {}",
                crate::redaction::http_error(e)
            ))
        };
        self.get(|| async {
            let body: serde_json::Value = request()
                .send()
                .await
                .map_err(|e| http_error("failed", e))?
                .json()
                .await
                .map_err(|e| http_error("unreadable", e))?;
            let token = body[answer.token]
                .as_str()
                .filter(|_| (answer.ok)(&body))
                .ok_or_else(|| DeliveryError::retry(format!("{what} refused: {body}")))?;
            Ok((
                token.to_string(),
                body[answer.expires_in].as_u64().unwrap_or(7200),
            ))
        })
        .await
    }

    /// Drops the token (the platform said it is no longer valid).
    pub fn forget(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Where a platform's token endpoint puts the token and its lifetime, and which answers
/// are refusals.
pub struct TokenAnswer {
    pub token: &'static str,
    pub expires_in: &'static str,
    pub ok: fn(&serde_json::Value) -> bool,
}

/// A reply the platform accepted.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub platform_message_id: Option<String>,
}

/// A reply the platform did not (or may not) have accepted.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct DeliveryError {
    pub message: String,
    /// The platform asked for this pause before the next try.
    pub retry_after: Option<Duration>,
    /// The send may or may not have reached the chat, and the platform has no idempotency
    /// key to make a re-send safe: the reply becomes UNKNOWN instead of being repeated.
    pub unknown: bool,
    /// The platform refused the reply for good (too large, malformed for it): trying again
    /// cannot help, so the reply ends FAILED with the platform's reason.
    pub permanent: bool,
}

impl DeliveryError {
    pub fn retry(message: impl Into<String>) -> Self {
        DeliveryError {
            message: message.into(),
            retry_after: None,
            unknown: false,
            permanent: false,
        }
    }
}

/// The methods every platform implements alike: its channel name (`CHANNEL` of its file),
/// its agent (`self.config.agent`) and `send` (its inherent `send`).
macro_rules! platform_basics {
    ($ty:ty) => {
        fn name(&self) -> &'static str {
            CHANNEL
        }

        fn agent(&self) -> &str {
            &self.config.agent
        }

        fn send<'a>(
            &'a self,
            reply: &'a ReplyRow,
        ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
            Box::pin(<$ty>::send(self, reply))
        }
    };
}
pub(crate) use platform_basics;

/// A progress line of a running task. `revision` grows as the task goes on and is the same
/// for the same point of the task in every run (it is the node's first step number), so a
/// receiver can drop repeats by `key`: `<reply key>-progress-<revision>` (a restarted task
/// answers under a new reply key, so its lines are new too).
#[derive(Debug, Clone)]
pub struct Progress {
    pub key: String,
    pub task_id: i64,
    pub conversation_id: String,
    pub in_reply_to: String,
    pub revision: i64,
    pub text: String,
}

/// A chat platform: its inbound checks, its sender, and its delivery properties. The
/// registry (`Channels`) maps the channel name on messages and replies to one of these.
pub trait Platform: Send + Sync {
    /// The channel name stored on messages and replies, and the webhook path segment.
    fn name(&self) -> &'static str;

    /// The agent that answers this platform's messages.
    fn agent(&self) -> &str;

    /// Verifies and parses one inbound request. Nothing is written before this succeeds.
    fn inbound<'a>(
        &'a self,
        request: &'a InboundRequest<'a>,
    ) -> BoxFuture<'a, Result<Parsed, Refused>>;

    /// Sends one reply under its idempotency key (`reply.idempotency_key`).
    fn send<'a>(&'a self, reply: &'a ReplyRow) -> BoxFuture<'a, Result<Delivered, DeliveryError>>;

    /// The longest text one message (sent or edited) may carry, as the platform documents
    /// it; a longer answer goes as numbered parts (`super::parts`).
    fn text_limit(&self) -> TextLimit {
        TextLimit::NONE
    }

    /// The largest card (its JSON, in bytes) the platform takes; a larger one is sent as
    /// its text, in parts where needed. `None`: no limit.
    fn card_limit_bytes(&self) -> Option<usize> {
        None
    }

    /// Whether a sent reply can be edited (`edit`): a slow run then shows a placeholder
    /// that becomes the answer, and a streamed answer is shown as it comes.
    fn can_edit(&self) -> bool {
        false
    }

    /// Replaces the message `message_id` (what `send` returned) with `reply`'s content.
    /// Editing twice to the same content must succeed both times.
    fn edit<'a>(
        &'a self,
        reply: &'a ReplyRow,
        _message_id: &'a str,
    ) -> BoxFuture<'a, Result<Delivered, DeliveryError>> {
        Box::pin(async move {
            Err(DeliveryError::retry(format!(
                "{} cannot edit a sent message",
                reply.channel
            )))
        })
    }

    /// Whether `error`, from `edit`, says the message to edit is gone for good (the user
    /// deleted it): the reply is then sent as a new message instead.
    fn edit_target_gone(&self, _error: &DeliveryError) -> bool {
        false
    }

    /// Acknowledges a card action (`Inbound::Action::ack`) with its outcome in words.
    fn acknowledge<'a>(&'a self, _ack: &'a str, _outcome: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    /// Joins a room the bot was invited to (`Inbound::Invite`), recording it as a direct
    /// chat with `direct_with` when the invite said so.
    fn accept_invite<'a>(
        &'a self,
        _room: &'a str,
        _direct_with: Option<&'a str>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    /// The least time between two sends into one chat, in ms (0 = no pacing).
    fn chat_interval_ms(&self) -> u64 {
        0
    }

    /// How many group messages not addressed to the bot are kept per chat as context for
    /// the next question there (`channels.<platform>.group_context`; 0: none).
    fn group_context(&self) -> usize {
        0
    }

    /// The conversation a stored `conversation_id` of this platform names: its chat
    /// (where replies go and sends are paced), thread and member.
    fn conversation(&self, conversation_id: &str) -> Conversation {
        Conversation::parse(conversation_id)
    }

    /// Whether a re-send could show a reply twice: the platform has no idempotency key and
    /// no way to look a send up.
    fn resend_is_blind(&self) -> bool {
        false
    }

    /// The id of the message sent under `key` (as a placeholder, the editable kind, when
    /// `placeholder`), where the platform names messages by the sender's key (DingTalk
    /// cards: `outTrackId`): a send in doubt is then settled by editing it.
    fn message_id_by_key(&self, _key: &str, _placeholder: bool) -> Option<String> {
        None
    }

    /// Whether `send` needs the answered message's `reply_context` on the reply row.
    fn wants_reply_context(&self) -> bool {
        false
    }

    /// Whether the text of an answer being streamed is kept for the platform's page to poll
    /// (the console), instead of being sent anywhere.
    fn keeps_live_text(&self) -> bool {
        false
    }

    /// Keeps (`Some`) or forgets (`None`) the streamed text so far of a task running here.
    fn keep_live_text(&self, _task_id: i64, _text: Option<&str>) {}

    /// The streamed text so far of a task running here, if it streams to this platform.
    fn live_text(&self, _task_id: i64) -> Option<String> {
        None
    }

    /// Whether a streamed answer is shown as progress lines (`progress`) while it is being
    /// written, on a platform that cannot edit a sent message.
    fn streams_progress(&self) -> bool {
        false
    }

    /// Shows a progress line of a running task (a workflow node's `progress`, or the text so
    /// far of a streamed answer), best effort.
    fn progress<'a>(&'a self, _update: &'a Progress) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// How often the platform's typing indicator must be shown again while a task runs
    /// (it fades by itself); `None` when the platform has none.
    fn typing_every(&self) -> Option<std::time::Duration> {
        None
    }

    /// Shows (`on`) or clears the typing indicator in a conversation. Best effort: a
    /// failure is the caller's to log, never the task's.
    fn typing<'a>(
        &'a self,
        _conversation_id: &'a str,
        _on: bool,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

/// What is wrong with an enabled platform's settings: the key under `channels.<platform>.`
/// and why.
pub type SettingProblem = (&'static str, String);

/// An enabled platform needs its secrets (`required`, by key) and an http(s) API URL.
pub fn require_settings(
    required: &[(&'static str, &str)],
    api: (&'static str, &str),
) -> Result<(), SettingProblem> {
    if let Some((key, _)) = required.iter().find(|(_, value)| value.is_empty()) {
        return Err((key, "must be set when the channel is enabled".into()));
    }
    if is_http_url(api.1) {
        Ok(())
    } else {
        Err((api.0, format!("`{}` is not an http(s) URL", api.1)))
    }
}

/// Whether `value` is an absolute http or https URL (settings checks share this).
pub fn is_http_url(value: &str) -> bool {
    url::Url::parse(value).is_ok_and(|url| matches!(url.scheme(), "http" | "https"))
}

/// The refusal of a path or method the platform does not serve (404).
pub fn no_route() -> Refused {
    Refused::Answer(Fixed {
        status: 404,
        content_type: "application/json",
        body: r#"{"error":"no such webhook"}"#.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_commands() {
        let request = crate::domain::ApprovalRef::new(7, 0, 3, "{}");
        let token = request.token();
        assert_eq!(
            parse_decision_command(&format!("approve {token}")),
            Some((true, request.clone()))
        );
        assert_eq!(
            parse_decision_command(&format!(" Reject  {} ", token.replace('.', ":"))),
            Some((false, request.clone()))
        );
        assert_eq!(
            parse_decision_command(&format!("同意 {token}")),
            Some((true, request))
        );
        // The request must be named whole: task and step alone could be a restarted run.
        assert_eq!(parse_decision_command("approve 7.3"), None);
        assert_eq!(parse_decision_command("approve 7"), None);
        assert_eq!(
            parse_decision_command(&format!("approve {token} please")),
            None
        );
        assert_eq!(
            parse_decision_command(&format!("please approve {token}")),
            None
        );
        assert_eq!(parse_decision_command("approve x.3.0.5f1d2a9c0b7e"), None);
        assert_eq!(parse_decision_command("approve 7.3.0.5f1d2a9c0b7"), None);
    }

    #[test]
    fn group_messages_are_questions_only_when_addressed() {
        let group = Addressing {
            group: true,
            ..Addressing::default()
        };
        let mentioned = Addressing {
            mentioned: true,
            ..group
        };
        let reply = Addressing {
            reply_to_bot: true,
            ..group
        };
        let prefixes = vec!["/ask".to_string(), "问".to_string()];
        let q = |mode, a, text| question(mode, &prefixes, a, text);
        assert_eq!(q(GroupReply::Mention, group, "lunch?"), None);
        assert_eq!(
            q(GroupReply::Mention, mentioned, "lunch?").as_deref(),
            Some("lunch?")
        );
        assert_eq!(
            q(GroupReply::Mention, reply, "and then?").as_deref(),
            Some("and then?")
        );
        assert_eq!(
            q(GroupReply::Mention, group, "/ask lunch?").as_deref(),
            Some("lunch?")
        );
        assert_eq!(
            q(GroupReply::Mention, group, "问：报销流程").as_deref(),
            Some("报销流程")
        );
        assert_eq!(q(GroupReply::Prefix, mentioned, "lunch?"), None);
        assert_eq!(
            q(GroupReply::Prefix, group, "/ask lunch?").as_deref(),
            Some("lunch?")
        );
        assert_eq!(
            q(GroupReply::All, group, "lunch?").as_deref(),
            Some("lunch?")
        );
        // Direct chats are always answered.
        let direct = Addressing::default();
        assert_eq!(
            q(GroupReply::Prefix, direct, "lunch?").as_deref(),
            Some("lunch?")
        );
    }

    #[test]
    fn pacing_is_per_chat() {
        let pacer = ChatPacer::default();
        assert_eq!(pacer.admit("lark", "a", 200, 1_000), Ok(()));
        assert_eq!(pacer.admit("lark", "a", 200, 1_100), Err(1_200));
        assert_eq!(pacer.admit("lark", "b", 200, 1_100), Ok(()));
        assert_eq!(pacer.admit("lark", "a", 200, 1_200), Ok(()));
        assert_eq!(pacer.admit("lark", "a", 0, 1_201), Ok(()));
    }
}
