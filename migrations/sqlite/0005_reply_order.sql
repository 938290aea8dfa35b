-- A conversation's replies are delivered in task order: a reply is claimed only when no
-- older reply of its conversation is still PENDING. This index answers that check.
CREATE INDEX outbound_reply_conversation_pending
    ON outbound_reply (channel, conversation_id, task_id, id) WHERE status = 'PENDING';
