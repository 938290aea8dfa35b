-- Issue 35 part 2 (see the PostgreSQL migration of the same number): a reply's audit rows
-- always name the reply's task and are found through `audit_log_task`, so the target index
-- leaves them out. The step key's unique constraint stays here (dropping a column
-- constraint rebuilds the table).
DROP INDEX audit_log_target;
CREATE INDEX audit_log_target ON audit_log (target_type, target_id, id)
    WHERE target_type NOT IN ('task', 'reply');
