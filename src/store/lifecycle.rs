//! Admin actions on a task's life: cancel, resume, pause, unpause and restart. Each is one
//! transaction that checks the status it applies to, moves the task, and audits the actor;
//! a worker running the task loses its fence with the version bump (cancel), or stops at
//! its next step boundary (pause).

use super::on_pool;
use super::sql::STEP_COLUMNS;
use super::sql::{insert_audit, insert_reply};
use super::tasks::Control;
use super::{Store, StoreResult, write_tx};
use crate::domain::{AuditEvent, FailureType, Fence, NewReply, StepRow, StepStatus, TaskStatus};

/// A step of a run a restart replaced.
#[derive(Debug, Clone)]
pub struct SupersededStep {
    pub restart_no: i64,
    pub superseded_at: i64,
    pub step: StepRow,
}

/// A task's status and whether a pause was asked, inside the caller's transaction.
macro_rules! status_and_pause {
    ($tx:expr, $task_id:expr) => {
        sqlx::query_as::<_, (TaskStatus, bool)>(
            "SELECT status, pause_requested <> 0 FROM agent_task WHERE id = $1",
        )
        .bind($task_id)
        .fetch_optional($tx)
        .await?
    };
}

impl Store {
    /// Cancels a PENDING, RUNNING, WAITING_HUMAN_CONFIRM or PAUSED task for `actor`, queuing
    /// `notice` as its one reply. A worker running it loses its fence with the version bump.
    pub async fn cancel_task(
        &self,
        task_id: i64,
        actor: &str,
        notice: &NewReply,
        now: i64,
    ) -> StoreResult<Control> {
        let control = write_tx!(self, tx => {
            let current: Option<(TaskStatus,)> =
                sqlx::query_as("SELECT status FROM agent_task WHERE id = $1")
                    .bind(task_id)
                    .fetch_optional(&mut *tx)
                    .await?;
            let Some((status,)) = current else {
                return Ok(Control::NotFound);
            };
            if !matches!(
                status,
                TaskStatus::Pending
                    | TaskStatus::Running
                    | TaskStatus::WaitingHumanConfirm
                    | TaskStatus::Paused
            ) {
                return Ok(Control::Conflict(status));
            }
            let n = sqlx::query(
                "UPDATE agent_task SET status = $1, failure_type = $2, \
                 error_msg = $3, version = version + 1, lease_expire = NULL, pause_requested = 0, \
                 finished_at = $4, updated_at = $4 WHERE id = $5 AND status = $6",
            )
            .bind(TaskStatus::Cancelled)
            .bind(FailureType::Cancelled)
            .bind(format!("cancelled by {actor}"))
            .bind(now)
            .bind(task_id)
            .bind(status)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n != 1 {
                return Ok(Control::Conflict(status));
            }
            // Whatever it waited for can no longer be decided.
            sqlx::query(
                "UPDATE pending_action SET decision = 'EXPIRED', decided_at = $1 \
                 WHERE task_id = $2 AND decision = 'PENDING'",
            )
            .bind(now)
            .bind(task_id)
            .execute(&mut *tx)
            .await?;
            insert_reply!(&mut *tx, task_id, notice, now).await?;
            insert_audit!(
                &mut *tx,
                Some(task_id),
                AuditEvent::TaskCancelled,
                actor,
                &format!("cancelled by {actor} while {status}"),
                false,
                now,
            )?;
            Control::Done
        });
        Ok(control)
    }

