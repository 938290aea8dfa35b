-- The W3C `traceparent` of the intake span that stored the message (only while traces are
-- exported, `[telemetry] otlp_endpoint`): the claim and the reply delivery continue its
-- trace, on whichever instance they run (issue 23).
ALTER TABLE im_message ADD COLUMN trace_context TEXT;
