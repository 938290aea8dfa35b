-- Issue 35 part 2: `agent_task_pending_provider` finds a named provider's oldest pending
-- tasks for a claim limited to that provider (`ProviderFilter::Only`). Tasks of the default
-- provider `[llm]` (provider '', most tasks) no longer get an entry in it: one index entry
-- fewer per message. A claim limited to '' reads `agent_task_pending` in id order, where
-- those tasks are; a claim limited to a named provider says `provider <> ''`, so both a
-- custom and a generic plan may use this index.
DROP INDEX agent_task_pending_provider;
CREATE INDEX agent_task_pending_provider ON agent_task (provider, id)
    WHERE status = 'PENDING' AND provider <> '';
