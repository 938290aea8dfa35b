//! Knowledge bases (docs/knowledge.md): an admin adds documents to a collection; each is
//! split by its structure into chunks (`chunk.rs`), each chunk's words (`terms.rs`: Chinese
//! and Japanese cut by jieba) are indexed by the database's own full-text search
//! (`store/knowledge.rs`), and a question finds the best chunks, for agents and admins alike.

pub mod chunk;
mod error;
pub mod ingest;
pub mod pdf;
pub mod search;
pub mod terms;

pub use error::KnowledgeError;
pub use search::{Found, Knowledge};

use chunk::{HEADING_MARK, Structure};

use sha2::{Digest, Sha256};

use crate::config::KnowledgeConfig;
use crate::store::knowledge::{Collection, Embedding, Hit, NewChunk, NewDocument, PutOutcome};
use crate::store::{Store, StoreError};

/// The formats a document may come in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentType {
    Text,
    Markdown,
    Html,
    /// Sent as the file's bytes; a [`Document`]'s text is what [`pdf::text_of`] extracted
    /// (which also gives its title: its headings are page numbers).
    Pdf,
}

impl ContentType {
    /// `text/plain` (the default), `text/markdown`, `text/html` or `application/pdf`,
    /// parameters ignored.
    pub fn parse(given: Option<&str>) -> Result<ContentType, KnowledgeError> {
        let Some(given) = given else {
            return Ok(ContentType::Text);
        };
        let essence = given
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match essence.as_str() {
            "" | "text/plain" => Ok(ContentType::Text),
            "text/markdown" | "text/x-markdown" => Ok(ContentType::Markdown),
            "text/html" => Ok(ContentType::Html),
            "application/pdf" => Ok(ContentType::Pdf),
            other => Err(KnowledgeError::Invalid(format!(
                "content_type `{other}` is not taken; use text/plain, text/markdown, text/html \
                 or application/pdf"
            ))),
        }
    }

    /// The format a file's name says (`.md`, `.html`, `.pdf`; anything else is plain text).
    pub fn of_path(path: &std::path::Path) -> ContentType {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("md" | "markdown") => ContentType::Markdown,
            Some("html" | "htm") => ContentType::Html,
            Some("pdf") => ContentType::Pdf,
            _ => ContentType::Text,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ContentType::Text => "text/plain",
            ContentType::Markdown => "text/markdown",
            ContentType::Html => "text/html",
            ContentType::Pdf => "application/pdf",
        }
    }

    /// Whether the document is sent as bytes rather than text (a file part, or
    /// `content_base64`).
    pub fn is_binary(self) -> bool {
        self == ContentType::Pdf
    }
}

/// A document's body as a request sends it: text, or a file's bytes.
#[derive(Debug)]
pub enum Body {
    Text(String),
    Bytes(Vec<u8>),
}

