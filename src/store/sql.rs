//! SQL shared by the store's files: column lists, the current-step expression, the audit
//! and reply inserts that run inside a caller's transaction, and the statement text of the
//! batched worker writes (`BatchSql`, built once per dialect).

use serde_json::{Value, json};

use super::{Dialect, PerDialect};
use crate::domain::{AuditEvent, AuditTarget};

/// Appends one audit event inside the caller's transaction (`$tx`). A macro rather than a
/// generic function: generic executors make the futures that call them not `Send`. The row's
/// target is its task unless `target = (type, id)` names another (a step, reply, approval or
/// job: `AuditTarget`).
macro_rules! insert_audit {
    ($tx:expr, $task_id:expr, $event:expr, $actor:expr, $summary:expr, $risk:expr, $now:expr $(,)?) => {{
        let task_id: Option<i64> = $task_id;
        $crate::store::sql::insert_audit!(
            $tx,
            task_id,
            $event,
            $actor,
            $summary,
            $risk,
            $now,
            target = task_id.map($crate::domain::AuditTarget::Task)
        )
    }};
    ($tx:expr, $task_id:expr, $event:expr, $actor:expr, $summary:expr, $risk:expr, $now:expr,
     target = $target:expr $(,)?) => {{
        let target: Option<$crate::domain::AuditTarget> = $target;
        let (target_type, target_id) = $crate::domain::AuditTarget::columns(target.as_ref());
        sqlx::query(
            "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, created_at, \
             target_type, target_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind($task_id)
        .bind($event)
        .bind($actor)
        .bind(
            $crate::store::text::storable(&$crate::redaction::redact(&$crate::domain::truncate(
                $summary, 2000,
            )))
            .into_owned(),
        )
        .bind($risk || $crate::domain::AuditEvent::is_risky($event))
        .bind($now)
        .bind(target_type)
        .bind(target_id)
        .execute($tx)
        .await
    }};
}
pub(crate) use insert_audit;

/// What a reply inserted under a key that is taken does: a placeholder under that key (a
/// slow run's "Thinking…") becomes the reply. It is edited into the reply when it was sent
/// and the platform gave its message id; it is simply replaced when it was never tried; and
/// when its send is in doubt (tried, not known to have arrived, or arrived without an id)
/// the reply goes as a new message under `<key>-answer`. Any other row under the key stands:
/// a second insert of a reply is a no-op.
macro_rules! reply_upsert {
    () => {
        concat!(
            " ON CONFLICT (task_id, idempotency_key) DO UPDATE SET ",
            $crate::store::sql::placeholder_becomes_reply!("excluded", "excluded.next_attempt_at"),
            " WHERE outbound_reply.placeholder = 1"
        )
    };
}

/// The `SET` of `reply_upsert!`: the placeholder row `outbound_reply` takes the reply of the
/// row aliased `$new`, due at `$next`. Also PostgreSQL's finish, which replaces placeholders
/// by an `UPDATE … FROM` its rows (`v`) instead of an upsert.
macro_rules! placeholder_becomes_reply {
    ($new:literal, $next:literal) => {
        concat!(
            "content = ", $new, ".content, reply_type = ", $new, ".reply_type, placeholder = 0, \
             status = 'PENDING', \
             edit = CASE WHEN outbound_reply.status = 'SENT' \
                 AND outbound_reply.platform_message_id IS NOT NULL THEN 1 ELSE 0 END, \
             send_key = CASE WHEN outbound_reply.attempts > 0 AND NOT (outbound_reply.status = 'SENT' \
                 AND outbound_reply.platform_message_id IS NOT NULL) \
                 THEN outbound_reply.idempotency_key || '-answer' ELSE NULL END, \
             attempts = 0, last_error = NULL, next_attempt_at = ", $next
        )
    };
}
pub(crate) use placeholder_becomes_reply;
pub(crate) use reply_upsert;

/// Queues a task's reply inside the caller's transaction; a second insert under the same key
/// is a no-op, except that it replaces a placeholder (see `reply_upsert!`). A macro for the
/// same reason as `insert_audit!`.
macro_rules! insert_reply {
    ($tx:expr, $task_id:expr, $reply:expr, $now:expr) => {
        sqlx::query(concat!(
            "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
             in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 0, $9, $9)",
            $crate::store::sql::reply_upsert!()
        ))
        .bind($task_id)
        .bind(&$reply.idempotency_key)
        .bind(&$reply.channel)
        .bind(&$reply.conversation_id)
        .bind(&$reply.in_reply_to)
        .bind($reply.reply_type)
        .bind($crate::store::text::storable(&$reply.content))
        .bind($crate::domain::ReplyStatus::Pending)
        .bind($now)
        .execute($tx)
    };
}

