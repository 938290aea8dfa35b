-- Knowledge bases (issue 34): collections of documents, split into chunks that agents and
-- admins search. `terms` is a chunk's text as searched: lowercased words, Chinese and
-- Japanese runs cut into words (jieba), joined by spaces, so the database's own full-text
-- index (tsvector with a GIN index here, FTS5 on SQLite) finds them. A document's chunks are
-- replaced in one transaction: nothing half-ingested is ever searchable.
CREATE TABLE knowledge_collection (
    id            BIGSERIAL PRIMARY KEY,
    name          TEXT    NOT NULL UNIQUE,
    chunk_chars   BIGINT  NOT NULL,
    overlap_chars BIGINT  NOT NULL,
    created_at    BIGINT  NOT NULL
);
CREATE TABLE knowledge_document (
    id            BIGSERIAL PRIMARY KEY,
    collection_id BIGINT  NOT NULL REFERENCES knowledge_collection (id),
    doc_id        TEXT    NOT NULL,
    title         TEXT    NOT NULL,
    source_url    TEXT,
    content_type  TEXT    NOT NULL,
    content_hash  TEXT    NOT NULL,
    bytes         BIGINT  NOT NULL,
    chunks        BIGINT  NOT NULL,
    updated_at    BIGINT  NOT NULL
);
CREATE UNIQUE INDEX knowledge_document_id ON knowledge_document (collection_id, doc_id);
CREATE TABLE knowledge_chunk (
    id            BIGSERIAL PRIMARY KEY,
    document_id   BIGINT  NOT NULL REFERENCES knowledge_document (id),
    collection_id BIGINT  NOT NULL,
    position      BIGINT  NOT NULL,
    heading       TEXT    NOT NULL,
    text          TEXT    NOT NULL,
    terms         TEXT    NOT NULL,
    tsv           tsvector GENERATED ALWAYS AS (to_tsvector('simple', terms)) STORED
);
CREATE INDEX knowledge_chunk_document ON knowledge_chunk (document_id, position);
CREATE INDEX knowledge_chunk_tsv ON knowledge_chunk USING GIN (tsv);
