//! The reply outbox. A reply row is created with its task's terminal status (see
//! `finish_task`); delivery claims it under a short lease so only one instance sends it at a
//! time, and every send carries the row's one idempotency key.

use super::sql::insert_audit;
use super::{Dialect, Store, StoreResult, on_pool, write_tx};
use crate::domain::AuditTarget;
use crate::domain::{AuditEvent, ReplyRow, ReplyStatus};

pub(super) const REPLY_COLUMNS: &str = "id, task_id, idempotency_key, channel, conversation_id, in_reply_to, \
     reply_type, content, status, platform_message_id, attempts, next_attempt_at, last_error, \
     created_at, sent_at, (placeholder = 1) AS placeholder, (edit = 1) AS edit, send_key, \
     parts_sent, streamed_parts";

/// A reply `owner` still holds, found by its primary key (`id`): the lease holder and the
/// PENDING status are checked on the row. Neither index of the PENDING replies can serve
/// these conditions: each one's predicate also names a column they do not compare
/// (migration 0036 on PostgreSQL, 0030 on SQLite). Before, `status = 'PENDING'` let
/// PostgreSQL answer such a statement by walking a pending index and filtering every entry,
/// the whole backlog per statement whenever the statistics predated it, as they do when an
/// outage grew it since the last `ANALYZE` (2–3 ms per statement at 50,000 pending
/// replies, against 0.07 ms by the key).
macro_rules! held_reply {
    ($id:literal, $owner:literal) => {
        concat!(
            "id = ",
            $id,
            " AND locked_by = ",
            $owner,
            " AND status = 'PENDING'"
        )
    };
}

/// `reply_as_new_message`: `$1` now, `$2` the error, `$3` the reply, `$4` its holder.
const AS_NEW_MESSAGE: &str = concat!(
    "UPDATE outbound_reply SET edit = 0, platform_message_id = NULL, \
     send_key = idempotency_key || '-answer', attempts = 0, next_attempt_at = $1, \
     parts_sent = 0, last_error = $2, locked_by = NULL, locked_until = NULL WHERE ",
    held_reply!("$3", "$4"),
    " AND edit = 1"
);
/// `reschedule_reply`: `$1` the next try's time, `$2` the error, `$3` the reply, `$4` its
/// holder.
const RESCHEDULE: &str = concat!(
    "UPDATE outbound_reply SET next_attempt_at = $1, last_error = $2, \
     locked_by = NULL, locked_until = NULL WHERE ",
    held_reply!("$3", "$4")
);
/// `note_parts_sent`: `$1` the parts sent, `$2` the first part's platform id, `$3` the
/// reply, `$4` its holder.
const NOTE_PARTS: &str = concat!(
    "UPDATE outbound_reply SET parts_sent = $1, \
     platform_message_id = COALESCE($2, platform_message_id) WHERE ",
    held_reply!("$3", "$4")
);
/// `defer_reply`: `$1` until, `$2` the reply, `$3` its holder.
const DEFER: &str = concat!(
    "UPDATE outbound_reply SET next_attempt_at = $1, attempts = attempts - 1, \
     locked_by = NULL, locked_until = NULL WHERE ",
    held_reply!("$2", "$3")
);
/// `give_up_reply`: `$1` the final status, `$2` the error, `$3` the reply, `$4` its holder.
const GIVE_UP: &str = concat!(
    "UPDATE outbound_reply SET status = $1, last_error = $2, locked_by = NULL, \
     locked_until = NULL WHERE ",
    held_reply!("$3", "$4")
);

/// The updates of a reply its holder makes between a claim and the delivered mark (the mark
/// is in `reply_write_sql`), for the tests of their plans.
pub fn held_reply_sql() -> [&'static str; 5] {
    [AS_NEW_MESSAGE, RESCHEDULE, NOTE_PARTS, DEFER, GIVE_UP]
}

/// The claim's choice of due replies (parameters: `$3` now, `$4` limit, `$5` the creation
/// time before which a reply stops waiting for older ones): PENDING, due, not leased, and
/// the oldest PENDING reply of its conversation (by task, then by queue order) unless it has
/// waited since before `$5`, so a conversation's replies go in task order. PostgreSQL locks
/// what it picks and skips rows another instance is claiming.
pub fn reply_pick_sql(dialect: Dialect) -> String {
    let lock = match dialect {
        Dialect::Sqlite => "",
        Dialect::Postgres => " FOR UPDATE SKIP LOCKED",
    };
    format!(
        "SELECT r.id FROM outbound_reply r WHERE r.status = 'PENDING' \
         AND r.next_attempt_at <= $3 AND (r.locked_until IS NULL OR r.locked_until < $3) \
         AND (r.created_at < $5 OR NOT EXISTS (SELECT 1 FROM outbound_reply o \
             WHERE o.status = 'PENDING' \
             AND o.channel = r.channel AND o.conversation_id = r.conversation_id \
             AND (o.task_id < r.task_id OR (o.task_id = r.task_id AND o.id < r.id)))) \
         ORDER BY r.next_attempt_at LIMIT $4{lock}"
    )
}

