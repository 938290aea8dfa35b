-- Knowledge bases (issue 34): collections of documents, split into chunks that agents and
-- admins search. `terms` is a chunk's text as searched: lowercased words, Chinese and
-- Japanese runs cut into words (jieba), joined by spaces, so the database's own full-text
-- index (FTS5 here, tsvector on PostgreSQL) finds them. A document's chunks are replaced in
-- one transaction: nothing half-ingested is ever searchable.
CREATE TABLE knowledge_collection (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    name          TEXT    NOT NULL UNIQUE,
    chunk_chars   INTEGER NOT NULL,
    overlap_chars INTEGER NOT NULL,
    created_at    INTEGER NOT NULL
);
CREATE TABLE knowledge_document (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    collection_id INTEGER NOT NULL REFERENCES knowledge_collection (id),
    doc_id        TEXT    NOT NULL,
    title         TEXT    NOT NULL,
    source_url    TEXT,
    content_type  TEXT    NOT NULL,
    content_hash  TEXT    NOT NULL,
    bytes         INTEGER NOT NULL,
    chunks        INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);
CREATE UNIQUE INDEX knowledge_document_id ON knowledge_document (collection_id, doc_id);
CREATE TABLE knowledge_chunk (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    document_id   INTEGER NOT NULL REFERENCES knowledge_document (id),
    collection_id INTEGER NOT NULL,
    position      INTEGER NOT NULL,
    heading       TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    terms         TEXT    NOT NULL
);
CREATE INDEX knowledge_chunk_document ON knowledge_chunk (document_id, position);
-- The full-text index over `terms`, kept in step with the chunks by triggers.
CREATE VIRTUAL TABLE knowledge_fts USING fts5 (
    terms, content = 'knowledge_chunk', content_rowid = 'id', tokenize = 'unicode61'
);
CREATE TRIGGER knowledge_chunk_indexed AFTER INSERT ON knowledge_chunk BEGIN
    INSERT INTO knowledge_fts (rowid, terms) VALUES (new.id, new.terms);
END;
CREATE TRIGGER knowledge_chunk_unindexed AFTER DELETE ON knowledge_chunk BEGIN
    INSERT INTO knowledge_fts (knowledge_fts, rowid, terms) VALUES ('delete', old.id, old.terms);
END;
