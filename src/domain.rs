//! The vocabulary of assistd: task, step and reply statuses, failure types and audit events.
//! Each enum maps to its TEXT column value here and nowhere else.

use serde::Serialize;

macro_rules! text_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(text: &str) -> Option<$name> {
                match text { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl<DB: sqlx::Database> sqlx::Type<DB> for $name
        where
            String: sqlx::Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <String as sqlx::Type<DB>>::type_info()
            }
            fn compatible(ty: &DB::TypeInfo) -> bool {
                <String as sqlx::Type<DB>>::compatible(ty)
            }
        }

        impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for $name
        where
            &'r str: sqlx::Decode<'r, DB>,
        {
            fn decode(
                value: <DB as sqlx::Database>::ValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let text = <&str as sqlx::Decode<DB>>::decode(value)?;
                $name::parse(text)
                    .ok_or_else(|| format!("unknown {} `{}`", stringify!($name), text).into())
            }
        }

        impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for $name
        where
            &'q str: sqlx::Encode<'q, DB>,
        {
            fn encode_by_ref(
                &self,
                buf: &mut <DB as sqlx::Database>::ArgumentBuffer<'q>,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<'q, DB>>::encode(self.as_str(), buf)
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}

text_enum!(
    /// The task state machine of DESIGN.md.
    TaskStatus {
        Pending => "PENDING",
        Running => "RUNNING",
        Succeeded => "SUCCEEDED",
        Failed => "FAILED",
        WaitingHumanConfirm => "WAITING_HUMAN_CONFIRM",
        Cancelled => "CANCELLED",
    }
);

impl TaskStatus {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Succeeded | TaskStatus::Failed | TaskStatus::Cancelled
        )
    }
}

text_enum!(
    StepStatus {
        Pending => "PENDING",
        Succeeded => "SUCCEEDED",
        Failed => "FAILED",
        Unknown => "UNKNOWN",
        Compensated => "COMPENSATED",
    }
);

text_enum!(
    StepType {
        Llm => "llm",
        Tool => "tool",
        /// A human decision (approval gate); its output is the decision.
        Human => "human",
        /// The undo call of a compensable tool.
        Undo => "undo",
    }
);

text_enum!(
    /// What a pending action waits for a human to decide.
    PendingKind {
        /// A human_confirm node: approve to go on.
        Confirm => "confirm",
        /// An irreversible tool call: approve to run it.
        Tool => "tool",
        /// A non-idempotent step interrupted by a crash: approve to run it again.
        UnknownStep => "unknown_step",
    }
);

text_enum!(
    Decision {
        Pending => "PENDING",
        Approved => "APPROVED",
        Rejected => "REJECTED",
        Expired => "EXPIRED",
    }
);

text_enum!(
    /// Why a task or a call failed. Transient types are retried with backoff.
    FailureType {
        Timeout => "TIMEOUT",
        RateLimited => "RATE_LIMITED",
        AuthFailed => "AUTH_FAILED",
        ProviderError => "PROVIDER_ERROR",
        InvalidResponse => "INVALID_RESPONSE",
        ContextTooLong => "CONTEXT_TOO_LONG",
        ContentFiltered => "CONTENT_FILTERED",
        ToolFailed => "TOOL_FAILED",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
    }
);

text_enum!(
    ReplyStatus {
        Pending => "PENDING",
        Sent => "SENT",
        Unknown => "UNKNOWN",
        Failed => "FAILED",
    }
);

text_enum!(
    ReplyType {
        Text => "text",
        Card => "card",
    }
);

text_enum!(
    AuditEvent {
        TaskCreated => "TASK_CREATED",
        TaskRunning => "TASK_RUNNING",
        TaskSucceeded => "TASK_SUCCEEDED",
        TaskFailed => "TASK_FAILED",
        TaskWaitingConfirm => "TASK_WAITING_CONFIRM",
        TaskConfirmed => "TASK_CONFIRMED",
        TaskRejected => "TASK_REJECTED",
        TaskTimeoutCancelled => "TASK_TIMEOUT_CANCELLED",
        TaskCancelled => "TASK_CANCELLED",
        TaskResumed => "TASK_RESUMED",
        StepUnknown => "STEP_UNKNOWN",
        StepCompensated => "STEP_COMPENSATED",
        TaskReclaimed => "TASK_RECLAIMED",
        ConfirmDenied => "CONFIRM_DENIED",
        ReplySent => "REPLY_SENT",
        ReplyFailed => "REPLY_FAILED",
        AgentVersionPublished => "AGENT_VERSION_PUBLISHED",
    }
);

text_enum!(
    JobRunStatus {
        Succeeded => "SUCCEEDED",
        Failed => "FAILED",
        Skipped => "SKIPPED",
    }
);

text_enum!(
    TaskType {
        ConversationReply => "conversation_reply",
    }
);

/// Milliseconds since the Unix epoch, the one time representation in the database.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The reply idempotency key of a task, carried to every platform that accepts one. A task
/// an admin resumed after its outcome was posted answers under `agent-task-<id>-r<n>`, so
/// its new outcome is not dropped as a repeat of the first.
pub fn reply_key(task_id: i64, resume_count: i64) -> String {
    if resume_count == 0 {
        format!("agent-task-{task_id}")
    } else {
        format!("agent-task-{task_id}-r{resume_count}")
    }
}

/// The idempotency key of a step: `<task>:<step>:<tool>`.
pub fn step_key(task_id: i64, step_no: i64, tool: &str) -> String {
    format!("{task_id}:{step_no}:{tool}")
}

/// Cuts `text` to at most `max` bytes on a char boundary, marking the cut.
pub fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip_through_text() {
        for s in TaskStatus::ALL {
            assert_eq!(TaskStatus::parse(s.as_str()), Some(*s));
        }
        for f in FailureType::ALL {
            assert_eq!(FailureType::parse(f.as_str()), Some(*f));
        }
        assert_eq!(TaskStatus::parse("nope"), None);
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h…");
        assert_eq!(truncate("abc", 5), "abc");
    }
}
