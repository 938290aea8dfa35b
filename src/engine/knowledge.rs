//! Answers from the organisation's documents (docs/knowledge.md): a single-turn agent with
//! `knowledge = [...]` retrieves the question's best passages from its collections as a
//! journalled step of its own (a resumed task answers from the passages it found first),
//! gives them to the model with the instruction to answer from them and cite them, and
//! answers with a `knowledge_answer` card listing the sources; when no passage scores above
//! `knowledge.min_score`, it says it does not know, without asking the model.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::step::{self, StepExec};
use super::task::{RunError, TaskContext};
use super::worker::Worker;
use crate::domain::{NewStep, ReplyType, StepStatus, StepType};
use crate::llm::ChatMessage;

/// The name the retrieval step is journalled under.
pub const TOOL: &str = crate::definition::KNOWLEDGE_SEARCH;

/// One passage given to the model, numbered as it is cited (`[n]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Passage {
    pub n: usize,
    pub collection: String,
    pub document_id: String,
    pub title: String,
    pub heading: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_url: Option<String>,
    pub text: String,
    pub score: f64,
}

/// The best passages for `question` from the agent's collections (at most
/// `knowledge.top_k`, each scoring above `knowledge.min_score`), as step `step_no`.
pub async fn retrieve(
    svc: &Worker,
    exec: &StepExec<'_>,
    ctx: &TaskContext,
    step_no: i64,
    question: &str,
) -> Result<Vec<Passage>, RunError> {
    let settings = &svc.config.knowledge;
    let input = json!({
        "collections": ctx.agent.knowledge,
        "question": question,
        "top_k": settings.top_k,
        "min_score": settings.min_score,
    })
    .to_string();
    let key = exec.key(step_no, TOOL);
    let row = exec
        .begin(&NewStep {
            step_no,
            step_type: StepType::Tool,
            tool_name: TOOL,
            idempotency_key: &key,
            input: &input,
        })
        .await?;
    if row.status == StepStatus::Succeeded {
        tracing::info!(step = step_no, "reusing the journalled passages");
        return serde_json::from_str(row.output.as_deref().unwrap_or(""))
            .map_err(|e| RunError::Corrupt(format!("journalled passages unreadable: {e}")));
    }
    let started = Instant::now();
    let found = find(
        &svc.knowledge,
        &ctx.agent.knowledge,
        question,
        settings.top_k,
    )
    .await
    .map_err(|e| match e {
        crate::knowledge::KnowledgeError::Store(e) => RunError::Store(e),
        other => RunError::Corrupt(other.to_string()),
    })?;
    let output = serde_json::to_string(&found).unwrap_or_else(|_| "[]".into());
    let duration = started.elapsed().as_millis() as i64;
    exec.complete(&step::record(&row, 1, duration, Ok((output, None, None))))
        .await?;
    tracing::info!(passages = found.len(), "knowledge retrieved");
    Ok(found)
}

/// The best `k` passages for `question` from `collections` (a missing one is skipped),
/// each above the collection's thresholds, numbered from 1: one collection's in its own
/// order; several taken in turns by rank (their scores are on different scales when some
/// rank by words and others by words and meaning).
pub async fn find(
    knowledge: &crate::knowledge::Knowledge,
    collections: &[String],
    question: &str,
    k: usize,
) -> Result<Vec<Passage>, crate::knowledge::KnowledgeError> {
    let mut lists: Vec<Vec<Passage>> = Vec::new();
    for name in collections {
        let Some(collection) = knowledge.store.collection(name).await? else {
            tracing::warn!(collection = %name, "the agent's knowledge collection is gone");
            continue;
        };
        let found = knowledge.search(&collection, question, k).await?;
        lists.push(
            found
                .hits
                .into_iter()
                .map(|h| Passage {
                    n: 0,
                    collection: name.clone(),
                    document_id: h.doc_id,
                    title: h.title,
                    heading: h.heading,
                    source_url: h.source_url,
                    text: h.text,
                    score: h.score,
                })
                .collect(),
        );
    }
    let mut found: Vec<Passage> = Vec::new();
    let deepest = lists.iter().map(Vec::len).max().unwrap_or(0);
    for rank in 0..deepest {
        let mut row: Vec<Passage> = lists.iter().filter_map(|l| l.get(rank).cloned()).collect();
        row.sort_by(|a, b| b.score.total_cmp(&a.score));
        found.extend(row);
    }
    found.truncate(k);
    for (i, passage) in found.iter_mut().enumerate() {
        passage.n = i + 1;
    }
    Ok(found)
}

