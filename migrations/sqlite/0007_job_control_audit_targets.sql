-- Job control (docs/architecture.md, "Scheduled jobs"): a job switched off or on by an admin
-- stays so for every instance (NULL: the config's `enabled` decides), and each run records
-- what triggered it (`schedule` or `manual`) and, for a manual run, the admin.
ALTER TABLE job_lock ADD COLUMN enabled INTEGER;
ALTER TABLE job_lock ADD COLUMN enabled_by TEXT;
ALTER TABLE job_run ADD COLUMN trigger_kind TEXT NOT NULL DEFAULT 'schedule';
ALTER TABLE job_run ADD COLUMN actor TEXT;

-- What an audit row is about besides its task: a task, step, reply, approval or job, so a
-- job run or an approval has its own trail.
ALTER TABLE audit_log ADD COLUMN target_type TEXT;
ALTER TABLE audit_log ADD COLUMN target_id TEXT;
UPDATE audit_log SET target_type = 'task', target_id = CAST(task_id AS TEXT) WHERE task_id IS NOT NULL;
CREATE INDEX audit_log_target ON audit_log (target_type, target_id, id);

-- A claim that takes a task over from an instance that lost it (1), so the time to its next
-- step can be measured (`assistd_recovery_seconds`). The orphan reclaim leaves 2 ("taken
-- over at the next claim"); every claim recomputes it from the status it found.
ALTER TABLE agent_task ADD COLUMN takeover INTEGER NOT NULL DEFAULT 0;
