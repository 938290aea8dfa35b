//! The background ingest job's worker (docs/knowledge.md): each instance that runs workers
//! takes the oldest open job whose lease has run out and adds its documents one by one,
//! each with its item's state and the job's progress in one transaction fenced by the claim.
//! A document that cannot be added (bad HTML, no text) fails alone and the job goes on; a
//! job claimed `knowledge.ingest_max_claims` times without progress is failed, for an
//! admin to see (audit, the collection's ingest state).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{ContentType, Document, KnowledgeError};
use crate::config::Config;
use crate::domain::{AuditEvent, AuditTarget, now_ms};
use crate::store::Store;
use crate::store::knowledge::Collection;
use crate::store::knowledge_ingest::{IngestClaim, IngestStep, ItemRow};
use crate::wake::Wake;

/// Pending documents read at a time.
const BATCH: i64 = 16;

/// What the ingest worker needs.
pub struct Ingester {
    pub config: Arc<Config>,
    pub store: Store,
    pub knowledge: Arc<super::Knowledge>,
    pub instance_id: String,
    pub wake: Arc<Wake>,
}

/// How a claimed job's run ended.
#[derive(Debug, PartialEq, Eq)]
enum Run {
    Finished,
    /// Shut down, lost its claim, or the database failed: another claim goes on.
    Left,
}

impl Ingester {
    fn lease_until(&self) -> i64 {
        now_ms() + (self.config.knowledge.ingest_lease_secs.max(1) * 1000) as i64
    }

    /// Claims and runs one job; `false` when there was none to take.
    pub async fn run_once(&self, shutdown: &CancellationToken) -> anyhow::Result<bool> {
        let claim = self
            .store
            .claim_ingest(&self.instance_id, self.lease_until(), now_ms())
            .await?;
        let Some(claim) = claim else {
            return Ok(false);
        };
        let max = self.config.knowledge.ingest_max_claims.max(1);
        if claim.claims > max {
            let error = format!(
                "claimed {} times without adding a document (knowledge.ingest_max_claims = \
                 {max}); the next pending document may crash or stall the worker",
                claim.claims - 1
            );
            tracing::error!(ingest = claim.id, %error, "knowledge ingest given up");
            self.end(&claim, Some(&error)).await?;
            return Ok(true);
        }
        tracing::info!(
            ingest = claim.id,
            claims = claim.claims,
            "knowledge ingest claimed"
        );
        match self.run(&claim, shutdown).await {
            Ok(Run::Finished) => self.end(&claim, None).await?,
            Ok(Run::Left) => {}
            Err(e) => {
                // The lease runs out and a later claim goes on; counted as a claim without
                // progress only if no document was added meanwhile.
                tracing::warn!(ingest = claim.id, error = %e, "knowledge ingest interrupted");
            }
        }
        Ok(true)
    }

    /// Ends the job and audits how it ended.
    async fn end(&self, claim: &IngestClaim, error: Option<&str>) -> anyhow::Result<()> {
        // The collection's words are counted (PostgreSQL) before the job shows as done, so
        // searches after it find the counts; once, after the last job queued for it.
        let latest = self.store.latest_ingest(claim.collection_id).await?;
        if latest.is_none_or(|j| j.id == claim.id)
            && let Err(e) = self.knowledge.count_terms(claim.collection_id).await
        {
            tracing::warn!(ingest = claim.id, error = %e, "could not count the collection's words");
        }
        let now = now_ms();
        if !self
            .store
            .finish_ingest(claim, &self.instance_id, error, now)
            .await?
        {
            return Ok(());
        }
        let collection = self.store.collection_by_id(claim.collection_id).await?;
        let name = collection.map(|c| c.name).unwrap_or_default();
        let row = self.store.ingest(claim.collection_id, claim.id).await?;
        let (event, summary) = match (error, row) {
            (Some(error), _) => (
                AuditEvent::KnowledgeIngestFailed,
                format!("ingest {} failed: {error}", claim.id),
            ),
            (None, Some(row)) => (
                AuditEvent::KnowledgeIngestFinished,
                format!(
                    "ingest {}: {} documents added or unchanged, {} failed, {} chunks",
                    claim.id, row.done, row.failed, row.chunks
                ),
            ),
            (None, None) => return Ok(()),
        };
        tracing::info!(ingest = claim.id, collection = %name, %summary, "knowledge ingest ended");

        let target = Some(AuditTarget::Knowledge(name));
        self.store
            .audit(None, target, event, &claim.actor, &summary, false, now)
            .await?;
        Ok(())
    }

