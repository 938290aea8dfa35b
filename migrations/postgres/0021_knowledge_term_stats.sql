-- How many chunks hold each word (issue 34): a question's words held by a large share of the
-- chunks ("the", a product's name in its own handbook) say little about which passage
-- answers it, and matching them ranks most of the collection. Search leaves them out.
-- PostgreSQL has no per-word count in its GIN index: the common words of a collection are
-- counted with ts_stat after its documents change, and kept here with the generation they
-- were counted at.
CREATE TABLE knowledge_term_stats (
    collection_id BIGINT NOT NULL REFERENCES knowledge_collection (id),
    term          TEXT   NOT NULL,
    chunks        BIGINT NOT NULL,
    PRIMARY KEY (collection_id, term)
);
ALTER TABLE knowledge_collection ADD COLUMN stats_generation BIGINT NOT NULL DEFAULT -1;
ALTER TABLE knowledge_collection ADD COLUMN stats_chunks BIGINT NOT NULL DEFAULT 0;
