//! Group chatter kept as context (`group_context`): the messages of a group chat that were
//! not addressed to the bot, the last `channels.<platform>.group_context` of each chat, for
//! the next question there. Retention deletes them by age, as it empties other messages.

use super::{Store, StoreResult, on_pool, write_tx};

/// One kept message.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ContextMessage {
    pub sender_id: String,
    pub sender_name: Option<String>,
    pub text: String,
    pub received_at: i64,
}

/// A message to keep: its platform event, chat, sender and text.
pub struct Chatter<'a> {
    pub channel: &'a str,
    pub event_id: &'a str,
    pub chat_id: &'a str,
    pub sender_id: &'a str,
    pub sender_name: Option<&'a str>,
    pub text: &'a str,
}

impl Store {
    /// Keeps `chatter` (once per event) and forgets the chat's older messages beyond the
    /// newest `keep`.
    pub async fn keep_context(
        &self,
        chatter: &Chatter<'_>,
        keep: i64,
        now: i64,
    ) -> StoreResult<()> {
        // PostgreSQL text cannot hold U+0000; it is kept as U+FFFD, as message texts are.
        let storable = super::text::storable;
        write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO group_context (channel, event_id, chat_id, sender_id, sender_name, \
                 text, received_at) VALUES ($1, $7, $2, $3, $4, $5, $6) \
                 ON CONFLICT (channel, event_id) DO NOTHING",
            )
            .bind(chatter.channel)
            .bind(storable(chatter.chat_id))
            .bind(storable(chatter.sender_id))
            .bind(super::text::storable_opt(chatter.sender_name))
            .bind(storable(chatter.text))
            .bind(now)
            .bind(storable(chatter.event_id))
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "DELETE FROM group_context WHERE channel = $1 AND chat_id = $2 AND id NOT IN \
                 (SELECT id FROM group_context WHERE channel = $1 AND chat_id = $2 \
                  ORDER BY id DESC LIMIT $3)",
            )
            .bind(chatter.channel)
            .bind(storable(chatter.chat_id))
            .bind(keep)
            .execute(&mut *tx)
            .await?;
        });
        Ok(())
    }

    /// The newest `limit` messages kept in the chat up to `until` (ms), oldest first.
    pub async fn group_context(
        &self,
        channel: &str,
        chat_id: &str,
        until: i64,
        limit: i64,
    ) -> StoreResult<Vec<ContextMessage>> {
        let mut rows: Vec<ContextMessage> = on_pool!(self, pool => {
            sqlx::query_as(
                "SELECT sender_id, sender_name, text, received_at FROM group_context \
                 WHERE channel = $1 AND chat_id = $2 AND received_at <= $3 \
                 ORDER BY id DESC LIMIT $4",
            )
            .bind(channel)
            .bind(chat_id)
            .bind(until)
            .bind(limit)
            .fetch_all(pool)
            .await?
        });
        rows.reverse();
        Ok(rows)
    }

    /// Deletes up to `limit` kept messages received before `cutoff`; returns how many.
    pub async fn prune_group_context(&self, cutoff: i64, limit: i64) -> StoreResult<u64> {
        Ok(on_pool!(self, pool => {
            sqlx::query(
                "DELETE FROM group_context WHERE id IN \
                 (SELECT id FROM group_context WHERE received_at < $1 ORDER BY id LIMIT $2)",
            )
            .bind(cutoff)
            .bind(limit)
            .execute(pool)
            .await?
            .rows_affected()
        }))
    }
}
