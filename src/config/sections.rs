//! The configuration's sections, as `config/default.toml` lays them out.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::knowledge::KnowledgeConfig;
use crate::definition::{AgentDefinition, AgentMode, ToolKind};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub database: DatabaseConfig,
    pub intake: IntakeConfig,
    pub llm: LlmConfig,
    pub worker: WorkerConfig,
    pub engine: EngineConfig,
    pub outbox: OutboxConfig,
    pub scheduler: SchedulerConfig,
    pub admin: AdminConfig,
    pub replies: RepliesConfig,
    pub log: LogConfig,
    pub telemetry: TelemetryConfig,
    pub channels: crate::channels::ChannelsConfig,
    pub agents: BTreeMap<String, AgentConfig>,
    pub context: ContextConfig,
    pub redaction: RedactionConfig,
    pub tooling: ToolingConfig,
    pub journal: JournalConfig,
    pub knowledge: KnowledgeConfig,
    #[serde(default)]
    pub tools: BTreeMap<String, ToolConfig>,
    /// MCP servers whose tools agents may use as `<server>.<tool>`.
    #[serde(default)]
    pub mcp_servers: BTreeMap<String, McpServerConfig>,
}

/// One MCP server: over streamable HTTP (`url`) or a child process speaking stdio
/// (`command`), exactly one of the two.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerConfig {
    /// The streamable-HTTP endpoint; empty with `command`.
    #[serde(default)]
    pub url: String,
    /// Sent as `Authorization: Bearer <token>`; empty = none.
    #[serde(default)]
    pub bearer_token: String,
    /// More request headers for `url` (e.g. an API key).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// A stdio server: the program and its arguments, run by each instance (restarted
    /// when it dies). Never taken from a model's output.
    #[serde(default)]
    pub command: Vec<String>,
    /// The stdio server's environment, on top of PATH, HOME, LANG and TMPDIR as assistd
    /// has them; nothing else of assistd's environment is passed on.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The tools to take (by the server's names); empty = all.
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default = "default_mcp_timeout")]
    pub timeout_secs: u64,
    /// A kind per tool, over what its annotations say.
    #[serde(default)]
    pub kinds: BTreeMap<String, ToolKind>,
    /// `<tool> = "<undo tool>"`: the server's tool that undoes another (called with the
    /// original arguments and the result's fields); makes an idempotent, non-destructive
    /// tool compensable.
    #[serde(default)]
    pub undo: BTreeMap<String, String>,
}

fn default_mcp_timeout() -> u64 {
    30
}

/// How the step journal keeps large outputs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalConfig {
    /// Step outputs longer than this (bytes) are kept in `step_blob`, by reference.
    pub inline_max_bytes: usize,
    /// The most of one tool output a model is shown (bytes); longer outputs are shortened
    /// with a note giving the whole length. Templates and the journal keep the whole.
    pub model_view_bytes: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntakeConfig {
    /// Most webhooks committed together in one intake transaction.
    pub batch_max: usize,
    /// Intake transactions in flight at once.
    pub writers: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedactionConfig {
    /// Regular expressions redacted in addition to the built-in ones.
    pub extra_patterns: Vec<String>,
}

/// How long model contexts are kept short.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextConfig {
    pub summary_every_steps: u32,
    pub summary_prompt: String,
    pub history_token_budget: usize,
    /// After a conversation's history is folded into a summary, the newest exchanges kept
    /// in full take at most this share of the history budget (0–100), so that the next
    /// messages carry the summary over instead of asking for a new one.
    pub recent_after_summary_percent: u32,
    /// The longest history summary a single-turn conversation asks for, in tokens (at most a
    /// quarter of the provider's context window).
    pub summary_max_tokens: u32,
}

/// Settings shared by every tool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolingConfig {
    /// Hosts (names or IP literals) tools may reach even though they are loopback,
    /// link-local or private. Everything else on those ranges is refused (SSRF guard).
    pub allowed_private_hosts: Vec<String>,
    /// Largest tool response kept, in bytes.
    pub max_response_bytes: usize,
    /// Tries of a read-only tool call before its error is handed to the model.
    pub read_only_attempts: u32,
    pub retry_backoff_base_ms: u64,
    pub retry_backoff_max_ms: u64,
}

/// One HTTP call, with `{{ ... }}` templates over `args` (and `result` for undo calls).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpCallConfig {
    pub method: String,
    pub url: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Body template; unset = the arguments as JSON (not sent for GET).
    #[serde(default)]
    pub body: Option<String>,
}