    /// Puts a FAILED task, or one CANCELLED by an error (not by a person), back to PENDING;
    /// it continues from its last SUCCEEDED step and answers under a new reply key. A pause
    /// asked of the run that failed is not carried into this one (as a restart does not):
    /// the admin who resumes asks for a run.
    pub async fn resume_task(&self, task_id: i64, actor: &str, now: i64) -> StoreResult<Control> {
        let control = write_tx!(self, tx => {
            let current: Option<(TaskStatus, Option<FailureType>)> =
                sqlx::query_as("SELECT status, failure_type FROM agent_task WHERE id = $1")
                    .bind(task_id)
                    .fetch_optional(&mut *tx)
                    .await?;
            let Some((status, failure)) = current else {
                return Ok(Control::NotFound);
            };
            let resumable = status == TaskStatus::Failed
                || (status == TaskStatus::Cancelled && failure != Some(FailureType::Cancelled));
            if !resumable {
                return Ok(Control::Conflict(status));
            }
            sqlx::query(
                "UPDATE agent_task SET status = $1, failure_type = NULL, error_msg = NULL, \
                 retry_count = retry_count + 1, resume_count = resume_count + 1, \
                 pause_requested = 0, run_aborts = 0, version = version + 1, owner = NULL, \
                 lease_expire = NULL, run_after = $2, \
                 finished_at = NULL, updated_at = $2 WHERE id = $3",
            )
            .bind(TaskStatus::Pending)
            .bind(now)
            .bind(task_id)
            .execute(&mut *tx)
            .await?;
            // The failed step runs again; everything that succeeded is reused.
            sqlx::query(
                "UPDATE agent_step SET status = $1, error = NULL, finished_at = NULL \
                 WHERE task_id = $2 AND status = $3",
            )
            .bind(StepStatus::Pending)
            .bind(task_id)
            .bind(StepStatus::Failed)
            .execute(&mut *tx)
            .await?;
            insert_audit!(
                &mut *tx,
                Some(task_id),
                AuditEvent::TaskResumed,
                actor,
                &format!("resumed by {actor} from {status}"),
                false,
                now,
            )?;
            Control::Done
        });
        Ok(control)
    }

    /// Pauses a task: a PENDING one at once (no instance claims it while PAUSED), a
    /// RUNNING one at its next step boundary (the worker's fenced step begin sees the
    /// request and parks it; the call in flight finishes and is recorded). A PAUSED task,
    /// or one already asked to pause, is left as it is.
    pub async fn pause_task(&self, task_id: i64, actor: &str, now: i64) -> StoreResult<Control> {
        // The status read can be overtaken (a claim on PostgreSQL takes the PENDING task
        // while this runs): then the update changes nothing and the transition is tried
        // again for the status the task has now, so the answer and the audit say what
        // happened. Each retry follows a change of status, and a task changes status a
        // bounded number of times in a few tries.
        for _ in 0..3 {
            let control = write_tx!(self, tx => {
                let Some((status, requested)) = status_and_pause!(&mut *tx, task_id) else {
                    return Ok(Control::NotFound);
                };
                let (sql, event, summary) = match status {
                    TaskStatus::Paused => return Ok(Control::Done),
                    TaskStatus::Running if requested => return Ok(Control::Done),
                    TaskStatus::Pending => (
                        "UPDATE agent_task SET status = 'PAUSED', version = version + 1, \
                         updated_at = $1 WHERE id = $2 AND status = $3",
                        AuditEvent::TaskPaused,
                        format!("paused by {actor} while PENDING"),
                    ),
                    TaskStatus::Running => (
                        "UPDATE agent_task SET pause_requested = 1, updated_at = $1 \
                         WHERE id = $2 AND status = $3",
                        AuditEvent::TaskPauseRequested,
                        format!(
                            "pause asked by {actor}; the task pauses at its next step boundary"
                        ),
                    ),
                    other => return Ok(Control::Conflict(other)),
                };
                let moved = sqlx::query(sql)
                    .bind(now)
                    .bind(task_id)
                    .bind(status)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if moved == 1 {
                    insert_audit!(&mut *tx, Some(task_id), event, actor, &summary, false, now)?;
                    Some(Control::Done)
                } else {
                    None
                }
            });
            if let Some(control) = control {
                return Ok(control);
            }
        }
        // Still moving after three tries: say what it is now.
        Ok(match self.task(task_id).await? {
            Some(task) => Control::Conflict(task.status),
            None => Control::NotFound,
        })
    }

