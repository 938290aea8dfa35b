//! Embeddings through a provider's OpenAI-compatible `/embeddings` endpoint (OpenAI, Ollama,
//! vLLM, llama.cpp's server with `--embedding`): async-openai's typed request and response,
//! checked strictly (one vector per input, in order, all of one size, finite), failures
//! classified like chat calls so callers retry the same failure types.

use async_openai::types::embeddings::{
    CreateEmbeddingRequest, CreateEmbeddingResponse, EmbeddingInput,
};

use super::{LlmError, OpenAiClient, classify_transport};
use crate::domain::FailureType;

impl OpenAiClient {
    /// The embedding of each of `inputs`, in order, by `model` (the provider's model when
    /// empty).
    #[tracing::instrument(skip_all, fields(inputs = inputs.len(), otel.kind = "client"))]
    pub async fn embed(&self, model: &str, inputs: &[String]) -> Result<Vec<Vec<f32>>, LlmError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let request = CreateEmbeddingRequest {
            model: if model.is_empty() {
                self.model.clone()
            } else {
                model.to_string()
            },
            input: EmbeddingInput::StringArray(inputs.to_vec()),
            ..Default::default()
        };
        let _slot = self.gate.call_slot().await;
        let response = self
            .post_to(&self.embeddings_endpoint, &request, "")
            .await?;
        let body = response.text().await.map_err(classify_transport)?;
        parse_embeddings(&body, inputs.len())
    }
}

fn parse_embeddings(body: &str, expected: usize) -> Result<Vec<Vec<f32>>, LlmError> {
    let invalid = |m: String| LlmError::new(FailureType::InvalidResponse, m);
    let response: CreateEmbeddingResponse = serde_json::from_str(body)
        .map_err(|e| invalid(format!("the answer is not an embeddings response: {e}")))?;
    if response.data.len() != expected {
        return Err(invalid(format!(
            "{} embeddings for {expected} inputs",
            response.data.len()
        )));
    }
    let mut out: Vec<Option<Vec<f32>>> = vec![None; expected];
    for item in response.data {
        let slot = out
            .get_mut(item.index as usize)
            .ok_or_else(|| invalid(format!("embedding index {} out of range", item.index)))?;
        if slot.is_some() {
            return Err(invalid(format!(
                "embedding index {} given twice",
                item.index
            )));
        }
        if item.embedding.is_empty() || item.embedding.iter().any(|x| !x.is_finite()) {
            return Err(invalid(format!(
                "embedding {} is empty or not finite",
                item.index
            )));
        }
        *slot = Some(item.embedding);
    }
    let out: Vec<Vec<f32>> = out.into_iter().flatten().collect();
    let dims = out[0].len();
    if out.iter().any(|v| v.len() != dims) {
        return Err(invalid(
            "embeddings of different sizes in one answer".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_strictly() {
        let ok = r#"{"object":"list","model":"m","usage":{"prompt_tokens":2,"total_tokens":2},
            "data":[{"object":"embedding","index":1,"embedding":[0.5,0.5]},
                    {"object":"embedding","index":0,"embedding":[1.0,0.0]}]}"#;
        assert_eq!(
            parse_embeddings(ok, 2).unwrap(),
            vec![vec![1.0, 0.0], vec![0.5, 0.5]]
        );
        for (body, says) in [
            (ok, "2 embeddings for 3"),
            (r#"{"data":[]}"#, "not an embeddings response"),
            (
                r#"{"object":"list","model":"m","usage":{"prompt_tokens":2,"total_tokens":2},
                "data":[{"object":"embedding","index":0,"embedding":[[1.0],[2.0]]}]}"#,
                "not an embeddings response",
            ),
        ] {
            let expected = if says.contains("for 3") { 3 } else { 1 };
            let e = parse_embeddings(body, expected).unwrap_err();
            assert_eq!(e.failure_type, FailureType::InvalidResponse);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }
}
