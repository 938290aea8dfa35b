//! Typed configuration: `config/default.toml` (compiled in) < `--config FILE` < `ASSISTD_*`
//! environment variables. Owns parsing and validation; every error names the offending key,
//! and nothing here touches the network or the database.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Value;

/// The defaults, with one comment per key. Shipped inside the binary so it runs from anywhere.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

const ENV_PREFIX: &str = "ASSISTD_";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub database: DatabaseConfig,
    pub intake: IntakeConfig,
    pub llm: LlmConfig,
    pub worker: WorkerConfig,
    pub outbox: OutboxConfig,
    pub scheduler: SchedulerConfig,
    pub admin: AdminConfig,
    pub replies: RepliesConfig,
    pub log: LogConfig,
    pub channels: ChannelsConfig,
    pub agents: BTreeMap<String, AgentConfig>,
    pub context: ContextConfig,
    pub redaction: RedactionConfig,
    pub tooling: ToolingConfig,
    #[serde(default)]
    pub tools: BTreeMap<String, ToolConfig>,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    /// Reads only: retried, and safe to repeat after a crash.
    ReadOnly,
    /// Changes something but declares how to undo it (saga compensation).
    Compensable,
    /// Cannot be undone: runs only after a human approves.
    Irreversible,
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
    pub retry: LlmRetryConfig,
    /// Named providers agents may choose with `provider`.
    #[serde(default)]
    pub providers: BTreeMap<String, LlmProviderConfig>,
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
}

/// Shortest admin token accepted when the server listens beyond loopback, in bytes.
const MIN_PUBLIC_ADMIN_TOKEN: usize = 32;

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
}

impl WorkerConfig {
    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_secs)
    }
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelsConfig {
    pub generic: crate::channels::generic::GenericChannelConfig,
    pub slack: crate::channels::slack::SlackChannelConfig,
    pub telegram: crate::channels::telegram::TelegramChannelConfig,
    pub matrix: crate::channels::matrix::MatrixChannelConfig,
    pub lark: crate::channels::lark::LarkChannelConfig,
    pub dingtalk: crate::channels::dingtalk::DingTalkChannelConfig,
    pub wecom: crate::channels::wecom::WeComChannelConfig,
    pub console: ConsoleChannelConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleChannelConfig {
    pub enabled: bool,
    /// Only answer requests from loopback addresses.
    pub loopback_only: bool,
    pub agent: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentMode {
    SingleTurn,
    Workflow,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    #[serde(default = "default_mode")]
    pub mode: AgentMode,
    pub system_prompt: String,
    #[serde(default)]
    pub model: String,
    /// A `[llm.providers.<name>]` entry; empty = `[llm]`.
    #[serde(default)]
    pub provider: String,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "default_history")]
    pub history_messages: u32,
    /// Workflow agents: path of the workflow JSON (docs/workflows.md).
    #[serde(default)]
    pub workflow_file: String,
    /// Chat user ids allowed to approve this agent's irreversible actions.
    #[serde(default)]
    pub approvers: Vec<String>,
    /// How long an approval request waits before the task is cancelled, in seconds.
    #[serde(default = "default_confirm_deadline")]
    pub confirm_deadline_secs: u64,
    /// Sent when the model answers nothing; empty = the task fails (INVALID_RESPONSE).
    #[serde(default)]
    pub fallback_text: String,
}

fn default_mode() -> AgentMode {
    AgentMode::SingleTurn
}
fn default_temperature() -> f64 {
    0.2
}
fn default_max_tokens() -> u32 {
    1024
}
fn default_history() -> u32 {
    20
}
fn default_confirm_deadline() -> u64 {
    3600
}

