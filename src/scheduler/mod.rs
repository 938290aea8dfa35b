//! Scheduled jobs. tokio-cron-scheduler fires each enabled job in every instance; each tick
//! first takes the job's lock in the database (by lease, once per tick), so the work is done
//! by exactly one instance and the others record a SKIPPED run. Every tick leaves one
//! job_run row with its counts or its error.

use std::future::Future;
use std::sync::Arc;

use serde_json::json;
use tokio_cron_scheduler::{Job, JobScheduler};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, JobSchedule};
use crate::domain::AuditTarget;
use crate::domain::NewReply;
use crate::domain::{AuditEvent, Decision, FailureType};
use crate::domain::{CALLBACK_CHANNEL, JobRunStatus, ReplyType, now_ms, reply_key};
use crate::store::jobs::{JobLock, LockGate, NewJobRun};
use crate::store::workflow::Decline;
use crate::store::{Store, StoreResult};
use crate::wake::Wake;

/// What one run of a job did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobCounts {
    pub scanned: i64,
    pub affected: i64,
}

/// What the scheduled jobs are given by `app.rs`.
pub struct Jobs {
    pub config: Arc<Config>,
    pub store: Store,
    pub instance_id: String,
    pub wake: Arc<Wake>,
}

/// The jobs there are, by name.
pub const JOB_NAMES: [&str; 3] = ["confirm_timeout", "orphan_reclaim", "retention"];

/// Job `name`'s schedule from config; `None` for a name that is not a job.
pub fn schedule_of(config: &Config, name: &str) -> Option<JobSchedule> {
    let jobs = &config.scheduler.jobs;
    match name {
        "confirm_timeout" => Some(jobs.confirm_timeout.schedule()),
        "orphan_reclaim" => Some(jobs.orphan_reclaim.schedule()),
        "retention" => Some(jobs.retention.schedule()),
        _ => None,
    }
}

/// What started a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger<'a> {
    Schedule,
    /// An admin's run-now (`POST /api/admin/jobs/{job}/run`).
    Manual {
        actor: &'a str,
    },
}

/// What a tick came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// It ran (or failed) and left a job_run row.
    Ran {
        status: JobRunStatus,
        counts: JobCounts,
        error: Option<String>,
    },
    /// Another instance ran this tick, or a run holds the lock (SKIPPED recorded for a
    /// scheduled tick; a manual run is refused).
    Held,
    /// The job is switched off: a scheduled tick does nothing and records nothing.
    Disabled,
}

/// Starts every job's schedule; each tick checks the job's switch in the database, so a
/// job an admin switches on runs without a restart. They stop when `shutdown` fires.
pub async fn run_scheduler(svc: Arc<Jobs>, shutdown: CancellationToken) {
    let mut scheduler = match JobScheduler::new().await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "scheduler could not start; scheduled jobs will not run");
            return;
        }
    };
    for name in JOB_NAMES {
        let Some(schedule) = schedule_of(&svc.config, name) else {
            continue;
        };
        if !schedule.enabled {
            tracing::info!(
                job = name,
                "job off in config until an admin switches it on"
            );
        }
        let svc = svc.clone();
        let cron = schedule.cron.clone();
        let job = Job::new_async(cron.as_str(), move |_id, _lock| {
            let svc = svc.clone();
            let schedule = schedule.clone();
            Box::pin(async move {
                tick(&svc, name, &schedule).await;
            })
        });
        match job {
            Ok(job) => {
                if let Err(e) = scheduler.add(job).await {
                    tracing::error!(job = name, error = %e, "could not schedule job");
                }
            }
            Err(e) => tracing::error!(job = name, cron = %cron, error = %e, "bad cron expression"),
        }
    }
    if let Err(e) = scheduler.start().await {
        tracing::error!(error = %e, "scheduler could not start");
        return;
    }
    shutdown.cancelled().await;
    let _ = scheduler.shutdown().await;
}

/// One scheduled tick of job `name`: its status (SKIPPED when it did not run here).
pub async fn tick(svc: &Jobs, name: &str, schedule: &JobSchedule) -> JobRunStatus {
    match run_tick(svc, name, schedule, Trigger::Schedule).await {
        TickOutcome::Ran { status, .. } => status,
        TickOutcome::Held | TickOutcome::Disabled => JobRunStatus::Skipped,
    }
}

