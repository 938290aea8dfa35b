//! The bench's mock model: OpenAI chat completions as strict clients read them, with a
//! context window it enforces as OpenAI does.

use serde_json::{Value, json};

/// ASSISTD_BENCH_ANSWER_CHARS: the mock model's answers run to about that many characters
/// (prose-like words, so PostgreSQL compresses them about as it would a real answer), for
/// the cost of a long answer along the path; unset: the short "answer to: …".
pub(crate) fn answer_chars() -> usize {
    std::env::var("ASSISTD_BENCH_ANSWER_CHARS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The mock model's context window, in tokens as assistd estimates them; assistd is told it
/// (`llm.context_window`).
pub(crate) const MODEL_WINDOW: usize = 8192;

/// The refusal a model gives a request whose prompt and `max_tokens` together exceed its
/// window (OpenAI's `context_length_exceeded` error, which assistd classifies as
/// CONTEXT_TOO_LONG), counted with assistd's token estimate; `None` when it fits.
pub(crate) fn over_window(body: &Value) -> Option<Value> {
    let messages = body["messages"].as_array()?;
    let prompt: usize = messages
        .iter()
        .map(|m| assistd::llm::estimate_tokens(m["content"].as_str().unwrap_or("")))
        .sum();
    let asked = prompt + requested_tokens(body);
    (asked > MODEL_WINDOW).then(|| {
        json!({"error": {
            "message": format!(
                "This model's maximum context length is {MODEL_WINDOW} tokens. However, you \
                 requested {asked} tokens. Please reduce the length of the messages."
            ),
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
    })
}

/// The answer's limit a request asks for (`max_tokens`, or `max_completion_tokens`).
fn requested_tokens(body: &Value) -> usize {
    body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_completion_tokens"].as_u64())
        .unwrap_or(16) as usize
}

/// The mock model's answer to the chat request `body`, a whole chat completion as strict
/// clients (async-openai's types) read it: `long_answer` to the last message, held to the
/// request's `max_tokens` as a model is (cut, `finish_reason: "length"`), and its usage
/// counted as assistd estimates tokens (`llm::estimate_tokens`). A history summary call
/// (asked for at most `context.summary_max_tokens`) thus gets a summary of that size, not an echo of the
/// whole conversation it was given.
pub(crate) fn chat_completion(body: &Value, answer_chars: usize) -> Value {
    use assistd::llm::estimate_tokens;
    let messages = body["messages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let text = |m: &Value| m["content"].as_str().unwrap_or("").to_string();
    let last = messages.last().map(text).unwrap_or_default();
    let limit = requested_tokens(body);
    let mut content = long_answer(&last, answer_chars);
    let cut = estimate_tokens(&content) > limit;
    if cut {
        let mut end = limit.saturating_sub(4) * 3;
        while !content.is_char_boundary(end.min(content.len())) {
            end -= 1;
        }
        content.truncate(end);
    }
    let prompt: usize = messages.iter().map(|m| estimate_tokens(&text(m))).sum();
    let completion = estimate_tokens(&content);
    json!({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 1_700_000_000u32,
        "model": body["model"],
        "choices": [{"index": 0, "logprobs": null, "finish_reason": if cut { "length" } else { "stop" },
            "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}})
}

/// "answer to: `question`", then words drawn from a small vocabulary by a generator seeded
/// with the question, up to about `chars` characters.
fn long_answer(question: &str, chars: usize) -> String {
    const WORDS: [&str; 16] = [
        "the",
        "request",
        "was",
        "approved",
        "by",
        "finance",
        "and",
        "the",
        "report",
        "shows",
        "quarterly",
        "revenue",
        "growth",
        "across",
        "regions",
        "today",
    ];
    let mut answer = format!("answer to: {question}");
    let mut seed = question.bytes().fold(0x9e37_79b9_7f4a_7c15_u64, |h, b| {
        h.rotate_left(5) ^ u64::from(b)
    });
    while answer.len() < chars {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        answer.push(' ');
        answer.push_str(WORDS[(seed >> 60) as usize]);
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mock model refuses, as OpenAI does, a prompt that with its `max_tokens` exceeds
    /// the window, and answers one that fits.
    #[test]
    fn the_mock_model_refuses_a_request_over_its_window() {
        let request = |chars: usize| {
            json!({"model": "m", "max_tokens": 512,
                "messages": [{"role": "user", "content": "x".repeat(chars)}]})
        };
        // (8,192 − 512 − 4) × 3 bytes fit exactly; three more do not.
        let fits = (MODEL_WINDOW - 512 - 4) * 3;
        assert!(over_window(&request(fits)).is_none());
        let refusal = over_window(&request(fits + 3)).unwrap();
        assert_eq!(refusal["error"]["code"], "context_length_exceeded");
        let answer = chat_completion(&request(10), 0);
        assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    }
}
