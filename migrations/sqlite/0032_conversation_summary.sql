-- A single-turn conversation's history summary is carried over to its next messages (as
-- PostgreSQL migration 0040, which says why): the task that folds the older turns keeps the
-- summary with the id of the newest message it covers.
ALTER TABLE agent_task ADD COLUMN summary_through INTEGER;