/// One tick of job `name`: lock, run, record, release. A manual tick runs under the same
/// lock and leaves the same job_run row (`trigger: manual`, with the actor).
pub async fn run_tick(
    svc: &Jobs,
    name: &str,
    schedule: &JobSchedule,
    trigger: Trigger<'_>,
) -> TickOutcome {
    let started = now_ms();
    let lease_until = started + (schedule.lock_lease_secs as i64) * 1000;
    let instance = svc.instance_id.as_str();
    let (gate, trigger_kind, actor) = match trigger {
        Trigger::Schedule => (
            LockGate::Scheduled {
                default_enabled: schedule.enabled,
            },
            "schedule",
            None,
        ),
        Trigger::Manual { actor } => (LockGate::Manual, "manual", Some(actor)),
    };
    let record = |status, counts: JobCounts, error: Option<String>| NewJobRun {
        job: name,
        instance,
        started_at: started,
        finished_at: now_ms(),
        status,
        scanned: counts.scanned,
        affected: counts.affected,
        error,
        trigger: trigger_kind,
        actor,
    };
    let finish = |status, counts, error: Option<String>| async move {
        let _ = svc
            .store
            .record_job_run(&record(status, counts, error.clone()))
            .await;
        TickOutcome::Ran {
            status,
            counts,
            error,
        }
    };
    let lock = svc
        .store
        .try_lock_job(name, instance, started / 1000, lease_until, started, gate)
        .await;
    match lock {
        Ok(JobLock::Taken) => {}
        Ok(JobLock::Disabled) => return TickOutcome::Disabled,
        Ok(JobLock::Held) => {
            if trigger == Trigger::Schedule {
                let _ = svc
                    .store
                    .record_job_run(&record(JobRunStatus::Skipped, JobCounts::default(), None))
                    .await;
            }
            return TickOutcome::Held;
        }
        Err(e) => {
            tracing::warn!(job = name, error = %e, "could not take the job lock");
            return finish(
                JobRunStatus::Failed,
                JobCounts::default(),
                Some(e.to_string()),
            )
            .await;
        }
    }
    let batch = i64::from(schedule.batch_size);
    let result = match name {
        "confirm_timeout" => confirm_timeout(svc, batch, now_ms()).await,
        "orphan_reclaim" => orphan_reclaim(svc, batch, now_ms()).await,
        "retention" => retention(svc, batch, now_ms()).await,
        other => Err(format!("unknown job {other}")),
    };
    let outcome = match result {
        Ok(counts) => {
            if counts.affected > 0 {
                tracing::info!(
                    job = name,
                    trigger = trigger_kind,
                    scanned = counts.scanned,
                    affected = counts.affected,
                    "job run"
                );
            }
            finish(JobRunStatus::Succeeded, counts, None).await
        }
        Err(error) => {
            tracing::error!(job = name, trigger = trigger_kind, error = %error, "job run failed");
            finish(JobRunStatus::Failed, JobCounts::default(), Some(error)).await
        }
    };
    if let Err(e) = svc.store.release_job(name, instance).await {
        tracing::warn!(job = name, error = %e, "could not release the job lock; its lease will end");
    }
    outcome
}

/// Runs one tick of job `name` now for `actor`, audited (JOB_RUN, target the job);
/// `None` when there is no such job.
pub async fn run_now(svc: &Jobs, name: &str, actor: &str) -> StoreResult<Option<TickOutcome>> {
    let Some(schedule) = schedule_of(&svc.config, name) else {
        return Ok(None);
    };
    let outcome = run_tick(svc, name, &schedule, Trigger::Manual { actor }).await;
    let summary = match &outcome {
        TickOutcome::Ran {
            status,
            counts,
            error,
        } => format!(
            "job {name} run now by {actor}: {status}, scanned {}, affected {}{}",
            counts.scanned,
            counts.affected,
            error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ),
        TickOutcome::Held | TickOutcome::Disabled => {
            format!("job {name} run now by {actor}: refused, another run holds its lock")
        }
    };
    svc.store
        .audit(
            None,
            Some(AuditTarget::Job(name.to_string())),
            AuditEvent::JobRun,
            actor,
            &summary,
            false,
            now_ms(),
        )
        .await?;
    Ok(Some(outcome))
}

/// A job's switch and schedule as an admin sees them.
#[derive(Debug, Clone)]
pub struct JobState {
    pub name: &'static str,
    pub cron: String,
    /// Whether scheduled ticks run now.
    pub enabled: bool,
    /// `config` until an admin switched it, then `admin`.
    pub source: &'static str,
    pub enabled_by: Option<String>,
}

/// Every job's switch and schedule.
pub async fn job_states(svc: &Jobs) -> StoreResult<Vec<JobState>> {
    let stored = svc.store.job_states().await?;
    Ok(JOB_NAMES
        .iter()
        .filter_map(|&name| {
            let schedule = schedule_of(&svc.config, name)?;
            let row = stored.iter().find(|r| r.name == name);
            let switched = row.and_then(|r| r.enabled);
            Some(JobState {
                name,
                cron: schedule.cron,
                enabled: switched.unwrap_or(schedule.enabled),
                source: if switched.is_some() {
                    "admin"
                } else {
                    "config"
                },
                enabled_by: row.and_then(|r| r.enabled_by.clone()),
            })
        })
        .collect())
}

async fn store_err<T>(r: impl Future<Output = crate::store::StoreResult<T>>) -> Result<T, String> {
    r.await.map_err(|e| e.to_string())
}

