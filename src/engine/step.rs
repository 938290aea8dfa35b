//! The one executor of a journalled step, shared by the single-turn path and the workflow
//! runner: begin the step (fenced; the journal hands back the row it already holds), run
//! its call with retries and backoff while the lease holds, and record how it ended. What
//! the callers decide themselves is only what differs between them: whether a journalled
//! row is replayed (a workflow reads its whole journal up front; a single-turn call reuses
//! the row `begin` returns) and when the last step is written (a single-turn task writes it
//! with its terminal status, in one transaction).

use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::backoff;
use crate::domain::{FailureType, Fence, NewStep, StepResult, StepRow, StepStatus, truncate};
use crate::llm::LlmError;
use crate::store::journal::Journal;

use super::task::{Recovery, RunError};

/// Longest error text kept on a step or task.
pub const ERROR_LIMIT: usize = 2000;

/// How to try a failed call again.
#[derive(Debug, Clone, Copy)]
pub struct RetryPlan {
    /// Tries in this run, the first included.
    pub max_tries: u32,
    pub base_ms: u64,
    pub max_ms: u64,
    /// Tries go on past `max_tries` until this long after the first (a provider refusing
    /// with 429: `llm.rate_limit_patience_secs`).
    pub patience: Option<Duration>,
}

impl RetryPlan {
    /// The retry plan of a failed model call of type `failure` (`[llm.retry]`), `None` for a
    /// type that is never retried. RATE_LIMITED is tried again until the provider has kept
    /// refusing for `llm.rate_limit_patience_secs`: a burst at 9 a.m. is waited out, not
    /// turned into failure notices.
    pub fn for_model(llm: &crate::config::LlmConfig, failure: FailureType) -> Option<RetryPlan> {
        llm.retry.policy(failure).map(|p| RetryPlan {
            max_tries: p.max_attempts,
            base_ms: p.backoff_base_ms,
            max_ms: p.backoff_max_ms,
            patience: (failure == FailureType::RateLimited)
                .then(|| Duration::from_secs(llm.rate_limit_patience_secs)),
        })
    }

    /// Whether another try may follow try number `tries`, `elapsed` after the first.
    fn allows(&self, tries: u32, elapsed: Duration) -> bool {
        tries < self.max_tries || self.patience.is_some_and(|p| elapsed < p)
    }
}

/// A failed call, classified, and whether (and how) to try again.
#[derive(Debug, Clone)]
pub struct CallErr {
    pub failure: FailureType,
    pub message: String,
    pub retry: Option<RetryPlan>,
    /// The other side asked for this pause before the next try.
    pub retry_after: Option<Duration>,
}

impl CallErr {
    /// A failed model call, retried as `[llm.retry]` says for its failure type.
    pub fn from_model(e: LlmError, llm: &crate::config::LlmConfig) -> CallErr {
        CallErr {
            retry: RetryPlan::for_model(llm, e.failure_type),
            failure: e.failure_type,
            message: e.message,
            retry_after: e.retry_after,
        }
    }
}

/// What running a step's call came to.
pub struct Attempted<T> {
    pub result: Result<T, CallErr>,
    /// Tries so far, across runs (the journal numbers them all).
    pub attempts: i64,
    pub duration_ms: i64,
}

/// The journal, the task's fence and its stop signal: what every step of one run needs.
#[derive(Clone, Copy)]
pub struct StepExec<'a> {
    pub journal: &'a Journal,
    pub fence: &'a Fence,
    /// Cancelled when the lease is lost (or an admin cancels the task).
    pub lost: &'a CancellationToken,
    /// The longest `retry_after` honoured.
    pub retry_after_max: Duration,
    /// The task's restarts so far: part of its step keys.
    pub restart: i64,
    /// The agent and model its model calls' tokens are counted under.
    pub agent: &'a str,
    pub model: &'a str,
    /// Set when this run took the task over: its first step begun ends the recovery.
    pub recovery: Option<&'a Recovery>,
}

