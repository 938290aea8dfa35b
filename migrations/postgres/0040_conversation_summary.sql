-- A single-turn conversation's history summary is carried over to its next messages.
-- Before, every message of a conversation whose history outgrew the budget made a summary
-- call of its own over the older turns (a model call, seconds before the answer, and its
-- whole transcript journalled again). Now the task that folds the older turns keeps the
-- summary in its `context_summary` with `summary_through`, the id of the newest message the
-- summary covers; a later task of the conversation reads the newest such summary before its
-- message and asks for a new one only when the turns since no longer fit (docs/workflows.md).
-- The index holds only the tasks that made a summary. Retention and a restart clear both.
ALTER TABLE agent_task ADD COLUMN summary_through BIGINT;
CREATE INDEX agent_task_conversation_summary
    ON agent_task (channel, conversation_id, summary_through)
    WHERE summary_through IS NOT NULL;
