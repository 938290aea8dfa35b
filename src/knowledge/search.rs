//! Finding passages (docs/knowledge.md): the database's full-text ranking, and for a
//! collection that names an embedding provider also the chunks nearest to the question's
//! embedding, the two fused by reciprocal rank. Vectors live in the database; each instance
//! keeps a copy of a collection's vectors in memory, read again when the collection's
//! generation has moved (a document written or deleted by any instance).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::error::KnowledgeError;
use crate::config::Config;
use crate::llm::ModelClients;
use crate::store::Store;
use crate::store::knowledge::{Collection, Hit, NewChunk, vector_of};

/// The knowledge part's context: the store, the settings, the embedding providers and the
/// vectors this instance has read.
pub struct Knowledge {
    pub store: Store,
    pub config: Arc<Config>,
    pub llm: Arc<ModelClients>,
    vectors: Mutex<HashMap<i64, Arc<Vectors>>>,
    /// When this instance last began counting a collection's words (PostgreSQL).
    counted: Mutex<HashMap<i64, std::time::Instant>>,
}

/// A collection's vectors at one generation, each of unit length, one after another.
struct Vectors {
    generation: i64,
    dims: usize,
    ids: Vec<i64>,
    data: Vec<f32>,
}

/// What a search found, and how it ranked them.
#[derive(Debug, Clone)]
pub struct Found {
    pub hits: Vec<Hit>,
    /// `lexical` or `hybrid`.
    pub ranking: &'static str,
    /// Why a hybrid collection was searched by words alone this time, if it was.
    pub note: Option<String>,
    /// The question's words searched for, and those left out as too common.
    pub searched: Vec<String>,
    pub left_out: Vec<String>,
    /// Every searched word was common, so a passage had to hold all of them (then fewer).
    pub all_required: bool,
}

