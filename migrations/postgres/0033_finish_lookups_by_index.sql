-- Issue 35 part 2: what a finishing batch looks up, it finds through an index, whatever the
-- statistics say (`auto_explain` of an `end-to-end` run found each of these answered by a
-- sequential scan of the whole table, hashed, once per finishing batch).

-- 1. The placeholders a finish turns into answers (`replace_placeholders`). A live
-- placeholder is rare and short-lived (it becomes its answer at the finish), so this index
-- is small; no update on the answer path changes `placeholder` but that replacement, which
-- is not HOT anyway.
CREATE INDEX outbound_reply_placeholder ON outbound_reply (task_id, idempotency_key)
WHERE placeholder = 1;

-- 2. The finishing statement's rollup trigger looks each finished task's answer and llm
-- steps up per task: migration 0034, which rewrites that function anyway.
