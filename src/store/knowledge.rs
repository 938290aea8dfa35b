//! Knowledge bases: collections, their documents and the documents' chunks, searched by
//! each database's own full-text index (SQLite FTS5 with bm25, PostgreSQL tsvector with a
//! GIN index). The words searched (`terms`) are made by `knowledge::terms`, not here.

use std::collections::HashMap;

use super::knowledge_ingest::{IngestStep, step_done};
use super::{Store, StoreResult, on_pool, write_tx};

/// A collection and its chunking, as ingest and search need it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Collection {
    pub id: i64,
    pub name: String,
    pub chunk_chars: i64,
    pub overlap_chars: i64,
    pub created_at: i64,
    /// The `[llm]` provider (`""` for the default one) whose `/embeddings` makes this
    /// collection's vectors; `None`: lexical search only.
    pub embedding_provider: Option<String>,
    pub embedding_model: Option<String>,
    /// Goes up with every document written or deleted.
    pub generation: i64,
}

/// How a new collection embeds its chunks, if it does.
#[derive(Debug, Clone, Default)]
pub struct Embedding {
    pub provider: String,
    pub model: String,
}

/// A collection with its counts, for the admin API and pages (not for every question).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CollectionRow {
    #[sqlx(flatten)]
    pub collection: Collection,
    pub documents: i64,
    pub chunks: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DocumentRow {
    pub doc_id: String,
    pub title: String,
    pub source_url: Option<String>,
    pub content_type: String,
    pub bytes: i64,
    pub chunks: i64,
    pub updated_at: i64,
}

/// A document as ingested, and the hash of its content (an unchanged one costs nothing).
#[derive(Debug, Clone)]
pub struct NewDocument<'a> {
    pub doc_id: &'a str,
    pub title: &'a str,
    pub source_url: Option<&'a str>,
    pub content_type: &'a str,
    pub content_hash: &'a str,
    pub bytes: i64,
}

/// One chunk: its heading path, text and searched words, and its vector when the
/// collection embeds.
#[derive(Debug, Clone)]
pub struct NewChunk {
    pub heading: String,
    pub text: String,
    pub terms: String,
    pub embedding: Option<Vec<f32>>,
}

/// What putting a document did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Added,
    /// Its chunks were replaced (the content changed).
    Replaced,
    /// The same content was there already; nothing was written.
    Unchanged,
}

impl PutOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            PutOutcome::Added => "added",
            PutOutcome::Replaced => "replaced",
            PutOutcome::Unchanged => "unchanged",
        }
    }
}

/// A chunk found by a search, best first.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Hit {
    pub chunk_id: i64,
    pub doc_id: String,
    pub title: String,
    pub heading: String,
    pub source_url: Option<String>,
    pub text: String,
    /// Higher is better: bm25 (negated) on SQLite, `ts_rank` on PostgreSQL.
    pub score: f64,
}

/// Counted from the documents (each keeps its chunk count), never by scanning the chunks.
const COLLECTION_COLUMNS: &str = "c.id, c.name, c.chunk_chars, c.overlap_chars, c.created_at, \
     c.embedding_provider, c.embedding_model, c.generation, \
     (SELECT COUNT(*) FROM knowledge_document d WHERE d.collection_id = c.id) AS documents, \
     (SELECT CAST(COALESCE(SUM(d.chunks), 0) AS BIGINT) FROM knowledge_document d \
      WHERE d.collection_id = c.id) AS chunks";

/// A vector as stored: little-endian f32s.
pub fn vector_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A stored vector read back; `None` when its length is not a whole number of f32s.
pub fn vector_of(bytes: &[u8]) -> Option<Vec<f32>> {
    bytes.len().is_multiple_of(4).then(|| {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    })
}

/// Inside a write transaction: the collection's generation goes up (its vectors changed).
macro_rules! bump_generation {
    ($tx:ident, $collection_id:expr) => {
        sqlx::query("UPDATE knowledge_collection SET generation = generation + 1 WHERE id = $1")
            .bind($collection_id)
            .execute(&mut *$tx)
            .await?;
    };
}

