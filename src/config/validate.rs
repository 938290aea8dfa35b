//! Validation of a loaded configuration: every check names the key it is about.

use super::error::{ConfigError, http_url, invalid, positive};
use super::sections::{Config, MIN_PUBLIC_ADMIN_TOKEN};
use crate::definition::AgentMode;

impl Config {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.check_server()?;
        self.check_runtime()?;
        self.check_scheduler()?;
        self.check_log()?;
        self.check_telemetry()?;
        self.check_channels()?;
        self.check_knowledge()?;
        self.check_agents()
    }

    /// The knowledge-base settings, the defaults and each declared collection's.
    fn check_knowledge(&self) -> Result<(), ConfigError> {
        let k = &self.knowledge;
        positive("knowledge.max_document_bytes", k.max_document_bytes as u64)?;
        positive("knowledge.max_results", k.max_results as u64)?;
        positive("knowledge.top_k", k.top_k as u64)?;
        positive("knowledge.embedding_batch", k.embedding_batch as u64)?;
        positive(
            "knowledge.embedding_input_chars",
            k.embedding_input_chars as u64,
        )?;
        positive("knowledge.fusion_candidates", k.fusion_candidates as u64)?;
        positive("knowledge.max_ranked_chunks", k.max_ranked_chunks as u64)?;
        positive(
            "knowledge.common_only_candidates",
            k.common_only_candidates as u64,
        )?;
        positive(
            "knowledge.ingest_max_documents",
            k.ingest_max_documents as u64,
        )?;
        positive("knowledge.ingest_max_bytes", k.ingest_max_bytes as u64)?;
        positive("knowledge.ingest_lease_secs", k.ingest_lease_secs)?;
        positive("knowledge.pdf_timeout_ms", k.pdf_timeout_ms)?;
        positive("knowledge.pdf_max_pages", k.pdf_max_pages as u64)?;
        positive(
            "knowledge.ingest_max_claims",
            k.ingest_max_claims.max(0) as u64,
        )?;
        if !(k.fusion_k.is_finite() && k.fusion_k >= 0.0) {
            return Err(invalid(
                "knowledge.fusion_k",
                "must be a number of at least 0".to_string(),
            ));
        }
        if !(k.common_term_share > 0.0 && k.common_term_share <= 1.0) {
            return Err(invalid(
                "knowledge.common_term_share",
                "must be above 0 and at most 1".to_string(),
            ));
        }
        if !(-1.0..=1.0).contains(&k.min_similarity) {
            return Err(invalid(
                "knowledge.min_similarity",
                "must be between -1 and 1 (cosine)".to_string(),
            ));
        }
        if !k.min_score.is_finite() {
            return Err(invalid(
                "knowledge.min_score",
                "must be a number".to_string(),
            ));
        }
        if k.unknown_answer.trim().is_empty() {
            return Err(invalid(
                "knowledge.unknown_answer",
                "must not be empty".to_string(),
            ));
        }
        let mut declared: Vec<(String, Option<&super::knowledge::CollectionConfig>)> =
            vec![("knowledge".to_string(), None)];
        for (name, c) in &k.collections {
            declared.push((format!("knowledge.collections.{name}"), Some(c)));
        }
        for (key, c) in declared {
            let (chunk, overlap) = k.chunking(c);
            if !(100..=20_000).contains(&chunk) {
                return Err(invalid(
                    &format!("{key}.chunk_chars"),
                    "must be between 100 and 20000".to_string(),
                ));
            }
            if overlap * 2 > chunk {
                return Err(invalid(
                    &format!("{key}.overlap_chars"),
                    "must be at most half of chunk_chars".to_string(),
                ));
            }
        }
        for name in k.collections.keys() {
            if !crate::domain::is_valid_name(name) {
                return Err(invalid(
                    &format!("knowledge.collections.{name}"),
                    "a collection name is 1 to 64 letters, digits, '-' or '_'".to_string(),
                ));
            }
        }
        for (name, c) in &k.collections {
            if let Some(p) = c.embedding_provider.as_deref()
                && p != "default"
                && !self.llm.providers.contains_key(p)
            {
                return Err(invalid(
                    &format!("knowledge.collections.{name}.embedding_provider"),
                    format!(
                        "no provider `{p}`: use `default` for [llm] or a name of [llm.providers]"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The server, database and intake settings.
    fn check_server(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// The model, worker, outbox and redaction settings.
    fn check_runtime(&self) -> Result<(), ConfigError> {
        http_url("llm.base_url", &self.llm.base_url)?;
        for (model, price) in &self.llm.prices {
            for (field, value) in [
                ("prompt_per_million", price.prompt_per_million),
                ("completion_per_million", price.completion_per_million),
            ] {
                if !value.is_finite() || value < 0.0 {
                    return Err(invalid(
                        &format!("llm.prices.{model}.{field}"),
                        "must be a number of 0 or more",
                    ));
                }
            }
        }
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
        positive(
            "journal.inline_max_bytes",
            self.journal.inline_max_bytes as u64,
        )?;
        positive(
            "journal.model_view_bytes",
            self.journal.model_view_bytes as u64,
        )?;
        positive(
            "tooling.max_response_bytes",
            self.tooling.max_response_bytes as u64,
        )?;
        if self.context.summary_every_steps < 2 {
            return Err(invalid("context.summary_every_steps", "must be at least 2"));
        }
        positive(
            "context.history_token_budget",
            self.context.history_token_budget as u64,
        )?;
        positive(
            "context.summary_max_tokens",
            u64::from(self.context.summary_max_tokens),
        )?;
        if self.context.recent_after_summary_percent > 100 {
            return Err(invalid(
                "context.recent_after_summary_percent",
                "must be at most 100",
            ));
        }
        if let Err(message) = crate::redaction::Redactor::new(&self.redaction.extra_patterns) {
            return Err(invalid("redaction.extra_patterns", message));
        }
        if self.worker.lease_secs < 3 {
            return Err(invalid("worker.lease_secs", "must be at least 3"));
        }
        positive("worker.poll_interval_ms", self.worker.poll_interval_ms)?;
        positive("worker.claim_batch", self.worker.claim_batch as u64)?;
        positive("worker.standby_poll_ms", self.worker.standby_poll_ms)?;
        positive(
            "engine.max_run_aborts",
            u64::from(self.engine.max_run_aborts),
        )?;
        positive("engine.abort_retry_ms", self.engine.abort_retry_ms)?;
        positive("engine.outage_wait_secs", self.engine.outage_wait_secs)?;
        positive("outbox.timeout_secs", self.outbox.timeout_secs)?;
        positive("outbox.batch", self.outbox.batch as u64)?;
        positive("outbox.poll_interval_ms", self.outbox.poll_interval_ms)?;
        positive("outbox.claim_wait_ms", self.outbox.claim_wait_ms)?;
        if self.outbox.lease_secs <= self.outbox.timeout_secs {
            return Err(invalid(
                "outbox.lease_secs",
                "must be longer than outbox.timeout_secs",
            ));
        }
        Ok(())
    }

    /// The scheduled jobs.
    fn check_scheduler(&self) -> Result<(), ConfigError> {
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
            // Parsed as the scheduler will parse it (tokio-cron-scheduler's croner settings):
            // an expression it refuses would leave the job silently never running.
            if let Err(e) = cron_parser().parse(&job.cron) {
                return Err(invalid(
                    &format!("{key}.cron"),
                    format!("`{}` is not a cron expression: {e}", job.cron),
                ));
            }
            positive(&format!("{key}.batch_size"), u64::from(job.batch_size))?;
            positive(&format!("{key}.lock_lease_secs"), job.lock_lease_secs)?;
        }
        if !jobs.orphan_reclaim.alert_url.is_empty() {
            http_url(
                "scheduler.jobs.orphan_reclaim.alert_url",
                &jobs.orphan_reclaim.alert_url,
            )?;
        }
        if !jobs.confirm_timeout.approval_callback_url.is_empty() {
            http_url(
                "scheduler.jobs.confirm_timeout.approval_callback_url",
                &jobs.confirm_timeout.approval_callback_url,
            )?;
        }
        Ok(())
    }

    /// `log.level`: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or directives
    /// `target=level` separated by commas. A bare word that is not a level would be taken
    /// as a target enabled at every level, leaving everything else silent (`verbose`).
    fn check_log(&self) -> Result<(), ConfigError> {
        let level = self.log.level.trim();
        let bad = |why: String| {
            invalid(
                "log.level",
                format!(
                    "`{level}` {why}: use error, warn, info, debug, trace or off, or \
                     directives like `info,assistd=debug`"
                ),
            )
        };
        if level.is_empty() {
            return Err(bad("is empty".into()));
        }
        for directive in level.split(',').map(str::trim) {
            let word = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
            if word
                .parse::<tracing_subscriber::filter::LevelFilter>()
                .is_err()
            {
                return Err(bad(format!("has `{directive}`, which names no level")));
            }
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(level) {
            return Err(bad(format!("is not a filter: {e}")));
        }
        Ok(())
    }

    /// The trace export, when it is on.
    fn check_telemetry(&self) -> Result<(), ConfigError> {
        let t = &self.telemetry;
        if t.otlp_endpoint.is_empty() {
            return Ok(());
        }
        http_url("telemetry.otlp_endpoint", &t.otlp_endpoint)?;
        if t.service_name.trim().is_empty() {
            return Err(invalid("telemetry.service_name", "is empty"));
        }
        if !(1..=300).contains(&t.export_timeout_secs) {
            return Err(invalid(
                "telemetry.export_timeout_secs",
                format!("{} is not between 1 and 300", t.export_timeout_secs),
            ));
        }
        Ok(())
    }

    /// The platforms: each enabled one complete, its agent configured.
    fn check_channels(&self) -> Result<(), ConfigError> {
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
        let platforms = [
            ("slack", c.slack.enabled, &c.slack.agent, c.slack.check()),
            (
                "telegram",
                c.telegram.enabled,
                &c.telegram.agent,
                c.telegram.check(),
            ),
            ("wecom", c.wecom.enabled, &c.wecom.agent, c.wecom.check()),
            (
                "dingtalk",
                c.dingtalk.enabled,
                &c.dingtalk.agent,
                c.dingtalk.check(),
            ),
            ("lark", c.lark.enabled, &c.lark.agent, c.lark.check()),
            (
                "matrix",
                c.matrix.enabled,
                &c.matrix.agent,
                c.matrix.check(),
            ),
        ];
        // Each platform checks its own settings (`channels/<platform>.rs`); an enabled one
        // also needs an agent that exists.
        for (platform, enabled, agent, checked) in platforms {
            if !enabled {
                continue;
            }
            if let Err((key, message)) = checked {
                return Err(invalid(&format!("channels.{platform}.{key}"), message));
            }
            if !self.agents.contains_key(agent.as_str()) {
                return Err(invalid(
                    &format!("channels.{platform}.agent"),
                    format!("no agent named `{agent}`"),
                ));
            }
        }
        Ok(())
    }

    /// The agents' settings.
    fn check_agents(&self) -> Result<(), ConfigError> {
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
}

/// The cron parser as tokio-cron-scheduler builds it (seconds required, day-of-month and
/// day-of-week both applying).
fn cron_parser() -> croner::parser::CronParser {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Required)
        .dom_and_dow(true)
        .build()
}
