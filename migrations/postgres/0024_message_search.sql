-- The task list's text search (issue 35): a case-insensitive substring of the message text,
-- found through a trigram index (pg_trgm, shipped with PostgreSQL and trusted: a database
-- owner may create it) instead of a scan of every message. The text is lowercased under
-- the ICU root collation, so case folds by Unicode whatever the database's locale.
CREATE EXTENSION IF NOT EXISTS pg_trgm;
CREATE INDEX im_message_trigram ON im_message
    USING gin (lower(text COLLATE "und-x-icu") gin_trgm_ops);
