-- Issue 35 part 2: a task's audit rows without a B-tree entry each.
--
-- Every answered message writes four audit rows, and `audit_log_task` (task_id, id) took an
-- entry for each (four WAL records, about 290 bytes per message). The audit log is
-- append-only (nothing updates or deletes its rows), and a task's rows are written while
-- the task runs, so the task ids of a run of heap pages lie close together: a BRIN index
-- summarises them in a few bytes per 16 pages and costs no WAL while the table's last
-- range fills. `minmax_multi` keeps a range's summary tight when a row of an old task
-- (an approval answered days later, a resumed task) lands among new ones. `autosummarize`
-- has each range summarised as soon as the next one starts, so a reader scans at most the
-- table's last few pages unsummarised.
--
-- What reads a task's rows: the task page and a task's or reply's audit trail (a bitmap
-- scan of the summaries, then the few ranges that hold the task); the task list's
-- "risky only" filter, which probes per listed task, reads the B-tree below instead, which
-- holds only risky rows (failures, reclaims, refused approvals: none for an answered
-- message).
-- SQLite keeps its B-tree (its WAL is not the measure there).
DROP INDEX audit_log_task;
CREATE INDEX audit_log_task ON audit_log USING brin (task_id int8_minmax_multi_ops)
    WITH (pages_per_range = 16, autosummarize = on);
CREATE INDEX audit_log_risky ON audit_log (task_id) WHERE risk_flag;
