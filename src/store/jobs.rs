//! Scheduled jobs: the per-job lock (one instance per tick), job_run records, and the scans
//! the jobs run. Every scan works in bounded batches over index-backed conditions.

use super::sql::{current_step_sql, insert_audit, insert_reply};
use super::{Store, StoreResult, on_pool, write_tx};
use crate::domain::AuditTarget;
use crate::domain::{AuditEvent, Decision, FailureType, JobRunStatus, TaskStatus};
use crate::domain::{NewReply, ORPHAN_ALERT_CHANNEL, ReplyType};

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct JobRunRow {
    pub id: i64,
    pub job: String,
    pub instance: String,
    pub started_at: i64,
    pub finished_at: Option<i64>,
    pub status: JobRunStatus,
    pub scanned: i64,
    pub affected: i64,
    pub error: Option<String>,
    /// `schedule` or `manual`.
    pub trigger_kind: String,
    /// The admin who ran it now (manual runs).
    pub actor: Option<String>,
}

/// Whether a tick may take a job's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockGate {
    /// A scheduled tick: once per tick across instances, and only while the job is enabled
    /// (the database's switch, else `default_enabled` from config).
    Scheduled { default_enabled: bool },
    /// An admin's run-now: whenever no other run holds the lock, enabled or not.
    Manual,
}

/// What a try for a job's lock came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobLock {
    Taken,
    /// Another run holds it, or this tick already ran elsewhere.
    Held,
    /// Switched off (scheduled ticks only).
    Disabled,
}

/// A job's switch and lock as the database holds them.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct JobStateRow {
    pub name: String,
    /// `None`: never switched by an admin; the config decides.
    pub enabled: Option<bool>,
    pub enabled_by: Option<String>,
    pub holder: Option<String>,
    pub lease_until: i64,
}

/// One finished tick of a job.
#[derive(Debug, Clone)]
pub struct NewJobRun<'a> {
    pub job: &'a str,
    pub instance: &'a str,
    pub started_at: i64,
    pub finished_at: i64,
    pub status: JobRunStatus,
    pub scanned: i64,
    pub affected: i64,
    pub error: Option<String>,
    /// `schedule` or `manual`.
    pub trigger: &'a str,
    pub actor: Option<&'a str>,
}

/// A task waiting for a human past its deadline.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OverdueTask {
    pub id: i64,
    pub channel: String,
    pub conversation_id: String,
    pub resume_count: i64,
    pub confirm_deadline: i64,
    pub in_reply_to: String,
}

/// A RUNNING task reclaimed from a vanished instance.
#[derive(Debug, Clone)]
pub struct Reclaimed {
    pub task_id: i64,
    pub owner: Option<String>,
    pub step: i64,
}