pub(crate) use insert_reply;

/// The highest step journalled for the task in `agent_task` (0 before its first step): the
/// step it is at, or was at when it stopped. Read, not stored, so that beginning a step
/// writes only the step row.
macro_rules! current_step_sql {
    () => {
        "(SELECT COALESCE(MAX(s.step_no), 0) FROM agent_step s WHERE s.task_id = agent_task.id)"
    };
}
pub(super) use current_step_sql;

pub(super) const STEP_COLUMNS: &str = "id, task_id, step_no, step_type, tool_name, idempotency_key, input, \
     output, error, status, tokens_in, tokens_out, duration_ms, attempt, created_at, finished_at";

/// The batched statements of [`Store::apply_writes`], per dialect. Each takes its rows as a
/// JSON array of objects (`$1`, see [`rows_json`]) and the time (`$2`); fenced rows carry
/// their task's `task_id`, `owner` and `version`.
pub(super) struct BatchSql {
    pub(super) renew: String,
    pub(super) begin: String,
    pub(super) existing_step: String,
    pub(super) complete: String,
    pub(super) finish: String,
    pub(super) insert_replies: String,
    pub(super) mark_sent: String,
    pub(super) insert_audits: String,
}

pub(super) const FENCE: [(&str, &str); 3] = [
    ("task_id", "bigint"),
    ("owner", "text"),
    ("version", "bigint"),
];