/// A tool declared in config: a named HTTP call the workflows and agent loops may use.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    pub kind: ToolKind,
    #[serde(default)]
    pub description: String,
    pub method: String,
    pub url: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default = "default_tool_timeout")]
    pub timeout_secs: u64,
    /// JSON Schema (object/required/properties with primitive types) for the arguments.
    #[serde(default = "default_args_schema")]
    pub args_schema: serde_json::Value,
    /// Whether repeating the call is harmless (the endpoint honours Idempotency-Key).
    /// Default: true for read_only, false otherwise. A non-idempotent call interrupted by a
    /// crash becomes UNKNOWN and waits for a human.
    #[serde(default)]
    pub idempotent: Option<bool>,
    /// The undo call of a compensable tool; `result` is the original call's response.
    #[serde(default)]
    pub undo: Option<HttpCallConfig>,
}

fn default_tool_timeout() -> u64 {
    10
}

fn default_args_schema() -> serde_json::Value {
    serde_json::json!({"type": "object"})
}

impl ToolConfig {
    /// The tool's own call.
    pub fn call(&self) -> HttpCallConfig {
        HttpCallConfig {
            method: self.method.clone(),
            url: self.url.clone(),
            headers: self.headers.clone(),
            body: self.body.clone(),
        }
    }

    pub fn is_idempotent(&self) -> bool {
        self.idempotent.unwrap_or(self.kind == ToolKind::ReadOnly)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub listen: String,
    pub role: Role,
    pub body_limit_bytes: usize,
    pub request_timeout_secs: u64,
    /// Connections the kernel queues for the HTTP listener before they are accepted
    /// (`listen(2)` backlog; Linux caps it at `net.core.somaxconn`).
    pub listen_backlog: u32,
    /// Time a client has to send a request's headers, in seconds.
    pub header_read_timeout_secs: u64,
    /// Open HTTP connections at most.
    pub max_connections: usize,
}

/// What an instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// HTTP, workers, outbox and scheduler.
    All,
    /// Webhooks and APIs only.
    Api,
    /// Workers, outbox and scheduler only.
    Worker,
}