impl Config {
    /// Defaults, then `file` if given, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// As [`Config::load`], with the environment given explicitly (tests).
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut merged = parse_toml(DEFAULT_TOML, "config/default.toml")?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let overlay = parse_toml(&text, &path.display().to_string())?;
            merge(&mut merged, overlay);
        }
        let mut vars: Vec<(String, String)> = env.into_iter().collect();
        vars.sort();
        for (var, raw) in vars {
            apply_env(&mut merged, &var, &raw)?;
        }
        let config: Config = serde_path_to_error::deserialize(merged).map_err(|e| {
            let key = e.path().to_string();
            invalid(&key, e.into_inner().to_string())
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.server.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "server.listen",
                format!(
                    "`{}` is not an address like 127.0.0.1:8787",
                    self.server.listen
                ),
            ));
        }
        positive(
            "server.body_limit_bytes",
            self.server.body_limit_bytes as u64,
        )?;
        positive(
            "server.request_timeout_secs",
            self.server.request_timeout_secs,
        )?;
        positive("server.listen_backlog", self.server.listen_backlog as u64)?;
        // Reachable from other machines, the admin API must not run on a guessable token (or
        // on one generated and printed in the log).
        let public = self
            .server
            .listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback());
        if public && self.admin.token.len() < MIN_PUBLIC_ADMIN_TOKEN {
            return Err(invalid(
                "admin.token",
                format!(
                    "must be at least {MIN_PUBLIC_ADMIN_TOKEN} bytes when server.listen is not a loopback address"
                ),
            ));
        }
        positive(
            "server.header_read_timeout_secs",
            self.server.header_read_timeout_secs,
        )?;
        positive("server.max_connections", self.server.max_connections as u64)?;
        if self.database.acquire_timeout_secs >= self.server.request_timeout_secs {
            return Err(invalid(
                "database.acquire_timeout_secs",
                "must be below server.request_timeout_secs (a webhook should get 503, not time out)",
            ));
        }
        let url = &self.database.url;
        if !(url.starts_with("sqlite:")
            || url.starts_with("postgres://")
            || url.starts_with("postgresql://"))
        {
            return Err(invalid(
                "database.url",
                "must start with sqlite:, postgres:// or postgresql://",
            ));
        }
        positive("intake.batch_max", self.intake.batch_max as u64)?;
        positive(
            "worker.group_commit_max",
            self.worker.group_commit_max as u64,
        )?;
        positive(
            "worker.group_commit_writers",
            self.worker.group_commit_writers as u64,
        )?;
        positive("intake.writers", self.intake.writers as u64)?;
        if self.intake.batch_max > 1000 {
            return Err(invalid(
                "intake.batch_max",
                "at most 1000 (a batch is a few statements with 11 parameters per message)",
            ));
        }
        positive(
            "database.max_connections",
            self.database.max_connections as u64,
        )?;
        positive(
            "database.sqlite_row_buffer",
            self.database.sqlite_row_buffer as u64,
        )?;
        http_url("llm.base_url", &self.llm.base_url)?;
        if self.llm.model.trim().is_empty() {
            return Err(invalid("llm.model", "must not be empty"));
        }
        positive("llm.timeout_secs", self.llm.timeout_secs)?;
        positive("llm.context_window", u64::from(self.llm.context_window))?;
        for (name, p) in &self.llm.providers {
            http_url(&format!("llm.providers.{name}.base_url"), &p.base_url)?;
            positive(
                &format!("llm.providers.{name}.timeout_secs"),
                p.timeout_secs,
            )?;
            positive(
                &format!("llm.providers.{name}.context_window"),
                u64::from(p.context_window),
            )?;
        }
        for (name, policy) in [
            ("timeout", &self.llm.retry.timeout),
            ("rate_limited", &self.llm.retry.rate_limited),
            ("provider_error", &self.llm.retry.provider_error),
        ] {
            positive(
                &format!("llm.retry.{name}.max_attempts"),
                u64::from(policy.max_attempts),
            )?;
        }
        positive("worker.concurrency", self.worker.concurrency as u64)?;
        if self.context.summary_every_steps < 2 {
            return Err(invalid("context.summary_every_steps", "must be at least 2"));
        }
        positive(
            "context.history_token_budget",
            self.context.history_token_budget as u64,
        )?;
        if let Err(message) = crate::redaction::Redactor::new(&self.redaction.extra_patterns) {
            return Err(invalid("redaction.extra_patterns", message));
        }
        if self.worker.lease_secs < 3 {
            return Err(invalid("worker.lease_secs", "must be at least 3"));
        }
        positive("worker.poll_interval_ms", self.worker.poll_interval_ms)?;
        positive("worker.claim_batch", self.worker.claim_batch as u64)?;
        positive("outbox.timeout_secs", self.outbox.timeout_secs)?;
        positive("outbox.batch", self.outbox.batch as u64)?;
        positive("outbox.poll_interval_ms", self.outbox.poll_interval_ms)?;
        if self.outbox.lease_secs <= self.outbox.timeout_secs {
            return Err(invalid(
                "outbox.lease_secs",
                "must be longer than outbox.timeout_secs",
            ));
        }
        let jobs = &self.scheduler.jobs;
        for (name, job) in [
            ("confirm_timeout", jobs.confirm_timeout.schedule()),
            ("orphan_reclaim", jobs.orphan_reclaim.schedule()),
            ("retention", jobs.retention.schedule()),
        ] {
            let key = format!("scheduler.jobs.{name}");
            if job.cron.split_whitespace().count() != 6 {
                return Err(invalid(
                    &format!("{key}.cron"),
                    "needs six fields: second minute hour day-of-month month day-of-week",
                ));
            }
            positive(&format!("{key}.batch_size"), u64::from(job.batch_size))?;
            positive(&format!("{key}.lock_lease_secs"), job.lock_lease_secs)?;
        }
        if !jobs.confirm_timeout.approval_callback_url.is_empty() {
            http_url(
                "scheduler.jobs.confirm_timeout.approval_callback_url",
                &jobs.confirm_timeout.approval_callback_url,
            )?;
        }
        let generic = &self.channels.generic;
        if !generic.reply_url.is_empty() {
            http_url("channels.generic.reply_url", &generic.reply_url)?;
        }
        if generic.enabled && !self.agents.contains_key(&generic.agent) {
            return Err(invalid(
                "channels.generic.agent",
                format!("no agent named `{}` under [agents]", generic.agent),
            ));
        }
        let c = &self.channels;
        if c.console.enabled && !self.agents.contains_key(&c.console.agent) {
            return Err(invalid(
                "channels.console.agent",
                format!("no agent named `{}`", c.console.agent),
            ));
        }
        self.check_channel(
            "slack",
            c.slack.enabled,
            &[
                ("signing_secret", &c.slack.signing_secret),
                ("bot_token", &c.slack.bot_token),
            ],
            ("api_base_url", &c.slack.api_base_url),
            &c.slack.agent,
        )?;
        self.check_channel(
            "telegram",
            c.telegram.enabled,
            &[
                ("bot_token", &c.telegram.bot_token),
                ("secret_token", &c.telegram.secret_token),
            ],
            ("api_base_url", &c.telegram.api_base_url),
            &c.telegram.agent,
        )?;
        self.check_channel(
            "wecom",
            c.wecom.enabled,
            &[
                ("corp_id", &c.wecom.corp_id),
                ("agent_id", &c.wecom.agent_id),
                ("secret", &c.wecom.secret),
                ("token", &c.wecom.token),
            ],
            ("api_base_url", &c.wecom.api_base_url),
            &c.wecom.agent,
        )?;
        if c.wecom.enabled && c.wecom.encoding_aes_key.len() != 43 {
            return Err(invalid(
                "channels.wecom.encoding_aes_key",
                "must be the 43-character EncodingAESKey",
            ));
        }
        self.check_channel(
            "dingtalk",
            c.dingtalk.enabled,
            &[
                ("app_key", &c.dingtalk.app_key),
                ("app_secret", &c.dingtalk.app_secret),
                ("robot_code", &c.dingtalk.robot_code),
            ],
            ("api_base_url", &c.dingtalk.api_base_url),
            &c.dingtalk.agent,
        )?;
        self.check_channel(
            "lark",
            c.lark.enabled,
            &[
                ("app_id", &c.lark.app_id),
                ("app_secret", &c.lark.app_secret),
                ("verification_token", &c.lark.verification_token),
            ],
            ("api_base_url", &c.lark.api_base_url),
            &c.lark.agent,
        )?;
        self.check_channel(
            "matrix",
            c.matrix.enabled,
            &[
                ("as_token", &c.matrix.as_token),
                ("hs_token", &c.matrix.hs_token),
                ("bot_user_id", &c.matrix.bot_user_id),
            ],
            ("homeserver_url", &c.matrix.homeserver_url),
            &c.matrix.agent,
        )?;
        for (name, agent) in &self.agents {
            if name.is_empty() || name.len() > 64 {
                return Err(invalid("agents", "agent names are 1 to 64 characters"));
            }
            if !(0.0..=2.0).contains(&agent.temperature) {
                return Err(invalid(
                    &format!("agents.{name}.temperature"),
                    "must be between 0 and 2",
                ));
            }
            if !agent.provider.is_empty() && !self.llm.providers.contains_key(&agent.provider) {
                return Err(invalid(
                    &format!("agents.{name}.provider"),
                    format!("names no [llm.providers.{}] entry", agent.provider),
                ));
            }
            if agent.mode == AgentMode::Workflow && agent.workflow_file.trim().is_empty() {
                return Err(invalid(
                    &format!("agents.{name}.workflow_file"),
                    "workflow agents need a workflow_file",
                ));
            }
        }
        Ok(())
    }

    /// An enabled platform needs its secrets, an http(s) API URL and an agent that exists.
    fn check_channel(
        &self,
        platform: &str,
        enabled: bool,
        required: &[(&str, &String)],
        api: (&str, &String),
        agent: &str,
    ) -> Result<(), ConfigError> {
        if !enabled {
            return Ok(());
        }
        for (key, value) in required {
            if value.is_empty() {
                return Err(invalid(
                    &format!("channels.{platform}.{key}"),
                    "must be set when the channel is enabled",
                ));
            }
        }
        http_url(&format!("channels.{platform}.{}", api.0), api.1)?;
        if !self.agents.contains_key(agent) {
            return Err(invalid(
                &format!("channels.{platform}.agent"),
                format!("no agent named `{agent}`"),
            ));
        }
        Ok(())
    }

    /// The instance id: configured, else the host name, else a random one.
    pub fn instance_id(&self) -> String {
        if !self.worker.instance_id.trim().is_empty() {
            return self.worker.instance_id.trim().to_string();
        }
        std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| format!("assistd-{}", uuid::Uuid::new_v4().simple()))
    }
}

