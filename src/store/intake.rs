//! Message intake: the message, its task and the TASK_CREATED audit row commit together or
//! not at all. Duplicates are refused by the unique keys of `im_message`, never by a cache.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::sql::{audit_row, insert_audits_sql, json_rows, per_row};
use super::{Dialect, PerDialect, Store, StoreError, StoreResult, TASK_NOTIFY_CHANNEL, write_tx};
use crate::domain::AuditTarget;
use crate::domain::{AuditEvent, Ingested, NewMessage, TaskStatus, TaskType};

/// A history row's answer (`t` its message's task): the task's result, where it succeeded.
macro_rules! history_answer {
    () => {
        "CASE WHEN t.status = 'SUCCEEDED' THEN t.result END"
    };
}

/// One earlier exchange of a conversation: the user's text and, when answered, the answer.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct HistoryEntry {
    pub message_id: i64,
    pub text: String,
    pub answer: Option<String>,
}

impl Store {
    /// Commits `message` with a PENDING task for the current version of agent `agent`, or
    /// finds the task of the message already stored under the same event or message id.
    /// `NotFound` (and nothing written) when the agent has no published version.
    pub async fn ingest_message(
        &self,
        message: &NewMessage,
        agent: &str,
        now: i64,
    ) -> StoreResult<Ingested> {
        let mut out = self.ingest_batch(&[(message, agent)], now, true).await?;
        out.pop().unwrap_or(Err(StoreError::NotFound))
    }