impl Role {
    pub fn runs_workers(self) -> bool {
        self != Role::Api
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    pub enabled: bool,
    pub jobs: JobsConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobsConfig {
    pub confirm_timeout: ConfirmTimeoutJob,
    pub orphan_reclaim: OrphanReclaimJob,
    pub retention: RetentionJob,
}

/// What every job has.
#[derive(Debug, Clone)]
pub struct JobSchedule {
    pub enabled: bool,
    pub cron: String,
    pub batch_size: u32,
    pub lock_lease_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfirmTimeoutJob {
    pub enabled: bool,
    pub cron: String,
    pub batch_size: u32,
    pub lock_lease_secs: u64,
    pub approval_callback_url: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrphanReclaimJob {
    pub enabled: bool,
    pub cron: String,
    pub batch_size: u32,
    pub lock_lease_secs: u64,
    pub grace_secs: u64,
    /// When set, each reclaim POSTs a signed alert here through the outbox.
    #[serde(default)]
    pub alert_url: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionJob {
    pub enabled: bool,
    pub cron: String,
    pub batch_size: u32,
    pub lock_lease_secs: u64,
    pub ttl_days: u64,
}

macro_rules! schedule_of {
    ($($job:ty),*) => {$(
        impl $job {
            pub fn schedule(&self) -> JobSchedule {
                JobSchedule {
                    enabled: self.enabled,
                    cron: self.cron.clone(),
                    batch_size: self.batch_size,
                    lock_lease_secs: self.lock_lease_secs,
                }
            }
        }
    )*};
}
schedule_of!(ConfirmTimeoutJob, OrphanReclaimJob, RetentionJob);

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    pub url: String,
    pub max_connections: u32,
    pub sqlite_busy_timeout_ms: u64,
    pub acquire_timeout_secs: u64,
    /// PostgreSQL: longest a statement may run, in milliseconds (0 = no limit).
    pub statement_timeout_ms: u64,
    /// SQLite `synchronous` in WAL mode: `normal` or `full`.
    pub sqlite_synchronous: SqliteSync,
    /// Rows a SQLite connection's thread may produce ahead of the reader (sqlx's default: 50).
    pub sqlite_row_buffer: usize,
    /// SQLite `mmap_size`: bytes of the file read through a memory map shared by every
    /// connection (the OS page cache) instead of `read` calls into each connection's cache;
    /// 0 = off.
    pub sqlite_mmap_bytes: u64,
}

/// How SQLite commits reach the disk (see `config/default.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SqliteSync {
    Normal,
    Full,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    pub base_url: String,
    pub api_key: String,
    /// Header that carries `api_key`; empty = `Authorization: Bearer`.
    pub api_key_header: String,
    pub model: String,
    pub timeout_secs: u64,
    /// The default model's context window, in tokens.
    pub context_window: u32,
    /// Extra headers sent with every model call.
    pub headers: BTreeMap<String, String>,
    /// Query parameters added to every model call (Azure's `api-version`).
    pub query: BTreeMap<String, String>,
    pub retry_after_max_secs: u64,
    /// Model calls this instance sends to `[llm]` at once (0 = no limit).
    pub max_concurrency: usize,
    /// How long a provider may keep answering 429 before a call fails RATE_LIMITED.
    pub rate_limit_patience_secs: u64,
    pub retry: LlmRetryConfig,
    /// Named providers agents may choose with `provider`.
    #[serde(default)]
    pub providers: BTreeMap<String, LlmProviderConfig>,
    /// Prices per model name, for the estimated cost on the dashboard and in /metrics.
    #[serde(default)]
    pub prices: BTreeMap<String, ModelPrice>,
    pub price_currency: String,
}

/// What a model's tokens cost, per million, in `llm.price_currency`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub prompt_per_million: f64,
    pub completion_per_million: f64,
}

impl ModelPrice {
    pub fn cost(&self, prompt: i64, completion: i64) -> f64 {
        (prompt as f64 * self.prompt_per_million + completion as f64 * self.completion_per_million)
            / 1_000_000.0
    }
}

impl LlmConfig {
    /// The `[llm]` endpoint as a provider.
    pub fn default_provider(&self) -> LlmProviderConfig {
        LlmProviderConfig {
            base_url: self.base_url.clone(),
            api_key: self.api_key.clone(),
            api_key_header: self.api_key_header.clone(),
            model: self.model.clone(),
            timeout_secs: self.timeout_secs,
            context_window: self.context_window,
            headers: self.headers.clone(),
            query: self.query.clone(),
            max_concurrency: self.max_concurrency,
        }
    }
}

/// One OpenAI-compatible endpoint (`[llm.providers.<name>]`); the fields mean what they mean
/// in `[llm]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmProviderConfig {
    pub base_url: String,
    #[serde(default)]
    pub api_key: String,
    #[serde(default)]
    pub api_key_header: String,
    #[serde(default)]
    pub model: String,
    #[serde(default = "default_provider_timeout")]
    pub timeout_secs: u64,
    #[serde(default = "default_context_window")]
    pub context_window: u32,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub query: BTreeMap<String, String>,
    /// Model calls this instance sends to this endpoint at once (0 = no limit).
    #[serde(default)]
    pub max_concurrency: usize,
}

/// Shortest admin token accepted when the server listens beyond loopback, in bytes.
pub(super) const MIN_PUBLIC_ADMIN_TOKEN: usize = 32;

fn default_provider_timeout() -> u64 {
    60
}
fn default_context_window() -> u32 {
    8192
}

/// Retry policies of the transient failure types; the others are never retried.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmRetryConfig {
    pub timeout: RetryPolicy,
    pub rate_limited: RetryPolicy,
    pub provider_error: RetryPolicy,
}

impl LlmRetryConfig {
    /// The policy for a failure type; `None` = fail at once.
    pub fn policy(&self, failure: crate::domain::FailureType) -> Option<&RetryPolicy> {
        use crate::domain::FailureType;
        match failure {
            FailureType::Timeout => Some(&self.timeout),
            FailureType::RateLimited => Some(&self.rate_limited),
            FailureType::ProviderError => Some(&self.provider_error),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub instance_id: String,
    pub concurrency: usize,
    pub lease_secs: u64,
    pub poll_interval_ms: u64,
    pub claim_batch: usize,
    pub shutdown_grace_secs: u64,
    /// Most step-journal, lease, finishing and reply-delivered writes of different tasks
    /// committed in one transaction (1 = a transaction each).
    pub group_commit_max: usize,
    /// PostgreSQL: such transactions in flight at once (SQLite: always 1).
    pub group_commit_writers: usize,
    /// PostgreSQL: only the instance holding the workers' lease (an advisory lock) runs
    /// workers, outbox, ingester and scheduler; the others take webhooks and stand by.
    /// SQLite: no effect.
    pub exclusive: bool,
    /// How often a standby tries the workers' lease, and its holder checks it, in ms.
    pub standby_poll_ms: u64,
}

impl WorkerConfig {
    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_secs)
    }
}