impl StepExec<'_> {
    /// The idempotency key of step `step_no` calling `name` in this run.
    pub fn key(&self, step_no: i64, name: &str) -> String {
        crate::domain::step_key(self.fence.task_id, self.restart, step_no, name)
    }

    /// Begins `step` under the fence: a new PENDING row, or the row the journal already
    /// holds for that step number (a resumed task).
    pub async fn begin(&self, step: &NewStep<'_>) -> Result<StepRow, RunError> {
        if let Some(row) = self.journal.begin_step(self.fence, step).await? {
            if let Some(recovery) = self.recovery {
                recovery.step_begun();
            }
            return Ok(row);
        }
        // Refused: either a pause was asked (this is the boundary where it takes effect)
        // or the task is no longer ours.
        if self.journal.pause_at_boundary(self.fence).await? {
            return Err(RunError::Paused);
        }
        Err(RunError::LostLease)
    }

    /// Calls `call` (given the step's idempotency key) until it succeeds, fails for good,
    /// or its retry plan runs out; every retry is recorded on the step as it starts, and a
    /// lost lease stops the wait and the call at once. The retry budget counts this run's
    /// tries, so a task an admin resumes gets a fresh budget.
    #[tracing::instrument(
        name = "step",
        skip_all,
        fields(task_id = self.fence.task_id, step = row.step_no, name = %row.tool_name)
    )]
    pub async fn attempt<T, F, Fut>(&self, row: &StepRow, call: F) -> Result<Attempted<T>, RunError>
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = Result<T, CallErr>>,
    {
        let started = Instant::now();
        let mut attempts = row.attempt;
        let mut tries = 0u32;
        let result = loop {
            attempts += 1;
            tries += 1;
            // The first try is fenced by `begin` and counted with the result; retries are
            // recorded as they start, so a long retry loop shows in the journal.
            if tries > 1
                && !self
                    .journal
                    .record_step_attempt(self.fence, row.id, attempts)
                    .await?
            {
                return Err(RunError::LostLease);
            }
            let outcome = tokio::select! {
                r = call(row.idempotency_key.clone()) => r,
                _ = self.lost.cancelled() => return Err(RunError::LostLease),
            };
            let err = match outcome {
                Ok(ok) => break Ok(ok),
                Err(err) => err,
            };
            let Some(plan) = err.retry.filter(|p| p.allows(tries, started.elapsed())) else {
                break Err(err);
            };
            let wait = backoff::delay(
                tries,
                plan.base_ms,
                plan.max_ms,
                err.retry_after,
                self.retry_after_max,
            );
            tracing::warn!(
                step = row.step_no,
                name = %row.tool_name,
                attempt = attempts,
                failure_type = %err.failure,
                wait_ms = wait.as_millis() as u64,
                error = %err.message,
                "step failed; retrying"
            );
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.lost.cancelled() => return Err(RunError::LostLease),
            }
        };
        crate::metrics::STEP_SECONDS.observe(started.elapsed());
        Ok(Attempted {
            result,
            attempts,
            duration_ms: started.elapsed().as_millis() as i64,
        })
    }

    /// Counts a recorded model call's tokens (`assistd_model_tokens_total`); call once the
    /// record is written.
    pub fn count_tokens(&self, record: &StepResult) {
        if let (StepStatus::Succeeded, Some(prompt), Some(completion)) =
            (record.status, record.tokens_in, record.tokens_out)
        {
            crate::metrics::count_tokens(self.agent, self.model, prompt, completion);
        }
    }

    /// Writes how a step ended (fenced).
    pub async fn complete(&self, record: &StepResult) -> Result<(), RunError> {
        if self.journal.complete_step(self.fence, record).await? {
            self.count_tokens(record);
            Ok(())
        } else {
            Err(RunError::LostLease)
        }
    }
}

/// The journal record of a finished step: its output (JSON text) and token counts, or the
/// classified failure (`{"failure_type", "error"}`, the error cut to [`ERROR_LIMIT`]).
pub fn record(
    row: &StepRow,
    attempts: i64,
    duration_ms: i64,
    result: Result<(String, Option<i64>, Option<i64>), &CallErr>,
) -> StepResult {
    match result {
        Ok((output, tokens_in, tokens_out)) => StepResult {
            step_id: row.id,
            attempts,
            status: StepStatus::Succeeded,
            output: Some(output),
            error: None,
            tokens_in,
            tokens_out,
            duration_ms,
            summary_through: None,
        },
        Err(err) => {
            let message = truncate(&err.message, ERROR_LIMIT);
            StepResult {
                step_id: row.id,
                attempts,
                status: StepStatus::Failed,
                output: Some(
                    json!({ "failure_type": err.failure.as_str(), "error": message }).to_string(),
                ),
                error: Some(message),
                tokens_in: None,
                tokens_out: None,
                duration_ms,
                summary_through: None,
            }
        }
    }
}

/// The failure type a FAILED step recorded in its output.
pub fn journalled_failure(row: &StepRow) -> Option<FailureType> {
    let output: serde_json::Value = serde_json::from_str(row.output.as_deref()?).ok()?;
    FailureType::parse(output.get("failure_type")?.as_str()?)
}
