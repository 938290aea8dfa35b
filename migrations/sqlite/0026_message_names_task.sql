-- Issue 35 part 2: a message names its task (`im_message.task_id`, given at intake), so
-- nothing needs an index over `agent_task.message_id` (see the PostgreSQL migration of the
-- same number). The history read, a duplicate's task and the task list's text search go
-- from the message to its task through the task's primary key.
ALTER TABLE im_message ADD COLUMN task_id INTEGER;
UPDATE im_message SET task_id = (SELECT t.id FROM agent_task t WHERE t.message_id = im_message.id);
DROP INDEX agent_task_message;