    /// Commits a batch of messages, each with its PENDING task and TASK_CREATED audit row,
    /// in one transaction of a few statements whatever the batch size (group commit: the per-statement
    /// round trips, not SQL, are what intake costs). Per message, in order: its task
    /// (`duplicate` when the event or message id was stored before, in this batch or
    /// earlier), or `NotFound` when its agent has no published version — that message writes
    /// nothing, the others are unaffected.
    ///
    /// With `wake_others` (PostgreSQL), the commit `NOTIFY`s every instance's workers.
    pub async fn ingest_batch(
        &self,
        batch: &[(&NewMessage, &str)],
        now: i64,
        wake_others: bool,
    ) -> StoreResult<Vec<StoreResult<Ingested>>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let notify = wake_others && matches!(self, Store::Postgres(_));
        let sql = IntakeSql::get(self.dialect());
        // PostgreSQL: a plain insert of messages whose keys are not stored yet, when no two
        // messages of the batch share a key, spares each message the speculative insertion's
        // confirmation record (issue 35 part 2). A message committed by another transaction
        // after this one began reading (the same event delivered twice at once) makes that
        // insert fail on the unique key, and nothing of the batch is written: the batch then
        // goes again the way that skips stored keys (`ON CONFLICT DO NOTHING`), as does a
        // batch that holds a key twice.
        match &sql.messages_unseen {
            Some(unseen) if !repeats_a_key(batch) => {
                match self.ingest_with(batch, now, notify, unseen).await {
                    Err(StoreError::UniqueViolation(_)) => {
                        self.ingest_with(batch, now, notify, &sql.messages).await
                    }
                    other => other,
                }
            }
            _ => self.ingest_with(batch, now, notify, &sql.messages).await,
        }
    }

    // long: one transaction of four statements for both dialects; split, the statements lose their order.
    /// [`ingest_batch`](Self::ingest_batch) with `messages_sql` inserting the messages.
    async fn ingest_with(
        &self,
        batch: &[(&NewMessage, &str)],
        now: i64,
        notify: bool,
        messages_sql: &str,
    ) -> StoreResult<Vec<StoreResult<Ingested>>> {
        let mut agent_names: Vec<&str> = batch.iter().map(|(_, a)| *a).collect();
        agent_names.sort_unstable();
        agent_names.dedup();
        // With the provider the version's definition names (`""`: `[llm]`), for the task
        // (`ProviderFilter`): read out by the database, so the definition (a whole workflow,
        // maybe) does not travel with every batch.
        let provider = match self.dialect() {
            Dialect::Sqlite => "json_extract(v.definition, '$.provider')",
            Dialect::Postgres => "v.definition::json ->> 'provider'",
        };
        let agents_sql = format!(
            "SELECT a.name, a.id, a.current_version_id, COALESCE({provider}, '') FROM agent a \
             JOIN agent_version v ON v.id = a.current_version_id WHERE a.name IN ({})",
            (1..=agent_names.len())
                .map(|i| format!("${i}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let sql = IntakeSql::get(self.dialect());
        let results = write_tx!(self, tx => {
            let mut agents_q = sqlx::query_as::<_, (String, i64, i64, String)>(&agents_sql);
            for name in &agent_names {
                agents_q = agents_q.bind(*name);
            }
            let agents: HashMap<String, (i64, i64, String)> = agents_q
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .map(|(name, id, version, provider)| (name, (id, version, provider)))
                .collect();
            let known: Vec<usize> = (0..batch.len())
                .filter(|&i| agents.contains_key(batch[i].1))
                .collect();
            // Messages (conflicts on either platform key skip the row: a duplicate).
            let mut inserted: HashMap<(String, String), (i64, i64)> = HashMap::new();
            if !known.is_empty() {
                // `ord` keeps the batch's order, so tasks get ids in arrival order.
                let rows: Vec<Value> = known
                    .iter()
                    .map(|&i| {
                        let m = batch[i].0;
                        json!({
                            "ord": i,
                            "channel": m.channel,
                            "event_id": m.event_id,
                            "message_id": m.message_id,
                            "conversation_id": m.conversation_id,
                            "sender_id": m.sender_id,
                            "sender_name": m.sender_name,
                            "text": m.text,
                            "reply_context": m.reply_context,
                            "trace_context": m.trace_context,
                        })
                    })
                    .collect();
                for (id, channel, event, task_id) in
                    sqlx::query_as::<_, (i64, String, String, i64)>(messages_sql)
                        .bind(super::text::storable_rows(rows))
                        .bind(now)
                        .fetch_all(&mut *tx)
                        .await?
                {
                    inserted.insert((channel, event), (id, task_id));
                }
            }
            // The message row each new message got (the first of equal keys in the batch).
            // (batch index, message row, its task's id)
            let mut fresh: Vec<(usize, i64, i64)> = Vec::new();
            for &i in &known {
                let m = batch[i].0;
                // The keys as stored (`store::text`), as the insert returned them.
                let key = (
                    super::text::storable(&m.channel).into_owned(),
                    super::text::storable(&m.event_id).into_owned(),
                );
                if let Some((id, task_id)) = inserted.remove(&key) {
                    fresh.push((i, id, task_id));
                }
            }
            if !fresh.is_empty() {
                let rows: Vec<Value> = fresh
                    .iter()
                    .map(|&(i, message_row, task_id)| {
                        let (m, agent) = batch[i];
                        let (agent_id, version_id, provider) = &agents[agent];
                        json!({
                            "ord": i,
                            "id": task_id,
                            "agent_id": agent_id,
                            "agent_version_id": version_id,
                            "provider": provider,
                            "channel": m.channel,
                            "conversation_id": m.conversation_id,
                            "message_id": message_row,
                            "trigger_user": m.sender_id,
                        })
                    })
                    .collect();
                sqlx::query(&sql.tasks)
                    .bind(super::text::storable_rows(rows))
                    .bind(now)
                    .bind(TaskType::ConversationReply)
                    .bind(TaskStatus::Pending)
                    .execute(&mut *tx)
                    .await?;
                let audits: Vec<Value> = fresh
                    .iter()
                    .map(|&(i, _, task_id)| {
                        let m = batch[i].0;
                        audit_row(
                            task_id,
                            AuditEvent::TaskCreated,
                            &format!("{}:{}", m.channel, m.sender_id),
                            &format!("message {} in conversation {}", m.message_id, m.conversation_id),
                            &AuditTarget::Task(task_id),
                        )
                    })
                    .collect();
                sqlx::query(insert_audits_sql(self.dialect()))
                    .bind(super::text::storable_rows(audits))
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                if notify {
                    // Delivered by PostgreSQL only when this transaction commits.
                    sqlx::query("SELECT pg_notify($1, '')")
                        .bind(TASK_NOTIFY_CHANNEL)
                        .execute(&mut *tx)
                        .await?;
                }
            }
            let fresh: HashMap<usize, i64> = fresh.into_iter().map(|(i, _, t)| (i, t)).collect();
            let mut results = Vec::with_capacity(batch.len());
            for (i, (m, agent)) in batch.iter().enumerate() {
                if !agents.contains_key(*agent) {
                    results.push(Err(StoreError::NotFound));
                } else if let Some(&task_id) = fresh.get(&i) {
                    results.push(Ok(Ingested {
                        task_id,
                        duplicate: false,
                    }));
                } else {
                    let (task_id,): (i64,) = sqlx::query_as(
                        "SELECT m.task_id FROM im_message m \
                         WHERE m.channel = $1 AND (m.external_message_id = $2 \
                         OR m.external_event_id = $3) ORDER BY m.task_id LIMIT 1",
                    )
                    .bind(super::text::storable(&m.channel))
                    .bind(super::text::storable(&m.message_id))
                    .bind(super::text::storable(&m.event_id))
                    .fetch_one(&mut *tx)
                    .await?;
                    results.push(Ok(Ingested { task_id, duplicate: true }));
                }
            }
            results
        });
        Ok(results)
    }

    /// The last `limit` exchanges of a conversation up to and including message
    /// `up_to_message`, oldest first, each with the answer its task gave (if it succeeded).
    pub async fn conversation_history(
        &self,
        channel: &str,
        conversation_id: &str,
        up_to_message: i64,
        limit: i64,
    ) -> StoreResult<Vec<HistoryEntry>> {
        let mut rows: Vec<HistoryEntry> = super::on_pool!(self, pool => {
            sqlx::query_as(concat!(
                "SELECT m.id AS message_id, m.text, ",
                history_answer!(),
                " AS answer FROM im_message m LEFT JOIN agent_task t ON t.id = m.task_id \
                 WHERE m.channel = $1 AND m.conversation_id = $2 AND m.id <= $3 \
                 ORDER BY m.id DESC LIMIT $4",
            ))
            .bind(channel)
            .bind(conversation_id)
            .bind(up_to_message)
            .bind(limit)
            .fetch_all(pool)
            .await?
        });
        rows.reverse();
        Ok(rows)
    }

    /// [`Store::conversation_history`] of each of `wants`, by task id, in one statement (its
    /// SQL: [`conversation_histories_sql`]): a claim's tasks read their conversations
    /// together rather than one statement each (the read was most of the statements a
    /// message cost, issue 35 part 2; on SQLite, too, each statement is a hand-over to the
    /// connection's thread and back). The same
    /// rows a run would read later: a claimed task is the only running one of its
    /// conversation and no older one is pending, so no earlier answer lands meanwhile.
    pub async fn conversation_histories(
        &self,
        wants: &[HistoryWant<'_>],
    ) -> StoreResult<HashMap<i64, Vec<HistoryEntry>>> {
        if wants.is_empty() {
            return Ok(HashMap::new());
        }
        let sql = conversation_histories_sql(self.dialect());
        let rows: Vec<Value> = wants
            .iter()
            .map(|w| {
                json!({
                    "task_id": w.task_id,
                    "channel": w.channel,
                    "conversation_id": w.conversation_id,
                    "up_to": w.up_to_message,
                    "lim": w.limit,
                })
            })
            .collect();
        let rows = Value::from(rows).to_string();
        let found: Vec<(i64, i64, String, Option<String>)> = super::on_pool!(self, pool => {
            sqlx::query_as(sql).bind(rows).fetch_all(pool).await?
        });
        let mut histories: HashMap<i64, Vec<HistoryEntry>> =
            wants.iter().map(|w| (w.task_id, Vec::new())).collect();
        for (task_id, message_id, text, answer) in found {
            if let Some(history) = histories.get_mut(&task_id) {
                history.push(HistoryEntry {
                    message_id,
                    text,
                    answer,
                });
            }
        }
        for history in histories.values_mut() {
            history.sort_by_key(|e| e.message_id);
        }
        Ok(histories)
    }
}

/// The read of the conversations of a claim's tasks (`$1` a JSON array of [`HistoryWant`]s
/// as `task_id`, `channel`, `conversation_id`, `up_to`, `lim`): each task's messages through
/// `im_message_conversation`, newest first up to its limit, with the answer of each
/// message's task where it succeeded.
///
/// PostgreSQL takes each task's rows with a `LATERAL` subquery and its `LIMIT`. SQLite has
/// no `LATERAL` and takes no outer column in a `LIMIT`, so it walks each conversation back
/// one message at a time (a recursive CTE, each step one probe of the index for the next
/// older message) until the task's limit: index lookups bounded by the limit, never the
/// conversation's length.
pub fn conversation_histories_sql(dialect: Dialect) -> &'static str {
    static PG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static LITE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let sqlite = dialect == Dialect::Sqlite;
    let cell = if sqlite { &LITE } else { &PG };
    cell.get_or_init(|| {
        let wanted = json_rows(
            sqlite,
            &[
                ("task_id", "bigint"),
                ("channel", "text"),
                ("conversation_id", "text"),
                ("up_to", "bigint"),
                ("lim", "bigint"),
            ],
        );
        let answer = history_answer!();
        if sqlite {
            let older = |bound: &str, than: &str| {
                format!(
                    "(SELECT m.id FROM im_message m WHERE m.channel = {bound}.channel \
                     AND m.conversation_id = {bound}.conversation_id AND m.id {than} \
                     ORDER BY m.id DESC LIMIT 1)"
                )
            };
            return format!(
                "WITH RECURSIVE walk (task_id, channel, conversation_id, id, n, lim) AS (\
                 SELECT v.task_id, v.channel, v.conversation_id, {}, 1, v.lim \
                 FROM {wanted} WHERE v.lim > 0 \
                 UNION ALL SELECT w.task_id, w.channel, w.conversation_id, {}, w.n + 1, w.lim \
                 FROM walk w WHERE w.n < w.lim AND w.id IS NOT NULL) \
                 SELECT w.task_id, m.id, m.text, {answer} AS answer FROM walk w \
                 JOIN im_message m ON m.id = w.id LEFT JOIN agent_task t ON t.id = m.task_id",
                older("v", "<= v.up_to"),
                older("w", "< w.id"),
            );
        }
        format!(
            "SELECT v.task_id, h.id, h.text, h.answer FROM {wanted} \
             CROSS JOIN LATERAL (SELECT m.id, m.text, {answer} AS answer \
             FROM im_message m LEFT JOIN agent_task t ON t.id = m.task_id \
             WHERE m.conversation_id = v.conversation_id AND m.channel = v.channel \
             AND m.id <= v.up_to ORDER BY m.id DESC LIMIT v.lim) h"
        )
    })
}

/// What [`Store::conversation_histories`] reads for one task: its conversation's last
/// `limit` messages up to and including `up_to_message`.
#[derive(Debug, Clone, Copy)]
pub struct HistoryWant<'a> {
    pub task_id: i64,
    pub channel: &'a str,
    pub conversation_id: &'a str,
    pub up_to_message: i64,
    pub limit: i64,
}

impl Store {
    /// The reply context a platform stored with message `external_message_id`.
    pub async fn reply_context(
        &self,
        channel: &str,
        external_message_id: &str,
    ) -> StoreResult<Option<String>> {
        self.message_field("reply_context", channel, external_message_id)
            .await
    }

    /// The `traceparent` intake stored with message `external_message_id`.
    pub async fn trace_context(
        &self,
        channel: &str,
        external_message_id: &str,
    ) -> StoreResult<Option<String>> {
        self.message_field("trace_context", channel, external_message_id)
            .await
    }

    async fn message_field(
        &self,
        column: &'static str,
        channel: &str,
        external_message_id: &str,
    ) -> StoreResult<Option<String>> {
        let sql = format!(
            "SELECT {column} FROM im_message WHERE channel = $1 AND external_message_id = $2"
        );
        let row: Option<(Option<String>,)> = super::on_pool!(self, pool => {
            sqlx::query_as(&sql)
                .bind(channel)
                .bind(external_message_id)
                .fetch_optional(pool)
                .await?
        });
        Ok(row.and_then(|r| r.0))
    }

    /// Records that `key` on `channel` was handled (a Matrix transaction id); false when it
    /// already was, so a repeated delivery is a no-op.
    pub async fn record_inbound_once(
        &self,
        channel: &str,
        key: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let n = write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO inbound_once (channel, key, created_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (channel, key) DO NOTHING",
            )
            .bind(channel)
            .bind(key)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        });
        Ok(n == 1)
    }

    /// Whether `key` on `channel` was handled already.
    pub async fn inbound_seen(&self, channel: &str, key: &str) -> StoreResult<bool> {
        let row: Option<(i64,)> = super::on_pool!(self, pool => {
            sqlx::query_as("SELECT created_at FROM inbound_once WHERE channel = $1 AND key = $2")
                .bind(channel)
                .bind(key)
                .fetch_optional(pool)
                .await?
        });
        Ok(row.is_some())
    }

    /// Forgets handled keys recorded before `cutoff` (platforms stop retrying long before).
    pub async fn forget_inbound_before(&self, cutoff: i64) -> StoreResult<u64> {
        Ok(write_tx!(self, tx => {
            sqlx::query("DELETE FROM inbound_once WHERE created_at < $1")
                .bind(cutoff)
                .execute(&mut *tx)
                .await?
                .rows_affected()
        }))
    }
}

