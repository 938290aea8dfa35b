-- A conversation's carried summary is read from the journalled `summary` step that made it,
-- not from a copy on the task (as PostgreSQL migration 0041, which says why): the step's
-- completion records `summary_through`, the id of the newest message the summary covers.
ALTER TABLE agent_step ADD COLUMN summary_through INTEGER;
UPDATE agent_step SET summary_through = (
    SELECT t.summary_through FROM agent_task t WHERE t.id = agent_step.task_id)
WHERE tool_name = 'summary' AND step_type = 'llm' AND status = 'SUCCEEDED'
  AND task_id IN (SELECT id FROM agent_task WHERE summary_through IS NOT NULL);
ALTER TABLE agent_task DROP COLUMN summary_through;
