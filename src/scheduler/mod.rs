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
use crate::domain::NewReply;
use crate::domain::{CALLBACK_CHANNEL, JobRunStatus, ReplyType, now_ms, reply_key};
use crate::store::Store;
use crate::store::jobs::NewJobRun;
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

/// Starts the enabled jobs; they stop when `shutdown` fires.
pub async fn run_scheduler(svc: Arc<Jobs>, shutdown: CancellationToken) {
    let jobs = &svc.config.scheduler.jobs;
    let mut scheduler = match JobScheduler::new().await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "scheduler could not start; scheduled jobs will not run");
            return;
        }
    };
    let schedules = [
        ("confirm_timeout", jobs.confirm_timeout.schedule()),
        ("orphan_reclaim", jobs.orphan_reclaim.schedule()),
        ("retention", jobs.retention.schedule()),
    ];
    for (name, schedule) in schedules {
        if !schedule.enabled {
            tracing::info!(job = name, "job disabled in config");
            continue;
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

/// One tick of job `name`: lock, run, record, release.
pub async fn tick(svc: &Jobs, name: &str, schedule: &JobSchedule) -> JobRunStatus {
    let started = now_ms();
    let tick = started / 1000;
    let lease_until = started + (schedule.lock_lease_secs as i64) * 1000;
    let instance = svc.instance_id.as_str();
    let record = |status, counts: JobCounts, error: Option<String>| NewJobRun {
        job: name,
        instance,
        started_at: started,
        finished_at: now_ms(),
        status,
        scanned: counts.scanned,
        affected: counts.affected,
        error,
    };
    let locked = match svc
        .store
        .try_lock_job(name, instance, tick, lease_until, started)
        .await
    {
        Ok(locked) => locked,
        Err(e) => {
            tracing::warn!(job = name, error = %e, "could not take the job lock");
            let _ = svc
                .store
                .record_job_run(&record(
                    JobRunStatus::Failed,
                    JobCounts::default(),
                    Some(e.to_string()),
                ))
                .await;
            return JobRunStatus::Failed;
        }
    };
    if !locked {
        let _ = svc
            .store
            .record_job_run(&record(JobRunStatus::Skipped, JobCounts::default(), None))
            .await;
        return JobRunStatus::Skipped;
    }
    let batch = i64::from(schedule.batch_size);
    let result = match name {
        "confirm_timeout" => confirm_timeout(svc, batch, now_ms()).await,
        "orphan_reclaim" => orphan_reclaim(svc, batch, now_ms()).await,
        "retention" => retention(svc, batch, now_ms()).await,
        other => Err(format!("unknown job {other}")),
    };
    let status = match result {
        Ok(counts) => {
            if counts.affected > 0 {
                tracing::info!(
                    job = name,
                    scanned = counts.scanned,
                    affected = counts.affected,
                    "job run"
                );
            }
            let _ = svc
                .store
                .record_job_run(&record(JobRunStatus::Succeeded, counts, None))
                .await;
            JobRunStatus::Succeeded
        }
        Err(error) => {
            tracing::error!(job = name, error = %error, "job run failed");
            let _ = svc
                .store
                .record_job_run(&record(
                    JobRunStatus::Failed,
                    JobCounts::default(),
                    Some(error),
                ))
                .await;
            JobRunStatus::Failed
        }
    };
    if let Err(e) = svc.store.release_job(name, instance).await {
        tracing::warn!(job = name, error = %e, "could not release the job lock; its lease will end");
    }
    status
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
        if store_err(
            svc.store
                .expire_confirmation(task.id, &notice, callback.as_ref(), now),
        )
        .await?
        {
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
    let grace = svc.config.scheduler.jobs.orphan_reclaim.grace_secs as i64 * 1000;
    let (scanned, reclaimed) =
        store_err(svc.store.reclaim_orphans(now - grace, batch, now)).await?;
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
    }
    Ok(JobCounts {
        scanned,
        affected: reclaimed.len() as i64,
    })
}

/// Removes bulky content of finished tasks older than the TTL, and job runs older than it
/// (every tick of every job leaves one, so they would grow without end).
pub async fn retention(svc: &Jobs, batch: i64, now: i64) -> Result<JobCounts, String> {
    let ttl = svc.config.scheduler.jobs.retention.ttl_days as i64 * 86_400_000;
    let (scanned, affected) = store_err(svc.store.purge_finished(now - ttl, batch, now)).await?;
    // Handled Matrix transaction ids: homeservers retry for hours, not for the TTL.
    store_err(svc.store.forget_inbound_before(now - ttl)).await?;
    let pruned = store_err(svc.store.prune_job_runs(now - ttl, batch)).await?;
    if pruned > 0 {
        tracing::info!(pruned, "old job runs removed");
    }
    Ok(JobCounts { scanned, affected })
}