/// How a run that aborts is treated (issue 32): an outage is waited out and the run goes on;
/// any other abort counts, and the task fails INTERNAL past the limit.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Aborted runs of a task (not counting outages) before it ends FAILED with INTERNAL.
    pub max_run_aborts: u32,
    /// Wait before an aborted run's task may be claimed again, in milliseconds; doubled with
    /// each abort, capped at the lease.
    pub abort_retry_ms: u64,
    /// Longest a run stopped by an outage waits for the database before it leaves the task
    /// to the lease reclaim, in seconds.
    pub outage_wait_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    pub timeout_secs: u64,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub max_attempts: u32,
    pub lease_secs: u64,
    pub batch: usize,
    pub poll_interval_ms: u64,
    /// Longest a wake-up (a task finished) waits for the outbox's next claim while
    /// deliveries are in flight, in milliseconds: claims are batched behind the next
    /// delivery to end, and this bounds the wait when none ends soon (a slow platform).
    pub claim_wait_ms: u64,
    /// Longest a reply waits for an older reply of its conversation that is still being
    /// retried, in seconds (0 = no limit: order over progress).
    pub order_wait_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    pub token: String,
    pub session_hours: u64,
    /// Where a generated token is written (never to the log).
    pub token_file: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepliesConfig {
    pub failure_notice: String,
    pub cancelled_notice: String,
    pub rejected_notice: String,
    pub timeout_notice: String,
    /// Show the platform's typing indicator while a task runs (Telegram, Matrix).
    pub typing_indicator: bool,
    /// The placeholder a slow run shows where the platform can edit it into the answer;
    /// empty = none (an agent's `placeholder` overrides it).
    pub placeholder: String,
    /// How long a run goes before its placeholder is sent (0 = at once).
    pub placeholder_after_ms: u64,
    /// The least time between two edits of a streamed answer; 0 = no streaming.
    pub stream_edit_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    pub level: String,
}

/// OpenTelemetry traces over OTLP/HTTP (see `crate::telemetry`); off while `otlp_endpoint`
/// is empty.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP base URL, e.g. `http://otel-collector:4318` (traces go to
    /// `<endpoint>/v1/traces`); empty = no export.
    pub otlp_endpoint: String,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Longest wait for one export request (the exporter drops that batch after it).
    pub export_timeout_secs: u64,
    /// More headers for the export requests (e.g. a collector's API key).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    #[serde(default)]
    pub mode: AgentMode,
    pub system_prompt: String,
    #[serde(default)]
    pub model: String,
    /// A `[llm.providers.<name>]` entry; empty = `[llm]`.
    #[serde(default)]
    pub provider: String,
    #[serde(default = "crate::definition::default_temperature")]
    pub temperature: f64,
    #[serde(default = "crate::definition::default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "crate::definition::default_history")]
    pub history_messages: u32,
    /// Workflow agents: path of the workflow JSON (docs/workflows.md).
    #[serde(default)]
    pub workflow_file: String,
    /// Chat user ids allowed to approve this agent's irreversible actions.
    #[serde(default)]
    pub approvers: Vec<String>,
    /// How long an approval request waits before the task is cancelled, in seconds.
    #[serde(default = "crate::definition::default_deadline")]
    pub confirm_deadline_secs: u64,
    /// Sent when the model answers nothing; empty = the task fails (INVALID_RESPONSE).
    #[serde(default)]
    pub fallback_text: String,
    /// This agent's placeholder (`replies.placeholder` when absent; "" = none).
    #[serde(default)]
    pub placeholder: Option<String>,
    /// Knowledge collections it answers from (single-turn agents; docs/knowledge.md).
    #[serde(default)]
    pub knowledge: Vec<String>,
}

impl AgentConfig {
    /// The definition this section declares, with the workflow read from `workflow_file`.
    pub fn definition(&self, workflow: Option<serde_json::Value>) -> AgentDefinition {
        AgentDefinition {
            mode: self.mode,
            system_prompt: self.system_prompt.clone(),
            model: self.model.clone(),
            provider: self.provider.clone(),
            temperature: self.temperature,
            max_tokens: self.max_tokens,
            history_messages: self.history_messages,
            workflow,
            approvers: self.approvers.clone(),
            confirm_deadline_secs: self.confirm_deadline_secs,
            fallback_text: self.fallback_text.clone(),
            placeholder: self.placeholder.clone(),
            knowledge: self.knowledge.clone(),
            mcp_tools: BTreeMap::new(),
        }
    }
}
