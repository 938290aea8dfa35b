//! The vocabulary of assistd: task, step and reply statuses, failure types and audit events.
//! Each enum maps to its TEXT column value here and nowhere else.

use serde::Serialize;
use serde_json::Value;

macro_rules! text_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
        /// Stopped by an admin; no instance claims it until it is unpaused.
        Paused => "PAUSED",
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
        /// A run that kept aborting for a cause that is not an outage (bad data, a bug):
        /// ended after `engine.max_run_aborts` tries instead of being claimed again forever.
        Internal => "INTERNAL",
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
        TaskPauseRequested => "TASK_PAUSE_REQUESTED",
        TaskPaused => "TASK_PAUSED",
        TaskUnpaused => "TASK_UNPAUSED",
        TaskRestarted => "TASK_RESTARTED",
        StepUnknown => "STEP_UNKNOWN",
        StepCompensated => "STEP_COMPENSATED",
        TaskReclaimed => "TASK_RECLAIMED",
        /// A run stopped by an error that is not an outage; counted toward
        /// `engine.max_run_aborts`.
        TaskAborted => "TASK_ABORTED",
        ConfirmDenied => "CONFIRM_DENIED",
        ReplySent => "REPLY_SENT",
        ReplyFailed => "REPLY_FAILED",
        /// An admin sent a reply that was failing or given up out again now.
        ReplyRetried => "REPLY_RETRIED",
        /// An admin opened a task's page unredacted ("show raw").
        TaskViewedRaw => "TASK_VIEWED_RAW",
        AgentVersionPublished => "AGENT_VERSION_PUBLISHED",
        /// An admin ran a job's tick now.
        JobRun => "JOB_RUN",
        JobEnabled => "JOB_ENABLED",
        JobDisabled => "JOB_DISABLED",
        /// A knowledge document was added or replaced (API or CLI).
        KnowledgeDocumentPut => "KNOWLEDGE_DOCUMENT_PUT",
        KnowledgeDocumentDeleted => "KNOWLEDGE_DOCUMENT_DELETED",
        /// An admin tried a question on a collection's page.
        KnowledgeSearched => "KNOWLEDGE_SEARCHED",
        /// A batch of documents was committed as a background ingest job.
        KnowledgeIngestQueued => "KNOWLEDGE_INGEST_QUEUED",
        /// An ingest job ended with each document added or failed on its own.
        KnowledgeIngestFinished => "KNOWLEDGE_INGEST_FINISHED",
        /// An ingest job was given up (claimed too often without progress).
        KnowledgeIngestFailed => "KNOWLEDGE_INGEST_FAILED",
    }
);

impl AuditEvent {
    /// Events an operator must look at (the IM pipeline's risk events): their audit rows
    /// always carry the risk flag, whoever writes them.
    pub fn is_risky(self) -> bool {
        matches!(
            self,
            AuditEvent::TaskFailed
                | AuditEvent::TaskTimeoutCancelled
                | AuditEvent::StepUnknown
                | AuditEvent::ConfirmDenied
                | AuditEvent::TaskReclaimed
                | AuditEvent::TaskAborted
                | AuditEvent::ReplyFailed
                | AuditEvent::KnowledgeIngestFailed
        )
    }
}

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

