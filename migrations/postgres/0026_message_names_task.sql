-- Issue 35 part 2: a message names its task (`im_message.task_id`, given at intake from
-- agent_task's sequence, the task then inserted with that id), so nothing needs an index
-- over `agent_task.message_id`. That unique index took a new entry at the task's insert
-- and at each of its two status changes (neither update can be HOT: status is in the
-- queue's partial-index predicates): 3 of ~56 WAL records per answered message. The
-- history read, a duplicate's task and the task list's text search go from the message to
-- its task through the task's primary key instead. One task per message stays the
-- intake's rule (a task is inserted only for a message row its own insert just wrote),
-- no longer also the schema's.
ALTER TABLE im_message ADD COLUMN task_id BIGINT;
UPDATE im_message m SET task_id = t.id FROM agent_task t WHERE t.message_id = m.id;
DROP INDEX agent_task_message;