impl BatchSql {
    pub(super) fn get(dialect: Dialect) -> &'static BatchSql {
        static SQL: PerDialect<BatchSql> = PerDialect::new();
        SQL.get(dialect, BatchSql::new)
    }

    // long: the statement text of every batched write, per dialect, built once.
    fn new(sqlite: bool) -> BatchSql {
        let rows = |cols: &[(&str, &str)]| json_rows(sqlite, cols);
        let fenced_rows = |cols: &[(&str, &str)]| {
            let all: Vec<(&str, &str)> = FENCE.iter().chain(cols).copied().collect();
            json_rows(sqlite, &all)
        };
        // PostgreSQL: the status is compared as `status || ''`, which no partial index's
        // predicate matches, so the tasks are found by their ids through the primary key
        // (`keyed_by` in the batched updates, `t.id = v.task_id` in the fence probes).
        // Compared plainly, it let the planner answer a batch's finish with a
        // bitmap scan of `agent_task_one_running_per_conversation` (`WHERE status =
        // 'RUNNING'`): that index holds an entry for every version of every task that ran
        // since vacuum last cleaned it (no update of a task is HOT), and a bitmap scan
        // visits each one's page: 4,380 entries and 373 pages for a batch of 14 finishing
        // tasks in an `end-to-end` run (`auto_explain`, issue 35 part 2).
        let running = if sqlite { "status" } else { "status || ''" };
        let fence = |task: &str| {
            format!(
                "{task}.id = v.task_id AND {task}.owner = v.owner AND {task}.version = v.version \
                 AND {task}.{running} = 'RUNNING'"
            )
        };
        // PostgreSQL: the fence check locks the task row (`FOR SHARE`). Under read committed
        // a plain `EXISTS` reads the statement's snapshot, so a takeover committing after it
        // would go unseen and a stale step row land; locking waits for such a claim and then
        // re-checks the fence on the row as it now stands. A claim arriving later waits for
        // this batch to commit (the claim's pick skips the locked row).
        let lock = if sqlite { "" } else { " FOR SHARE" };
        let owned = format!(
            "EXISTS (SELECT 1 FROM agent_task t WHERE {}{lock})",
            fence("t")
        );
        // A step begins only while no pause is asked: a pause takes effect at the next step
        // boundary (the worker then parks the task PAUSED), never in the middle of a call,
        // whose completion stays fenced by `owned` alone.
        let owned_unpaused = format!(
            "EXISTS (SELECT 1 FROM agent_task t WHERE {} AND t.pause_requested = 0{lock})",
            fence("t")
        );
        let renew = format!(
            "UPDATE agent_task SET lease_expire = v.lease_until, updated_at = $2 \
             FROM {} WHERE {}{} RETURNING agent_task.id",
            fenced_rows(&[("lease_until", "bigint")]),
            fence("agent_task"),
            keyed_by(sqlite, "agent_task.id", "task_id")
        );
        // The PENDING step, inserted only where its task's fence holds. The task row is not
        // touched: its current step is read from the journal (`TASK_COLUMNS`), so a step
        // costs one row write to begin and one to complete. A key journalled before (a
        // resume) is found by `NOT EXISTS`, not `ON CONFLICT`: keys name their task, and
        // only the run holding the task's fence begins its steps (one write in flight, a
        // batch's repeats in later rounds), so no concurrent insert of the key can race
        // this one, and a plain insert spares PostgreSQL the speculative insertion's extra
        // WAL record. Should one race all the same, the unique (task_id, step_no) refuses
        // it. Keys are read by task and key, through that index (a key names its task and
        // step, so PostgreSQL keeps no index of its own over keys: migration 0027).
        let begin = format!(
            "INSERT INTO agent_step (task_id, step_no, step_type, tool_name, idempotency_key, \
             input, status, attempt, created_at) \
             SELECT v.task_id, v.step_no, v.step_type, v.tool_name, v.idempotency_key, v.input, \
             $3, 0, $2 FROM {} WHERE {owned_unpaused} AND NOT EXISTS (SELECT 1 FROM agent_step s \
             WHERE s.task_id = v.task_id AND s.idempotency_key = v.idempotency_key{}) \
             RETURNING id, idempotency_key",
            fenced_rows(&[
                ("step_no", "bigint"),
                ("step_type", "text"),
                ("tool_name", "text"),
                ("idempotency_key", "text"),
                ("input", "text"),
            ]),
            per_row(sqlite)
        );
        let existing_step = format!(
            "SELECT {STEP_COLUMNS} FROM agent_step WHERE task_id = $2 AND idempotency_key = $1 \
             AND EXISTS (SELECT 1 FROM agent_task t WHERE t.id = $2 AND t.owner = $3 \
             AND t.version = $4 AND t.status = 'RUNNING' AND t.pause_requested = 0{lock})"
        );
        let complete = format!(
            "UPDATE agent_step SET status = v.status, output = v.output, error = v.error, \
             tokens_in = v.tokens_in, tokens_out = v.tokens_out, duration_ms = v.duration_ms, \
             finished_at = $2, attempt = v.attempts, summary_through = v.summary_through FROM {} \
             WHERE agent_step.id = v.step_id AND agent_step.task_id = v.task_id AND {owned}{} \
             RETURNING agent_step.id",
            fenced_rows(&[
                ("step_id", "bigint"),
                ("status", "text"),
                ("output", "text"),
                ("error", "text"),
                ("tokens_in", "bigint"),
                ("tokens_out", "bigint"),
                ("duration_ms", "bigint"),
                ("attempts", "bigint"),
                ("summary_through", "bigint"),
            ]),
            keyed_by(sqlite, "agent_step.task_id", "task_id")
        );
        let finish_cols = [
            ("status", "text"),
            ("result", "text"),
            ("failure_type", "text"),
            ("error", "text"),
            ("retries", "bigint"),
            ("trace", "text"),
        ];
        let finish_set = "status = v.status, result = v.result, \
             failure_type = v.failure_type, error_msg = v.error, \
             retry_count = agent_task.retry_count + v.retries, \
             version = agent_task.version + 1, lease_expire = NULL, finished_at = $2, \
             updated_at = $2, trace = v.trace";
        // SQLite: the task's finish alone (its last step went by `complete` just before).
        // PostgreSQL: a finish and its task's last step in one statement (issue 35 part 2).
        // The task's update is the fence (it locks the row and re-checks the fence on the
        // row as it then stands), and the step is completed only for the tasks it returned,
        // so the step needs no row lock of its own (`complete`'s `FOR SHARE`, one WAL record
        // per answered message). Both land before the statement's rollup trigger runs,
        // which reads the step's tokens. A finish without a last step (`step_id` null)
        // completes no step.
        let step_cols = [
            ("step_id", "bigint"),
            ("step_status", "text"),
            ("output", "text"),
            ("step_error", "text"),
            ("tokens_in", "bigint"),
            ("tokens_out", "bigint"),
            ("duration_ms", "bigint"),
            ("attempts", "bigint"),
            ("summary_through", "bigint"),
        ];
        let finish = if sqlite {
            format!(
                "UPDATE agent_task SET {finish_set} FROM {} WHERE {} RETURNING agent_task.id",
                fenced_rows(&finish_cols),
                fence("agent_task"),
            )
        } else {
            let all: Vec<(&str, &str)> = finish_cols.iter().chain(&step_cols).copied().collect();
            format!(
                "WITH fin AS (UPDATE agent_task SET {finish_set} FROM {} WHERE {}{} \
                 RETURNING agent_task.id), \
                 step AS (UPDATE agent_step SET status = v.step_status, output = v.output, \
                 error = v.step_error, tokens_in = v.tokens_in, tokens_out = v.tokens_out, \
                 duration_ms = v.duration_ms, finished_at = $2, attempt = v.attempts, \
                 summary_through = v.summary_through FROM {} \
                 WHERE agent_step.id = v.step_id AND agent_step.task_id = v.task_id \
                 AND v.task_id IN (SELECT id FROM fin){}) \
                 SELECT id FROM fin",
                fenced_rows(&finish_cols),
                fence("agent_task"),
                keyed_by(sqlite, "agent_task.id", "task_id"),
                fenced_rows(&all),
                keyed_by(sqlite, "agent_step.task_id", "task_id")
            )
        };
        // One reply per task and key: a second insert under the same key is a no-op, and a
        // placeholder under the key becomes the reply (`reply_upsert!`). SQLite: that upsert.
        // PostgreSQL: one statement (`handed_replies`) whose first part replaces the
        // placeholders (the upsert's own `SET`) and whose insert adds the replies where no
        // row is under their key, by `NOT EXISTS`: a plain insert spares PostgreSQL the
        // speculative insertion's extra WAL record (issue 35 part 2). No other transaction
        // inserts under a finishing task's reply key meanwhile: the finish's update holds
        // the task row, and a placeholder is queued only under a share lock on it
        // (`queue_placeholder`).
        let reply_rows = rows(&[
            ("task_id", "bigint"),
            ("idempotency_key", "text"),
            ("channel", "text"),
            ("conversation_id", "text"),
            ("in_reply_to", "text"),
            ("reply_type", "text"),
            ("content", "text"),
            ("owner", "text"),
            ("hand_until", "bigint"),
        ]);
        let insert_reply_rows = format!(
            "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
             in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at) \
             SELECT v.task_id, v.idempotency_key, v.channel, v.conversation_id, v.in_reply_to, \
             v.reply_type, v.content, $3, 0, $2, $2 FROM {reply_rows} WHERE "
        );
        let insert_replies = if sqlite {
            format!("{insert_reply_rows}true{}", reply_upsert!())
        } else {
            handed_replies(&reply_rows)
        };
        // A placeholder that went out after the answer took its row (`reply_upsert!`) is
        // not the end: the row stays PENDING, to edit the message just sent into the answer
        // (or, without its id, to send the answer as a new message). Each marked row comes
        // back with `more_due`: it is PENDING again, or another reply of its conversation
        // is (through `outbound_reply_conversation_pending`), so the outbox claims after a
        // delivery only when a reply may have waited for it (`WriteOut::Sent`). A reply of
        // the conversation committed while this statement ran is not seen; the next claim
        // of any outbox takes it, at the latest at its poll (`outbox.poll_interval_ms`).
        // The marked rows are found by their primary key, the probe goes by the
        // conversation's index (migration 0036 on PostgreSQL, 0030 on SQLite: each pending
        // index serves only what names its column).
        let superseded = "v.placeholder = 1 AND outbound_reply.placeholder = 0";
        let mark_sent = format!(
            "UPDATE outbound_reply SET \
             status = CASE WHEN {superseded} THEN 'PENDING' ELSE $3 END, \
             edit = CASE WHEN {superseded} AND v.platform_message_id IS NOT NULL THEN 1 \
                 ELSE outbound_reply.edit END, \
             send_key = CASE WHEN {superseded} AND v.platform_message_id IS NOT NULL THEN NULL \
                 ELSE outbound_reply.send_key END, \
             platform_message_id = COALESCE(v.platform_message_id, \
                 outbound_reply.platform_message_id), \
             sent_at = $2, locked_by = NULL, locked_until = NULL, last_error = NULL FROM {} \
             WHERE outbound_reply.id = v.reply_id AND outbound_reply.locked_by = v.owner \
             AND outbound_reply.status = 'PENDING'{} \
             RETURNING outbound_reply.id, (outbound_reply.status = 'PENDING' \
                 OR EXISTS (SELECT 1 FROM outbound_reply o WHERE o.status = 'PENDING' \
                 AND o.channel = outbound_reply.channel \
                 AND o.conversation_id = outbound_reply.conversation_id \
                 AND o.id <> outbound_reply.id)) AS more_due",
            rows(&[
                ("reply_id", "bigint"),
                ("owner", "text"),
                ("platform_message_id", "text"),
                ("placeholder", "bigint"),
            ]),
            keyed_by(sqlite, "outbound_reply.id", "reply_id")
        );
        let insert_audits = format!(
            "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, created_at, \
             target_type, target_id) \
             SELECT v.task_id, v.event, v.actor, v.summary, v.risk_flag, $2, v.target_type, \
             v.target_id FROM {}",
            rows(&[
                ("task_id", "bigint"),
                ("event", "text"),
                ("actor", "text"),
                ("summary", "text"),
                ("risk_flag", "boolean"),
                ("target_type", "text"),
                ("target_id", "text"),
            ])
        );
        BatchSql {
            renew,
            begin,
            existing_step,
            complete,
            finish,
            insert_replies,
            mark_sent,
            insert_audits,
        }
    }
}