/// The idempotency key of a step: `<task>:<step>:<tool>`, and `<task>r<n>:<step>:<tool>`
/// in the run after the task's `n`th restart (a restart runs every call again, so a tool
/// that drops repeated keys must see new ones).
pub fn step_key(task_id: i64, restart: i64, step_no: i64, tool: &str) -> String {
    if restart == 0 {
        format!("{task_id}:{step_no}:{tool}")
    } else {
        format!("{task_id}r{restart}:{step_no}:{tool}")
    }
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

/// The channel name of approval requests sent to `scheduler.confirm_timeout`'s callback URL
/// (not a chat platform: the generic channel's transport delivers them).
pub const CALLBACK_CHANNEL: &str = "approval_callback";
/// The outbox channel of orphan-reclaim alerts (`scheduler.jobs.orphan_reclaim.alert_url`).
pub const ORPHAN_ALERT_CHANNEL: &str = "orphan_alert";

/// Proof of ownership of a running task: the claim's owner and version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub task_id: i64,
    pub owner: String,
    pub version: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TaskRow {
    pub id: i64,
    pub agent_id: i64,
    pub agent_version_id: i64,
    pub task_type: TaskType,
    pub channel: String,
    pub conversation_id: String,
    pub message_id: i64,
    pub trigger_user: String,
    pub status: TaskStatus,
    pub current_step: i64,
    pub workflow_snapshot: Option<String>,
    pub context_summary: Option<String>,
    pub result: Option<String>,
    pub trace: Option<String>,
    pub failure_type: Option<FailureType>,
    pub error_msg: Option<String>,
    pub retry_count: i64,
    pub claim_count: i64,
    pub resume_count: i64,
    /// Restarts from scratch so far (the step keys of the current run carry it).
    pub restart_count: i64,
    /// Runs aborted by something other than an outage since the task last started afresh
    /// (`engine.max_run_aborts`).
    pub run_aborts: i64,
    /// The provider its model calls go to (`""`: `[llm]`), as its agent version named it.
    pub provider: String,
    /// An admin asked a RUNNING task to pause: it does at its next step boundary.
    pub pause_requested: bool,
    pub version: i64,
    pub owner: Option<String>,
    pub lease_expire: Option<i64>,
    pub confirm_deadline: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
    /// This claim took the task over from an instance that lost it.
    pub taken_over: bool,
    /// The agent's name (metrics labels).
    pub agent_name: String,
}

impl TaskRow {
    /// The task's one reply to its chat (its answer, or a notice), in reply to the message
    /// `in_reply_to`, under the task's reply key (`reply_key`).
    pub fn reply(&self, in_reply_to: String, reply_type: ReplyType, content: String) -> NewReply {
        NewReply {
            idempotency_key: reply_key(self.id, self.resume_count),
            channel: self.channel.clone(),
            conversation_id: self.conversation_id.clone(),
            in_reply_to,
            reply_type,
            content,
        }
    }
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct MessageRow {
    pub id: i64,
    pub channel: String,
    pub external_event_id: String,
    pub external_message_id: String,
    pub conversation_id: String,
    pub sender_id: String,
    pub sender_name: Option<String>,
    pub text: String,
    pub received_at: i64,
    /// See [`NewMessage::trace_context`].
    pub trace_context: Option<String>,
}

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct StepRow {
    pub id: i64,
    pub task_id: i64,
    pub step_no: i64,
    pub step_type: StepType,
    pub tool_name: String,
    pub idempotency_key: String,
    pub input: Option<String>,
    pub output: Option<String>,
    pub error: Option<String>,
    pub status: StepStatus,
    pub tokens_in: Option<i64>,
    pub tokens_out: Option<i64>,
    pub duration_ms: Option<i64>,
    pub attempt: i64,
    pub created_at: i64,
    pub finished_at: Option<i64>,
}

/// A step to journal before its call is made.
#[derive(Debug, Clone)]
pub struct NewStep<'a> {
    pub step_no: i64,
    pub step_type: StepType,
    pub tool_name: &'a str,
    pub idempotency_key: &'a str,
    pub input: &'a str,
}

/// How a step ended.
#[derive(Debug, Clone)]
pub struct StepResult {
    pub step_id: i64,
    /// Tries made so far, this one included (numbered across runs).
    pub attempts: i64,
    pub status: StepStatus,
    pub output: Option<String>,
    pub error: Option<String>,
    pub tokens_in: Option<i64>,
    pub tokens_out: Option<i64>,
    pub duration_ms: i64,
    /// A conversation's history summary: the id of the newest message it covers (the
    /// conversation's later messages carry it over: `Store::conversation_summary`).
    pub summary_through: Option<i64>,
}

/// The reply a finished task owes the chat.
#[derive(Debug, Clone)]
pub struct NewReply {
    /// `agent-task-<id>` (see `domain::reply_key`).
    pub idempotency_key: String,
    pub channel: String,
    pub conversation_id: String,
    pub in_reply_to: String,
    pub reply_type: ReplyType,
    /// JSON: `{"text": ..., "card": ...}`.
    pub content: String,
}

/// A terminal outcome, written with its step, its reply and its audit event in one transaction.
#[derive(Debug, Clone)]
pub struct TaskOutcome {
    pub status: TaskStatus,
    pub result: Option<String>,
    /// Workflow runs: the trace of nodes and steps, as JSON.
    pub trace: Option<String>,
    pub failure_type: Option<FailureType>,
    pub error: Option<String>,
    pub retries: i64,
    pub step: Option<StepResult>,
    pub reply: NewReply,
    pub audit_summary: String,
}

/// A chat message as a channel parsed it.
#[derive(Debug, Clone)]
pub struct NewMessage {
    pub channel: String,
    pub event_id: String,
    pub message_id: String,
    pub conversation_id: String,
    pub sender_id: String,
    pub sender_name: Option<String>,
    pub text: String,
    /// What the platform needs later to answer this message (JSON), e.g. DingTalk's
    /// session webhook.
    pub reply_context: Option<String>,
    /// The W3C `traceparent` of the intake that stores it (set by intake, not by the
    /// platforms; see `crate::telemetry`).
    pub trace_context: Option<String>,
}

/// Longest id (event, message, conversation, sender) or sender name accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// Longest conversation key: a chat's id and a thread's or member's id, each an id, with
/// the mark between them (`channels::platform::Conversation`).
pub const MAX_CONVERSATION_BYTES: usize = 2 * MAX_ID_BYTES + 3;

impl NewMessage {
    /// Refuses an id or name over [`MAX_ID_BYTES`] (a message whose reply could never be
    /// addressed), naming the field.
    pub fn check_sizes(&self) -> Result<(), String> {
        let fields = [
            ("event id", Some(&self.event_id)),
            ("message id", Some(&self.message_id)),
            ("conversation id", Some(&self.conversation_id)),
            ("sender id", Some(&self.sender_id)),
            ("sender name", self.sender_name.as_ref()),
        ];
        for (name, value) in fields {
            let max = if name == "conversation id" {
                MAX_CONVERSATION_BYTES
            } else {
                MAX_ID_BYTES
            };
            if value.is_some_and(|v| v.len() > max) {
                return Err(format!("the {name} is longer than {max} bytes"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ingested {
    pub task_id: i64,
    pub duplicate: bool,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ReplyRow {
    pub id: i64,
    pub task_id: i64,
    pub idempotency_key: String,
    pub channel: String,
    pub conversation_id: String,
    pub in_reply_to: String,
    pub reply_type: ReplyType,
    pub content: String,
    pub status: ReplyStatus,
    pub platform_message_id: Option<String>,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub last_error: Option<String>,
    pub created_at: i64,
    pub sent_at: Option<i64>,
    /// The content is a slow run's placeholder, which the task's answer replaces.
    pub placeholder: bool,
    /// The content is shown by editing the sent message `platform_message_id`.
    pub edit: bool,
    /// The key the platform sees when it is not `idempotency_key` (see migration 0009).
    pub send_key: Option<String>,
    /// How many numbered parts of a reply too long for one message the platform has
    /// accepted (see `channels::parts`): a resumed delivery sends only the rest.
    pub parts_sent: i64,
    /// The messages a streamed answer already shows its parts 2, 3, … in (`{"2": "<id>"}`),
    /// which its delivery edits.
    pub streamed_parts: Option<String>,
    /// The answered message's `reply_context` (DingTalk's session webhook), read by the
    /// outbox for platforms that want it; not a column of the reply.
    #[sqlx(skip)]
    pub reply_context: Option<String>,
}

/// The one pending request an approval decision is for, as a card, a callback, a decision
/// command or a reaction names it: the task, the run (its restart number when the request
/// was made), the step, and a digest of the arguments the approver was shown. Built and read
/// only here, so every path checks the same thing: a decision applies only to the request
/// that is open now, with the arguments that were shown (issue 32).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalRef {
    pub task_id: i64,
    pub run: i64,
    pub step_no: i64,
    /// The first 12 hex digits of the SHA-256 of the arguments as shown.
    pub digest: String,
}

impl ApprovalRef {
    const DIGEST_LEN: usize = 12;

    pub fn new(task_id: i64, run: i64, step_no: i64, args: &str) -> ApprovalRef {
        ApprovalRef {
            task_id,
            run,
            step_no,
            digest: Self::digest_of(args),
        }
    }

    /// The digest of arguments as a request stores and shows them.
    pub fn digest_of(args: &str) -> String {
        use sha2::Digest;
        let mut hex = hex::encode(sha2::Sha256::digest(args.as_bytes()));
        hex.truncate(Self::DIGEST_LEN);
        hex
    }

    /// `<task>.<step>.<run>.<digest>`: what a button key, a callback and a typed decision
    /// command carry (`approve 12.3.0.5f1d2a9c0b7e`).
    pub fn token(&self) -> String {
        format!(
            "{}.{}.{}.{}",
            self.task_id, self.step_no, self.run, self.digest
        )
    }

    /// Reads a [`token`](Self::token) (`.` or `:` between its parts); `None` for anything
    /// else, a token without its run and digest included.
    pub fn parse_token(token: &str) -> Option<ApprovalRef> {
        let mut parts = token.trim().split(['.', ':']);
        let task_id = parts.next()?.parse().ok()?;
        let step_no = parts.next()?.parse().ok()?;
        let run = parts.next()?.parse().ok()?;
        let digest = parts.next()?;
        if parts.next().is_some()
            || digest.len() != Self::DIGEST_LEN
            || !digest.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return None;
        }
        Some(ApprovalRef {
            task_id,
            run,
            step_no,
            digest: digest.to_ascii_lowercase(),
        })
    }

    /// An approval card's button value for `decision` ("approve" or "reject").
    pub fn card_value(&self, decision: &str) -> Value {
        serde_json::json!({
            "task_id": self.task_id,
            "step_no": self.step_no,
            "run": self.run,
            "digest": self.digest,
            "request": self.token(),
            "decision": decision,
        })
    }

    /// The request a card's button value names (see [`card_value`](Self::card_value)).
    pub fn from_card_value(value: &Value) -> Option<ApprovalRef> {
        let named = Self::parse_token(value["request"].as_str()?)?;
        let agrees = value["task_id"].as_i64().is_none_or(|t| t == named.task_id)
            && value["step_no"].as_i64().is_none_or(|s| s == named.step_no);
        agrees.then_some(named)
    }

    /// Why this names something other than the open request of its task (run `run`, step
    /// `step_no`, arguments `args`); `None` when it names exactly that request.
    pub fn stale_against(&self, run: i64, step_no: i64, args: &str) -> Option<String> {
        if self.run != run {
            return Some(format!(
                "it was made for run {} of the task; the task was restarted and now runs run {run}",
                self.run
            ));
        }
        if self.step_no != step_no {
            return Some(format!(
                "it asked about step {}; the open request is step {step_no}",
                self.step_no
            ));
        }
        if self.digest != Self::digest_of(args) {
            return Some(
                "its arguments are not the ones the open request would run with".to_string(),
            );
        }
        None
    }
}

/// A decision (Approve/Reject) posted back by the IM: a card action, a callback, a typed
/// command or a reaction, naming the request it decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardAction {
    pub request: ApprovalRef,
    pub approve: bool,
    pub approver: String,
}

impl CardAction {
    /// The decision carried by an approval card's button value, as the runner writes it
    /// ([`ApprovalRef::card_value`]); `None` for anything else.
    pub fn from_card_value(value: &Value, approver: &str) -> Option<CardAction> {
        let approve = match value["decision"].as_str()? {
            "approve" => true,
            "reject" => false,
            _ => return None,
        };
        Some(CardAction {
            request: ApprovalRef::from_card_value(value)?,
            approve,
            approver: approver.to_string(),
        })
    }

    pub fn task_id(&self) -> i64 {
        self.request.task_id
    }
}

/// Whether `name` may name an agent or a knowledge collection: 1 to 64 ASCII letters,
/// digits, `-` or `_` (it appears in URLs and config keys).
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
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

/// What an audit row is about, besides the task it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuditTarget {
    Task(i64),
    /// A journalled step, by its row id.
    Step(i64),
    /// An outbox reply, by its row id.
    Reply(i64),
    /// A pending action (approval request), by its id.
    Approval(i64),
    /// A scheduled job, by its name.
    Job(String),
    /// A knowledge collection, by its name.
    Knowledge(String),
}

impl AuditTarget {
    pub const TYPES: [&'static str; 6] = ["task", "step", "reply", "approval", "job", "knowledge"];

    /// `target_type` and `target_id` as stored.
    pub fn columns(target: Option<&AuditTarget>) -> (Option<&'static str>, Option<String>) {
        match target {
            None => (None, None),
            Some(AuditTarget::Task(id)) => (Some("task"), Some(id.to_string())),
            Some(AuditTarget::Step(id)) => (Some("step"), Some(id.to_string())),
            Some(AuditTarget::Reply(id)) => (Some("reply"), Some(id.to_string())),
            Some(AuditTarget::Approval(id)) => (Some("approval"), Some(id.to_string())),
            Some(AuditTarget::Job(name)) => (Some("job"), Some(name.clone())),
            Some(AuditTarget::Knowledge(name)) => (Some("knowledge"), Some(name.clone())),
        }
    }
}