impl Body {
    /// The body from a request's `text` or `content_base64` (one of them; a binary format
    /// only as bytes).
    pub fn of(
        content_type: ContentType,
        text: Option<String>,
        base64: Option<&str>,
    ) -> Result<Body, KnowledgeError> {
        use base64::Engine as _;
        let invalid = |m: String| Err(KnowledgeError::Invalid(m));
        match (text, base64) {
            (Some(_), Some(_)) => invalid("give `text` or `content_base64`, not both".into()),
            (Some(_), None) if content_type.is_binary() => invalid(format!(
                "a {} document is sent as `content_base64` (or a multipart `file`), not as `text`",
                content_type.as_str()
            )),
            (Some(text), None) => Ok(Body::Text(text)),
            (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .map(Body::Bytes)
                .or_else(|e| invalid(format!("`content_base64` is not base64: {e}"))),
            (None, None) => invalid("`text` (or `content_base64`) is required".into()),
        }
    }
}

impl Body {
    /// The document's text: a file's bytes read by their format ([`text_of_bytes`]).
    pub async fn read(
        self,
        content_type: ContentType,
        config: &KnowledgeConfig,
    ) -> Result<Extracted, KnowledgeError> {
        match self {
            Body::Text(text) => Ok(Extracted { text, title: None }),
            Body::Bytes(bytes) => text_of_bytes(content_type, bytes, config).await,
        }
    }
}

/// A document's text as read from what was sent, and the title the file itself gives (a
/// PDF's metadata or first line), if any.
#[derive(Debug, Clone)]
pub struct Extracted {
    pub text: String,
    pub title: Option<String>,
}

/// A file's bytes as UTF-8 text.
pub fn utf8_text(bytes: Vec<u8>) -> Result<String, KnowledgeError> {
    String::from_utf8(bytes)
        .map_err(|_| KnowledgeError::Invalid("the file is not UTF-8 text".into()))
}

/// The text of a document sent as a file's bytes: a PDF's pages (`pdf.rs`), any other
/// format as UTF-8.
pub async fn text_of_bytes(
    content_type: ContentType,
    bytes: Vec<u8>,
    config: &KnowledgeConfig,
) -> Result<Extracted, KnowledgeError> {
    if content_type == ContentType::Pdf {
        let timeout = std::time::Duration::from_millis(config.pdf_timeout_ms);
        return pdf::text_of(
            bytes,
            config.max_document_bytes,
            config.pdf_max_pages,
            timeout,
        )
        .await;
    }
    Ok(Extracted {
        text: utf8_text(bytes)?,
        title: None,
    })
}

/// A document to add: only `text` is needed.
#[derive(Debug, Clone, Copy)]
pub struct Document<'a> {
    pub id: Option<&'a str>,
    pub title: Option<&'a str>,
    pub source_url: Option<&'a str>,
    pub content_type: ContentType,
    pub text: &'a str,
}

/// What adding a document did.
#[derive(Debug, Clone)]
pub struct Ingested {
    pub id: String,
    pub title: String,
    pub chunks: usize,
    pub outcome: PutOutcome,
}

/// The longest document id and title taken.
const MAX_ID_BYTES: usize = 512;
const MAX_TITLE_CHARS: usize = 300;

/// The text a document is chunked from, and how it marks its headings: HTML is rendered to
/// text by html2text (headings as `#` lines), each heading marked first, since its code
/// blocks come out as plain lines that may begin with `#` too.
fn readable(doc: &Document<'_>) -> Result<(String, Structure), KnowledgeError> {
    static HEADING: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)(<h([1-6])(?:\s[^>]*)?>)").expect("a valid pattern")
    });
    match doc.content_type {
        ContentType::Text => Ok((doc.text.to_string(), Structure::Plain)),
        ContentType::Markdown => Ok((doc.text.to_string(), Structure::Markdown)),
        // Already text, with its pages as marked headings.
        ContentType::Pdf => Ok((doc.text.to_string(), Structure::Marked)),
        ContentType::Html => {
            let marked = HEADING.replace_all(doc.text, |c: &regex::Captures<'_>| {
                format!("{}{HEADING_MARK}{}", &c[1], &c[2])
            });
            html2text::config::plain_no_decorate()
                .string_from_read(marked.as_bytes(), 10_000)
                .map(|text| (text, Structure::Marked))
                .map_err(|e| KnowledgeError::Invalid(format!("the HTML cannot be read: {e}")))
        }
    }
}

/// A title from the text: its first heading, else its first line.
fn title_of(text: &str, structure: Structure) -> Option<String> {
    let lines = || text.lines().map(str::trim).filter(|l| !l.is_empty());
    let heading = lines().find(|l| match structure {
        Structure::Marked => l.contains(HEADING_MARK),
        _ => l.starts_with('#'),
    });
    let line = heading.or_else(|| lines().next())?;
    let line = match line.split_once(HEADING_MARK) {
        // The mark and the level digit after it.
        Some((_, rest)) => rest.get(1..).unwrap_or(""),
        None => line.trim_start_matches('#'),
    };
    let line = line
        .replace("[¶]", "")
        .replace(['¶', '[', ']'], "")
        .replace('\u{a0}', " ");
    let line = line.trim();
    (!line.is_empty()).then(|| line.chars().take(120).collect())
}

