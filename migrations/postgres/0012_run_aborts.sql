-- Runs of the task that aborted for a cause that is not an outage (bad data, a bug) since
-- it last started afresh: past `engine.max_run_aborts` the task ends FAILED with INTERNAL
-- instead of being claimed again forever (issue 32). Resume and restart set it back to 0.
ALTER TABLE agent_task ADD COLUMN run_aborts BIGINT NOT NULL DEFAULT 0;
