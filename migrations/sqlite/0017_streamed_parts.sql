-- A streamed answer longer than one message goes on in its next parts while it is written,
-- on platforms that drop a repeated send by its key (issue 33): the platform message ids of
-- those parts (k ≥ 2), as a JSON object {"2": "<id>", ...} on the answer's row, so that the
-- answer edits them rather than sending them again.
ALTER TABLE outbound_reply ADD COLUMN streamed_parts TEXT;