/// The batched statements that write step rows (`begin`, `complete`, `finish` with its
/// task's last step), for the tests of their plans: each finds its steps through their
/// task (on PostgreSQL the unique `(task_id, step_no)` index; the surrogate `id` has no
/// index of its own since migration 0032).
pub fn step_write_sql(dialect: Dialect) -> [&'static str; 3] {
    let sql = BatchSql::get(dialect);
    [&sql.begin, &sql.complete, &sql.finish]
}

/// The batched statements that write replies: a finishing batch's (placeholders turned into
/// answers, answers inserted) and the marks of delivered ones (with their probe for another
/// pending reply of the conversation), for the tests of their plans.
pub fn reply_write_sql(dialect: Dialect) -> [&'static str; 2] {
    let sql = BatchSql::get(dialect);
    [&sql.insert_replies, &sql.mark_sent]
}

/// PostgreSQL's write of finished tasks' replies (`$1` the rows, `$2` the time, `$3`
/// PENDING), one statement. Its first part (`rep`) makes a placeholder under a reply's key
/// the reply (`placeholder_becomes_reply!`, found through `outbound_reply_placeholder`):
/// a statement of its own before, which found nothing for almost every batch (432 calls,
/// no row, in an `end-to-end` run of 5,000), one round trip per finishing batch. Its insert
/// adds the others where no row is under their key, by `NOT EXISTS`, which sees the
/// statement's snapshot, placeholders included, never the `rep` part's new versions of
/// them: the two parts touch disjoint rows. A plain insert spares
/// PostgreSQL the speculative insertion's extra WAL record. A row with `hand_until` (its
/// instance's outbox is running) is inserted already leased to its `owner` until then, its
/// first attempt counted, when the delivery claim would take it now: no older reply of its
/// conversation is PENDING (`reply_pick_sql`'s order; the statement does not see its own
/// rows, and a conversation has one task finishing at a time). Those rows are returned,
/// for that outbox to send without a claim: the claim's row lock and second row version
/// were about a sixth of a reply's WAL (issue 35 part 2). The others wait for a claim as
/// before.
fn handed_replies(reply_rows: &str) -> String {
    let set = placeholder_becomes_reply!("v", "$2");
    format!(
        "WITH rep AS (UPDATE outbound_reply SET {set} FROM {reply_rows} \
             WHERE outbound_reply.task_id = v.task_id \
             AND outbound_reply.idempotency_key = v.idempotency_key \
             AND outbound_reply.placeholder = 1), \
         ins AS (INSERT INTO outbound_reply (task_id, idempotency_key, channel, \
         conversation_id, in_reply_to, reply_type, content, status, attempts, next_attempt_at, \
         created_at, locked_by, locked_until) \
         SELECT v.task_id, v.idempotency_key, v.channel, v.conversation_id, v.in_reply_to, \
         v.reply_type, v.content, $3, h.handed::int, $2, $2, \
         CASE WHEN h.handed THEN v.owner END, CASE WHEN h.handed THEN v.hand_until END \
         FROM {reply_rows} CROSS JOIN LATERAL (SELECT v.hand_until IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM outbound_reply o WHERE o.status = 'PENDING' \
             AND o.channel = v.channel AND o.conversation_id = v.conversation_id \
             AND o.task_id <= v.task_id) AS handed) h \
         WHERE NOT EXISTS (SELECT 1 FROM outbound_reply o \
             WHERE o.task_id = v.task_id AND o.idempotency_key = v.idempotency_key{}) \
         RETURNING *) \
         SELECT {} FROM ins WHERE locked_by IS NOT NULL",
        per_row(false),
        super::outbox::REPLY_COLUMNS
    )
}

