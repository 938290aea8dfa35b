//! The embeddings double: `POST /v1/embeddings` held to OpenAI's documented contract
//! (API reference, "Create embeddings"): `model` is required; `input` is a string or an
//! array of at most 2,048 strings, none empty, each under the model's 8,192 input tokens, at
//! most 300,000 tokens summed over one request; `encoding_format` is `float` or `base64`;
//! `dimensions` a positive integer; no other fields. A request that breaks it is answered
//! 400 with OpenAI's error body before anything is embedded. Tokens are estimated at four
//! bytes each, as the chat double does.
//!
//! The vectors are deterministic "meanings": each input is mapped onto a few concepts by the
//! words (English or Chinese) that stand for them, so texts that share a concept and no word
//! are near each other — what lexical search cannot see and a real embedding model can.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use wiremock::matchers::{method, path_regex};
use wiremock::{Mock, Request, Respond, ResponseTemplate};

/// The concepts and the words that stand for them.
const CONCEPTS: &[&[&str]] = &[
    &[
        "money",
        "refund",
        "reimburse",
        "reimbursed",
        "expense",
        "expenses",
        "receipt",
        "receipts",
        "cost",
        "paid",
        "报销",
        "发票",
        "费用",
    ],
    &[
        "trip",
        "travel",
        "flight",
        "flights",
        "journey",
        "business trip",
        "出差",
        "旅行",
    ],
    &["holiday", "vacation", "leave", "time off", "休假", "假期"],
    &["laptop", "computer", "hardware", "device", "电脑"],
];

/// The vector of `text`: one dimension per concept (how often it is named) and one for
/// everything else, so no vector is zero.
pub fn meaning(text: &str) -> Vec<f32> {
    let lower = text.to_lowercase();
    let mut v: Vec<f32> = CONCEPTS
        .iter()
        .map(|words| words.iter().map(|w| lower.matches(w).count() as f32).sum())
        .collect();
    v.push(0.2);
    v
}

/// How the double answers after the contract checks.
#[derive(Clone)]
pub struct EmbeddingsDouble {
    /// Requests answered so far (valid ones).
    pub calls: Arc<AtomicU64>,
    /// The first this many valid requests are refused with this status (429 carries
    /// `Retry-After: 0`).
    pub fail_first: u64,
    pub fail_status: u16,
}

impl EmbeddingsDouble {
    pub fn new() -> Self {
        EmbeddingsDouble {
            calls: Arc::new(AtomicU64::new(0)),
            fail_first: 0,
            fail_status: 500,
        }
    }

    pub fn failing_first(mut self, n: u64, status: u16) -> Self {
        self.fail_first = n;
        self.fail_status = status;
        self
    }

    pub fn mock(self) -> Mock {
        Mock::given(method("POST"))
            .and(path_regex(r"/v1/embeddings$"))
            .respond_with(self)
    }
}

fn refuse(message: String) -> ResponseTemplate {
    ResponseTemplate::new(400).set_body_json(json!({
        "error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}
    }))
}

/// The contract's checks; `Err` is the 400 message.
pub fn check(body: &Value) -> Result<Vec<String>, String> {
    let object = body.as_object().ok_or("the body must be a JSON object")?;
    for key in object.keys() {
        if !["model", "input", "encoding_format", "dimensions", "user"].contains(&key.as_str()) {
            return Err(format!("Unrecognized request argument supplied: {key}"));
        }
    }
    match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => {}
        _ => return Err("you must provide a model parameter".into()),
    }
    if let Some(f) = body.get("encoding_format")
        && f != "float"
        && f != "base64"
    {
        return Err(format!(
            "{f} is not one of ['float', 'base64'] - 'encoding_format'"
        ));
    }
    if let Some(d) = body.get("dimensions")
        && d.as_u64().is_none_or(|d| d == 0)
    {
        return Err("dimensions must be a positive integer".into());
    }
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.is_empty() || items.len() > 2048 {
                return Err("input: an array must have 1 to 2048 items".into());
            }
            items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_string)
                        .ok_or("input items must be strings")
                })
                .collect::<Result<_, _>>()?
        }
        _ => return Err("input must be a string or an array of strings".into()),
    };
    let mut total = 0;
    for (n, input) in inputs.iter().enumerate() {
        if input.is_empty() {
            return Err(format!("input[{n}] cannot be an empty string"));
        }
        let tokens = input.len().div_ceil(4);
        if tokens > 8192 {
            return Err(format!(
                "This model's maximum context length is 8192 tokens, however you requested {tokens} tokens (input[{n}])"
            ));
        }
        total += tokens;
    }
    if total > 300_000 {
        return Err(format!(
            "Requested {total} tokens, max 300000 tokens per request"
        ));
    }
    Ok(inputs)
}

impl Respond for EmbeddingsDouble {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let Ok(body) = serde_json::from_slice::<Value>(&request.body) else {
            return refuse("We could not parse the JSON body of your request.".into());
        };
        let inputs = match check(&body) {
            Ok(i) => i,
            Err(m) => return refuse(m),
        };
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n < self.fail_first {
            let template = ResponseTemplate::new(self.fail_status).set_body_json(json!({
                "error": {"message": "embedding double: failing as told", "type": "server_error"}
            }));
            return if self.fail_status == 429 {
                template.insert_header("retry-after", "0")
            } else {
                template
            };
        }
        let tokens: usize = inputs.iter().map(|i| i.len().div_ceil(4)).sum();
        ResponseTemplate::new(200).set_body_json(json!({
            "object": "list",
            "model": body["model"],
            "data": inputs.iter().enumerate().map(|(i, text)| json!({
                "object": "embedding", "index": i, "embedding": meaning(text),
            })).collect::<Vec<_>>(),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }))
    }
}

#[test]
fn the_double_holds_to_the_contract() {
    assert!(check(&json!({"model": "m", "input": ["a", "b"]})).is_ok());
    for (body, says) in [
        (json!({"input": "a"}), "model"),
        (json!({"model": "m", "input": ""}), "empty"),
        (json!({"model": "m", "input": []}), "1 to 2048"),
        (json!({"model": "m", "input": vec!["a"; 2049]}), "1 to 2048"),
        (json!({"model": "m", "input": "x".repeat(40_000)}), "8192"),
        (json!({"model": "m", "input": [1, 2]}), "strings"),
        (
            json!({"model": "m", "input": "a", "stream": true}),
            "Unrecognized",
        ),
        (
            json!({"model": "m", "input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
    ] {
        let e = check(&body).unwrap_err();
        assert!(e.contains(says), "{says}: {e}");
    }
    let near = |a: &str, b: &str| {
        let (x, y) = (meaning(a), meaning(b));
        let dot: f32 = x.iter().zip(&y).map(|(p, q)| p * q).sum();
        dot / (x.iter().map(|p| p * p).sum::<f32>().sqrt()
            * y.iter().map(|q| q * q).sum::<f32>().sqrt())
    };
    assert!(
        near(
            "get my money back for a trip",
            "expenses of business travel are reimbursed"
        ) > 0.8
    );
    assert!(near("get my money back", "annual leave and holidays") < 0.3);
}
