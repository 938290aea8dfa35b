//! The single-turn path: one journalled model call with the agent's system prompt and the
//! conversation's recent history, retried on transient failures, then the task's terminal
//! status and its one reply in one transaction.

use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::{RunError, TaskContext, backoff, reply};
use crate::app::Services;
use crate::domain::{ReplyType, StepStatus, StepType, TaskStatus, reply_key, step_key};
use crate::llm::{ChatMessage, ChatRequest, ChatResponse, LlmError};
use crate::store::tasks::{Fence, NewReply, NewStep, StepResult, StepRow, TaskOutcome};

const STEP_NO: i64 = 1;
const TOOL: &str = "chat";
const SUMMARY: &str = "summary";

pub async fn run(
    svc: &Services,
    fence: &Fence,
    lost: &CancellationToken,
    ctx: &TaskContext,
) -> Result<(), RunError> {
    let (task, message, agent) = (&ctx.task, &ctx.message, &ctx.agent);
    let history = svc
        .store
        .conversation_history(
            &task.channel,
            &task.conversation_id,
            message.id,
            i64::from(agent.history_messages) + 1,
        )
        .await?;
    let mut turns = Vec::new();
    for entry in &history {
        turns.push(ChatMessage::new("user", entry.text.clone()));
        if entry.message_id == message.id {
            break;
        }
        if let Some(answer) = &entry.answer {
            turns.push(ChatMessage::new("assistant", answer.clone()));
        }
    }
    let model = if agent.model.is_empty() {
        svc.config.llm.model.clone()
    } else {
        agent.model.clone()
    };
    let budget = svc.config.context.history_token_budget;
    let recent = within_budget(turns.clone(), budget);
    let older = &turns[..turns.len() - recent.len()];
    let mut messages = vec![ChatMessage::new("system", agent.system_prompt.clone())];
    // Over the budget: the older exchanges are folded into a summary by the model (a
    // journalled step of its own, so a resumed task reuses it), and the chat call is step 2.
    let mut chat_step = STEP_NO;
    if !older.is_empty() {
        chat_step = STEP_NO + 1;
        let summary = summarize_history(svc, fence, lost, &model, older).await?;
        if let Some(summary) = summary {
            messages.push(ChatMessage::new(
                "user",
                format!("Summary of the earlier conversation:\n{summary}"),
            ));
        }
    }
    messages.extend(recent);
    let fresh_request = ChatRequest {
        model,
        messages,
        temperature: agent.temperature,
        max_tokens: agent.max_tokens,
        tools: Vec::new(),
    };
    let input = serde_json::to_string(&fresh_request).unwrap_or_default();
    let key = step_key(fence.task_id, chat_step, TOOL);
    let step = svc
        .journal
        .begin_step(
            fence,
            &NewStep {
                step_no: chat_step,
                step_type: StepType::Llm,
                tool_name: TOOL,
                idempotency_key: &key,
                input: &input,
            },
        )
        .await?
        .ok_or(RunError::LostLease)?;
    // On resume the journal, not today's database, is the context: reuse the request the
    // step was first written with so the model sees exactly the same history.
    let request = match step
        .input
        .as_deref()
        .map(serde_json::from_str::<ChatRequest>)
    {
        Some(Ok(journalled)) => journalled,
        _ => fresh_request,
    };

    let started = Instant::now();
    let (outcome, attempts) = if step.status == StepStatus::Succeeded {
        // Resumed after the call finished: reuse its journalled output, never call again.
        let output: ChatResponse = serde_json::from_str(step.output.as_deref().unwrap_or(""))
            .map_err(|e| RunError::Corrupt(format!("journalled output unreadable: {e}")))?;
        tracing::info!(step = step.step_no, "reusing the journalled model answer");
        (Ok(output), step.attempt)
    } else {
        call_with_retries(svc, fence, &step, &request, lost).await?
    };
    crate::metrics::STEP_SECONDS.observe(started.elapsed());
    let duration_ms = started.elapsed().as_millis() as i64;
    // Retries made by this run; earlier runs' retries are already counted on the task.
    let retries = (attempts - step.attempt - 1).max(0);

    let in_reply_to = message.external_message_id.clone();
    let outcome = match outcome {
        Ok(answer) => {
            let (reply_type, content) = reply::compose_answer(&answer.content);
            TaskOutcome {
                status: TaskStatus::Succeeded,
                result: Some(answer.content.clone()),
                trace: None,
                failure_type: None,
                error: None,
                retries,
                step: Some(StepResult {
                    step_id: step.id,
                    attempts,
                    status: StepStatus::Succeeded,
                    output: Some(serde_json::to_string(&answer).unwrap_or_default()),
                    error: None,
                    tokens_in: answer.prompt_tokens,
                    tokens_out: answer.completion_tokens,
                    duration_ms,
                }),
                reply: NewReply {
                    idempotency_key: reply_key(task.id, task.resume_count),
                    channel: task.channel.clone(),
                    conversation_id: task.conversation_id.clone(),
                    in_reply_to,
                    reply_type,
                    content: content.to_string(),
                },
                audit_summary: format!(
                    "answered by {} after {} attempt(s) ({})",
                    request.model,
                    attempts,
                    reply_type.as_str()
                ),
            }
        }
        Err(err) => {
            tracing::warn!(failure_type = %err.failure_type, error = %err.message, "task failed");
            let notice = reply::failure_notice(
                &svc.config.replies.failure_notice,
                fence.task_id,
                err.failure_type,
            );
            TaskOutcome {
                status: TaskStatus::Failed,
                result: None,
                trace: None,
                failure_type: Some(err.failure_type),
                error: Some(crate::domain::truncate(&err.message, 2000)),
                retries,
                step: Some(StepResult {
                    step_id: step.id,
                    attempts,
                    status: StepStatus::Failed,
                    output: None,
                    error: Some(crate::domain::truncate(&err.message, 2000)),
                    tokens_in: None,
                    tokens_out: None,
                    duration_ms,
                }),
                reply: NewReply {
                    idempotency_key: reply_key(task.id, task.resume_count),
                    channel: task.channel.clone(),
                    conversation_id: task.conversation_id.clone(),
                    in_reply_to,
                    reply_type: ReplyType::Text,
                    content: notice.to_string(),
                },
                audit_summary: format!(
                    "{} after {} attempt(s): {}",
                    err.failure_type,
                    attempts,
                    crate::domain::truncate(&err.message, 300)
                ),
            }
        }
    };
    if !svc.journal.finish_task(fence, &outcome).await? {
        return Err(RunError::LostLease);
    }
    tracing::info!(status = %outcome.status, "task finished");
    svc.reply_wake.notify_one();
    Ok(())
}