/// Cancels tasks whose approval deadline passed (at `now`), in one batch.
pub async fn confirm_timeout(svc: &Jobs, batch: i64, now: i64) -> Result<JobCounts, String> {
    let overdue = store_err(svc.store.overdue_confirmations(now, batch)).await?;
    let callback_url = &svc
        .config
        .scheduler
        .jobs
        .confirm_timeout
        .approval_callback_url;
    let mut counts = JobCounts {
        scanned: overdue.len() as i64,
        affected: 0,
    };
    for task in overdue {
        let text = svc
            .config
            .replies
            .timeout_notice
            .replace("{task_id}", &task.id.to_string());
        let notice = NewReply {
            idempotency_key: reply_key(task.id, task.resume_count),
            channel: task.channel.clone(),
            conversation_id: task.conversation_id.clone(),
            in_reply_to: task.in_reply_to.clone(),
            reply_type: ReplyType::Text,
            content: json!({ "text": text }).to_string(),
        };
        let callback = (!callback_url.is_empty()).then(|| NewReply {
            idempotency_key: format!("{}-timeout", reply_key(task.id, task.resume_count)),
            channel: CALLBACK_CHANNEL.to_string(),
            conversation_id: task.conversation_id.clone(),
            in_reply_to: task.in_reply_to.clone(),
            reply_type: ReplyType::Text,
            content: json!({
                "event": "TASK_TIMEOUT_CANCELLED",
                "task_id": task.id,
                "conversation_id": task.conversation_id,
                "confirm_deadline": task.confirm_deadline,
            })
            .to_string(),
        });
        let undo = store_err(crate::control::has_undoable_steps(
            &svc.config,
            &svc.store,
            task.id,
        ))
        .await?;
        let action = if undo {
            store_err(svc.store.open_pending_action(task.id)).await?
        } else {
            None
        };
        let expired = match action {
            // Earlier compensable steps: a worker undoes them and ends the task.
            Some(action) => {
                let decline = Decline {
                    decision: Decision::Expired,
                    actor: "scheduler:confirm_timeout",
                    reason: "approval deadline passed".into(),
                    failure: FailureType::Timeout,
                };
                let due = now.min(now_ms());
                let handed = store_err(svc.store.decline_to_worker(
                    &action,
                    &decline,
                    callback.as_ref(),
                    due,
                ))
                .await?;
                if handed {
                    svc.wake.tasks.notify_one();
                }
                handed
            }
            None => {
                store_err(
                    svc.store
                        .expire_confirmation(task.id, &notice, callback.as_ref(), now),
                )
                .await?
            }
        };
        if expired {
            tracing::warn!(
                task_id = task.id,
                "approval deadline passed; task cancelled"
            );
            counts.affected += 1;
        }
    }
    if counts.affected > 0 {
        svc.wake.replies.notify_one();
    }
    Ok(counts)
}

/// Puts RUNNING tasks whose lease expired more than the grace period ago back to PENDING.
pub async fn orphan_reclaim(svc: &Jobs, batch: i64, now: i64) -> Result<JobCounts, String> {
    let job = &svc.config.scheduler.jobs.orphan_reclaim;
    let grace = job.grace_secs as i64 * 1000;
    let alert = !job.alert_url.is_empty();
    let (scanned, reclaimed) =
        store_err(svc.store.reclaim_orphans(now - grace, batch, now, alert)).await?;
    for r in &reclaimed {
        tracing::warn!(
            task_id = r.task_id,
            last_owner = r.owner.as_deref().unwrap_or("?"),
            step = r.step,
            "reclaimed a task whose instance is gone"
        );
    }
    if !reclaimed.is_empty() {
        svc.wake.tasks.notify_one();
        if alert {
            svc.wake.replies.notify_one();
        }
    }
    Ok(JobCounts {
        scanned,
        affected: reclaimed.len() as i64,
    })
}

/// Removes bulky content of finished tasks older than the TTL, job runs older than it
/// (every tick of every job leaves one, so they would grow without end), and group chatter
/// kept as context older than it; folds the rollups of hours a day old.
pub async fn retention(svc: &Jobs, batch: i64, now: i64) -> Result<JobCounts, String> {
    let ttl = svc.config.scheduler.jobs.retention.ttl_days as i64 * 86_400_000;
    let (scanned, affected) = store_err(svc.store.purge_finished(now - ttl, batch, now)).await?;
    // Handled Matrix transaction ids: homeservers retry for hours, not for the TTL.
    store_err(svc.store.forget_inbound_before(now - ttl)).await?;
    let pruned = store_err(svc.store.prune_job_runs(now - ttl, batch)).await?;
    if pruned > 0 {
        tracing::info!(pruned, "old job runs removed");
    }
    // Rollups of hours a day old: one row per cell instead of one per database connection.
    let folded = store_err(svc.store.fold_rollups(now / 3_600_000 - 24)).await?;
    if folded > 0 {
        tracing::debug!(folded, "rollups folded");
    }
    // Group chatter kept as context goes at the same age as message texts.
    let chatter = store_err(svc.store.prune_group_context(now - ttl, batch)).await?;
    if chatter > 0 {
        tracing::info!(chatter, "old group context removed");
    }
    Ok(JobCounts { scanned, affected })
}
