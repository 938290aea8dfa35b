-- Issue 35: the token rollups read a model call's model from its journalled request's first
-- bytes. A request is journalled with `model` as its first member (`llm::journal_text`), so
-- the model's JSON string is cut from the text's first kilobyte and parsed alone; `substr`
-- reads only that slice of a long (TOASTed) value. Before, each finish parsed every model
-- call's whole request of its tasks (`input::json`, then `->>` lexing the prompt up to the
-- key) inside the write transaction, and each summary request the live tasks' requests:
-- 2.4 ms for a 200 KB prompt on this project's machine, growing with the conversation.
-- Requests journalled before (members in other orders), or a model name over a kilobyte,
-- are parsed whole as before. One slice is read (an LZ4-compressed value stored apart is
-- fetched whole for each slice taken). Same values; `store::rollups::step_model` names it.
CREATE OR REPLACE FUNCTION step_model(input TEXT) RETURNS TEXT LANGUAGE sql IMMUTABLE AS $$
    SELECT COALESCE(
        (substring(substr(input, 1, 1024) from '^\{"model":("(?:[^"\\]|\\.)*")'))::json #>> '{}',
        CASE WHEN input LIKE '{%' THEN input::json ->> 'model' END)
$$;
