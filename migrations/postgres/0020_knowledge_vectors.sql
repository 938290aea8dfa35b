-- Dense vectors for knowledge collections that name an embedding provider (issue 34): each
-- chunk's embedding (little-endian f32, unit length), written with the chunk. A collection's
-- generation goes up with every document written or deleted, so a cache of its vectors in
-- an instance knows when to read them again.
ALTER TABLE knowledge_collection ADD COLUMN embedding_provider TEXT;
ALTER TABLE knowledge_collection ADD COLUMN embedding_model TEXT;
ALTER TABLE knowledge_collection ADD COLUMN generation BIGINT NOT NULL DEFAULT 0;
ALTER TABLE knowledge_chunk ADD COLUMN embedding BYTEA;