impl Store {
    /// The vectors of collection `collection_id`'s chunks, with the chunk ids, and the
    /// generation they were read at (one transaction-consistent read).
    pub async fn collection_vectors(&self, collection_id: i64) -> StoreResult<Vec<(i64, Vec<u8>)>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, (i64, Vec<u8>)>(
                "SELECT id, embedding FROM knowledge_chunk \
                 WHERE collection_id = $1 AND embedding IS NOT NULL ORDER BY id",
            )
            .bind(collection_id)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Chunks by id, as search hits (score 0; the caller ranks them).
    pub async fn chunk_hits(&self, ids: &[i64]) -> StoreResult<Vec<Hit>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let marks: Vec<String> = (1..=ids.len()).map(|n| format!("${n}")).collect();
        let sql = format!(
            "SELECT c.id AS chunk_id, d.doc_id, d.title, c.heading, d.source_url, c.text, \
             CAST(0 AS DOUBLE PRECISION) AS score FROM knowledge_chunk c \
             JOIN knowledge_document d ON d.id = c.document_id WHERE c.id IN ({})",
            marks.join(", ")
        );
        Ok(on_pool!(self, pool => {
            let mut query = sqlx::query_as::<_, Hit>(&sql);
            for id in ids {
                query = query.bind(*id);
            }
            query.fetch_all(pool).await?
        }))
    }

    /// Creates collection `name`; `false` when it exists already (its settings kept).
    pub async fn create_collection(
        &self,
        name: &str,
        chunk_chars: i64,
        overlap_chars: i64,
        embedding: Option<&Embedding>,
        now: i64,
    ) -> StoreResult<bool> {
        let done = on_pool!(self, pool => {
            sqlx::query(
                "INSERT INTO knowledge_collection (name, chunk_chars, overlap_chars, created_at, \
                 embedding_provider, embedding_model) VALUES ($1, $2, $3, $4, $5, $6) \
                 ON CONFLICT (name) DO NOTHING",
            )
            .bind(name)
            .bind(chunk_chars)
            .bind(overlap_chars)
            .bind(now)
            .bind(embedding.map(|e| e.provider.as_str()))
            .bind(embedding.map(|e| e.model.as_str()))
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(done == 1)
    }

    /// Collection `name` (one indexed read: what a question or a new document needs).
    pub async fn collection(&self, name: &str) -> StoreResult<Option<Collection>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, Collection>(
                "SELECT id, name, chunk_chars, overlap_chars, created_at, embedding_provider, \
                 embedding_model, generation FROM knowledge_collection WHERE name = $1",
            )
            .bind(name)
            .fetch_optional(pool)
            .await?
        }))
    }

    /// Collection number `id` (an ingest job's).
    pub async fn collection_by_id(&self, id: i64) -> StoreResult<Option<Collection>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, Collection>(
                "SELECT id, name, chunk_chars, overlap_chars, created_at, embedding_provider, \
                 embedding_model, generation FROM knowledge_collection WHERE id = $1",
            )
            .bind(id)
            .fetch_optional(pool)
            .await?
        }))
    }

    /// Collection `name` with its counts.
    pub async fn collection_summary(&self, name: &str) -> StoreResult<Option<CollectionRow>> {
        let sql =
            format!("SELECT {COLLECTION_COLUMNS} FROM knowledge_collection c WHERE c.name = $1");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, CollectionRow>(&sql)
                .bind(name)
                .fetch_optional(pool)
                .await?
        }))
    }

    pub async fn collections(&self) -> StoreResult<Vec<CollectionRow>> {
        let sql =
            format!("SELECT {COLLECTION_COLUMNS} FROM knowledge_collection c ORDER BY c.name");
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, CollectionRow>(&sql).fetch_all(pool).await?
        }))
    }

    /// The collection's documents, by id.
    pub async fn documents(&self, collection_id: i64) -> StoreResult<Vec<DocumentRow>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, DocumentRow>(
                "SELECT doc_id, title, source_url, content_type, bytes, chunks, updated_at \
                 FROM knowledge_document WHERE collection_id = $1 ORDER BY doc_id",
            )
            .bind(collection_id)
            .fetch_all(pool)
            .await?
        }))
    }

    /// Puts a document and its chunks in one transaction: a new one is added; a changed one
    /// (another content hash) has its old chunks deleted and the new ones inserted; an
    /// unchanged one is left as it is.
    pub async fn put_document(
        &self,
        collection_id: i64,
        doc: &NewDocument<'_>,
        chunks: &[NewChunk],
        now: i64,
    ) -> StoreResult<PutOutcome> {
        let put = self.put_document_in(collection_id, doc, chunks, None, now);
        Ok(put.await?.unwrap_or(PutOutcome::Unchanged))
    }

    /// [`Store::put_document`] as one item of an ingest job: the item's state and the job's
    /// progress are written in the same transaction, which commits only while the job is
    /// still held under `step`'s claim (`None`: it was not, and nothing was written).
    pub async fn put_document_in(
        &self,
        collection_id: i64,
        doc: &NewDocument<'_>,
        chunks: &[NewChunk],
        step: Option<&IngestStep<'_>>,
        now: i64,
    ) -> StoreResult<Option<PutOutcome>> {
        let outcome = write_tx!(self, tx => {
            if let Some(step) = step {
                let outcome_chunks = chunks.len() as i64;
                if !step_done!(tx, step, "done", outcome_chunks, None::<&str>, now) {
                    return Ok(None);
                }
            }
            let existing: Option<(i64, String)> = sqlx::query_as(
                "SELECT id, content_hash FROM knowledge_document \
                 WHERE collection_id = $1 AND doc_id = $2",
            )
            .bind(collection_id)
            .bind(doc.doc_id)
            .fetch_optional(&mut *tx)
            .await?;
            let outcome = match existing {
                Some((_, hash)) if hash == doc.content_hash => PutOutcome::Unchanged,
                Some(_) => PutOutcome::Replaced,
                None => PutOutcome::Added,
            };
            if outcome != PutOutcome::Unchanged {
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO knowledge_document (collection_id, doc_id, title, source_url, \
                     content_type, content_hash, bytes, chunks, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                     ON CONFLICT (collection_id, doc_id) DO UPDATE SET title = excluded.title, \
                     source_url = excluded.source_url, content_type = excluded.content_type, \
                     content_hash = excluded.content_hash, bytes = excluded.bytes, \
                     chunks = excluded.chunks, updated_at = excluded.updated_at RETURNING id",
                )
                .bind(collection_id)
                .bind(doc.doc_id)
                .bind(doc.title)
                .bind(doc.source_url)
                .bind(doc.content_type)
                .bind(doc.content_hash)
                .bind(doc.bytes)
                .bind(chunks.len() as i64)
                .bind(now)
                .fetch_one(&mut *tx)
                .await?;
                // Whatever chunks the document had go, even when this transaction saw no
                // document: a concurrent put of the same id (read committed) may have
                // added it since, and its chunks must not stay beside these.
                sqlx::query("DELETE FROM knowledge_chunk WHERE document_id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                for (position, chunk) in chunks.iter().enumerate() {
                    sqlx::query(
                        "INSERT INTO knowledge_chunk (document_id, collection_id, position, \
                         heading, text, terms, embedding) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    )
                    .bind(id)
                    .bind(collection_id)
                    .bind(position as i64)
                    .bind(&chunk.heading)
                    .bind(&chunk.text)
                    .bind(&chunk.terms)
                    .bind(chunk.embedding.as_deref().map(vector_bytes))
                    .execute(&mut *tx)
                    .await?;
                }
                bump_generation!(tx, collection_id);
            }
            if let Some(step) = step {
                sqlx::query("UPDATE knowledge_ingest_item SET outcome = $1 WHERE id = $2")
                    .bind(outcome.as_str())
                    .bind(step.item_id)
                    .execute(&mut *tx)
                    .await?;
            }
            outcome
        });
        Ok(Some(outcome))
    }

    /// Whether document `doc_id` is held with content hash `hash` (then adding it again
    /// writes nothing, and need not be embedded again).
    pub async fn document_is(
        &self,
        collection_id: i64,
        doc_id: &str,
        hash: &str,
    ) -> StoreResult<bool> {
        let held: Option<String> = on_pool!(self, pool => {
            sqlx::query_scalar(
                "SELECT content_hash FROM knowledge_document WHERE collection_id = $1 AND doc_id = $2",
            )
            .bind(collection_id)
            .bind(doc_id)
            .fetch_optional(pool)
            .await?
        });
        Ok(held.as_deref() == Some(hash))
    }

    /// Deletes a document and its chunks; `false` when there was none.
    pub async fn delete_document(&self, collection_id: i64, doc_id: &str) -> StoreResult<bool> {
        let deleted = write_tx!(self, tx => {
            let id: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM knowledge_document WHERE collection_id = $1 AND doc_id = $2",
            )
            .bind(collection_id)
            .bind(doc_id)
            .fetch_optional(&mut *tx)
            .await?;
            match id {
                None => false,
                Some(id) => {
                    sqlx::query("DELETE FROM knowledge_chunk WHERE document_id = $1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query("DELETE FROM knowledge_document WHERE id = $1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    bump_generation!(tx, collection_id);
                    true
                }
            }
        });
        Ok(deleted)
    }

    /// The `k` chunks of the collection that match any of `terms` best, best first.
    pub async fn search_chunks(
        &self,
        collection_id: i64,
        terms: &[String],
        k: i64,
    ) -> StoreResult<Vec<Hit>> {
        self.search_chunks_with(collection_id, terms, false, None, k)
            .await
    }

    /// [`Store::search_chunks`]; with `all`, a chunk must hold every one of `terms`, and
    /// only the first `candidates` chunks that do are ranked, when given (SQLite: by id;
    /// PostgreSQL: as its index finds them, in storage order).
    pub async fn search_chunks_with(
        &self,
        collection_id: i64,
        terms: &[String],
        all: bool,
        candidates: Option<i64>,
        k: i64,
    ) -> StoreResult<Vec<Hit>> {
        if terms.is_empty() {
            return Ok(Vec::new());
        }
        // Every term is letters and digits only (`knowledge::terms`); quoted all the same.
        let hits = match self {
            Store::Sqlite(pool, _) => {
                let query: Vec<String> = terms.iter().map(|t| format!("\"{t}\"")).collect();
                let query = query.join(if all { " AND " } else { " OR " });
                let bound = match candidates {
                    // FTS5 walks its matches in rowid order and stops at the bound.
                    Some(n) => sqlx::query_scalar::<_, i64>(
                        "SELECT f.rowid FROM knowledge_fts f \
                         JOIN knowledge_chunk c ON c.id = f.rowid \
                         WHERE knowledge_fts MATCH $1 AND c.collection_id = $2 \
                         ORDER BY f.rowid LIMIT 1 OFFSET $3",
                    )
                    .bind(&query)
                    .bind(collection_id)
                    .bind(n.max(1) - 1)
                    .fetch_optional(pool)
                    .await?
                    .unwrap_or(i64::MAX),
                    None => i64::MAX,
                };
                sqlx::query_as::<_, Hit>(
                    "SELECT c.id AS chunk_id, d.doc_id, d.title, c.heading, d.source_url, c.text, \
                     -bm25(knowledge_fts) AS score \
                     FROM knowledge_fts JOIN knowledge_chunk c ON c.id = knowledge_fts.rowid \
                     JOIN knowledge_document d ON d.id = c.document_id \
                     WHERE knowledge_fts MATCH $1 AND c.collection_id = $2 \
                     AND knowledge_fts.rowid <= $4 \
                     ORDER BY bm25(knowledge_fts) LIMIT $3",
                )
                .bind(&query)
                .bind(collection_id)
                .bind(k)
                .bind(bound)
                .fetch_all(pool)
                .await?
            }
            Store::Postgres(pool) => {
                let query: Vec<String> = terms.iter().map(|t| format!("'{t}'")).collect();
                let query = query.join(if all { " & " } else { " | " });
                // The chunks to rank: every match, or the first `candidates` the index
                // yields, in storage order (no order asked, so the heap is read only that
                // far; ordering by id would read every match first).
                let limit = if candidates.is_some() { "LIMIT $4" } else { "" };
                // Ranked on the narrow rows; texts and documents read for the best `k` only.
                let sql = format!(
                    "WITH q AS (SELECT to_tsquery('simple', $1) AS q), \
                     matched AS MATERIALIZED (SELECT id, tsv FROM knowledge_chunk, q \
                     WHERE collection_id = $2 AND tsv @@ q.q {limit}), \
                     best AS (SELECT id, ts_rank(tsv, q.q, 1)::float8 AS score FROM matched, q \
                     ORDER BY score DESC, id LIMIT $3) \
                     SELECT c.id AS chunk_id, d.doc_id, d.title, c.heading, d.source_url, c.text, \
                     best.score FROM best JOIN knowledge_chunk c ON c.id = best.id \
                     JOIN knowledge_document d ON d.id = c.document_id \
                     ORDER BY best.score DESC, c.id"
                );
                let mut ranked = sqlx::query_as::<_, Hit>(&sql)
                    .bind(&query)
                    .bind(collection_id)
                    .bind(k);
                if let Some(n) = candidates {
                    ranked = ranked.bind(n);
                }
                ranked.fetch_all(pool).await?
            }
        };
        Ok(hits)
    }
}