/// A table `v` of the objects in the JSON array bound as `$1`, with columns `cols` (name,
/// PostgreSQL type).
///
/// On SQLite each object is converted to SQLite's binary JSON once, in an inner query that
/// `LIMIT -1 OFFSET 0` keeps from being flattened into the outer one. Reading
/// `value ->> 'col'` straight off `json_each` renders the object as text and parses it again
/// for every column read: a ten-column batch row was rendered and parsed ten times, and
/// SQLite's JSON functions were ~15 % of the SQLite thread's CPU in the end-to-end profile
/// (`docs/benchmarks.md`). SQLite 3.46, which libsqlite3-sys bundles, has no `jsonb_each`.
pub(super) fn json_rows(sqlite: bool, cols: &[(&str, &str)]) -> String {
    if sqlite {
        let fields: Vec<String> = cols
            .iter()
            .map(|(name, _)| format!("j ->> '{name}' AS {name}"))
            .collect();
        format!(
            "(SELECT {} FROM (SELECT jsonb(value) AS j FROM json_each($1) LIMIT -1 OFFSET 0)) AS v",
            fields.join(", ")
        )
    } else {
        let fields: Vec<String> = cols
            .iter()
            .map(|(name, ty)| format!("{name} {ty}"))
            .collect();
        format!(
            "json_to_recordset($1::text::json) AS v({})",
            fields.join(", ")
        )
    }
}

