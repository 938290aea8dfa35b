//! A workflow's journalled step: replayed from the journal read at the start of the run, or
//! run by the shared step executor (`engine::step`).

use std::future::Future;
use std::time::Duration;

use serde_json::Value;

use crate::domain::{FailureType, NewStep, StepStatus, StepType};
use crate::engine::step::{self, CallErr, StepExec};
use crate::engine::task::RunError;

use super::runner::{CallOk, Runner, StepDone, Stop, parse_output};

impl Runner<'_> {
    /// Runs `call` as the next step, or replays it from the journal: a finished step gives
    /// back its outcome; an interrupted non-idempotent one parks the task (UNKNOWN).
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
        let key = self.exec().key(step_no, name);
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
                    if let Some(stop) = self.declined_stop(&row) {
                        return Err(stop);
                    }
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
        let input_text = match step_type {
            StepType::Llm => crate::llm::journal_text(input),
            _ => input.to_string(),
        };
        let exec = self.exec();
        let row = exec
            .begin(&NewStep {
                step_no,
                step_type,
                tool_name: name,
                idempotency_key: &key,
                input: &input_text,
            })
            .await?;
        let attempted = exec.attempt(&row, call).await?;
        let (attempts, duration_ms) = (attempted.attempts, attempted.duration_ms);
        let (record, done) = match attempted.result {
            Ok(ok) => (
                step::record(
                    &row,
                    attempts,
                    duration_ms,
                    Ok((ok.output.to_string(), ok.tokens_in, ok.tokens_out)),
                ),
                StepDone::Ok {
                    output: ok.output,
                    compensated: false,
                },
            ),
            Err(err) => {
                let record = step::record(&row, attempts, duration_ms, Err(&err));
                let message = record.error.clone().unwrap_or_default();
                (record, StepDone::Failed(err.failure, message))
            }
        };
        exec.complete(&record).await?;
        Ok(done)
    }

    /// The shared step executor, bound to this run.
    pub(super) fn exec(&self) -> StepExec<'_> {
        StepExec {
            journal: &self.svc.journal,
            fence: self.fence,
            lost: self.lost,
            retry_after_max: Duration::from_secs(self.svc.config.llm.retry_after_max_secs),
            restart: self.ctx.task.restart_count,
            agent: &self.ctx.task.agent_name,
            model: &self.model,
            recovery: self.ctx.recovery.as_ref(),
        }
    }
}