    async fn run(&self, claim: &IngestClaim, shutdown: &CancellationToken) -> anyhow::Result<Run> {
        let Some(collection) = self.store.collection_by_id(claim.collection_id).await? else {
            anyhow::bail!("collection {} is gone", claim.collection_id);
        };
        let collection = Arc::new(collection);
        loop {
            let items = self.store.pending_items(claim.id, BATCH).await?;
            if items.is_empty() {
                return Ok(Run::Finished);
            }
            for item in items {
                if shutdown.is_cancelled() {
                    return Ok(Run::Left);
                }
                if !self.add(claim, &collection, item).await? {
                    tracing::warn!(ingest = claim.id, "knowledge ingest lost its claim");
                    return Ok(Run::Left);
                }
            }
        }
    }

    /// Adds one document under the claim; `false` when the claim is lost.
    async fn add(
        &self,
        claim: &IngestClaim,
        collection: &Arc<Collection>,
        item: ItemRow,
    ) -> anyhow::Result<bool> {
        let config = self.config.clone();
        let on = collection.clone();
        let item_id = item.id;
        let position = item.position;
        // A PDF waits in base64 (`http/ingest.rs`) and is read here.
        let text = item.text;
        let read: Result<_, KnowledgeError> = async {
            let content_type = ContentType::parse(Some(&item.content_type))?;
            let body = if content_type.is_binary() {
                super::Body::of(content_type, None, Some(&text))?
            } else {
                super::Body::Text(text)
            };
            Ok((
                content_type,
                body.read(content_type, &config.knowledge).await?,
            ))
        }
        .await;
        // Chunking and word cutting are CPU work: off the runtime's threads.
        let prepared = tokio::task::spawn_blocking(move || {
            let (content_type, read) = read?;
            let doc = Document {
                id: item.doc_id.as_deref(),
                title: item.title.as_deref().or(read.title.as_deref()),
                source_url: item.source_url.as_deref(),
                content_type,
                text: &read.text,
            };
            super::prepare(&config.knowledge, &on, doc)
        })
        .await?;
        let step = IngestStep {
            job_id: claim.id,
            owner: &self.instance_id,
            version: claim.version,
            item_id,
            lease_until: self.lease_until(),
        };
        let now = now_ms();
        let prepared = match prepared {
            Ok(mut ready) => {
                // An unchanged document is not embedded again (its put writes nothing).
                let no_embedding = collection.embedding_provider.is_none()
                    || self
                        .store
                        .document_is(collection.id, &ready.id, &ready.hash)
                        .await?;
                if no_embedding {
                    Ok(ready)
                } else {
                    let embedded = self
                        .knowledge
                        .embed_chunks(collection, &ready.title, &mut ready.chunks)
                        .await;
                    embedded.map(|()| ready)
                }
            }
            Err(e) => Err(e),
        };
        match prepared {
            Ok(ready) => {
                let put = self
                    .store
                    .put_document_in(
                        collection.id,
                        &ready.document(),
                        &ready.chunks,
                        Some(&step),
                        now,
                    )
                    .await?;
                if let Some(outcome) = put {
                    tracing::debug!(ingest = claim.id, position, id = %ready.id, outcome = outcome.as_str(), "knowledge document put");
                }
                Ok(put.is_some())
            }
            Err(KnowledgeError::Store(e)) => Err(e.into()),
            // An outage of the embedding provider (after its retries): the document stays
            // pending, and a later claim tries again.
            Err(e) if e.is_transient() => Err(e.into()),
            Err(e) => {
                tracing::info!(ingest = claim.id, position, error = %e, "knowledge document refused");
                Ok(self.store.fail_item(&step, &e.to_string(), now).await?)
            }
        }
    }
}

/// Runs ingest jobs until `shutdown`: at once when one is submitted here, else every
/// `knowledge.ingest_poll_ms`. Leaves a job it is running at shutdown to the next claim.
pub async fn run_ingester(ingester: Arc<Ingester>, shutdown: CancellationToken) {
    let poll = Duration::from_millis(ingester.config.knowledge.ingest_poll_ms.max(10));
    while !shutdown.is_cancelled() {
        let wake = ingester.wake.knowledge.notified();
        match ingester.run_once(&shutdown).await {
            Ok(true) => continue,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "knowledge ingest: cannot claim a job"),
        }
        tokio::select! {
            _ = wake => {}
            _ = tokio::time::sleep(poll) => {}
            _ = shutdown.cancelled() => {}
        }
    }
    if let Err(e) = ingester
        .store
        .release_ingests_of(&ingester.instance_id)
        .await
    {
        tracing::warn!(error = %e, "knowledge ingest: could not release the job's lease");
    }
}