/// What a workflow's `knowledge.search` runs: `{"query", "collection"?, "k"?}` (checked
/// against the tool's schema first) over `collections`, answered with `passages`, `found`
/// and `text` (the passages numbered, ready for a prompt).
pub fn search_tool(
    knowledge: std::sync::Arc<crate::knowledge::Knowledge>,
    collections: Vec<String>,
) -> crate::tools::task_tools::SearchFn {
    std::sync::Arc::new(move |args: Value| {
        let (knowledge, collections) = (knowledge.clone(), collections.clone());
        Box::pin(async move {
            let settings = &knowledge.config.knowledge;
            let query = args["query"].as_str().unwrap_or_default();
            let k = args["k"].as_u64().map_or(settings.top_k, |k| k as usize);
            let only: Vec<String> = match args["collection"].as_str() {
                Some(one) => vec![one.to_string()],
                None => collections,
            };
            let found =
                find(&knowledge, &only, query, k)
                    .await
                    .map_err(|e| crate::tools::ToolError {
                        retryable: e.is_transient(),
                        message: format!("knowledge.search: {e}"),
                    })?;
            let text = passages_text(&found);
            Ok(json!({ "passages": found, "found": found.len(), "text": text }))
        })
    })
}

/// The passages numbered, each with its title and heading.
fn passages_text(passages: &[Passage]) -> String {
    let mut text = String::new();
    for p in passages {
        let heading = if p.heading.is_empty() {
            String::new()
        } else {
            format!(" — {}", p.heading)
        };
        text.push_str(&format!("\n[{}] {}{heading}\n{}\n", p.n, p.title, p.text));
    }
    text
}

/// The message that gives the model the passages, put just before the question.
pub fn passages_message(passages: &[Passage]) -> ChatMessage {
    let mut text = String::from(
        "Answer the next question from these passages of the organisation's documents only. \
         Cite the passages you use by their numbers, like [1]. If they do not hold the \
         answer, say that you do not know; do not guess.\n",
    );
    text.push_str(&passages_text(passages));
    ChatMessage::user(text)
}

/// The passages an answer cites (`[n]`), or all of them when it cites none.
fn cited<'a>(answer: &str, passages: &'a [Passage]) -> Vec<&'a Passage> {
    let named: Vec<&Passage> = passages
        .iter()
        .filter(|p| answer.contains(&format!("[{}]", p.n)))
        .collect();
    if named.is_empty() {
        passages.iter().collect()
    } else {
        named
    }
}

/// The reply of an answer drawn from `passages`: a `knowledge_answer` card with its sources
/// (title, heading, link), and as its text the answer and a sources list, for platforms
/// that show text.
pub fn answer_card(answer: &str, passages: &[Passage]) -> (ReplyType, Value) {
    let sources: Vec<&Passage> = cited(answer, passages);
    let lines: Vec<String> = sources
        .iter()
        .map(|p| {
            let heading = if p.heading.is_empty() {
                String::new()
            } else {
                format!(" — {}", p.heading)
            };
            let link = p
                .source_url
                .as_deref()
                .map(|u| format!(" ({u})"))
                .unwrap_or_default();
            format!("[{}] {}{heading}{link}", p.n, p.title)
        })
        .collect();
    let text = format!("{}\n\nSources:\n{}", answer.trim(), lines.join("\n"));
    let card = json!({
        "card_type": "knowledge_answer",
        "title": sources.first().map(|p| p.title.as_str()).unwrap_or("Answer"),
        "answer": answer.trim(),
        "sources": sources.iter().map(|p| json!({
            "n": p.n,
            "title": p.title,
            "heading": p.heading,
            "url": p.source_url,
            "document_id": p.document_id,
            "collection": p.collection,
        })).collect::<Vec<_>>(),
    });
    (ReplyType::Card, json!({ "text": text, "card": card }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passage(n: usize, title: &str, url: Option<&str>) -> Passage {
        Passage {
            n,
            collection: "handbook".into(),
            document_id: title.to_lowercase(),
            title: title.into(),
            heading: "Flights".into(),
            source_url: url.map(str::to_string),
            text: "Economy class.".into(),
            score: 1.0,
        }
    }

    #[test]
    fn the_card_lists_the_cited_sources_and_its_text_too() {
        let passages = [
            passage(1, "Travel", Some("https://intranet.example/travel")),
            passage(2, "Leave", None),
        ];
        let (kind, content) = answer_card("Fly economy [1].", &passages);
        assert_eq!(kind, ReplyType::Card);
        assert_eq!(content["card"]["sources"].as_array().unwrap().len(), 1);
        assert_eq!(content["card"]["title"], "Travel");
        let text = content["text"].as_str().unwrap();
        assert!(
            text.ends_with("Sources:\n[1] Travel — Flights (https://intranet.example/travel)"),
            "{text}"
        );
        // No citation: every passage given is a source.
        let (_, content) = answer_card("Fly economy.", &passages);
        assert_eq!(content["card"]["sources"].as_array().unwrap().len(), 2);
    }
}
