-- Issue 35 part 2: a step is found by its task. Every statement that reads or writes a step
-- names its task (`task_id`, with `step_no`, its idempotency key or its id), so each walks
-- the unique (task_id, step_no) index, and the B-tree over the surrogate `id` was one index
-- entry per step that nothing read (about 70 bytes of WAL per answered message). Ids still
-- come from the sequence, so they stay unique; SQLite keeps its rowid key, which costs no
-- index of its own.
ALTER TABLE agent_step DROP CONSTRAINT agent_step_pkey;
