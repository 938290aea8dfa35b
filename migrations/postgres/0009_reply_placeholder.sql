-- A placeholder message that becomes the answer (docs/replies.md, "Placeholder and edits").
-- `placeholder` = 1 while the row's content is the placeholder a slow run shows; the
-- task's answer replaces it in the same row (same reply key). `edit` = 1 when the content
-- must be shown by editing the message already sent (`platform_message_id`) rather than
-- by sending a new one. `send_key` is the key the platform sees when it is not the reply
-- key: the answer of a placeholder whose send is in doubt goes as a new message under
-- `<reply key>-answer`, so a platform that drops repeated keys does not drop it.
ALTER TABLE outbound_reply ADD COLUMN placeholder INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_reply ADD COLUMN edit INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_reply ADD COLUMN send_key TEXT;