/// Refuses a document that cannot be added (size, empty text, bad id, title or URL).
pub fn check(doc: &Document<'_>, config: &KnowledgeConfig) -> Result<(), KnowledgeError> {
    if doc.text.len() > config.max_document_bytes {
        return Err(KnowledgeError::TooLarge(
            doc.text.len(),
            config.max_document_bytes,
        ));
    }
    if doc.text.trim().is_empty() {
        return Err(KnowledgeError::Invalid("`text` is empty".into()));
    }
    check_fields(doc)
}

/// Refuses a document whose id, title or source URL cannot be taken (its text aside).
pub fn check_fields(doc: &Document<'_>) -> Result<(), KnowledgeError> {
    let invalid = |m: &str| Err(KnowledgeError::Invalid(m.to_string()));
    if let Some(id) = doc.id
        && (id.trim().is_empty() || id.len() > MAX_ID_BYTES || id.chars().any(char::is_control))
    {
        return invalid("`id` must be 1 to 512 bytes without control characters");
    }
    if doc
        .title
        .is_some_and(|t| t.chars().count() > MAX_TITLE_CHARS)
    {
        return invalid("`title` may have at most 300 characters");
    }
    if let Some(link) = doc.source_url {
        let ok = url::Url::parse(link).is_ok_and(|u| matches!(u.scheme(), "http" | "https"));
        if !ok {
            return invalid("`source_url` must be an http or https URL");
        }
    }
    Ok(())
}

/// A document made ready to be written: its id, title, content hash and chunks.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub id: String,
    pub title: String,
    pub source_url: Option<String>,
    pub content_type: ContentType,
    pub hash: String,
    pub bytes: usize,
    pub chunks: Vec<NewChunk>,
}

impl Prepared {
    pub fn document(&self) -> NewDocument<'_> {
        NewDocument {
            doc_id: &self.id,
            title: &self.title,
            source_url: self.source_url.as_deref(),
            content_type: self.content_type.as_str(),
            content_hash: &self.hash,
            bytes: self.bytes as i64,
        }
    }
}

/// Checks `doc` and cuts it into chunks with `collection`'s settings (CPU only: no I/O).
pub fn prepare(
    config: &KnowledgeConfig,
    collection: &Collection,
    doc: Document<'_>,
) -> Result<Prepared, KnowledgeError> {
    check(&doc, config)?;
    let (text, structure) = readable(&doc)?;
    let digest = |parts: &[&str]| {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update(part.as_bytes());
            hash.update([0]);
        }
        hex::encode(hash.finalize())
    };
    // The text is hashed once: the default id, and (with the rest) the content hash.
    let text_hash = digest(&[doc.text]);
    let id = match doc.id {
        Some(id) => id.trim().to_string(),
        None => format!("sha256:{}", &text_hash[..16]),
    };
    let title = doc
        .title
        .map(str::to_string)
        .or_else(|| title_of(&text, structure))
        .unwrap_or_else(|| id.clone());
    // A change of chunking or of embedding model makes the document new.
    let settings = format!(
        "{}/{}/{}/{}",
        collection.chunk_chars,
        collection.overlap_chars,
        collection.embedding_provider.as_deref().unwrap_or("-"),
        collection.embedding_model.as_deref().unwrap_or("-"),
    );
    let hash = digest(&[
        doc.content_type.as_str(),
        &title,
        doc.source_url.unwrap_or(""),
        &settings,
        &text_hash,
    ]);
    let pieces = chunk::chunks(
        &text,
        structure,
        collection.chunk_chars.max(1) as usize,
        collection.overlap_chars.max(0) as usize,
    );
    let chunks: Vec<NewChunk> = pieces
        .into_iter()
        .map(|p| {
            let searched = format!("{title}\n{}\n{}", p.heading, p.text);
            NewChunk {
                terms: terms::terms(&searched).join(" "),
                heading: p.heading,
                text: p.text,
                embedding: None,
            }
        })
        .collect();
    if chunks.is_empty() {
        return Err(KnowledgeError::Invalid(
            "the document has no text to search".into(),
        ));
    }
    Ok(Prepared {
        id,
        title,
        source_url: doc.source_url.map(str::to_string),
        content_type: doc.content_type,
        hash,
        bytes: doc.text.len(),
        chunks,
    })
}