/// `column` is one of the ids of the JSON array bound as `$1`: `… WHERE <this>`.
///
/// PostgreSQL gets an array (`= ANY(ARRAY(…))`, computed once) rather than `IN (SELECT …)`:
/// it plans a set-returning function at 100 rows, and under `IN` it hashed them against a
/// sequential scan of the whole table, on every claim (issue 22; `docs/benchmarks.md`). An
/// array on a key column is an index scan whatever the table's size.
pub(super) fn in_json_ids(dialect: Dialect, column: &str) -> String {
    match dialect {
        Dialect::Sqlite => format!("{column} IN (SELECT value FROM json_each($1))"),
        Dialect::Postgres => format!(
            "{column} = ANY(ARRAY(SELECT value::bigint \
             FROM json_array_elements_text($1::text::json)))"
        ),
    }
}

/// PostgreSQL: ` OFFSET 0`, to end a correlated `EXISTS` subquery that probes a table by its
/// unique key for each row of a batch. Without it the planner turns `NOT EXISTS` into an
/// anti join and, while the table's statistics still say it is small (a table that grew
/// since autovacuum last looked, as every table does in a burst), answers it by hashing a
/// sequential scan of the whole table, once per batch statement: the step begin, the reply
/// insert and the message intake each hashed every row so far (`auto_explain` of an
/// `end-to-end` run, issue 35 part 2). With an offset the subquery cannot become a join and
/// runs once per batch row, through the key's index, whatever the statistics say. Nothing on
/// SQLite, which has no `OFFSET` without `LIMIT` and looks each row up by its key anyway.
pub(super) fn per_row(sqlite: bool) -> &'static str {
    if sqlite { "" } else { " OFFSET 0" }
}