/// Calls the model until it answers, a permanent failure occurs, or the tries run out.
/// Returns the outcome and the number of tries made so far (journalled on the step).
async fn call_with_retries(
    svc: &Services,
    fence: &Fence,
    step: &StepRow,
    request: &ChatRequest,
    lost: &CancellationToken,
) -> Result<(Result<ChatResponse, LlmError>, i64), RunError> {
    let llm = &svc.config.llm;
    // Attempts are numbered across runs (the journal shows them all); the retry budget
    // counts this run's tries, so a task an admin resumes gets a fresh budget.
    let mut attempt = step.attempt;
    let first_this_run = step.attempt + 1;
    loop {
        attempt += 1;
        // The first try is fenced by `begin_step` and its count written with the result;
        // retries are recorded as they start, so a long retry loop shows in the journal.
        if attempt > first_this_run
            && !svc
                .store
                .record_step_attempt(fence, step.id, attempt)
                .await?
        {
            return Err(RunError::LostLease);
        }
        let result = tokio::select! {
            r = svc.llm.chat(request, &step.idempotency_key) => r,
            _ = lost.cancelled() => return Err(RunError::LostLease),
        };
        match result {
            Ok(answer) => return Ok((Ok(answer), attempt)),
            Err(err) => {
                let Some(policy) = llm
                    .retry
                    .policy(err.failure_type)
                    .filter(|p| attempt - first_this_run + 1 < i64::from(p.max_attempts))
                else {
                    return Ok((Err(err), attempt));
                };
                let wait = backoff::delay(
                    attempt as u32,
                    policy.backoff_base_ms,
                    policy.backoff_max_ms,
                    err.retry_after,
                    std::time::Duration::from_secs(llm.retry_after_max_secs),
                );
                tracing::warn!(
                    attempt,
                    failure_type = %err.failure_type,
                    wait_ms = wait.as_millis() as u64,
                    error = %err.message,
                    "model call failed; retrying"
                );
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = lost.cancelled() => return Err(RunError::LostLease),
                }
            }
        }
    }
}