/// PostgreSQL's insert of a batch of new messages (`NOT EXISTS` on both platform keys), for
/// the tests of its plan; `None` on SQLite, which has only the `ON CONFLICT` form.
pub fn unseen_messages_sql(dialect: Dialect) -> Option<&'static str> {
    IntakeSql::get(dialect).messages_unseen.as_deref()
}

/// Whether two messages of `batch` share an event id or a message id on their channel (a
/// platform's retry arriving with its original, or one message under two events).
fn repeats_a_key(batch: &[(&NewMessage, &str)]) -> bool {
    let mut events = std::collections::HashSet::new();
    let mut messages = std::collections::HashSet::new();
    batch.iter().any(|(m, _)| {
        !events.insert((&m.channel, &m.event_id)) || !messages.insert((&m.channel, &m.message_id))
    })
}

/// The intake's batched inserts, per dialect: the rows come as one JSON array (`$1`, see
/// `sql::json_rows`), so the statement text stays the same for any batch size. `$2` is
/// the time.
struct IntakeSql {
    /// Messages; a row whose event or message id is stored already is skipped.
    messages: String,
    /// PostgreSQL: messages, by a plain insert of those whose keys no committed row holds
    /// (`NOT EXISTS`), for a batch without a key twice; a key committed meanwhile by another
    /// transaction fails it on the unique index. `None` on SQLite, whose single writer sees
    /// every committed key (and whose `ON CONFLICT` writes nothing extra).
    messages_unseen: Option<String>,
    /// Their PENDING tasks, with the ids their messages name (`$3` task type, `$4` status).
    tasks: String,
}