fn unit(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

impl Knowledge {
    pub fn new(store: Store, config: Arc<Config>, llm: Arc<ModelClients>) -> Knowledge {
        Knowledge {
            store,
            config,
            llm,
            vectors: Mutex::new(HashMap::new()),
            counted: Mutex::new(HashMap::new()),
        }
    }

    /// The embeddings of `texts` by the collection's provider, in batches of
    /// `knowledge.embedding_batch`; a failure of a type `[llm.retry]` retries is tried
    /// again as a model call would be, at most its `max_attempts` times.
    pub async fn embed(
        &self,
        collection: &Collection,
        texts: &[String],
    ) -> Result<Vec<Vec<f32>>, KnowledgeError> {
        let provider_name = collection.embedding_provider.as_deref().unwrap_or("");
        let model = collection.embedding_model.as_deref().unwrap_or("");
        let provider =
            self.llm
                .provider(provider_name)
                .ok_or_else(|| KnowledgeError::Embedding {
                    message: format!("embedding provider `{provider_name}` is not configured"),
                    transient: false,
                })?;
        let settings = &self.config.knowledge;
        let mut out = Vec::with_capacity(texts.len());
        for batch in texts.chunks(settings.embedding_batch.max(1)) {
            let mut attempt = 0;
            let vectors = loop {
                attempt += 1;
                match provider.embed(model, batch).await {
                    Ok(v) => break v,
                    Err(e) => {
                        let policy = self.config.llm.retry.policy(e.failure_type);
                        let again = policy.filter(|p| attempt < p.max_attempts);
                        let Some(p) = again else {
                            return Err(KnowledgeError::Embedding {
                                transient: policy.is_some(),
                                message: format!(
                                    "embedding ({}, try {attempt}): {}",
                                    e.failure_type.as_str(),
                                    e.message
                                ),
                            });
                        };
                        let max = Duration::from_secs(self.config.llm.retry_after_max_secs);
                        let wait = crate::backoff::delay(
                            attempt,
                            p.backoff_base_ms,
                            p.backoff_max_ms,
                            e.retry_after,
                            max,
                        );
                        tracing::warn!(collection = %collection.name, attempt, error = %e.message, "embedding failed; trying again");
                        tokio::time::sleep(wait).await;
                    }
                }
            };
            out.extend(vectors.into_iter().map(unit));
        }
        Ok(out)
    }

    /// What a chunk is embedded by: its document's title, heading path and text, cut to
    /// `knowledge.embedding_input_chars`.
    fn embedded_text(&self, title: &str, chunk: &NewChunk) -> String {
        let text = format!("{title}\n{}\n{}", chunk.heading, chunk.text);
        text.chars()
            .take(self.config.knowledge.embedding_input_chars.max(1))
            .collect()
    }

    /// Gives each chunk its vector when the collection embeds (else leaves them as they are).
    pub async fn embed_chunks(
        &self,
        collection: &Collection,
        title: &str,
        chunks: &mut [NewChunk],
    ) -> Result<(), KnowledgeError> {
        if collection.embedding_provider.is_none() {
            return Ok(());
        }
        let texts: Vec<String> = chunks
            .iter()
            .map(|c| self.embedded_text(title, c))
            .collect();
        let vectors = self.embed(collection, &texts).await?;
        for (chunk, vector) in chunks.iter_mut().zip(vectors) {
            chunk.embedding = Some(vector);
        }
        Ok(())
    }

    /// The collection's vectors as of its generation, read again only when it has moved.
    async fn vectors(&self, collection: &Collection) -> Result<Arc<Vectors>, KnowledgeError> {
        if let Some(held) = self.cached(collection) {
            return Ok(held);
        }
        let rows = self.store.collection_vectors(collection.id).await?;
        let mut dims = 0;
        let mut ids = Vec::with_capacity(rows.len());
        let mut data = Vec::new();
        for (id, bytes) in rows {
            let Some(v) = vector_of(&bytes) else { continue };
            if dims == 0 {
                dims = v.len();
            }
            if v.len() == dims {
                ids.push(id);
                data.extend(v);
            }
        }
        let loaded = Arc::new(Vectors {
            generation: collection.generation,
            dims,
            ids,
            data,
        });
        let mut held = self.vectors.lock().unwrap_or_else(|p| p.into_inner());
        held.insert(collection.id, loaded.clone());
        Ok(loaded)
    }

    fn cached(&self, collection: &Collection) -> Option<Arc<Vectors>> {
        let held = self.vectors.lock().unwrap_or_else(|p| p.into_inner());
        held.get(&collection.id)
            .filter(|v| v.generation == collection.generation)
            .cloned()
    }

    /// The `k` chunks that answer `question` best, each above the thresholds: words only,
    /// or (when the collection embeds) words and meaning fused by reciprocal rank.
    pub async fn search(
        &self,
        collection: &Collection,
        question: &str,
        k: usize,
    ) -> Result<Found, KnowledgeError> {
        let settings = &self.config.knowledge;
        let terms = super::terms::query_terms(question, 32);
        let plan = self.search_plan(collection, terms.clone()).await?;
        let searched: Vec<String> = plan.first().map(|(t, _)| t.clone()).unwrap_or_default();
        let left_out: Vec<String> = terms
            .into_iter()
            .filter(|t| !searched.contains(t))
            .collect();
        let all_required = plan.first().is_some_and(|(_, all)| *all);
        let wanted = if collection.embedding_provider.is_some() {
            settings.fusion_candidates.max(k)
        } else {
            k
        };
        let mut lexical: Vec<Hit> = Vec::new();
        for (terms, all) in plan {
            if lexical.len() >= wanted {
                break;
            }
            // A passage must hold all of several common words: the first
            // `common_only_candidates` that do are ranked, not every one.
            let candidates = all.then_some(settings.common_only_candidates as i64);
            let more = self
                .store
                .search_chunks_with(collection.id, &terms, all, candidates, wanted as i64)
                .await?;
            for hit in more {
                if lexical.len() < wanted && !lexical.iter().any(|h| h.chunk_id == hit.chunk_id) {
                    lexical.push(hit);
                }
            }
        }
        lexical.retain(|h| h.score > settings.min_score);
        let mut found = Found {
            hits: Vec::new(),
            ranking: "lexical",
            note: None,
            searched,
            left_out,
            all_required,
        };
        if collection.embedding_provider.is_none() {
            found.hits = lexical;
            return Ok(found);
        }
        let asked = self.embed(collection, &[question.to_string()]).await;
        let query = match asked.map(|v| v.into_iter().next()) {
            Ok(Some(query)) => query,
            failed => {
                // `embed` answers one vector per input: no vector is a failure too.
                let why = match failed {
                    Err(e) => e.to_string(),
                    _ => "the provider answered no vector".to_string(),
                };
                tracing::warn!(collection = %collection.name, error = %why, "searching by words alone: the question could not be embedded");
                lexical.truncate(k);
                found.hits = lexical;
                found.note = Some(why);
                return Ok(found);
            }
        };
        let vectors = self.vectors(collection).await?;
        let dense = nearest(&vectors, &query, wanted, settings.min_similarity);
        found.hits = self.fuse(lexical, &dense, settings.fusion_k, k).await?;
        found.ranking = "hybrid";
        Ok(found)
    }

    /// How to search for `terms`, as a list of tries (each: words, and whether a passage
    /// needs all of them), taken in turn until `k` passages are found. The words that tell
    /// passages apart are those held by at most `knowledge.common_term_share` of the
    /// chunks; of them the rarest first, as long as together they match at most
    /// `knowledge.max_ranked_chunks` (a common word ranks little and matches most of the
    /// collection, which then all has to be ranked). A question with no such word (each is
    /// common, or even its rarest matches more than that) needs all of its words in a
    /// passage, then its two rarest, then its rarest (each time the best of the first
    /// `knowledge.common_only_candidates` passages that hold them: by id on SQLite, in storage
    /// order on PostgreSQL).
    async fn search_plan(
        &self,
        collection: &Collection,
        terms: Vec<String>,
    ) -> Result<Vec<(Vec<String>, bool)>, KnowledgeError> {
        if terms.len() < 2 {
            return Ok(vec![(terms, false)]);
        }
        let counts = self.store.term_counts(collection.id, &terms).await?;
        if counts
            .generation
            .is_some_and(|g| g != collection.generation)
        {
            self.count_terms_later(collection);
        }
        let settings = &self.config.knowledge;
        // Without counts, or where ranking every chunk is within the budget: every word.
        if counts.total <= settings.max_ranked_chunks as i64 {
            return Ok(vec![(terms, false)]);
        }
        let held = |t: &String| counts.chunks.get(t).copied().unwrap_or(0);
        let mut by_rarity = terms;
        by_rarity.sort_by_key(held);
        let common = |t: &String| held(t) as f64 > settings.common_term_share * counts.total as f64;
        let mut telling = Vec::new();
        let mut matched = 0;
        for term in by_rarity.iter().filter(|t| !common(t)) {
            if matched + held(term) > settings.max_ranked_chunks as i64 {
                break;
            }
            matched += held(term);
            telling.push(term.clone());
        }
        if !telling.is_empty() {
            return Ok(vec![(telling, false)]);
        }
        let two: Vec<String> = by_rarity.iter().take(2).cloned().collect();
        let one: Vec<String> = by_rarity.iter().take(1).cloned().collect();
        Ok(vec![(by_rarity, true), (two, true), (one, true)])
    }

    /// PostgreSQL: counts the collection's words again in the background, at most once a
    /// minute per collection in this instance (the counts only make searches faster).
    fn count_terms_later(&self, collection: &Collection) {
        {
            let mut counted = self.counted.lock().unwrap_or_else(|p| p.into_inner());
            let now = std::time::Instant::now();
            if counted
                .get(&collection.id)
                .is_some_and(|at| now.duration_since(*at) < Duration::from_secs(60))
            {
                return;
            }
            counted.insert(collection.id, now);
        }
        let (store, id, name) = (self.store.clone(), collection.id, collection.name.clone());
        tokio::spawn(async move {
            if let Err(e) = store.count_terms(id).await {
                tracing::warn!(collection = %name, error = %e, "could not count the collection's words");
            }
        });
    }

    /// Counts the collection's words now (after an ingest job; PostgreSQL only).
    pub async fn count_terms(&self, collection_id: i64) -> Result<(), KnowledgeError> {
        self.counted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(collection_id, std::time::Instant::now());
        Ok(self.store.count_terms(collection_id).await?)
    }

    /// Reciprocal rank fusion: each chunk scores Σ 1 / (fusion_k + rank) over the rankings
    /// it is in; the best `k`.
    async fn fuse(
        &self,
        lexical: Vec<Hit>,
        dense: &[(i64, f32)],
        fusion_k: f64,
        k: usize,
    ) -> Result<Vec<Hit>, KnowledgeError> {
        let mut score: HashMap<i64, f64> = HashMap::new();
        for (rank, hit) in lexical.iter().enumerate() {
            *score.entry(hit.chunk_id).or_default() += 1.0 / (fusion_k + rank as f64 + 1.0);
        }
        for (rank, (id, _)) in dense.iter().enumerate() {
            *score.entry(*id).or_default() += 1.0 / (fusion_k + rank as f64 + 1.0);
        }
        let mut order: Vec<(i64, f64)> = score.into_iter().collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        order.truncate(k);
        let mut known: HashMap<i64, Hit> = lexical.into_iter().map(|h| (h.chunk_id, h)).collect();
        let missing: Vec<i64> = order
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !known.contains_key(id))
            .collect();
        for hit in self.store.chunk_hits(&missing).await? {
            known.insert(hit.chunk_id, hit);
        }
        Ok(order
            .into_iter()
            .filter_map(|(id, fused)| {
                known.remove(&id).map(|mut h| {
                    h.score = fused;
                    h
                })
            })
            .collect())
    }
}

