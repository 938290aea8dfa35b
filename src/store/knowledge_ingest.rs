//! Background ingest jobs (docs/knowledge.md): a batch of documents committed with its job,
//! taken by one instance at a time under a lease, each document written with its item's
//! state and the job's progress in one transaction fenced by the claim. A crash loses
//! nothing and repeats nothing: a later claim goes on from the first pending item.

use super::{Store, StoreResult, on_pool, write_tx};

/// One document of a batch, as submitted.
#[derive(Debug, Clone)]
pub struct NewItem {
    pub doc_id: Option<String>,
    pub title: Option<String>,
    pub source_url: Option<String>,
    pub content_type: String,
    pub text: String,
}

/// A job as the API and the pages show it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct IngestRow {
    pub id: i64,
    pub collection_id: i64,
    /// `queued`, `running`, `done` or `failed`.
    pub state: String,
    pub documents: i64,
    pub done: i64,
    pub failed: i64,
    pub chunks: i64,
    pub error: Option<String>,
    pub actor: String,
    pub created_at: i64,
    pub updated_at: i64,
    pub finished_at: Option<i64>,
}

/// A job this instance has claimed: `version` fences every write made under the claim.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct IngestClaim {
    pub id: i64,
    pub collection_id: i64,
    pub version: i64,
    /// Claims since the job last made progress (this one included).
    pub claims: i64,
    pub actor: String,
}

/// A pending document of a claimed job.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ItemRow {
    pub id: i64,
    pub position: i64,
    pub doc_id: Option<String>,
    pub title: Option<String>,
    pub source_url: Option<String>,
    pub content_type: String,
    pub text: String,
}

/// A document of a job that could not be added.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ItemFailure {
    pub position: i64,
    pub doc_id: Option<String>,
    pub error: String,
}

/// Writing one item under a claim.
#[derive(Debug, Clone, Copy)]
pub struct IngestStep<'a> {
    pub job_id: i64,
    pub owner: &'a str,
    pub version: i64,
    pub item_id: i64,
    /// The claim's lease is extended to this with the write.
    pub lease_until: i64,
}

/// Inside a write transaction: counts `$step`'s item as `$state` (`done` or `failed`) in
/// its job, extends the lease and empties the item's text; `false` (nothing written) when
/// the job is no longer held under the step's claim.
macro_rules! step_done {
    ($tx:ident, $step:expr, $state:expr, $chunks:expr, $error:expr, $now:expr) => {{
        let step: &$crate::store::knowledge_ingest::IngestStep<'_> = $step;
        let failed = i64::from($state == "failed");
        let held = sqlx::query(
            "UPDATE knowledge_ingest SET done = done + 1 - $1, failed = failed + $1, \
             chunks = chunks + $2, claims = 0, lease_until = $3, updated_at = $4 \
             WHERE id = $5 AND owner = $6 AND version = $7 AND state = 'running'",
        )
        .bind(failed)
        .bind($chunks)
        .bind(step.lease_until)
        .bind($now)
        .bind(step.job_id)
        .bind(step.owner)
        .bind(step.version)
        .execute(&mut *$tx)
        .await?
        .rows_affected()
            == 1;
        if held {
            sqlx::query(
                "UPDATE knowledge_ingest_item SET state = $1, chunks = $2, error = $3, \
                 text = '' WHERE id = $4 AND state = 'pending'",
            )
            .bind($state)
            .bind($chunks)
            .bind($error)
            .bind(step.item_id)
            .execute(&mut *$tx)
            .await?;
        }
        held
    }};
}

pub(crate) use step_done;

const JOB_COLUMNS: &str = "id, collection_id, state, documents, done, failed, chunks, error, \
     actor, created_at, updated_at, finished_at";

/// Items inserted per statement when a batch is committed.
const INSERT_ROWS: usize = 200;

