-- A superseded step is known by its task, its restart and its id in the journal it came
-- from, as on SQLite (which gives a deleted step's id to the next step; issue 32).
ALTER TABLE agent_step_superseded DROP CONSTRAINT agent_step_superseded_pkey;
ALTER TABLE agent_step_superseded ADD PRIMARY KEY (task_id, restart_no, id);