impl Store {
    /// Takes job `name`'s lock for tick `tick` (seconds) until `lease_until`, as `gate`
    /// allows: never while another holder's lease runs; a scheduled tick also not for a
    /// tick that already ran anywhere, nor while the job is switched off.
    pub async fn try_lock_job(
        &self,
        name: &str,
        holder: &str,
        tick: i64,
        lease_until: i64,
        now: i64,
        gate: LockGate,
    ) -> StoreResult<JobLock> {
        let lock = write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO job_lock (name, holder, lease_until, last_tick) VALUES ($1, NULL, 0, 0) \
                 ON CONFLICT (name) DO NOTHING",
            )
            .bind(name)
            .execute(&mut *tx)
            .await?;
            let scheduled = match gate {
                LockGate::Scheduled { default_enabled } => Some(i64::from(default_enabled)),
                LockGate::Manual => None,
            };
            let sql = if scheduled.is_some() {
                "UPDATE job_lock SET holder = $1, lease_until = $2, last_tick = $3 \
                 WHERE name = $4 AND lease_until < $5 AND last_tick < $3 \
                 AND COALESCE(enabled, $6) <> 0"
            } else {
                "UPDATE job_lock SET holder = $1, lease_until = $2, \
                 last_tick = CASE WHEN last_tick < $3 THEN $3 ELSE last_tick END \
                 WHERE name = $4 AND lease_until < $5"
            };
            let mut update = sqlx::query(sql)
                .bind(holder)
                .bind(lease_until)
                .bind(tick)
                .bind(name)
                .bind(now);
            if let Some(default_enabled) = scheduled {
                update = update.bind(default_enabled);
            }
            let taken = update.execute(&mut *tx).await?.rows_affected() == 1;
            if taken {
                JobLock::Taken
            } else if let LockGate::Scheduled { default_enabled } = gate {
                let (enabled,): (bool,) = sqlx::query_as(
                    "SELECT COALESCE(enabled, $2) <> 0 FROM job_lock WHERE name = $1",
                )
                .bind(name)
                .bind(i64::from(default_enabled))
                .fetch_one(&mut *tx)
                .await?;
                if enabled { JobLock::Held } else { JobLock::Disabled }
            } else {
                JobLock::Held
            }
        });
        Ok(lock)
    }

    /// Switches job `name` on or off for every instance (kept until switched again; the
    /// config's `enabled` is only the state before the first switch), audited for `actor`.
    pub async fn set_job_enabled(
        &self,
        name: &str,
        enabled: bool,
        actor: &str,
        now: i64,
    ) -> StoreResult<()> {
        write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO job_lock (name, holder, lease_until, last_tick, enabled, enabled_by) \
                 VALUES ($1, NULL, 0, 0, $2, $3) \
                 ON CONFLICT (name) DO UPDATE SET enabled = $2, enabled_by = $3",
            )
            .bind(name)
            .bind(i64::from(enabled))
            .bind(actor)
            .execute(&mut *tx)
            .await?;
            let (event, verb) = if enabled {
                (AuditEvent::JobEnabled, "switched on")
            } else {
                (AuditEvent::JobDisabled, "switched off")
            };
            insert_audit!(
                &mut *tx,
                None::<i64>,
                event,
                actor,
                &format!("job {name} {verb} by {actor} for every instance"),
                false,
                now,
                target = Some(AuditTarget::Job(name.to_string())),
            )?;
        });
        Ok(())
    }

    /// Every job's switch and lock the database knows (a job never run nor switched has no
    /// row).
    pub async fn job_states(&self) -> StoreResult<Vec<JobStateRow>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, JobStateRow>(
                "SELECT name, enabled <> 0 AS enabled, enabled_by, holder, lease_until \
                 FROM job_lock ORDER BY name",
            )
            .fetch_all(pool)
            .await?
        }))
    }

    /// Releases the lock if `holder` still has it.
    pub async fn release_job(&self, name: &str, holder: &str) -> StoreResult<()> {
        write_tx!(self, tx => {
            sqlx::query(
                "UPDATE job_lock SET holder = NULL, lease_until = 0 WHERE name = $1 AND holder = $2",
            )
            .bind(name)
            .bind(holder)
            .execute(&mut *tx)
            .await?;
        });
        Ok(())
    }

    pub async fn record_job_run(&self, run: &NewJobRun<'_>) -> StoreResult<()> {
        write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO job_run (job, instance, started_at, finished_at, status, scanned, \
                 affected, error, trigger_kind, actor) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            )
            .bind(run.job)
            .bind(run.instance)
            .bind(run.started_at)
            .bind(run.finished_at)
            .bind(run.status)
            .bind(run.scanned)
            .bind(run.affected)
            .bind(super::text::storable_opt(run.error.as_deref()))
            .bind(run.trigger)
            .bind(run.actor)
            .execute(&mut *tx)
            .await?;
        });
        Ok(())
    }

    /// The admin session epoch: sessions signed in under another epoch are over.
    pub async fn admin_session_epoch(&self) -> StoreResult<i64> {
        let (epoch,): (i64,) = on_pool!(self, pool => {
            sqlx::query_as("SELECT value FROM admin_state WHERE name = 'session_epoch'")
                .fetch_one(pool)
                .await?
        });
        Ok(epoch)
    }

    /// Moves the admin session epoch on, ending every session; returns the new epoch.
    pub async fn end_admin_sessions(&self) -> StoreResult<i64> {
        let (epoch,): (i64,) = write_tx!(self, tx => {
            sqlx::query_as(
                "UPDATE admin_state SET value = value + 1 WHERE name = 'session_epoch' \
                 RETURNING value",
            )
            .fetch_one(&mut *tx)
            .await?
        });
        Ok(epoch)
    }

    /// Deletes up to `limit` job runs started before `cutoff`, oldest first; returns how many.
    pub async fn prune_job_runs(&self, cutoff: i64, limit: i64) -> StoreResult<u64> {
        Ok(write_tx!(self, tx => {
            sqlx::query(
                "DELETE FROM job_run WHERE id IN \
                 (SELECT id FROM job_run WHERE started_at < $1 ORDER BY id LIMIT $2)",
            )
            .bind(cutoff)
            .bind(limit)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        }))
    }

    /// Job runs, newest first.
    pub async fn job_runs(&self, job: Option<&str>, limit: i64) -> StoreResult<Vec<JobRunRow>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, JobRunRow>(
                "SELECT id, job, instance, started_at, finished_at, status, scanned, affected, \
                 error, trigger_kind, actor FROM job_run WHERE ($1 IS NULL OR job = $1) ORDER BY id DESC LIMIT $2",
            )
            .bind(job)
            .bind(limit)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Up to `limit` tasks waiting for a human whose deadline is before `now`, oldest first.
    pub async fn overdue_confirmations(
        &self,
        now: i64,
        limit: i64,
    ) -> StoreResult<Vec<OverdueTask>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, OverdueTask>(
                "SELECT t.id, t.channel, t.conversation_id, t.resume_count, t.confirm_deadline, \
                 m.external_message_id AS in_reply_to \
                 FROM agent_task t JOIN im_message m ON m.id = t.message_id \
                 WHERE t.status = 'WAITING_HUMAN_CONFIRM' AND t.confirm_deadline < $1 \
                 ORDER BY t.confirm_deadline LIMIT $2",
            )
            .bind(now)
            .bind(limit)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Cancels one overdue task (if it is still waiting and overdue): CANCELLED with
    /// TIMEOUT, its request EXPIRED, a risk-flagged TASK_TIMEOUT_CANCELLED, the notice (and
    /// the callback, when given) queued in the outbox. False when nothing was due any more.
    pub async fn expire_confirmation(
        &self,
        task_id: i64,
        notice: &NewReply,
        callback: Option<&NewReply>,
        now: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            let n = sqlx::query(
                "UPDATE agent_task SET status = $1, failure_type = $2, \
                 error_msg = 'approval deadline passed', version = version + 1, \
                 finished_at = $3, updated_at = $3 \
                 WHERE id = $4 AND status = 'WAITING_HUMAN_CONFIRM' AND confirm_deadline < $3",
            )
            .bind(TaskStatus::Cancelled)
            .bind(FailureType::Timeout)
            .bind(now)
            .bind(task_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n != 1 {
                return Ok(false);
            }
            let expired: Option<(i64,)> = sqlx::query_as(
                "UPDATE pending_action SET decision = $1, decided_at = $2 \
                 WHERE task_id = $3 AND decision = 'PENDING' RETURNING id",
            )
            .bind(Decision::Expired)
            .bind(now)
            .bind(task_id)
            .fetch_optional(&mut *tx)
            .await?;
            // Due at once, even when `now` is a scan time ahead of the wall clock.
            let due = now.min(crate::domain::now_ms());
            insert_reply!(&mut *tx, task_id, notice, due).await?;
            if let Some(callback) = callback {
                insert_reply!(&mut *tx, task_id, callback, due).await?;
            }
            insert_audit!(
                &mut *tx,
                Some(task_id),
                AuditEvent::TaskTimeoutCancelled,
                "scheduler:confirm_timeout",
                "approval deadline passed; task cancelled",
                true,
                now,
                target = expired
                    .map(|(id,)| AuditTarget::Approval(id))
                    .or(Some(AuditTarget::Task(task_id))),
            )?;
            true
        });
        Ok(done)
    }

    /// Puts RUNNING tasks whose lease expired before `cutoff` back to PENDING (at most
    /// `limit`), auditing the last owner and step. With `alert`, each reclaim also queues
    /// a signed alert (channel [`ORPHAN_ALERT_CHANNEL`]) in the same transaction, so an
    /// alert goes out exactly when a reclaim happened. Returns what was reclaimed.
    pub async fn reclaim_orphans(
        &self,
        cutoff: i64,
        limit: i64,
        now: i64,
        alert: bool,
    ) -> StoreResult<(i64, Vec<Reclaimed>)> {
        let sql = concat!(
            "SELECT id, owner, ",
            current_step_sql!(),
            ", channel, conversation_id, version FROM agent_task \
             WHERE status = 'RUNNING' AND lease_expire < $1 ORDER BY id LIMIT $2"
        );
        type Candidate = (i64, Option<String>, i64, String, String, i64);
        let candidates: Vec<Candidate> = on_pool!(self, pool => {
            sqlx::query_as(sql)
            .bind(cutoff)
            .bind(limit)
            .fetch_all(pool)
            .await?
        });
        let scanned = candidates.len() as i64;
        let mut reclaimed = Vec::new();
        for (id, owner, step, channel, conversation_id, version) in candidates {
            let last_owner = owner.as_deref().unwrap_or("unknown owner");
            let notice = alert.then(|| NewReply {
                idempotency_key: format!("agent-task-{id}-reclaimed-v{}", version + 1),
                channel: ORPHAN_ALERT_CHANNEL.to_string(),
                conversation_id: conversation_id.clone(),
                in_reply_to: String::new(),
                reply_type: ReplyType::Text,
                content: serde_json::json!({
                    "event": "TASK_RECLAIMED",
                    "task_id": id,
                    "channel": channel,
                    "conversation_id": conversation_id,
                    "last_owner": owner,
                    "step": step,
                    "reclaimed_at": now,
                })
                .to_string(),
            });
            let done = write_tx!(self, tx => {
                let n = sqlx::query(
                    "UPDATE agent_task SET status = 'PENDING', owner = NULL, lease_expire = NULL, \
                     run_after = $1, version = version + 1, updated_at = $1, takeover = 2 \
                     WHERE id = $2 AND status = 'RUNNING' AND lease_expire < $3",
                )
                .bind(now)
                .bind(id)
                .bind(cutoff)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if n == 1 {
                    insert_audit!(
                        &mut *tx,
                        Some(id),
                        AuditEvent::TaskReclaimed,
                        "scheduler:orphan_reclaim",
                        &format!("lease of {last_owner} expired at step {step}; back to PENDING"),
                        false,
                        now,
                    )?;
                    if let Some(notice) = &notice {
                        insert_reply!(&mut *tx, id, notice, now.min(crate::domain::now_ms())).await?;
                    }
                }
                n == 1
            });
            if done {
                reclaimed.push(Reclaimed {
                    task_id: id,
                    owner,
                    step,
                });
            }
        }
        Ok((scanned, reclaimed))
    }

    /// Removes bulky content of up to `limit` terminal tasks finished before `cutoff`: step
    /// inputs and outputs (those of superseded runs and those kept as blobs too; a model
    /// call keeps only its model), the message text and reply content. Rows, statuses, failure types
    /// and audit stay. Returns (tasks scanned, tasks purged).
    pub async fn purge_finished(
        &self,
        cutoff: i64,
        limit: i64,
        now: i64,
    ) -> StoreResult<(i64, i64)> {
        let ids: Vec<(i64, i64)> = on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT id, message_id FROM agent_task WHERE purged_at IS NULL \
                 AND finished_at IS NOT NULL AND finished_at < $1 \
                 AND status IN ('SUCCEEDED', 'FAILED', 'CANCELLED') ORDER BY finished_at LIMIT $2",
            )
            .bind(cutoff)
            .bind(limit)
            .fetch_all(pool)
            .await?
        });
        let scanned = ids.len() as i64;
        // A model call keeps the model it asked for: the summary's tokens are per model.
        let model = super::rollups::step_model(self.dialect(), "input");
        let object = match self.dialect() {
            super::Dialect::Sqlite => "json_object",
            super::Dialect::Postgres => "json_build_object",
        };
        let purge_steps = format!(
            "UPDATE agent_step SET output = NULL, summary_through = NULL, \
             input = CASE WHEN step_type = 'llm' AND {model} IS NOT NULL \
             THEN CAST({object}('model', {model}) AS TEXT) END \
             WHERE task_id = $1"
        );
        let mut purged = 0;
        for (task_id, message_id) in ids {
            write_tx!(self, tx => {
                sqlx::query(&purge_steps)
                    .bind(task_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(
                    "UPDATE agent_step_superseded SET input = NULL, output = NULL WHERE task_id = $1",
                )
                .bind(task_id)
                .execute(&mut *tx)
                .await?;
                // Outputs kept by reference go with the steps' other bodies.
                sqlx::query("DELETE FROM step_blob WHERE task_id = $1")
                    .bind(task_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("UPDATE im_message SET text = '' WHERE id = $1")
                    .bind(message_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(
                    "UPDATE outbound_reply SET content = '{}' WHERE task_id = $1 AND status <> 'PENDING'",
                )
                .bind(task_id)
                .execute(&mut *tx)
                .await?;
                sqlx::query(
                    "UPDATE agent_task SET result = NULL, context_summary = NULL, purged_at = $1 \
                     WHERE id = $2",
                )
                .bind(now)
                .bind(task_id)
                .execute(&mut *tx)
                .await?;
            });
            purged += 1;
        }
        Ok((scanned, purged))
    }
}
