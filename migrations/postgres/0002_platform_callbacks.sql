-- Platform deliveries that are not messages but must be handled once (a Matrix transaction),
-- and the lookup of a sent reply by the platform's id for it (a Matrix reaction names the
-- event it reacts to).
CREATE TABLE inbound_once (
    channel     TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    created_at  BIGINT  NOT NULL,
    PRIMARY KEY (channel, key)
);
CREATE INDEX inbound_once_age ON inbound_once (created_at);

CREATE INDEX outbound_reply_platform_message ON outbound_reply (channel, platform_message_id)
    WHERE platform_message_id IS NOT NULL;
