//! Large step outputs by reference (`step_blob`): an output over `journal.inline_max_bytes`
//! is written here and the step keeps `{"$blob": <id>, "bytes": <n>}`; whoever reads steps
//! through the store (replay, the task API) gets the whole output back.

use serde_json::json;

use super::sql::in_json_ids;
use super::{Store, StoreResult, on_pool, write_tx};
use crate::domain::StepRow;

/// How a blob reference starts; an inline output that starts so is stored as a blob too,
/// so no output is ever mistaken for a reference.
const REFERENCE_PREFIX: &str = "{\"$blob\":";

/// Whether `output` must go to a blob rather than inline (over `inline_max` bytes, or
/// looking like a reference).
pub fn needs_blob(output: &str, inline_max: usize) -> bool {
    output.len() > inline_max || output.starts_with(REFERENCE_PREFIX)
}

/// The id a step output refers to, when it is a reference.
pub fn blob_id(output: &str) -> Option<i64> {
    if !output.starts_with(REFERENCE_PREFIX) {
        return None;
    }
    serde_json::from_str::<serde_json::Value>(output)
        .ok()?
        .get("$blob")?
        .as_i64()
}

impl Store {
    /// Keeps `body` (a step's whole output) and returns the reference the step stores.
    /// Written before the step's fenced completion: a completion that then fails leaves an
    /// unreferenced blob of the task, which retention removes with the task's bodies.
    pub async fn put_blob(
        &self,
        task_id: i64,
        step_id: i64,
        body: &str,
        now: i64,
    ) -> StoreResult<String> {
        let (id,): (i64,) = write_tx!(self, tx => {
            sqlx::query_as(
                "INSERT INTO step_blob (task_id, step_id, bytes, body, created_at) \
                 VALUES ($1, $2, $3, $4, $5) RETURNING id",
            )
            .bind(task_id)
            .bind(step_id)
            .bind(body.len() as i64)
            .bind(super::text::storable(body))
            .bind(now)
            .fetch_one(&mut *tx)
            .await?
        });
        Ok(json!({ "$blob": id, "bytes": body.len() }).to_string())
    }

    /// Replaces the blob references among `steps`' outputs by the outputs, in one query.
    pub async fn read_through_blobs(&self, steps: &mut [StepRow]) -> StoreResult<()> {
        let ids: Vec<i64> = steps
            .iter()
            .filter_map(|s| s.output.as_deref().and_then(blob_id))
            .collect();
        let bodies = self.blob_bodies(&ids).await?;
        for step in steps.iter_mut() {
            if let Some(id) = step.output.as_deref().and_then(blob_id)
                && let Some((_, body)) = bodies.iter().find(|(b, _)| *b == id)
            {
                step.output = Some(body.clone());
            }
        }
        Ok(())
    }

    /// The bodies of the blobs `ids` that are still kept, with their ids, in one query.
    pub async fn blob_bodies(&self, ids: &[i64]) -> StoreResult<Vec<(i64, String)>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT id, body FROM step_blob WHERE {}",
            in_json_ids(self.dialect(), "id")
        );
        let ids_json = serde_json::to_string(ids).unwrap_or_else(|_| "[]".into());
        Ok(on_pool!(self, pool => {
            sqlx::query_as(&sql).bind(&ids_json).fetch_all(pool).await?
        }))
    }

    /// Blobs kept for task `task_id` (tests and the task API).
    pub async fn blob_count(&self, task_id: i64) -> StoreResult<i64> {
        let (n,): (i64,) = on_pool!(self, pool => {
            sqlx::query_as("SELECT COUNT(*) FROM step_blob WHERE task_id = $1")
                .bind(task_id)
                .fetch_one(pool)
                .await?
        });
        Ok(n)
    }
}