/// Folds `older` turns into a summary with a journalled `summary` step (step 1); `None` when
/// the summary could not be made (the older turns are then simply left out).
async fn summarize_history(
    svc: &Services,
    fence: &Fence,
    lost: &CancellationToken,
    model: &str,
    older: &[ChatMessage],
) -> Result<Option<String>, RunError> {
    let transcript: String = older
        .iter()
        .map(|m| format!("{}: {}\n", m.role, m.content))
        .collect();
    let request = ChatRequest {
        model: model.to_string(),
        messages: vec![
            ChatMessage::new("system", svc.config.context.summary_prompt.clone()),
            ChatMessage::new("user", format!("Conversation so far:\n{transcript}")),
        ],
        temperature: 0.0,
        max_tokens: 512,
        tools: Vec::new(),
    };
    let input = serde_json::to_string(&request).unwrap_or_default();
    let key = step_key(fence.task_id, STEP_NO, SUMMARY);
    let step = svc
        .journal
        .begin_step(
            fence,
            &NewStep {
                step_no: STEP_NO,
                step_type: StepType::Llm,
                tool_name: SUMMARY,
                idempotency_key: &key,
                input: &input,
            },
        )
        .await?
        .ok_or(RunError::LostLease)?;
    if step.status == StepStatus::Succeeded {
        let output: ChatResponse = serde_json::from_str(step.output.as_deref().unwrap_or(""))
            .map_err(|e| RunError::Corrupt(format!("journalled summary unreadable: {e}")))?;
        return Ok(Some(output.content));
    }
    let started = Instant::now();
    let (outcome, attempts) = call_with_retries(svc, fence, &step, &request, lost).await?;
    let duration_ms = started.elapsed().as_millis() as i64;
    let (record, summary) = match outcome {
        Ok(answer) => (
            StepResult {
                step_id: step.id,
                attempts,
                status: StepStatus::Succeeded,
                output: Some(serde_json::to_string(&answer).unwrap_or_default()),
                error: None,
                tokens_in: answer.prompt_tokens,
                tokens_out: answer.completion_tokens,
                duration_ms,
            },
            Some(answer.content),
        ),
        Err(err) => {
            tracing::warn!(error = %err, "history summary failed; leaving older turns out");
            (
                StepResult {
                    step_id: step.id,
                    attempts,
                    status: StepStatus::Failed,
                    output: None,
                    error: Some(crate::domain::truncate(&err.message, 2000)),
                    tokens_in: None,
                    tokens_out: None,
                    duration_ms,
                },
                None,
            )
        }
    };
    if !svc.journal.complete_step(fence, &record).await? {
        return Err(RunError::LostLease);
    }
    Ok(summary)
}

/// Keeps the newest turns that fit in about `budget` tokens (characters / 4); the current
/// question (the last turn) is always kept.
fn within_budget(turns: Vec<ChatMessage>, budget: usize) -> Vec<ChatMessage> {
    let mut used = 0usize;
    let mut keep = 0usize;
    for (i, turn) in turns.iter().rev().enumerate() {
        used += turn.content.len() / 4 + 1;
        if used > budget && i > 0 {
            break;
        }
        keep += 1;
    }
    let skip = turns.len() - keep;
    turns.into_iter().skip(skip).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_is_cut_oldest_first_but_keeps_the_question() {
        let turns: Vec<ChatMessage> = (0..10)
            .map(|i| ChatMessage::new("user", format!("{i}{}", "x".repeat(399))))
            .collect();
        let kept = within_budget(turns.clone(), 350);
        assert_eq!(kept.len(), 3);
        assert!(kept[2].content.starts_with('9'));
        assert_eq!(
            within_budget(turns.clone(), 1).len(),
            1,
            "the question stays"
        );
        assert_eq!(within_budget(turns, 100_000).len(), 10);
    }
}