/// The `n` chunks nearest to `query` (cosine: both are unit length), above `min`.
fn nearest(vectors: &Vectors, query: &[f32], n: usize, min: f64) -> Vec<(i64, f32)> {
    if vectors.dims == 0 || query.len() != vectors.dims {
        return Vec::new();
    }
    let query = unit(query.to_vec());
    let mut scored: Vec<(i64, f32)> = vectors
        .data
        .chunks_exact(vectors.dims)
        .zip(&vectors.ids)
        .map(|(v, id)| (*id, v.iter().zip(&query).map(|(a, b)| a * b).sum::<f32>()))
        .filter(|(_, s)| f64::from(*s) > min)
        .collect();
    let n = n.min(scored.len());
    if n == 0 {
        return Vec::new();
    }
    scored.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1));
    scored.truncate(n);
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    scored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_ranks_by_cosine_above_the_floor() {
        let vectors = Vectors {
            generation: 0,
            dims: 2,
            ids: vec![1, 2, 3],
            data: [
                unit(vec![1.0, 0.0]),
                unit(vec![1.0, 1.0]),
                unit(vec![-1.0, 0.0]),
            ]
            .concat(),
        };
        let found = nearest(&vectors, &[2.0, 0.1], 5, 0.0);
        let ids: Vec<i64> = found.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [1, 2], "the opposite vector is below the floor");
        assert!(
            nearest(&vectors, &[1.0, 0.0, 0.0], 5, 0.0).is_empty(),
            "other dims"
        );
    }
}
