-- The provider a task's model calls go to ('' = [llm]), from its agent version at intake:
-- workers claim a provider's tasks only while it has a free slot (`max_concurrency`, a
-- pause after 429), so a saturated provider holds up no other provider's tasks (issue 32).
-- The index finds one provider's oldest pending tasks without reading the others'.
ALTER TABLE agent_task ADD COLUMN provider TEXT NOT NULL DEFAULT '';
CREATE INDEX agent_task_pending_provider ON agent_task (provider, id) WHERE status = 'PENDING';