impl Store {
    /// Commits a job for `items` (all of them, or nothing) and returns its id.
    pub async fn create_ingest(
        &self,
        collection_id: i64,
        items: &[NewItem],
        actor: &str,
        now: i64,
    ) -> StoreResult<i64> {
        let id = write_tx!(self, tx => {
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO knowledge_ingest (collection_id, state, documents, actor, \
                 created_at, updated_at) VALUES ($1, 'queued', $2, $3, $4, $4) RETURNING id",
            )
            .bind(collection_id)
            .bind(items.len() as i64)
            .bind(actor)
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
            for (n, rows) in items.chunks(INSERT_ROWS).enumerate() {
                let mut insert = sqlx::QueryBuilder::new(
                    "INSERT INTO knowledge_ingest_item (ingest_id, position, doc_id, title, \
                     source_url, content_type, text, state) ",
                );
                insert.push_values(rows.iter().enumerate(), |mut row, (i, item)| {
                    row.push_bind(id)
                        .push_bind((n * INSERT_ROWS + i) as i64)
                        .push_bind(item.doc_id.as_deref())
                        .push_bind(item.title.as_deref())
                        .push_bind(item.source_url.as_deref())
                        .push_bind(item.content_type.as_str())
                        .push_bind(item.text.as_str())
                        .push_bind("pending");
                });
                insert.build().execute(&mut *tx).await?;
            }
            id
        });
        Ok(id)
    }

    /// Takes the oldest open job whose lease has run out (a queued one has none) and that no
    /// older open job of its collection waits before, for `owner` until `lease_until`; each
    /// claim raises the job's version, so writes made under an earlier claim no longer
    /// commit. A collection's jobs so run one after another in the order they were
    /// submitted: a document given again in a later job is never overwritten by its older
    /// text from an earlier job that was interrupted and resumed.
    pub async fn claim_ingest(
        &self,
        owner: &str,
        lease_until: i64,
        now: i64,
    ) -> StoreResult<Option<IngestClaim>> {
        // The outer conditions are checked again on the row PostgreSQL locks, so two
        // instances racing for one job cannot both take it; a later job of the collection
        // is not taken while an earlier one is open (both read the open jobs' index).
        let sql = "UPDATE knowledge_ingest SET state = 'running', owner = $1, \
             version = version + 1, claims = claims + 1, lease_until = $2, updated_at = $3 \
             WHERE id = (SELECT j.id FROM knowledge_ingest j \
             WHERE j.state IN ('queued', 'running') AND j.lease_until < $3 \
             AND NOT EXISTS (SELECT 1 FROM knowledge_ingest o \
             WHERE o.state IN ('queued', 'running') AND o.collection_id = j.collection_id \
             AND o.id < j.id) \
             ORDER BY j.id LIMIT 1) \
             AND state IN ('queued', 'running') AND lease_until < $3 \
             RETURNING id, collection_id, version, claims, actor";
        let claim = write_tx!(self, tx => {
            sqlx::query_as::<_, IngestClaim>(sql)
                .bind(owner)
                .bind(lease_until)
                .bind(now)
                .fetch_optional(&mut *tx)
                .await?
        });
        Ok(claim)
    }

    /// Up to `limit` pending documents of job `job_id`, in the order they were given.
    pub async fn pending_items(&self, job_id: i64, limit: i64) -> StoreResult<Vec<ItemRow>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, ItemRow>(
                "SELECT id, position, doc_id, title, source_url, content_type, text \
                 FROM knowledge_ingest_item WHERE ingest_id = $1 AND state = 'pending' \
                 ORDER BY position LIMIT $2",
            )
            .bind(job_id)
            .bind(limit)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Records that a document of a claimed job could not be added; `false` when the job
    /// is no longer held under the claim.
    pub async fn fail_item(
        &self,
        step: &IngestStep<'_>,
        error: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let held = write_tx!(self, tx => {
            step_done!(tx, step, "failed", 0_i64, Some(error), now)
        });
        Ok(held)
    }

    /// Extends a claim's lease; `false` when the job is no longer held under it.
    pub async fn renew_ingest(
        &self,
        job_id: i64,
        owner: &str,
        version: i64,
        lease_until: i64,
    ) -> StoreResult<bool> {
        let n = on_pool!(self, pool => {
            sqlx::query(
                "UPDATE knowledge_ingest SET lease_until = $1 \
                 WHERE id = $2 AND owner = $3 AND version = $4 AND state = 'running'",
            )
            .bind(lease_until)
            .bind(job_id)
            .bind(owner)
            .bind(version)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(n == 1)
    }

    /// Ends a claimed job as `done` (when no document is pending) or `failed` with
    /// `error`; `false` when it was not held under the claim or still has pending items.
    pub async fn finish_ingest(
        &self,
        claim: &IngestClaim,
        owner: &str,
        error: Option<&str>,
        now: i64,
    ) -> StoreResult<bool> {
        let state = if error.is_some() { "failed" } else { "done" };
        let n = on_pool!(self, pool => {
            sqlx::query(
                "UPDATE knowledge_ingest SET state = $1, error = $2, owner = NULL, \
                 lease_until = 0, finished_at = $3, updated_at = $3 \
                 WHERE id = $4 AND owner = $5 AND version = $6 AND state = 'running' \
                 AND ($2 IS NOT NULL OR NOT EXISTS (SELECT 1 FROM knowledge_ingest_item i \
                 WHERE i.ingest_id = $4 AND i.state = 'pending'))",
            )
            .bind(state)
            .bind(error)
            .bind(now)
            .bind(claim.id)
            .bind(owner)
            .bind(claim.version)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(n == 1)
    }

    /// Hands `owner`'s running jobs back at once (at start and at shutdown), so another
    /// claim need not wait for their leases.
    pub async fn release_ingests_of(&self, owner: &str) -> StoreResult<u64> {
        Ok(on_pool!(self, pool => {
            sqlx::query(
                "UPDATE knowledge_ingest SET lease_until = 0, owner = NULL \
                 WHERE owner = $1 AND state = 'running'",
            )
            .bind(owner)
            .execute(pool)
            .await?
            .rows_affected()
        }))
    }

    /// Job `id` of collection `collection_id`.
    pub async fn ingest(&self, collection_id: i64, id: i64) -> StoreResult<Option<IngestRow>> {
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM knowledge_ingest WHERE id = $1 AND collection_id = $2"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, IngestRow>(&sql)
                .bind(id)
                .bind(collection_id)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// The collection's latest job, if it ever had one.
    pub async fn latest_ingest(&self, collection_id: i64) -> StoreResult<Option<IngestRow>> {
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM knowledge_ingest WHERE collection_id = $1 \
             ORDER BY id DESC LIMIT 1"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, IngestRow>(&sql)
                .bind(collection_id)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// The first `limit` documents of job `id` that could not be added.
    pub async fn ingest_failures(&self, id: i64, limit: i64) -> StoreResult<Vec<ItemFailure>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, ItemFailure>(
                "SELECT position, doc_id, COALESCE(error, '') AS error \
                 FROM knowledge_ingest_item WHERE ingest_id = $1 AND state = 'failed' \
                 ORDER BY position LIMIT $2",
            )
            .bind(id)
            .bind(limit)
            .fetch_all(pool)
            .await?
        }))
    }
}
