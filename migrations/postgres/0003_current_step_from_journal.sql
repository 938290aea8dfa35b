-- A task's current step is read from its journal (the highest step begun), not kept on the
-- task row: beginning a step no longer rewrites the task row (docs/architecture.md, "Step
-- journal").
ALTER TABLE agent_task DROP COLUMN current_step;
