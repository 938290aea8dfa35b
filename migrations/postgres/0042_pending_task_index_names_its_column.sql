-- The claim reads only each conversation's oldest pending task when a backlog builds up
-- behind running ones (a loose scan of this index, one probe per conversation; before, every
-- pending task with two probes each, per claim), then locks each candidate found by its id.
-- Partial on the status alone, this index could serve any statement saying
-- `status = 'PENDING'`: while a backlog grows faster than autovacuum analyzes the table,
-- PostgreSQL thinks the pending tasks are few and took this index for the lock's look-up by
-- id (`id` is its third column: a walk of every pending task per candidate), as migration
-- 0036 found for the replies' indexes. The added term is true of every row
-- (`conversation_id` is NOT NULL) and is implied only by a statement that names the column:
-- the claim's probes (`conversation_id = …`) and its loose scan (`conversation_id IS NOT
-- NULL`, said outright, as a row comparison implies nothing). SQLite needs no such term:
-- it looks a task up by its rowid whatever its statistics say (and drops `IS NOT NULL` of a
-- NOT NULL column before matching a partial index, so the loose scan could not say it).
DROP INDEX agent_task_pending_conversation;
CREATE INDEX agent_task_pending_conversation ON agent_task (channel, conversation_id, id)
    WHERE status = 'PENDING' AND conversation_id IS NOT NULL;