fn positive(key: &str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(invalid(key, "must be greater than 0"));
    }
    Ok(())
}

fn http_url(key: &str, value: &str) -> Result<(), ConfigError> {
    match reqwest::Url::parse(value) {
        Ok(url) if matches!(url.scheme(), "http" | "https") => Ok(()),
        _ => Err(invalid(key, format!("`{value}` is not an http(s) URL"))),
    }
}

fn parse_toml(text: &str, origin: &str) -> Result<Value, ConfigError> {
    text.parse::<toml::Table>()
        .map(Value::Table)
        .map_err(|e| ConfigError::Syntax {
            path: origin.to_string(),
            message: e.to_string(),
        })
}

fn merge(base: &mut Value, overlay: Value) {
    match (base, overlay) {
        (Value::Table(base), Value::Table(overlay)) => {
            for (key, value) in overlay {
                match base.get_mut(&key) {
                    Some(existing) => merge(existing, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, overlay) => *base = overlay,
    }
}

/// Applies one `ASSISTD_SECTION__KEY=value`. The value is read as the type the key already
/// has (so a numeric secret stays a string); variables without `__` (such as
/// `ASSISTD_TEST_POSTGRES_URL`) are not configuration and are ignored.
fn apply_env(root: &mut Value, var: &str, raw: &str) -> Result<(), ConfigError> {
    let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
        return Ok(());
    };
    if !rest.contains("__") {
        return Ok(());
    }
    let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::Env {
            var: var.to_string(),
            message: "empty key segment".into(),
        });
    }
    let mut node = root;
    for (i, segment) in path.iter().enumerate() {
        let Value::Table(table) = node else {
            return Err(ConfigError::Env {
                var: var.to_string(),
                message: format!("`{}` is not a section", path[..i].join(".")),
            });
        };
        if i + 1 == path.len() {
            let value = match table.get(segment) {
                Some(existing) => {
                    typed_like(existing, raw).map_err(|message| ConfigError::Env {
                        var: var.to_string(),
                        message,
                    })?
                }
                None => Value::String(raw.to_string()),
            };
            table.insert(segment.clone(), value);
            return Ok(());
        }
        node = table
            .entry(segment.clone())
            .or_insert_with(|| Value::Table(toml::Table::new()));
    }
    Ok(())
}