impl IntakeSql {
    fn get(dialect: Dialect) -> &'static IntakeSql {
        static SQL: PerDialect<IntakeSql> = PerDialect::new();
        SQL.get(dialect, IntakeSql::new)
    }

    fn new(sqlite: bool) -> IntakeSql {
        // The id its task will have, given with the message (issue 35 part 2: no index
        // over `agent_task.message_id`). PostgreSQL draws it from the task's sequence (a
        // duplicate's draw is a gap); SQLite has one writer, whose transaction inserts the
        // tasks next, so ids after the highest are free (`ord` is unique in a batch).
        let task_id = if sqlite {
            "(SELECT COALESCE(MAX(id), 0) FROM agent_task) + 1 + v.ord"
        } else {
            "nextval('agent_task_id_seq')"
        };
        let insert = format!(
            "INSERT INTO im_message (channel, external_event_id, external_message_id, \
             conversation_id, sender_id, sender_name, text, received_at, reply_context, \
             trace_context, task_id) SELECT v.channel, v.event_id, v.message_id, \
             v.conversation_id, v.sender_id, v.sender_name, v.text, $2, v.reply_context, \
             v.trace_context, {task_id} FROM {}",
            json_rows(
                sqlite,
                &[
                    ("ord", "bigint"),
                    ("channel", "text"),
                    ("event_id", "text"),
                    ("message_id", "text"),
                    ("conversation_id", "text"),
                    ("sender_id", "text"),
                    ("sender_name", "text"),
                    ("text", "text"),
                    ("reply_context", "text"),
                    ("trace_context", "text"),
                ],
            )
        );
        let returning = "RETURNING id, channel, external_event_id, task_id";
        let messages = format!("{insert} ORDER BY v.ord ON CONFLICT DO NOTHING {returning}");
        let messages_unseen = (!sqlite).then(|| {
            format!(
                "{insert} WHERE NOT EXISTS (SELECT 1 FROM im_message m \
                 WHERE m.channel = v.channel AND m.external_event_id = v.event_id{probe}) \
                 AND NOT EXISTS (SELECT 1 FROM im_message m \
                 WHERE m.channel = v.channel AND m.external_message_id = v.message_id{probe}) \
                 ORDER BY v.ord {returning}",
                probe = per_row(sqlite)
            )
        });
        let tasks = format!(
            "INSERT INTO agent_task (id, agent_id, agent_version_id, provider, task_type, \
             channel, conversation_id, message_id, trigger_user, status, run_after, \
             created_at, updated_at) SELECT v.id, v.agent_id, v.agent_version_id, v.provider, \
             $3, v.channel, v.conversation_id, v.message_id, v.trigger_user, $4, $2, $2, $2 \
             FROM {} ORDER BY v.ord",
            json_rows(
                sqlite,
                &[
                    ("ord", "bigint"),
                    ("id", "bigint"),
                    ("agent_id", "bigint"),
                    ("agent_version_id", "bigint"),
                    ("provider", "text"),
                    ("channel", "text"),
                    ("conversation_id", "text"),
                    ("message_id", "bigint"),
                    ("trigger_user", "text"),
                ],
            )
        );
        IntakeSql {
            messages,
            messages_unseen,
            tasks,
        }
    }
}
