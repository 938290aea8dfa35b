//! The `[knowledge]` section (docs/knowledge.md).

use std::collections::BTreeMap;

use serde::Deserialize;

/// Knowledge bases (docs/knowledge.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnowledgeConfig {
    /// Characters per chunk of a new collection.
    pub chunk_chars: usize,
    /// Characters of the chunk before that a later chunk of a section begins with.
    pub overlap_chars: usize,
    /// The largest document taken, in bytes.
    pub max_document_bytes: usize,
    /// The most results one search returns.
    pub max_results: usize,
    /// Passages an agent's answer is drawn from, at most.
    pub top_k: usize,
    /// Passages must score above this to be given to the model (the score's scale is the
    /// database's: bm25 on SQLite, ts_rank on PostgreSQL).
    pub min_score: f64,
    /// What an agent says when no passage answers the question (the model is not asked).
    pub unknown_answer: String,
    /// A question's word held by more than this share of a collection's chunks is not
    /// searched for (it ranks little and matches most of the collection).
    pub common_term_share: f64,
    /// A question's telling words are searched for, rarest first, only as long as together
    /// they are held by at most this many chunks (the ranking's work).
    pub max_ranked_chunks: usize,
    /// A question of common words only: the first this many chunks holding them are ranked
    /// (by id on SQLite, in storage order on PostgreSQL).
    pub common_only_candidates: usize,
    /// Chunks embedded per `/embeddings` call.
    pub embedding_batch: usize,
    /// Characters of a chunk (title, heading and text) given to the embedding model.
    pub embedding_input_chars: usize,
    /// Hybrid collections: a chunk must be at least this similar (cosine) to the question
    /// to be found by meaning.
    pub min_similarity: f64,
    /// Hybrid collections: chunks taken from each ranking before fusion.
    pub fusion_candidates: usize,
    /// Reciprocal rank fusion's constant (60 in the literature).
    pub fusion_k: f64,
    /// Documents one ingest job may hold.
    pub ingest_max_documents: usize,
    /// The largest ingest request body, in bytes.
    pub ingest_max_bytes: usize,
    /// How long a claimed ingest job stays with its instance without progress, in seconds.
    pub ingest_lease_secs: u64,
    /// How often idle instances look for ingest jobs, in milliseconds.
    pub ingest_poll_ms: u64,
    /// Claims of one job without progress before it is failed (a document that crashes the
    /// process each time ends here).
    pub ingest_max_claims: i64,
    /// How long reading one PDF's text may take, in milliseconds.
    pub pdf_timeout_ms: u64,
    /// The most pages of a PDF that is read.
    pub pdf_max_pages: usize,
    /// Collections created at start-up when missing.
    #[serde(default)]
    pub collections: BTreeMap<String, CollectionConfig>,
}

/// A collection declared in the config (`[knowledge.collections.<name>]`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectionConfig {
    /// This collection's chunk size (`knowledge.chunk_chars` when absent).
    #[serde(default)]
    pub chunk_chars: Option<usize>,
    /// This collection's overlap (`knowledge.overlap_chars` when absent).
    #[serde(default)]
    pub overlap_chars: Option<usize>,
    /// The provider whose `/embeddings` gives this collection dense vectors: `default` for
    /// `[llm]`, or a name of `[llm.providers]`; absent = lexical search only.
    #[serde(default)]
    pub embedding_provider: Option<String>,
    /// The embedding model (the provider's `model` when absent).
    #[serde(default)]
    pub embedding_model: Option<String>,
}

impl KnowledgeConfig {
    /// The chunk size and overlap of a collection declared as `declared` (or of one
    /// created through the API with no settings of its own).
    pub fn chunking(&self, declared: Option<&CollectionConfig>) -> (usize, usize) {
        let declared = declared.cloned().unwrap_or_default();
        (
            declared.chunk_chars.unwrap_or(self.chunk_chars),
            declared.overlap_chars.unwrap_or(self.overlap_chars),
        )
    }
}