fn typed_like(existing: &Value, raw: &str) -> Result<Value, String> {
    let raw_t = raw.trim();
    match existing {
        Value::Integer(_) => raw_t
            .parse::<i64>()
            .map(Value::Integer)
            .map_err(|_| format!("`{raw}` is not an integer")),
        Value::Float(_) => raw_t
            .parse::<f64>()
            .map(Value::Float)
            .map_err(|_| format!("`{raw}` is not a number")),
        Value::Boolean(_) => match raw_t.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Value::Boolean(true)),
            "false" | "0" | "no" | "off" => Ok(Value::Boolean(false)),
            _ => Err(format!("`{raw}` is not true or false")),
        },
        Value::Table(_) | Value::Array(_) => {
            Err("a section cannot be set from one variable; set its keys".into())
        }
        _ => Ok(Value::String(raw.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn sqlite_durability_is_a_choice_of_two() {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(c.database.sqlite_synchronous, SqliteSync::Full);
        let c = Config::load_with_env(
            None,
            env(&[("ASSISTD_DATABASE__SQLITE_SYNCHRONOUS", "normal")]),
        )
        .unwrap();
        assert_eq!(c.database.sqlite_synchronous, SqliteSync::Normal);
        let err = Config::load_with_env(
            None,
            env(&[("ASSISTD_DATABASE__SQLITE_SYNCHRONOUS", "sometimes")]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("database.sqlite_synchronous"), "{err}");
    }

    /// A count setting: `default` unless `var` says otherwise, and 0 rejected naming `key`.
    fn check_count_setting(var: &str, key: &str, default: u64, read: fn(&Config) -> u64) {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(read(&c), default, "{key}");
        let other = (default * 2).to_string();
        let c = Config::load_with_env(None, env(&[(var, other.as_str())])).unwrap();
        assert_eq!(read(&c), default * 2, "{key}");
        let err = Config::load_with_env(None, env(&[(var, "0")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{err}");
    }

    /// Issue 17, item 10: listening beyond loopback needs a strong admin token.
    #[test]
    fn a_public_listen_needs_a_strong_admin_token() {
        let public = |token: &str| {
            Config::load_with_env(
                None,
                env(&[
                    ("ASSISTD_SERVER__LISTEN", "0.0.0.0:8787"),
                    ("ASSISTD_ADMIN__TOKEN", token),
                ]),
            )
        };
        for weak in ["", "change-me-too", &"x".repeat(31)] {
            let err = public(weak).unwrap_err().to_string();
            assert!(err.contains("admin.token"), "{err}");
        }
        assert!(public(&"k".repeat(32)).is_ok());
        // On loopback a generated token is fine.
        assert!(Config::load_with_env(None, Vec::new()).is_ok());
    }

    /// The shipped docker-compose file listens publicly, so it must not carry a weak default.
    #[test]
    fn docker_compose_demands_an_admin_token() {
        let compose = std::fs::read_to_string("docker-compose.yml").unwrap();
        let line = compose
            .lines()
            .find(|l| l.trim_start().starts_with("ASSISTD_ADMIN__TOKEN:"))
            .expect("the compose file sets the admin token");
        assert!(
            line.contains(":?"),
            "no default, a required variable: {line}"
        );
    }

    #[test]
    fn the_listen_backlog_is_set_and_must_hold_a_connection() {
        check_count_setting(
            "ASSISTD_SERVER__LISTEN_BACKLOG",
            "server.listen_backlog",
            1024,
            |c| c.server.listen_backlog as u64,
        );
    }

    #[test]
    fn the_sqlite_row_buffer_is_set_and_must_hold_a_row() {
        check_count_setting(
            "ASSISTD_DATABASE__SQLITE_ROW_BUFFER",
            "database.sqlite_row_buffer",
            256,
            |c| c.database.sqlite_row_buffer as u64,
        );
    }

    #[test]
    fn defaults_load_and_env_overrides_keep_types() {
        let c = Config::load_with_env(
            None,
            env(&[
                ("ASSISTD_WORKER__CONCURRENCY", "8"),
                ("ASSISTD_CHANNELS__GENERIC__SECRET", "12345"),
                ("ASSISTD_TEST_POSTGRES_URL", "postgres://ignored"),
                ("ASSISTD_LLM__RETRY__RATE_LIMITED__MAX_ATTEMPTS", "9"),
            ]),
        )
        .unwrap();
        assert_eq!(c.llm.retry.rate_limited.max_attempts, 9);
        assert_eq!(c.worker.concurrency, 8);
        assert_eq!(c.channels.generic.secret, "12345");
        assert_eq!(c.server.listen, "127.0.0.1:8787");
        assert_eq!(c.llm.base_url, "http://127.0.0.1:11434/v1");
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::load_with_env(None, env(&[("ASSISTD_WORKER__CONCURRENCY", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ASSISTD_WORKER__CONCURRENCY"), "{e}");
        let e = Config::load_with_env(None, env(&[("ASSISTD_WORKER__CONCURRENCY", "0")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("worker.concurrency"), "{e}");
        let e = Config::load_with_env(None, env(&[("ASSISTD_LLM__BASE_URL", "nope")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("llm.base_url"), "{e}");
        let e = Config::load_with_env(None, env(&[("ASSISTD_SERVER__LISTNE", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("listne"), "{e}");
    }

    #[test]
    fn an_enabled_platform_needs_its_secrets() {
        let e = Config::load_with_env(None, env(&[("ASSISTD_CHANNELS__SLACK__ENABLED", "true")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("channels.slack.signing_secret"), "{e}");
        let e = Config::load_with_env(
            None,
            env(&[
                ("ASSISTD_CHANNELS__TELEGRAM__ENABLED", "true"),
                ("ASSISTD_CHANNELS__TELEGRAM__BOT_TOKEN", "t"),
                ("ASSISTD_CHANNELS__TELEGRAM__SECRET_TOKEN", "s"),
                ("ASSISTD_CHANNELS__TELEGRAM__AGENT", "ghost"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("channels.telegram.agent"), "{e}");
    }

    #[test]
    fn file_overlays_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[llm]\nmodel = \"qwen\"\n[log]\nformat = \"json\"\n").unwrap();
        let c = Config::load_with_env(Some(&path), Vec::new()).unwrap();
        assert_eq!(c.llm.model, "qwen");
        assert_eq!(c.log.format, LogFormat::Json);
        assert_eq!(c.llm.timeout_secs, 60);
        std::fs::write(&path, "[log]\nformat = \"xml\"\n").unwrap();
        let e = Config::load_with_env(Some(&path), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("log.format"), "{e}");
    }
}
