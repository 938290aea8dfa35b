-- Background ingest jobs (issue 34): a batch of documents is committed with its job, then a
-- worker of any instance takes the job under a lease and adds the documents one by one, each
-- document's chunks, its item's state and the job's progress in one fenced transaction. A
-- crash loses nothing: another claim (after the lease) goes on from the first pending item,
-- and a document put twice is replaced, never doubled.
CREATE TABLE knowledge_ingest (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    collection_id INTEGER NOT NULL REFERENCES knowledge_collection (id),
    state         TEXT    NOT NULL,          -- queued, running, done, failed
    documents     INTEGER NOT NULL,
    done          INTEGER NOT NULL DEFAULT 0,
    failed        INTEGER NOT NULL DEFAULT 0,
    chunks        INTEGER NOT NULL DEFAULT 0,
    error         TEXT,
    owner         TEXT,
    version       INTEGER NOT NULL DEFAULT 0,
    lease_until   INTEGER NOT NULL DEFAULT 0,
    claims        INTEGER NOT NULL DEFAULT 0,
    actor         TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL,
    finished_at   INTEGER
);
CREATE INDEX knowledge_ingest_open ON knowledge_ingest (lease_until, id)
    WHERE state IN ('queued', 'running');
CREATE INDEX knowledge_ingest_collection ON knowledge_ingest (collection_id, id);
CREATE TABLE knowledge_ingest_item (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    ingest_id     INTEGER NOT NULL REFERENCES knowledge_ingest (id),
    position      INTEGER NOT NULL,
    doc_id        TEXT,
    title         TEXT,
    source_url    TEXT,
    content_type  TEXT    NOT NULL,
    -- Emptied once the document is in (the chunks hold it then).
    text          TEXT    NOT NULL,
    state         TEXT    NOT NULL,          -- pending, done, failed
    outcome       TEXT,                      -- added, replaced, unchanged
    chunks        INTEGER NOT NULL DEFAULT 0,
    error         TEXT
);
CREATE INDEX knowledge_ingest_item_pending ON knowledge_ingest_item (ingest_id, position)
    WHERE state = 'pending';
CREATE INDEX knowledge_ingest_item_failed ON knowledge_ingest_item (ingest_id, position)
    WHERE state = 'failed';
