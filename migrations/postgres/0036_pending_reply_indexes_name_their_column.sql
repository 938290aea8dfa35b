-- Outages: each index of the PENDING replies serves only the statements that name its own
-- column, so no statement can walk the other one (as migration 0035 did for messages).
--
-- Both indexes were partial on `status = 'PENDING'` alone, so every statement that says
-- `status = 'PENDING'` could take either. While a backlog grows faster than autovacuum
-- analyzes the table (a platform refusing everything for an hour: a backlog of thousands
-- against statistics that say PENDING rows are rare), PostgreSQL thinks both are nearly
-- empty and takes whichever is cheaper to open, then filters every entry: the claim walked
-- the conversation index to sort the whole backlog by due time (145 ms per claim at
-- 50,000 pending replies, against 0.8 ms through the due index), and each probe for an
-- older pending reply of a conversation (the claim's order check, the delivery mark's
-- `more_due`, the finish's hand-over check) walked the whole due index. A recovery from an
-- outage cost the square of its backlog.
--
-- Now the due index also requires `next_attempt_at IS NOT NULL` (always true: the column is
-- NOT NULL), which only a statement comparing `next_attempt_at` implies (the claim's
-- `next_attempt_at <= now`, the backlog readers' `next_attempt_at >= <the smallest time>`),
-- and the conversation index `conversation_id IS NOT NULL` (as true), which only a
-- statement comparing `conversation_id` implies (the probes). The same rows, the same keys.
DROP INDEX outbound_reply_due;
CREATE INDEX outbound_reply_due ON outbound_reply (next_attempt_at)
    WHERE status = 'PENDING' AND next_attempt_at IS NOT NULL;
DROP INDEX outbound_reply_conversation_pending;
CREATE INDEX outbound_reply_conversation_pending
    ON outbound_reply (channel, conversation_id, task_id, id)
    WHERE status = 'PENDING' AND conversation_id IS NOT NULL;