/// Adds `doc` to `collection`, replacing the chunks of a changed document with the same id
/// in one transaction; an unchanged one (the same content and settings) costs one read.
/// A collection with an embedding provider embeds the chunks first.
pub async fn ingest(
    knowledge: &Knowledge,
    collection: &Collection,
    doc: Document<'_>,
    now: i64,
) -> Result<Ingested, KnowledgeError> {
    let mut ready = prepare(&knowledge.config.knowledge, collection, doc)?;
    let store = &knowledge.store;
    if collection.embedding_provider.is_some()
        && store
            .document_is(collection.id, &ready.id, &ready.hash)
            .await?
    {
        return Ok(Ingested {
            id: ready.id,
            title: ready.title,
            chunks: ready.chunks.len(),
            outcome: PutOutcome::Unchanged,
        });
    }
    knowledge
        .embed_chunks(collection, &ready.title, &mut ready.chunks)
        .await?;
    let outcome = store
        .put_document(collection.id, &ready.document(), &ready.chunks, now)
        .await?;
    Ok(Ingested {
        id: ready.id,
        title: ready.title,
        chunks: ready.chunks.len(),
        outcome,
    })
}

/// The `k` chunks of `collection` whose words match `question` best, best first, with no
/// threshold and no vectors (what the database's full-text index alone ranks).
pub async fn search_words(
    store: &Store,
    collection: &Collection,
    question: &str,
    k: usize,
) -> Result<Vec<Hit>, KnowledgeError> {
    let terms = terms::query_terms(question, 32);
    Ok(store.search_chunks(collection.id, &terms, k as i64).await?)
}

/// How a declared collection embeds, if it does (`default` names `[llm]` itself, stored
/// as the empty provider name).
pub fn embedding_of(declared: &crate::config::CollectionConfig) -> Option<Embedding> {
    declared.embedding_provider.as_deref().map(|p| Embedding {
        provider: if p == "default" {
            String::new()
        } else {
            p.to_string()
        },
        model: declared.embedding_model.clone().unwrap_or_default(),
    })
}

/// Creates the collections the config declares (`knowledge.collections`) that are missing;
/// an existing one keeps its settings.
pub async fn create_configured_collections(
    store: &Store,
    config: &KnowledgeConfig,
) -> Result<(), StoreError> {
    for (name, declared) in &config.collections {
        let (chunk, overlap) = config.chunking(Some(declared));
        let embedding = embedding_of(declared);
        let now = crate::domain::now_ms();
        if store
            .create_collection(name, chunk as i64, overlap as i64, embedding.as_ref(), now)
            .await?
        {
            tracing::info!(collection = %name, "created knowledge collection");
        } else if let Some(have) = store.collection(name).await? {
            let want = embedding
                .as_ref()
                .map(|e| (e.provider.as_str(), e.model.as_str()));
            let held = have
                .embedding_provider
                .as_deref()
                .map(|p| (p, have.embedding_model.as_deref().unwrap_or("")));
            if want != held {
                tracing::warn!(collection = %name, "the configured embedding differs from the collection's; the collection keeps its own (create a new collection to change it)");
            }
        }
    }
    Ok(())
}

/// What adding files did.
#[derive(Debug, Clone, Default)]
pub struct AddReport {
    pub added: usize,
    pub replaced: usize,
    pub unchanged: usize,
    pub failed: usize,
    pub chunks: usize,
}