/// How many chunks hold each of some words, out of how many.
#[derive(Debug, Clone, Default)]
pub struct TermCounts {
    pub chunks: HashMap<String, i64>,
    /// The chunks counted over (0: no counts yet).
    pub total: i64,
    /// PostgreSQL: the collection's generation the counts were made at (`None` on SQLite,
    /// whose counts are always current).
    pub generation: Option<i64>,
}

/// Words held by at least this share of a collection's chunks are kept by the PostgreSQL
/// count (rarer ones are absent, and count as rare).
const COUNTED_SHARE: f64 = 0.005;

impl Store {
    /// How many chunks hold each of `terms`: on SQLite from FTS5's vocabulary (over all
    /// collections), on PostgreSQL from the collection's last count.
    pub async fn term_counts(
        &self,
        collection_id: i64,
        terms: &[String],
    ) -> StoreResult<TermCounts> {
        if terms.is_empty() {
            return Ok(TermCounts::default());
        }
        let marks: Vec<String> = (1..=terms.len()).map(|n| format!("${n}")).collect();
        let counts = match self {
            Store::Sqlite(pool, _) => {
                let sql = format!(
                    "SELECT term, doc FROM knowledge_vocab WHERE term IN ({})",
                    marks.join(", ")
                );
                let mut query = sqlx::query_as::<_, (String, i64)>(&sql);
                for t in terms {
                    query = query.bind(t);
                }
                let rows = query.fetch_all(pool).await?;
                let total: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM knowledge_chunk")
                    .fetch_one(pool)
                    .await?;
                TermCounts {
                    chunks: rows.into_iter().collect(),
                    total,
                    generation: None,
                }
            }
            Store::Postgres(pool) => {
                let (total, generation): (i64, i64) = sqlx::query_as(
                    "SELECT stats_chunks, stats_generation FROM knowledge_collection WHERE id = $1",
                )
                .bind(collection_id)
                .fetch_one(pool)
                .await?;
                let rows: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT term, chunks FROM knowledge_term_stats \
                     WHERE collection_id = $1 AND term = ANY($2)",
                )
                .bind(collection_id)
                .bind(terms)
                .fetch_all(pool)
                .await?;
                TermCounts {
                    chunks: rows.into_iter().collect(),
                    total,
                    generation: Some(generation),
                }
            }
        };
        Ok(counts)
    }

    /// PostgreSQL: counts the collection's common words again (ts_stat over its chunks) and
    /// records the generation counted at; nothing to do on SQLite.
    pub async fn count_terms(&self, collection_id: i64) -> StoreResult<()> {
        let Store::Postgres(pool) = self else {
            return Ok(());
        };
        let mut tx = pool.begin().await?;
        let (generation, total): (i64, i64) = sqlx::query_as(
            "SELECT c.generation, (SELECT COUNT(*) FROM knowledge_chunk k \
             WHERE k.collection_id = c.id) FROM knowledge_collection c WHERE c.id = $1",
        )
        .bind(collection_id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM knowledge_term_stats WHERE collection_id = $1")
            .bind(collection_id)
            .execute(&mut *tx)
            .await?;
        // ts_stat takes the query as text: the id is a number formatted here, not input.
        let counted = format!(
            "SELECT tsv FROM knowledge_chunk WHERE collection_id = {}",
            collection_id
        );
        sqlx::query(
            "INSERT INTO knowledge_term_stats (collection_id, term, chunks) \
             SELECT $1, word, ndoc FROM ts_stat($2) WHERE ndoc >= $3",
        )
        .bind(collection_id)
        .bind(counted)
        .bind(((total as f64) * COUNTED_SHARE).ceil().max(2.0) as i64)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE knowledge_collection SET stats_generation = $1, stats_chunks = $2 \
             WHERE id = $3",
        )
        .bind(generation)
        .bind(total)
        .bind(collection_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}