/// A slow run's placeholder, queued under the run's reply key.
pub struct NewPlaceholder<'a> {
    pub key: &'a str,
    pub channel: &'a str,
    pub conversation_id: &'a str,
    pub in_reply_to: &'a str,
    /// The outbox content (`{"text": …}`).
    pub content: &'a str,
}

/// What became of a part (≥ 2) of a streamed answer, as `outbound_reply.streamed_parts`
/// keeps it: `{"<part>": "<message id>"}` once shown, `null` while its send is in doubt
/// (about to go, or gone with no answer), absent when it never went.
#[derive(Debug, Clone, Copy)]
pub enum StreamedPart<'a> {
    /// About to be sent: until its id is recorded, the part may be in the chat.
    Sending,
    /// Shown in this platform message.
    Shown(&'a str),
    /// The platform answered that it was not sent.
    NotSent,
}

/// What `note_streamed_part` found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Noted {
    Recorded,
    /// An earlier run of the task showed this part in this message (nothing written).
    WasShown(String),
    /// An earlier run's send of this part is in doubt (nothing written).
    WasInDoubt,
    /// The run no longer owns its task, or has no placeholder (nothing written).
    RunEnded,
}

impl Store {
    /// Queues a placeholder for the run `fence` holds, due now: only while the run still
    /// owns its task and nothing was queued under its reply key (the answer, or the
    /// placeholder of an earlier run, which the answer then edits). Returns whether it was
    /// queued.
    pub async fn queue_placeholder(
        &self,
        fence: &crate::domain::Fence,
        placeholder: &NewPlaceholder<'_>,
        now: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            // PostgreSQL (SQLite has one writer): the task row before the reply row, in the
            // order a finishing batch takes them, and in share mode, so that a finish in
            // flight (which updates the task row, then, in one statement, replaces a
            // placeholder under its key or inserts its reply where none is) is waited for,
            // after which the fence below sees the task finished; and a finish arriving
            // meanwhile waits for this placeholder to commit, then finds and replaces it. No
            // placeholder lands between a finish's task update and its reply statement.
            if self.dialect() == Dialect::Postgres {
                sqlx::query("SELECT id FROM agent_task WHERE id = $1 FOR SHARE")
                    .bind(fence.task_id)
                    .fetch_optional(&mut *tx)
                    .await?;
            }
            sqlx::query(
                "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
                 in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at, \
                 placeholder) \
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, 0, $9, $9, 1 WHERE EXISTS \
                 (SELECT 1 FROM agent_task WHERE id = $1 AND owner = $10 AND version = $11 \
                 AND status = 'RUNNING') ON CONFLICT (task_id, idempotency_key) DO NOTHING",
            )
            .bind(fence.task_id)
            .bind(placeholder.key)
            .bind(placeholder.channel)
            .bind(placeholder.conversation_id)
            .bind(placeholder.in_reply_to)
            .bind(crate::domain::ReplyType::Text)
            .bind(placeholder.content)
            .bind(ReplyStatus::Pending)
            .bind(now)
            .bind(&fence.owner)
            .bind(fence.version)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// The platform message id of the placeholder of task `task_id` under `key`, once it
    /// was sent and while it is still the placeholder (the answer has not replaced it).
    pub async fn placeholder_message(
        &self,
        task_id: i64,
        key: &str,
    ) -> StoreResult<Option<String>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT platform_message_id FROM outbound_reply WHERE task_id = $2 \
                 AND idempotency_key = $1 AND placeholder = 1 AND status = 'SENT'",
            )
            .bind(key)
            .bind(task_id)
            .fetch_optional(pool)
            .await?
            .flatten()
        }))
    }

    /// Records on the placeholder's row (`key`) of the streamed answer of the run `fence`
    /// what became of its part `part` (≥ 2), while the run still owns its task: about to be
    /// sent, shown in a platform message, or surely not sent. A part an earlier run of the
    /// task recorded is not marked as going again: its record is returned instead.
    pub async fn note_streamed_part(
        &self,
        fence: &crate::domain::Fence,
        key: &str,
        part: usize,
        state: StreamedPart<'_>,
    ) -> StoreResult<Noted> {
        let noted = write_tx!(self, tx => {
            let row: Option<(i64, Option<String>)> = sqlx::query_as(
                "SELECT id, streamed_parts FROM outbound_reply WHERE task_id = $2 \
                 AND idempotency_key = $1 AND placeholder = 1",
            )
            .bind(key)
            .bind(fence.task_id)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((id, parts)) = row else {
                return Ok(Noted::RunEnded);
            };
            let mut parts: serde_json::Map<String, serde_json::Value> = parts
                .and_then(|p| serde_json::from_str(&p).ok())
                .unwrap_or_default();
            let slot = part.to_string();
            match (state, parts.get(&slot)) {
                (StreamedPart::Sending, Some(serde_json::Value::String(shown))) => {
                    return Ok(Noted::WasShown(shown.clone()));
                }
                (StreamedPart::Sending, Some(_)) => return Ok(Noted::WasInDoubt),
                (StreamedPart::Sending, None) => {
                    parts.insert(slot, serde_json::Value::Null);
                }
                (StreamedPart::Shown(id), _) => {
                    parts.insert(slot, serde_json::json!(id));
                }
                (StreamedPart::NotSent, _) => {
                    parts.remove(&slot);
                }
            }
            let written = sqlx::query(
                "UPDATE outbound_reply SET streamed_parts = $1 WHERE id = $2 \
                 AND EXISTS (SELECT 1 FROM agent_task WHERE id = $3 AND owner = $4 \
                 AND version = $5 AND status = 'RUNNING')",
            )
            .bind(serde_json::Value::Object(parts).to_string())
            .bind(id)
            .bind(fence.task_id)
            .bind(&fence.owner)
            .bind(fence.version)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if written == 1 { Noted::Recorded } else { Noted::RunEnded }
        });
        Ok(noted)
    }

    /// Takes up to `limit` due PENDING replies for `owner` until `lease_until`, counting the
    /// attempt. A reply whose lease lapsed (its sender died) is due again. A conversation's
    /// replies go in task order (a task's own replies in the order they were queued): a reply
    /// is not taken while an older one of its conversation is still PENDING, even one
    /// claimed by an instance that died; it goes once that one is SENT or given up.
    pub async fn claim_due_replies(
        &self,
        owner: &str,
        limit: usize,
        lease_until: i64,
        now: i64,
        order_wait_ms: i64,
    ) -> StoreResult<Vec<ReplyRow>> {
        // 0 = no limit: no reply was created before the start of time.
        let stop_waiting = if order_wait_ms > 0 {
            now - order_wait_ms
        } else {
            i64::MIN
        };
        let pick = reply_pick_sql(self.dialect());
        let sql = format!(
            "UPDATE outbound_reply SET locked_by = $1, locked_until = $2, attempts = attempts + 1 \
             WHERE id IN ({pick}) RETURNING {REPLY_COLUMNS}"
        );
        let mut rows = write_tx!(self, tx => {
            sqlx::query_as::<_, ReplyRow>(&sql)
                .bind(owner)
                .bind(lease_until)
                .bind(now)
                .bind(limit as i64)
                .bind(stop_waiting)
                .fetch_all(&mut *tx)
                .await?
        });
        rows.sort_by_key(|r| r.id);
        Ok(rows)
    }

    /// A reply whose placeholder is gone (deleted in the chat) goes as a new message, under
    /// `<key>-answer`, due now.
    pub async fn reply_as_new_message(
        &self,
        reply: &ReplyRow,
        owner: &str,
        error: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            sqlx::query(
                AS_NEW_MESSAGE,
            )
            .bind(now)
            .bind(super::text::stored_error(error))
            .bind(reply.id)
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// Puts a reply back for another try at `next_attempt_at`, noting why this one failed.
    pub async fn reschedule_reply(
        &self,
        reply: &ReplyRow,
        owner: &str,
        next_attempt_at: i64,
        error: &str,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            sqlx::query(
                RESCHEDULE,
            )
            .bind(next_attempt_at)
            .bind(super::text::stored_error(error))
            .bind(reply.id)
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// Records that the first `parts_sent` parts of a long reply were accepted (the first
    /// one as `platform_message_id`), while `owner` still holds it.
    pub async fn note_parts_sent(
        &self,
        reply: &ReplyRow,
        owner: &str,
        parts_sent: i64,
        platform_message_id: Option<&str>,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            sqlx::query(
                NOTE_PARTS,
            )
            .bind(parts_sent)
            .bind(platform_message_id)
            .bind(reply.id)
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// Puts a claimed reply back without counting the attempt: the chat's send rate is used
    /// up until `until`, so the reply waits (it was not tried).
    pub async fn defer_reply(
        &self,
        reply: &ReplyRow,
        owner: &str,
        until: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            sqlx::query(
                DEFER,
            )
            .bind(until)
            .bind(reply.id)
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// The sent reply the platform knows as `platform_message_id` on `channel` (what a
    /// reaction or a quote refers to).
    pub async fn reply_by_platform_message(
        &self,
        channel: &str,
        platform_message_id: &str,
    ) -> StoreResult<Option<ReplyRow>> {
        let sql = format!(
            "SELECT {REPLY_COLUMNS} FROM outbound_reply \
             WHERE channel = $1 AND platform_message_id = $2 ORDER BY id LIMIT 1"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, ReplyRow>(&sql)
                .bind(channel)
                .bind(platform_message_id)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// Gives a reply up for good (status `status`: FAILED, or UNKNOWN when it may have
    /// reached the chat), with a risk-flagged audit event.
    pub async fn give_up_reply(
        &self,
        reply: &ReplyRow,
        owner: &str,
        status: ReplyStatus,
        error: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let done = write_tx!(self, tx => {
            let n = sqlx::query(
                GIVE_UP,
            )
            .bind(status)
            .bind(super::text::stored_error(error))
            .bind(reply.id)
            .bind(owner)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 1 {
                let summary = format!(
                    "reply {} {} after {} attempt(s): {}",
                    reply.idempotency_key, status, reply.attempts, error
                );
                insert_audit!(
                    &mut *tx,
                    Some(reply.task_id),
                    AuditEvent::ReplyFailed,
                    owner,
                    &summary,
                    true,
                    now,
                    target = Some(AuditTarget::Reply(reply.id)),
                )?;
            }
            n == 1
        });
        Ok(done)
    }

    /// The task's latest reply (a resumed task has one per outcome).
    pub async fn task_reply(&self, task_id: i64) -> StoreResult<Option<ReplyRow>> {
        Ok(self.task_replies(task_id).await?.pop())
    }

    /// Every reply of a task, oldest first.
    pub async fn task_replies(&self, task_id: i64) -> StoreResult<Vec<ReplyRow>> {
        let sql =
            format!("SELECT {REPLY_COLUMNS} FROM outbound_reply WHERE task_id = $1 ORDER BY id");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, ReplyRow>(&sql).bind(task_id).fetch_all(pool).await?
        }))
    }

    /// An admin's "retry delivery now": a PENDING reply waiting out its backoff becomes due
    /// now; a FAILED (given up) one is PENDING again with its attempts counted from zero.
    /// Refused (`Err` with the reason) for a reply delivered, in doubt (UNKNOWN: it may
    /// have reached the chat; sending again could show it twice) or being sent right now.
    /// Audited (REPLY_RETRIED, target the reply). `Ok(None)`: no such reply.
    pub async fn retry_reply(
        &self,
        reply_id: i64,
        actor: &str,
        now: i64,
    ) -> StoreResult<Option<Result<ReplyRow, String>>> {
        let sql = format!(
            "UPDATE outbound_reply SET status = 'PENDING', next_attempt_at = $1, \
             attempts = CASE WHEN status = 'FAILED' THEN 0 ELSE attempts END \
             WHERE id = $2 AND status IN ('PENDING', 'FAILED') \
             AND (locked_until IS NULL OR locked_until < $1) RETURNING {REPLY_COLUMNS}"
        );
        let out = write_tx!(self, tx => {
            let row: Option<ReplyRow> = sqlx::query_as(&sql)
                .bind(now)
                .bind(reply_id)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(row) = row {
                let summary = format!("reply {} sent out again now by {actor}", row.idempotency_key);
                insert_audit!(
                    &mut *tx,
                    Some(row.task_id),
                    AuditEvent::ReplyRetried,
                    actor,
                    &summary,
                    false,
                    now,
                    target = Some(AuditTarget::Reply(row.id)),
                )?;
                Some(Ok(row))
            } else {
                // Not retried: say why, or that there is no such reply.
                let found: Option<(ReplyStatus, Option<i64>)> =
                    sqlx::query_as("SELECT status, locked_until FROM outbound_reply WHERE id = $1")
                        .bind(reply_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                found.map(|(status, locked_until)| {
                    Err(match status {
                        ReplyStatus::Sent => "the reply was delivered".to_string(),
                        ReplyStatus::Unknown => "the reply may have reached the chat (UNKNOWN); \
                             sending it again could show it twice"
                            .to_string(),
                        _ if locked_until.is_some_and(|l| l >= now) => {
                            "the reply is being sent right now".to_string()
                        }
                        other => format!("the reply is {other}"),
                    })
                })
            }
        });
        Ok(out)
    }
}
