-- Issue 35: the token rollups read a model call's model from its journalled request's first
-- bytes. A request is journalled with `model` as its first member (`llm::journal_text`), so
-- the model's JSON string is cut from the text's start and parsed alone, not the whole
-- prompt after it, which grows with the conversation (a finish parsed every call's request
-- of its task twice: `json_valid`, then `json_extract`, inside the write transaction).
-- Requests journalled before, or a model name over a kilobyte, are parsed whole as before.
-- The string runs to the first `",` after it; where that quote is escaped, the cut is not
-- valid JSON and the whole text is parsed instead. The same expression as
-- `store::rollups::step_model`; the triggers are those of 0023 with it.
DROP TRIGGER task_rollup_finish;
DROP TRIGGER task_rollup_unfinish;
DROP TRIGGER task_rollup_insert;
DROP TRIGGER task_rollup_delete;

CREATE TRIGGER task_rollup_finish AFTER UPDATE OF status, failure_type, claim_count, resume_count ON agent_task
WHEN NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
    AND (OLD.status IS NOT NEW.status OR OLD.failure_type IS NOT NEW.failure_type
         OR OLD.claim_count IS NOT NEW.claim_count OR OLD.resume_count IS NOT NEW.resume_count)
BEGIN
    INSERT INTO task_rollup SELECT NEW.created_at / 3600000, NEW.agent_id,
        NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END), ''),
        0, 1, MAX(NEW.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, 1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = NEW.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE(CASE WHEN substr(s.input, 1, 10) = '{"model":"' AND json_valid('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']')
            THEN json_extract('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']', '$[0]')
            WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, 1 * COUNT(*), 1 * SUM(s.tokens_in), 1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = NEW.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER task_rollup_unfinish AFTER UPDATE OF status, failure_type, claim_count, resume_count ON agent_task
WHEN OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
    AND (OLD.status IS NOT NEW.status OR OLD.failure_type IS NOT NEW.failure_type
         OR OLD.claim_count IS NOT NEW.claim_count OR OLD.resume_count IS NOT NEW.resume_count)
BEGIN
    INSERT INTO task_rollup SELECT OLD.created_at / 3600000, OLD.agent_id,
        OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END), ''),
        0, -1, -MAX(OLD.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, -1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = OLD.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE(CASE WHEN substr(s.input, 1, 10) = '{"model":"' AND json_valid('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']')
            THEN json_extract('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']', '$[0]')
            WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, -1 * COUNT(*), -1 * SUM(s.tokens_in), -1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = OLD.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER task_rollup_insert AFTER INSERT ON agent_task
WHEN NEW.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
BEGIN
    INSERT INTO task_rollup SELECT NEW.created_at / 3600000, NEW.agent_id,
        NEW.agent_version_id, NEW.channel, NEW.status, COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END), ''),
        0, 1, MAX(NEW.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, 1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || NEW.id || CASE WHEN NEW.resume_count = 0 THEN '' ELSE '-r' || NEW.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = NEW.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT NEW.created_at / 3600000, NEW.agent_id, NEW.channel,
        COALESCE(NEW.failure_type, ''),
        COALESCE(CASE WHEN substr(s.input, 1, 10) = '{"model":"' AND json_valid('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']')
            THEN json_extract('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']', '$[0]')
            WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, 1 * COUNT(*), 1 * SUM(s.tokens_in), 1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = NEW.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;

CREATE TRIGGER task_rollup_delete AFTER DELETE ON agent_task
WHEN OLD.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
BEGIN
    INSERT INTO task_rollup SELECT OLD.created_at / 3600000, OLD.agent_id,
        OLD.agent_version_id, OLD.channel, OLD.status, COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT CASE WHEN r.status = 'SENT' AND r.placeholder = 0 THEN 'DELIVERED' WHEN r.status = 'SENT' THEN 'PENDING' ELSE r.status END FROM outbound_reply r
            WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END), ''),
        0, -1, -MAX(OLD.claim_count - 1, 0) WHERE true
    ON CONFLICT DO UPDATE SET tasks = tasks + excluded.tasks,
        takeovers = takeovers + excluded.takeovers;
    INSERT INTO latency_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= r.sent_at - m.received_at),
            (SELECT MAX(le) FROM latency_bound)), 0, -1
    FROM outbound_reply r, im_message m
    WHERE r.idempotency_key = 'agent-task-' || OLD.id || CASE WHEN OLD.resume_count = 0 THEN '' ELSE '-r' || OLD.resume_count END
        AND r.status = 'SENT' AND r.placeholder = 0 AND m.id = OLD.message_id
    ON CONFLICT DO UPDATE SET answers = answers + excluded.answers;
    INSERT INTO token_rollup SELECT OLD.created_at / 3600000, OLD.agent_id, OLD.channel,
        COALESCE(OLD.failure_type, ''),
        COALESCE(CASE WHEN substr(s.input, 1, 10) = '{"model":"' AND json_valid('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']')
            THEN json_extract('[' || substr(s.input, 10, instr(substr(s.input, 11, 1024), '",') + 1) || ']', '$[0]')
            WHEN json_valid(s.input) THEN json_extract(s.input, '$.model') END, ''),
        0, -1 * COUNT(*), -1 * SUM(s.tokens_in), -1 * COALESCE(SUM(s.tokens_out), 0)
    FROM agent_step s WHERE s.task_id = OLD.id AND s.step_type = 'llm' AND s.tokens_in IS NOT NULL
    GROUP BY 5
    ON CONFLICT DO UPDATE SET calls = calls + excluded.calls,
        prompt_tokens = prompt_tokens + excluded.prompt_tokens,
        completion_tokens = completion_tokens + excluded.completion_tokens;
END;
