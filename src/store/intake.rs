//! Message intake: the message, its task and the TASK_CREATED audit row commit together or
//! not at all. Duplicates are refused by the unique keys of `im_message`, never by a cache.

use super::{Store, StoreError, StoreResult, TASK_NOTIFY_CHANNEL, write_tx};
use crate::domain::{AuditEvent, TaskStatus, TaskType};

/// A chat message as a channel parsed it.
#[derive(Debug, Clone)]
pub struct NewMessage {
    pub channel: String,
    pub event_id: String,
    pub message_id: String,
    pub conversation_id: String,
    pub sender_id: String,
    pub sender_name: Option<String>,
    pub text: String,
    /// What the platform needs later to answer this message (JSON), e.g. DingTalk's
    /// session webhook.
    pub reply_context: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ingested {
    pub task_id: i64,
    pub duplicate: bool,
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
        let notify = matches!(self, Store::Postgres(_));
        let ingested = write_tx!(self, tx => {
            let inserted: Option<(i64,)> = sqlx::query_as(
                "INSERT INTO im_message (channel, external_event_id, external_message_id, \
                 conversation_id, sender_id, sender_name, text, received_at, reply_context) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING RETURNING id",
            )
            .bind(&message.channel)
            .bind(&message.event_id)
            .bind(&message.message_id)
            .bind(&message.conversation_id)
            .bind(&message.sender_id)
            .bind(&message.sender_name)
            .bind(&message.text)
            .bind(now)
            .bind(&message.reply_context)
            .fetch_optional(&mut *tx)
            .await?;
            match inserted {
                None => {
                    let (task_id,): (i64,) = sqlx::query_as(
                        "SELECT t.id FROM im_message m JOIN agent_task t ON t.message_id = m.id \
                         WHERE m.channel = $1 AND (m.external_message_id = $2 \
                         OR m.external_event_id = $3) ORDER BY t.id LIMIT 1",
                    )
                    .bind(&message.channel)
                    .bind(&message.message_id)
                    .bind(&message.event_id)
                    .fetch_one(&mut *tx)
                    .await?;
                    Ingested { task_id, duplicate: true }
                }
                Some((message_row,)) => {
                    let created: Option<(i64,)> = sqlx::query_as(
                        "INSERT INTO agent_task (agent_id, agent_version_id, task_type, channel, \
                         conversation_id, message_id, trigger_user, status, run_after, \
                         created_at, updated_at) \
                         SELECT a.id, a.current_version_id, $2, $3, $4, $5, $6, $7, $8, $8, $8 \
                         FROM agent a WHERE a.name = $1 AND a.current_version_id IS NOT NULL \
                         RETURNING id",
                    )
                    .bind(agent)
                    .bind(TaskType::ConversationReply)
                    .bind(&message.channel)
                    .bind(&message.conversation_id)
                    .bind(message_row)
                    .bind(&message.sender_id)
                    .bind(TaskStatus::Pending)
                    .bind(now)
                    .fetch_optional(&mut *tx)
                    .await?;
                    let Some((task_id,)) = created else {
                        return Err(StoreError::NotFound);
                    };
                    sqlx::query(
                        "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, \
                         created_at) VALUES ($1, $2, $3, $4, $5, $6)",
                    )
                    .bind(task_id)
                    .bind(AuditEvent::TaskCreated)
                    .bind(format!("{}:{}", message.channel, message.sender_id))
                    .bind(format!(
                        "message {} in conversation {}",
                        message.message_id, message.conversation_id
                    ))
                    .bind(false)
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
                    Ingested { task_id, duplicate: false }
                }
            }
        });
        Ok(ingested)
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
            sqlx::query_as(
                "SELECT m.id AS message_id, m.text, \
                 CASE WHEN t.status = 'SUCCEEDED' THEN t.result END AS answer \
                 FROM im_message m LEFT JOIN agent_task t ON t.message_id = m.id \
                 WHERE m.channel = $1 AND m.conversation_id = $2 AND m.id <= $3 \
                 ORDER BY m.id DESC LIMIT $4",
            )
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
}

impl Store {
    /// The reply context a platform stored with message `external_message_id`.
    pub async fn reply_context(
        &self,
        channel: &str,
        external_message_id: &str,
    ) -> StoreResult<Option<String>> {
        let row: Option<(Option<String>,)> = super::on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT reply_context FROM im_message WHERE channel = $1 AND external_message_id = $2",
            )
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
