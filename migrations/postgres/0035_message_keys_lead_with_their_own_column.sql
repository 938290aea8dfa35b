-- Issue 35 part 3: each of a message's indexes leads with a column of its own, not with the
-- channel they all share.
--
-- The intake looks each new message's platform keys up (`NOT EXISTS` on `channel` and the
-- event id, then on `channel` and the message id), as do the duplicate check and the
-- reply context. Each key has its unique index, but `(channel, external_event_id)`,
-- `(channel, external_message_id)` and `(channel, conversation_id, id)` all began with the
-- channel. On a young table (never analyzed: a new deployment, or any burst before
-- autovacuum looks) every one of them costs the same to the planner, and under the generic
-- plan PostgreSQL caches for a prepared statement it took one of the others by its first
-- column alone and filtered every message of the channel (most deployments have one channel
-- per platform) for each message taken in: in `assistd-bench instances` the intake's insert
-- grew to 5–25 ms a batch, most of the database's CPU, and stayed so until the table was
-- analyzed (auto_explain: 4,900 rows filtered per probe, 93,000 buffers per batch).
--
-- Led by its own column, an index serves only the lookups that name that column, so each
-- probe has exactly one index to take. Uniqueness is the same (a set of columns), and
-- `ON CONFLICT` finds these indexes as before. The conversation's history (`channel` and
-- `conversation_id` equal, newest `id` first) reads its index as before.
ALTER TABLE im_message DROP CONSTRAINT im_message_channel_external_event_id_key;
ALTER TABLE im_message DROP CONSTRAINT im_message_channel_external_message_id_key;
ALTER TABLE im_message ADD CONSTRAINT im_message_event_key UNIQUE (external_event_id, channel);
ALTER TABLE im_message ADD CONSTRAINT im_message_message_key UNIQUE (external_message_id, channel);
DROP INDEX im_message_conversation;
CREATE INDEX im_message_conversation ON im_message (conversation_id, channel, id);