    /// The worker's side of a pause: at a step boundary where the begin was refused, parks
    /// the task PAUSED if a pause was asked and the fence still holds. `false`: no pause
    /// was asked (the fence was lost instead).
    pub async fn pause_at_boundary(&self, fence: &Fence, now: i64) -> StoreResult<bool> {
        let paused = write_tx!(self, tx => {
            let n = sqlx::query(
                "UPDATE agent_task SET status = $1, pause_requested = 0, owner = NULL, \
                 lease_expire = NULL, version = version + 1, updated_at = $2 \
                 WHERE id = $3 AND owner = $4 AND version = $5 AND status = $6 \
                 AND pause_requested <> 0",
            )
            .bind(TaskStatus::Paused)
            .bind(now)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .bind(TaskStatus::Running)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 1 {
                insert_audit!(
                    &mut *tx,
                    Some(fence.task_id),
                    AuditEvent::TaskPaused,
                    &fence.owner,
                    "paused at a step boundary, as an admin asked",
                    false,
                    now,
                )?;
            }
            n == 1
        });
        Ok(paused)
    }

    /// Unpauses a task: PAUSED → PENDING (it continues from its last finished step), or
    /// withdraws a pause a RUNNING task has not reached yet.
    pub async fn unpause_task(&self, task_id: i64, actor: &str, now: i64) -> StoreResult<Control> {
        let control = write_tx!(self, tx => {
            let Some((status, requested)) = status_and_pause!(&mut *tx, task_id) else {
                return Ok(Control::NotFound);
            };
            let sql = match status {
                TaskStatus::Paused => {
                    "UPDATE agent_task SET status = 'PENDING', pause_requested = 0, \
                     version = version + 1, run_after = $1, updated_at = $1 \
                     WHERE id = $2 AND status = $3"
                }
                TaskStatus::Running if requested => {
                    "UPDATE agent_task SET pause_requested = 0, updated_at = $1 \
                     WHERE id = $2 AND status = $3"
                }
                other => return Ok(Control::Conflict(other)),
            };
            sqlx::query(sql)
                .bind(now)
                .bind(task_id)
                .bind(status)
                .execute(&mut *tx)
                .await?;
            insert_audit!(
                &mut *tx,
                Some(task_id),
                AuditEvent::TaskUnpaused,
                actor,
                &format!("unpaused by {actor} while {status}"),
                false,
                now,
            )?;
            Control::Done
        });
        Ok(control)
    }