/// PostgreSQL: ` AND <column> = ANY(<the field of every row of the JSON array $1>)`, for an
/// `UPDATE … FROM json_to_recordset($1)` keyed on `column`, so the rows to update are found
/// by an index scan on that key and never by a sequential scan of the table hashed against
/// the planner's 100 guessed rows (as `complete` was, 301 times in a 3,000-message run).
/// Nothing on SQLite, which looks each row up by its key anyway.
fn keyed_by(sqlite: bool, column: &str, field: &str) -> String {
    if sqlite {
        return String::new();
    }
    format!(
        " AND {column} = ANY(ARRAY(SELECT (r ->> '{field}')::bigint \
         FROM json_array_elements($1::text::json) r))"
    )
}

/// The statement that inserts the audit rows (see [`audit_row`]) of the JSON array bound as
/// `$1`, at time `$2`, in one round trip.
pub(super) fn insert_audits_sql(dialect: Dialect) -> &'static str {
    &BatchSql::get(dialect).insert_audits
}

/// An audit row for `insert_audits` (summary truncated and redacted as `insert_audit!` does).
pub(super) fn audit_row(
    task_id: i64,
    event: AuditEvent,
    actor: &str,
    summary: &str,
    target: &AuditTarget,
) -> Value {
    let (target_type, target_id) = AuditTarget::columns(Some(target));
    json!({
        "task_id": task_id,
        "event": event.as_str(),
        "actor": actor,
        "summary": crate::redaction::redact(&crate::domain::truncate(summary, 2000)),
        "risk_flag": event.is_risky(),
        "target_type": target_type,
        "target_id": target_id,
    })
}
