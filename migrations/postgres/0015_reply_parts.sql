-- A reply longer than its platform allows goes as numbered parts, each under its own key
-- (`<key>`, `<key>-part-2`, ...): the count of parts the platform has accepted, so a
-- delivery resumed after a crash sends only the missing parts (issue 33).
ALTER TABLE outbound_reply ADD COLUMN parts_sent BIGINT NOT NULL DEFAULT 0;
