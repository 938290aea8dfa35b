-- Outages: each index of the PENDING replies serves only the statements that name its own
-- column, as on PostgreSQL (its migration 0036 says why). Partial on the status alone,
-- either index could serve any statement saying `status = 'PENDING'`: once `PRAGMA
-- optimize` at start-up had analyzed the table while the backlog was small, SQLite answered
-- the delivery mark by walking the due index (the whole backlog per mark) instead of
-- looking each marked row up by rowid. The added terms are true of every row (both columns
-- are NOT NULL), and SQLite takes a partial index with `x IS NOT NULL` only for a statement
-- that compares `x`: the claim's `next_attempt_at <= now`, the backlog readers'
-- `next_attempt_at >= …`, the probes' `conversation_id = …`.
DROP INDEX outbound_reply_due;
CREATE INDEX outbound_reply_due ON outbound_reply (next_attempt_at)
    WHERE status = 'PENDING' AND next_attempt_at IS NOT NULL;
DROP INDEX outbound_reply_conversation_pending;
CREATE INDEX outbound_reply_conversation_pending
    ON outbound_reply (channel, conversation_id, task_id, id)
    WHERE status = 'PENDING' AND conversation_id IS NOT NULL;
