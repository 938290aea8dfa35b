-- Issue 35 part 2 (see the PostgreSQL migration 0031): only named providers' pending tasks
-- are indexed by provider; the default provider's ('') are read through
-- `agent_task_pending`.
DROP INDEX agent_task_pending_provider;
CREATE INDEX agent_task_pending_provider ON agent_task (provider, id)
    WHERE status = 'PENDING' AND provider <> '';
