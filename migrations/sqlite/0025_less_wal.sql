-- The claim's "oldest active task of its conversation" reads pending tasks through an index
-- of pending tasks only and running ones through the unique running index (issue 35 part 2;
-- PostgreSQL's 0025 has the rest of that change, which concerns its WAL).
CREATE INDEX agent_task_pending_conversation ON agent_task (channel, conversation_id, id)
    WHERE status = 'PENDING';
DROP INDEX agent_task_active_conversation;
