-- Group messages not addressed to the bot, kept (the last `group_context` of each chat) as
-- context for the next question in that chat (issue 33). Retention deletes them with the
-- other bodies of their age.
CREATE TABLE group_context (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    channel     TEXT   NOT NULL,
    -- The platform's event: a message delivered again is kept once.
    event_id    TEXT   NOT NULL,
    chat_id     TEXT   NOT NULL,
    sender_id   TEXT   NOT NULL,
    sender_name TEXT,
    text        TEXT   NOT NULL,
    received_at INTEGER NOT NULL
);
CREATE UNIQUE INDEX group_context_event ON group_context (channel, event_id);
CREATE INDEX group_context_chat ON group_context (channel, chat_id, id);
CREATE INDEX group_context_age ON group_context (received_at);
