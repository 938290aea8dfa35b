//! Conversation scopes: what makes one conversation (one history, one queue, one running
//! task) of a chat's messages — the chat, a thread, or a member — and the key stored as a
//! message's and a task's `conversation_id`.

/// How a chat's messages are grouped into conversations — one history, one queue, one
/// running task each (`channels.<platform>.conversation_scope`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Direct chats per chat; group chats per thread where the message is in one (or starts
    /// one, where the platform's answers open a thread), otherwise per member.
    #[default]
    Auto,
    /// The whole chat is one conversation.
    Chat,
    /// Each thread is its own conversation, answered in the thread; a message outside a
    /// thread goes by `auto`.
    Thread,
    /// Each member of a group has their own conversation (in a direct chat: the chat).
    User,
}

/// Where a conversation lives on its platform: the chat, the thread in it, or the member
/// whose own conversation it is. Its key (`conversation_id`) is the chat's id, then
/// `#t=<thread>` or `#u=<member>`: a chat's own id (every conversation stored before scopes)
/// reads back as the whole chat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    pub chat: String,
    pub thread: Option<String>,
    pub user: Option<String>,
}

const THREAD_MARK: &str = "#t=";
const USER_MARK: &str = "#u=";

impl Conversation {
    /// The conversation of a message in `chat` (in `thread`, when it is in one or starts
    /// one) by `user`, as `scope` groups them.
    pub fn scoped(scope: Scope, group: bool, chat: &str, thread: Option<&str>, user: &str) -> Self {
        let whole = Conversation {
            chat: chat.to_string(),
            thread: None,
            user: None,
        };
        let by_thread = |fallback: Conversation| match thread.filter(|t| !t.is_empty()) {
            Some(thread) => Conversation {
                thread: Some(thread.to_string()),
                ..whole.clone()
            },
            None => fallback,
        };
        let by_user = Conversation {
            user: Some(user.to_string()),
            ..whole.clone()
        };
        match (scope, group) {
            (Scope::Chat, _) | (Scope::User | Scope::Auto, false) => whole.clone(),
            (Scope::User, true) => by_user,
            (Scope::Thread, false) => by_thread(whole.clone()),
            (Scope::Thread | Scope::Auto, true) => by_thread(by_user),
        }
    }

    /// The key stored as `conversation_id`.
    pub fn key(&self) -> String {
        match (&self.thread, &self.user) {
            (Some(thread), _) => format!("{}{THREAD_MARK}{thread}", self.chat),
            (None, Some(user)) => format!("{}{USER_MARK}{user}", self.chat),
            (None, None) => self.chat.clone(),
        }
    }

    /// The conversation a stored `conversation_id` names.
    pub fn parse(id: &str) -> Self {
        if let Some((chat, thread)) = id.rsplit_once(THREAD_MARK) {
            return Conversation {
                chat: chat.to_string(),
                thread: Some(thread.to_string()),
                user: None,
            };
        }
        if let Some((chat, user)) = id.rsplit_once(USER_MARK) {
            return Conversation {
                chat: chat.to_string(),
                thread: None,
                user: Some(user.to_string()),
            };
        }
        Conversation {
            chat: id.to_string(),
            thread: None,
            user: None,
        }
    }

    /// Whether a chat id given from outside (the generic channel's `conversation_id`)
    /// could be read as a scoped key.
    pub fn is_marked(chat: &str) -> bool {
        chat.contains(THREAD_MARK) || chat.contains(USER_MARK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversation_scopes_and_keys() {
        let key =
            |scope, group, thread| Conversation::scoped(scope, group, "C5", thread, "U1").key();
        // Direct chats are one conversation unless threads are asked for.
        assert_eq!(key(Scope::Auto, false, Some("1.2")), "C5");
        assert_eq!(key(Scope::User, false, None), "C5");
        assert_eq!(key(Scope::Thread, false, Some("1.2")), "C5#t=1.2");
        assert_eq!(key(Scope::Thread, false, None), "C5");
        // Groups: per thread where there is one, else per member.
        assert_eq!(key(Scope::Auto, true, Some("1.2")), "C5#t=1.2");
        assert_eq!(key(Scope::Auto, true, None), "C5#u=U1");
        assert_eq!(key(Scope::Thread, true, Some("")), "C5#u=U1");
        assert_eq!(key(Scope::User, true, Some("1.2")), "C5#u=U1");
        assert_eq!(key(Scope::Chat, true, Some("1.2")), "C5");
        for id in ["C5", "C5#t=1.2", "C5#u=U1", "!room:hs#t=$ev", "-100#u=42"] {
            assert_eq!(Conversation::parse(id).key(), id);
        }
        assert_eq!(
            Conversation::parse("!room:hs#t=$ev"),
            Conversation {
                chat: "!room:hs".into(),
                thread: Some("$ev".into()),
                user: None
            }
        );
        assert!(Conversation::is_marked("a#u=b") && !Conversation::is_marked("a#b"));
    }
}