/// The extensions a folder's files are taken by.
const FILE_EXTENSIONS: [&str; 6] = ["txt", "md", "markdown", "html", "htm", "pdf"];

/// The files to add for each path given, with their ids: a file as given; a folder's files
/// (recursively, by extension, in name order) by their path below it.
fn files_of(paths: &[std::path::PathBuf]) -> std::io::Result<Vec<(std::path::PathBuf, String)>> {
    let mut out = Vec::new();
    for root in paths {
        if root.is_file() {
            out.push((root.clone(), root.to_string_lossy().into_owned()));
            continue;
        }
        let mut stack = vec![root.clone()];
        let mut found = Vec::new();
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                if path.is_dir() {
                    stack.push(path);
                } else if path
                    .extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| FILE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
                {
                    found.push(path);
                }
            }
        }
        found.sort();
        for path in found {
            let id = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            out.push((path, id));
        }
    }
    Ok(out)
}

/// Adds files and folders to collection `name` (created with the configured chunking when
/// missing), one document per file, each in its own transaction; `report` gets a line per
/// file. A file that cannot be read or is refused counts as failed, and the rest go on.
pub async fn add_files(
    knowledge: &Knowledge,
    name: &str,
    paths: &[std::path::PathBuf],
    mut report: impl FnMut(&str),
) -> anyhow::Result<AddReport> {
    if !crate::domain::is_valid_name(name) {
        anyhow::bail!("`{name}`: collection names are 1 to 64 letters, digits, '-' or '_'");
    }
    let (store, config) = (&knowledge.store, &knowledge.config.knowledge);
    let declared = config.collections.get(name);
    let (chunk, overlap) = config.chunking(declared);
    let embedding = declared.and_then(embedding_of);
    let now = crate::domain::now_ms();
    store
        .create_collection(name, chunk as i64, overlap as i64, embedding.as_ref(), now)
        .await?;
    let collection = store
        .collection(name)
        .await?
        .ok_or_else(|| anyhow::anyhow!("collection `{name}` vanished"))?;
    let mut done = AddReport::default();
    for (path, id) in files_of(paths)? {
        let content_type = ContentType::of_path(&path);
        let read = match std::fs::read(&path) {
            Ok(bytes) => text_of_bytes(content_type, bytes, config).await,
            Err(e) => Err(KnowledgeError::Invalid(e.to_string())),
        };
        let read = match read {
            Ok(read) => read,
            Err(e) => {
                done.failed += 1;
                report(&format!("{id}: failed: {e}"));
                continue;
            }
        };
        let doc = Document {
            id: Some(&id),
            title: read.title.as_deref(),
            source_url: None,
            content_type,
            text: &read.text,
        };
        match ingest(knowledge, &collection, doc, crate::domain::now_ms()).await {
            Ok(ingested) => {
                match ingested.outcome {
                    PutOutcome::Added => done.added += 1,
                    PutOutcome::Replaced => done.replaced += 1,
                    PutOutcome::Unchanged => done.unchanged += 1,
                }
                if ingested.outcome != PutOutcome::Unchanged {
                    done.chunks += ingested.chunks;
                    let summary = format!(
                        "document `{id}` {} ({} chunks)",
                        ingested.outcome.as_str(),
                        ingested.chunks
                    );
                    let target = Some(crate::domain::AuditTarget::Knowledge(name.to_string()));
                    let event = crate::domain::AuditEvent::KnowledgeDocumentPut;
                    let now = crate::domain::now_ms();
                    store
                        .audit(None, target, event, "admin:cli", &summary, false, now)
                        .await?;
                }
                report(&format!(
                    "{id}: {} ({} chunks)",
                    ingested.outcome.as_str(),
                    ingested.chunks
                ));
            }
            Err(KnowledgeError::Store(e)) => return Err(e.into()),
            Err(e) => {
                done.failed += 1;
                report(&format!("{id}: failed: {e}"));
            }
        }
    }
    Ok(done)
}
