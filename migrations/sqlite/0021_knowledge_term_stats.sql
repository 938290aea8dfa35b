-- How many chunks hold each word (issue 34): a question's words held by a large share of the
-- chunks ("the", a product's name in its own handbook) say little about which passage
-- answers it, and matching them ranks most of the collection. Search leaves them out.
-- SQLite reads the counts from FTS5's own vocabulary (always current, all collections).
CREATE VIRTUAL TABLE knowledge_vocab USING fts5vocab('knowledge_fts', 'row');
