//! What adding to or searching a knowledge base can fail with.

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum KnowledgeError {
    /// The request is wrong; nothing was written.
    #[error("{0}")]
    Invalid(String),
    #[error(
        "the document is {0} bytes; a document may have at most {1} (knowledge.max_document_bytes)"
    )]
    TooLarge(usize, usize),
    /// The embedding provider failed (after the retries its failure type gets).
    #[error("{message}")]
    Embedding { message: String, transient: bool },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl KnowledgeError {
    /// Whether another try later may succeed (a database or provider outage).
    pub fn is_transient(&self) -> bool {
        match self {
            KnowledgeError::Store(_) => true,
            KnowledgeError::Embedding { transient, .. } => *transient,
            _ => false,
        }
    }
}
