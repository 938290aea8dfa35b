-- The task list's text search (issue 35): a case-insensitive substring of the message text,
-- found through a trigram index instead of a scan of every message. FTS5's trigram tokenizer
-- folds case by Unicode (`case_sensitive 0`, its default); a phrase of the query's trigrams
-- finds the messages holding it. Queries under three characters have no trigram and are
-- matched by a scan (Store::find_tasks).
CREATE VIRTUAL TABLE im_message_trigram USING fts5 (
    text, content = 'im_message', content_rowid = 'id', tokenize = 'trigram'
);
INSERT INTO im_message_trigram (im_message_trigram) VALUES ('rebuild');
CREATE TRIGGER im_message_searchable AFTER INSERT ON im_message BEGIN
    INSERT INTO im_message_trigram (rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER im_message_unsearchable AFTER DELETE ON im_message BEGIN
    INSERT INTO im_message_trigram (im_message_trigram, rowid, text) VALUES ('delete', old.id, old.text);
END;
-- Retention empties texts.
CREATE TRIGGER im_message_researchable AFTER UPDATE OF text ON im_message BEGIN
    INSERT INTO im_message_trigram (im_message_trigram, rowid, text) VALUES ('delete', old.id, old.text);
    INSERT INTO im_message_trigram (rowid, text) VALUES (new.id, new.text);
END;