    /// Runs a finished task (SUCCEEDED, FAILED or CANCELLED) again from its first step on a
    /// fresh journal: the old steps move to `agent_step_superseded` (kept for the record,
    /// with the restart number), the result, error and context summary are cleared, and
    /// the task answers under a new reply key. A task whose bodies retention purged cannot
    /// run again ([`Control::Purged`]).
    pub async fn restart_task(&self, task_id: i64, actor: &str, now: i64) -> StoreResult<Control> {
        let control = write_tx!(self, tx => {
            let current: Option<(TaskStatus, i64, Option<i64>)> = sqlx::query_as(
                "SELECT status, restart_count, purged_at FROM agent_task WHERE id = $1",
            )
            .bind(task_id)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((status, restarts, purged)) = current else {
                return Ok(Control::NotFound);
            };
            if !status.is_terminal() {
                return Ok(Control::Conflict(status));
            }
            if purged.is_some() {
                return Ok(Control::Purged);
            }
            let restart_no = restarts + 1;
            // The task first: the rollups take it out with the steps it finished with
            // (migration 0023).
            sqlx::query(
                "UPDATE agent_task SET status = 'PENDING', result = NULL, trace = NULL, \
                 failure_type = NULL, error_msg = NULL, context_summary = NULL, \
                 confirm_deadline = NULL, pause_requested = 0, restart_count = $1, \
                 resume_count = resume_count + 1, run_aborts = 0, version = version + 1, \
                 owner = NULL, lease_expire = NULL, run_after = $2, finished_at = NULL, updated_at = $2 \
                 WHERE id = $3",
            )
            .bind(restart_no)
            .bind(now)
            .bind(task_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "INSERT INTO agent_step_superseded (id, task_id, restart_no, step_no, step_type, \
                 tool_name, idempotency_key, input, output, error, status, tokens_in, tokens_out, \
                 duration_ms, attempt, created_at, finished_at, superseded_at) \
                 SELECT id, task_id, $1, step_no, step_type, tool_name, idempotency_key, input, \
                 output, error, status, tokens_in, tokens_out, duration_ms, attempt, created_at, \
                 finished_at, $2 FROM agent_step WHERE task_id = $3",
            )
            .bind(restart_no)
            .bind(now)
            .bind(task_id)
            .execute(&mut *tx)
            .await?;
            let moved = sqlx::query("DELETE FROM agent_step WHERE task_id = $1")
                .bind(task_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            insert_audit!(
                &mut *tx,
                Some(task_id),
                AuditEvent::TaskRestarted,
                actor,
                &format!(
                    "restarted by {actor} from {status} (restart {restart_no}; {moved} steps superseded)"
                ),
                false,
                now,
            )?;
            Control::Done
        });
        Ok(control)
    }

    /// The steps of the runs restarts replaced, oldest run first.
    pub async fn superseded_steps(&self, task_id: i64) -> StoreResult<Vec<SupersededStep>> {
        let sql = format!(
            "SELECT {STEP_COLUMNS}, restart_no, superseded_at FROM agent_step_superseded \
             WHERE task_id = $1 ORDER BY restart_no, step_no"
        );
        let rows: Vec<(StepRow, i64, i64)> = on_pool!(self, pool => {
            sqlx::query(&sql)
                .bind(task_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|row| {
                    use sqlx::{FromRow, Row};
                    Ok((StepRow::from_row(row)?, row.try_get("restart_no")?, row.try_get("superseded_at")?))
                })
                .collect::<Result<_, sqlx::Error>>()?
        });
        Ok(rows
            .into_iter()
            .map(|(step, restart_no, superseded_at)| SupersededStep {
                restart_no,
                superseded_at,
                step,
            })
            .collect())
    }

    /// Counts an aborted run of a task this worker still owns (fenced), with a risk-flagged
    /// TASK_ABORTED audit row naming `error`. Below `max` aborts the task may be claimed
    /// again from `retry_at` (its lease ends then); at `max` the lease is kept for the
    /// caller to fail the task. The task's aborts now, or `None` when the worker no longer
    /// owns it.
    pub async fn record_run_abort(
        &self,
        fence: &Fence,
        error: &str,
        max: i64,
        retry_at: i64,
        now: i64,
    ) -> StoreResult<Option<i64>> {
        let aborts = write_tx!(self, tx => {
            let aborts: Option<i64> = sqlx::query_scalar(
                "UPDATE agent_task SET run_aborts = run_aborts + 1, updated_at = $1, \
                 lease_expire = CASE WHEN run_aborts + 1 >= $2 THEN lease_expire ELSE $3 END \
                 WHERE id = $4 AND owner = $5 AND version = $6 AND status = 'RUNNING' \
                 RETURNING run_aborts",
            )
            .bind(now)
            .bind(max)
            .bind(retry_at)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(n) = aborts {
                insert_audit!(
                    &mut *tx,
                    Some(fence.task_id),
                    AuditEvent::TaskAborted,
                    &fence.owner,
                    &format!("run aborted ({n} of {max}): {error}"),
                    true,
                    now
                )?;
            }
            aborts
        });
        Ok(aborts)
    }
}
