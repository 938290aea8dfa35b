//! The workflow's journalled step: begin, replay if it already succeeded, run with retries
//! and backoff while the lease holds, complete, all fenced.

use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::backoff;
use crate::domain::{FailureType, StepStatus, StepType, step_key, truncate};
use crate::domain::{NewStep, StepResult};
use crate::engine::task::RunError;

use super::runner::{CallErr, CallOk, ERROR_LIMIT, Runner, StepDone, Stop, parse_output};

impl Runner<'_> {
    // long: the journalled step's begin/replay/retry/complete state machine, kept in one place.
    /// Runs `call` as the next step, or replays it from the journal.
    pub(super) async fn journal<F, Fut>(
        &mut self,
        step_type: StepType,
        name: &str,
        input: &Value,
        idempotent: bool,
        call: F,
    ) -> Result<StepDone, Stop>
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = Result<CallOk, CallErr>>,
    {
        self.step_no += 1;
        let step_no = self.step_no;
        let key = step_key(self.fence.task_id, step_no, name);
        if let Some(row) = self.journal.get(&step_no).cloned() {
            self.expect_name(&row, name)?;
            match row.status {
                StepStatus::Succeeded | StepStatus::Compensated => {
                    return Ok(StepDone::Ok {
                        output: parse_output(row.output.as_deref()),
                        compensated: row.status == StepStatus::Compensated,
                    });
                }
                StepStatus::Failed => {
                    let output = parse_output(row.output.as_deref());
                    let failure = output
                        .get("failure_type")
                        .and_then(Value::as_str)
                        .and_then(FailureType::parse)
                        .unwrap_or(FailureType::Unknown);
                    return Ok(StepDone::Failed(failure, row.error.unwrap_or_default()));
                }
                StepStatus::Pending if !idempotent => {
                    return Err(self.park_unknown(&row).await);
                }
                // Idempotent and interrupted, or UNKNOWN and approved: run it again.
                StepStatus::Pending | StepStatus::Unknown => {}
            }
        }
        if self.replay_only {
            // The resume point: a real run would execute this step.
            self.step_no -= 1;
            return Err(Stop::Run(RunError::Parked));
        }
        let input_text = input.to_string();
        let row = self
            .svc
            .journal
            .begin_step(
                self.fence,
                &NewStep {
                    step_no,
                    step_type,
                    tool_name: name,
                    idempotency_key: &key,
                    input: &input_text,
                },
            )
            .await?
            .ok_or(Stop::Run(RunError::LostLease))?;
        let started = Instant::now();
        let mut attempt = row.attempt;
        let mut tries = 0u32;
        let result = loop {
            attempt += 1;
            tries += 1;
            // The first try is fenced by `begin_step` and counted with the result;
            // retries are recorded as they start.
            if tries > 1
                && !self
                    .svc
                    .store
                    .record_step_attempt(self.fence, row.id, attempt)
                    .await?
            {
                return Err(Stop::Run(RunError::LostLease));
            }
            let outcome = tokio::select! {
                r = call(key.clone()) => r,
                _ = self.lost.cancelled() => return Err(Stop::Run(RunError::LostLease)),
            };
            match outcome {
                Ok(ok) => break Ok(ok),
                Err(err) => match err.retry.filter(|p| tries < p.max_tries) {
                    Some(plan) => {
                        let wait = backoff::delay(
                            tries,
                            plan.base_ms,
                            plan.max_ms,
                            err.retry_after,
                            Duration::from_secs(self.svc.config.llm.retry_after_max_secs),
                        );
                        tracing::warn!(step = step_no, name, attempt, error = %err.message, "step failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = self.lost.cancelled() => return Err(Stop::Run(RunError::LostLease)),
                        }
                    }
                    None => break Err(err),
                },
            }
        };
        crate::metrics::STEP_SECONDS.observe(started.elapsed());
        let duration_ms = started.elapsed().as_millis() as i64;
        let (record, done) = match result {
            Ok(ok) => (
                StepResult {
                    step_id: row.id,
                    attempts: attempt,
                    status: StepStatus::Succeeded,
                    output: Some(ok.output.to_string()),
                    error: None,
                    tokens_in: ok.tokens_in,
                    tokens_out: ok.tokens_out,
                    duration_ms,
                },
                StepDone::Ok {
                    output: ok.output,
                    compensated: false,
                },
            ),
            Err(err) => {
                let message = truncate(&err.message, ERROR_LIMIT);
                (
                    StepResult {
                        step_id: row.id,
                        attempts: attempt,
                        status: StepStatus::Failed,
                        output: Some(
                            json!({ "failure_type": err.failure.as_str(), "error": message })
                                .to_string(),
                        ),
                        error: Some(message.clone()),
                        tokens_in: None,
                        tokens_out: None,
                        duration_ms,
                    },
                    StepDone::Failed(err.failure, message),
                )
            }
        };
        if !self.svc.journal.complete_step(self.fence, &record).await? {
            return Err(Stop::Run(RunError::LostLease));
        }
        Ok(done)
    }
}
