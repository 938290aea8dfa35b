-- Issue 35 part 2: a reply's key is unique within its task (see the PostgreSQL migration
-- 0030): the upserts' conflict target is (task_id, idempotency_key), and this index serves
-- the lookups by task in place of `outbound_reply_task`. The key's column constraint stays
-- (dropping it rebuilds the table).
DROP INDEX outbound_reply_task;
CREATE UNIQUE INDEX outbound_reply_task_key ON outbound_reply (task_id, idempotency_key);
