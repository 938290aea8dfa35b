-- A conversation's carried summary is read from the journalled `summary` step that made it,
-- not from a copy on the task. Migration 0040 kept the summary in `agent_task.context_summary`
-- with `summary_through`: the step's output written a second time, in a transaction of its
-- own, an `agent_task` update that also ran the task rollup trigger (about 0.9 ms of
-- PostgreSQL CPU per message in a conversation of long answers, where every message folds;
-- docs/benchmarks.md).
-- Now the step's completion, which is written anyway (batched with other completions),
-- records `summary_through`, the id of the newest message the summary covers; a later task of
-- the conversation reads the step through the messages it reads anyway and each message's
-- task's steps (`agent_step_task_id_step_no_key`). No index; the step update stays HOT
-- (fillfactor 50, migration 0025). A restart moves the steps aside (`agent_step_superseded`,
-- which does not carry the column) and retention empties their output, so neither leaves a
-- summary to carry. Summaries kept by 0040 move to their steps (a single-turn task has one
-- `summary` step, step 1).
ALTER TABLE agent_step ADD COLUMN summary_through BIGINT;
UPDATE agent_step s SET summary_through = t.summary_through
FROM agent_task t
WHERE t.summary_through IS NOT NULL AND s.task_id = t.id AND s.tool_name = 'summary'
  AND s.step_type = 'llm' AND s.status = 'SUCCEEDED';
ALTER TABLE agent_task DROP COLUMN summary_through;
