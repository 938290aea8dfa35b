-- Issue 35 part 2, two index entries fewer per answered message.
--
-- A reply's audit rows (target `reply`) always name the reply's task, so they are found
-- through `audit_log_task` (the reply's task, then its rows naming the reply); the target
-- index no longer holds them too (as 0010 did for a task's own rows).
DROP INDEX audit_log_target;
CREATE INDEX audit_log_target ON audit_log (target_type, target_id, id)
    WHERE target_type NOT IN ('task', 'reply');
-- A step's idempotency key is `<task>[r<restart>]:<step_no>:<tool>` (`domain::step_key`),
-- so two rows with one key have one (task_id, step_no), which the table's other unique key
-- refuses: the key's own unique index (an entry per step) guarded nothing more. Steps are
-- looked up by task and key (`existing_step`, the begin's `NOT EXISTS`) through the
-- (task_id, step_no) index. SQLite keeps its column constraint (dropping one rebuilds the
-- table); the same statements run there.
ALTER TABLE agent_step DROP CONSTRAINT agent_step_idempotency_key_key;
