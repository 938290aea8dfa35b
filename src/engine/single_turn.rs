//! The single-turn path: one journalled model call with the agent's system prompt and the
//! conversation's recent history, retried on transient failures, then the task's terminal
//! status and its one reply in one transaction.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::feedback::Feedback;
use super::history;
use super::reply;
use super::step::{self, CallErr, StepExec};
use super::task::{RunError, TaskContext, model_of};
use super::worker::Worker;
use crate::domain::{FailureType, ReplyType, StepStatus, StepType, TaskStatus};
use crate::domain::{Fence, NewStep, StepResult, StepRow, TaskOutcome};
use crate::llm::{
    ChatMessage, ChatRequest, ChatResponse, OpenAiClient, WireRequest, history_budget,
};

const STEP_NO: i64 = 1;
const TOOL: &str = "chat";
const SUMMARY: &str = "summary";
/// The retry of a chat the model refused as too long, with the question alone.
const SHRUNK: &str = "chat_shrunk";

pub async fn run(
    svc: &Worker,
    fence: &Fence,
    lost: &CancellationToken,
    ctx: &TaskContext,
) -> Result<(), RunError> {
    let agent = &ctx.agent;
    let (provider, model) = model_of(svc, agent)?;
    let model_label = model.clone();
    let exec = StepExec {
        journal: &svc.journal,
        fence,
        lost,
        retry_after_max: std::time::Duration::from_secs(svc.config.llm.retry_after_max_secs),
        restart: ctx.task.restart_count,
        agent: &ctx.task.agent_name,
        model: &model_label,
        recovery: ctx.recovery.as_ref(),
    };
    // A knowledge agent's passages come first (step 1; the model's steps follow). With none
    // that answers, it says so without asking the model.
    let knows = !agent.knowledge.is_empty();
    let first_step = if knows { STEP_NO + 1 } else { STEP_NO };
    let passages = if knows {
        let found = super::knowledge::retrieve(svc, &exec, ctx, STEP_NO, &ctx.message.text).await?;
        if found.is_empty() {
            return finish(svc, fence, &exec, ctx, unknown_outcome(svc, ctx)).await;
        }
        Some(found)
    } else {
        None
    };
    let turns = history::conversation_turns(svc, ctx).await?;
    let budget = history_budget(
        svc.config.context.history_token_budget,
        provider.context_window,
        agent.max_tokens,
        &agent.system_prompt,
    );
    let plan = history::plan(svc, ctx, &turns, budget).await?;
    let system = ChatMessage::system(agent.system_prompt.clone());
    let question = turns.last().map(|t| t.message.clone());
    let mut messages = vec![system.clone()];
    // Over the budget: the older exchanges are folded into a summary by the model (a
    // journalled step of its own, so a resumed task reuses it; step 2 is then the chat
    // call), or an earlier task's summary is carried over.
    let chat_step = first_step + i64::from(!plan.fold.is_empty());
    let (summary, made) = summary_of(svc, &exec, (provider, &model), first_step, &plan).await?;
    let recent = if made { plan.recent } else { plan.unfolded };
    messages.extend(summary.as_deref().map(history::summary_message));
    messages.extend(recent.iter().map(|t| t.message.clone()));
    // The group's chatter before the question, then the passages, just before it (the
    // passages also with the question alone, if it comes to that).
    let chatter = chatter_message(&group_chatter(svc, ctx).await?);
    let given = passages.as_deref().map(super::knowledge::passages_message);
    for context in [chatter, given.clone()].into_iter().flatten() {
        let question = messages.pop();
        messages.extend([Some(context), question].into_iter().flatten());
    }
    let request = ChatRequest {
        model,
        messages,
        temperature: agent.temperature,
        max_tokens: agent.max_tokens,
        tools: Vec::new(),
        tool_choice: None,
    };
    let stream = ctx.feedback.as_ref().filter(|f| f.streams());
    let mut call = chat_step_call(svc, &exec, provider, chat_step, TOOL, &request, stream).await?;
    // The model refused the context after all (our estimate is not its tokenizer): journal
    // the refusal and ask once more with the question alone, as a step of its own.
    let shrunk = ChatRequest {
        messages: [Some(system), given, question]
            .into_iter()
            .flatten()
            .collect(),
        ..request.clone()
    };
    if call.context_too_long() && shrunk.messages.len() < request.messages.len() {
        if !call.journalled {
            exec.complete(&call.record()).await?;
        }
        tracing::warn!(
            step = call.step.step_no,
            "the model refused the context as too long; asking again with the question alone"
        );
        call = chat_step_call(svc, &exec, provider, chat_step + 1, SHRUNK, &shrunk, stream).await?;
    }
    let outcome = outcome_of(svc, ctx, call, passages.as_deref());
    finish(svc, fence, &exec, ctx, outcome).await
}

/// Commits the task's end and its one reply (after the streamed edits stopped).
async fn finish(
    svc: &Worker,
    fence: &Fence,
    exec: &StepExec<'_>,
    ctx: &TaskContext,
    outcome: TaskOutcome,
) -> Result<(), RunError> {
    if let Some(feedback) = &ctx.feedback {
        feedback.settle().await;
    }
    // The chat sees the typing indicator end before the answer, which may go at once.
    svc.running.end_typing(fence.task_id).await;
    if !svc.journal.finish_task(fence, &outcome).await? {
        return Err(RunError::LostLease);
    }
    if let Some(step) = &outcome.step {
        exec.count_tokens(step);
    }
    // The journal rang the outbox (or handed it the reply).
    tracing::info!(status = %outcome.status, "task finished");
    Ok(())
}

/// A knowledge agent whose collections hold nothing that answers: `knowledge.unknown_answer`.
fn unknown_outcome(svc: &Worker, ctx: &TaskContext) -> TaskOutcome {
    let text = svc.config.knowledge.unknown_answer.clone();
    let content = serde_json::json!({ "text": text });
    let summary = format!(
        "no passage of {} answers the question; said so without asking the model",
        ctx.agent.knowledge.join(", ")
    );
    succeeded(ctx, text, (ReplyType::Text, content), (0, None), summary)
}

/// A task answered with `text`, replying `reply`; `(retries, step)` of its last call.
fn succeeded(
    ctx: &TaskContext,
    text: String,
    (reply_type, content): (ReplyType, serde_json::Value),
    (retries, step): (i64, Option<StepResult>),
    audit_summary: String,
) -> TaskOutcome {
    let in_reply_to = ctx.message.external_message_id.clone();
    TaskOutcome {
        status: TaskStatus::Succeeded,
        result: Some(text),
        trace: None,
        failure_type: None,
        error: None,
        retries,
        step,
        reply: ctx.task.reply(in_reply_to, reply_type, content.to_string()),
        audit_summary,
    }
}

/// Longest kept group message shown as context, in characters.
const CHATTER_CHARS: usize = 500;

/// The messages of the task's group chat that were not addressed to the bot, up to the
/// question (the last `channels.<platform>.group_context`), oldest first, as (who, text);
/// none when the platform keeps none.
pub(crate) async fn group_chatter(
    svc: &Worker,
    ctx: &TaskContext,
) -> Result<Vec<(String, String)>, RunError> {
    let (task, message) = (&ctx.task, &ctx.message);
    let keep = svc.channels.group_context(&task.channel);
    if keep == 0 {
        return Ok(Vec::new());
    }
    let chat = svc
        .channels
        .conversation(&task.channel, &task.conversation_id)
        .chat;
    let kept = svc
        .store
        .group_context(&task.channel, &chat, message.received_at, keep as i64)
        .await?;
    Ok(kept
        .into_iter()
        .map(|m| {
            let who = m.sender_name.unwrap_or(m.sender_id);
            (who, m.text.chars().take(CHATTER_CHARS).collect())
        })
        .collect())
}

/// The group's chatter as one message put just before the question; `None` without any.
pub(crate) fn chatter_message(chatter: &[(String, String)]) -> Option<ChatMessage> {
    if chatter.is_empty() {
        return None;
    }
    let lines: Vec<String> = chatter
        .iter()
        .map(|(who, text)| format!("{who}: {text}"))
        .collect();
    Some(ChatMessage::user(format!(
        "For context, the latest messages in this group chat that were not addressed to you:\n{}",
        lines.join("\n")
    )))
}

/// The task's terminal outcome from its chat call: the answer (or the agent's fallback for an
/// empty one) as the reply, or the failure notice.
fn outcome_of(
    svc: &Worker,
    ctx: &TaskContext,
    call: ChatCall,
    passages: Option<&[super::knowledge::Passage]>,
) -> TaskOutcome {
    let (task, message, agent) = (&ctx.task, &ctx.message, &ctx.agent);

    // Retries made by this run; earlier runs' retries are already counted on the task.
    let retries = (call.attempts - call.step.attempt - 1).max(0);
    let step = Some(call.record());
    let in_reply_to = message.external_message_id.clone();
    // The step keeps what the model said; the chat gets its text, or the fallback.
    let answered = call.outcome.and_then(|answer| {
        reply::answer_text(&answer, &agent.fallback_text).map_err(|(failure_type, message)| {
            CallErr {
                failure: failure_type,
                message,
                retry: None,
                retry_after: None,
            }
        })
    });
    match answered {
        Ok(text) => {
            // An answer drawn from passages goes as a card with its sources (unless the
            // model answered with a card of its own).
            let (reply_type, content) = match (reply::compose_answer(&text), passages) {
                ((ReplyType::Text, _), Some(passages)) => {
                    super::knowledge::answer_card(&text, passages)
                }
                (composed, _) => composed,
            };
            let summary = format!(
                "answered by {} after {} attempt(s) ({})",
                call.model,
                call.attempts,
                reply_type.as_str()
            );
            succeeded(ctx, text, (reply_type, content), (retries, step), summary)
        }
        Err(err) => {
            tracing::warn!(failure_type = %err.failure, error = %err.message, "task failed");
            let notice =
                reply::failure_notice(&svc.config.replies.failure_notice, task.id, err.failure);
            TaskOutcome {
                status: TaskStatus::Failed,
                result: None,
                trace: None,
                failure_type: Some(err.failure),
                error: Some(crate::domain::truncate(&err.message, step::ERROR_LIMIT)),
                retries,
                step,
                reply: task.reply(in_reply_to, ReplyType::Text, notice.to_string()),
                audit_summary: format!(
                    "{} after {} attempt(s): {}",
                    err.failure,
                    call.attempts,
                    crate::domain::truncate(&err.message, 300)
                ),
            }
        }
    }
}

/// A journalled chat step, run (or found finished) but not yet completed in the journal.
struct ChatCall {
    step: StepRow,
    /// The model named in the request sent.
    model: String,
    outcome: Result<ChatResponse, CallErr>,
    /// Tries so far, across runs.
    attempts: i64,
    duration_ms: i64,
    /// The journal already holds how this step ended (a resumed task).
    journalled: bool,
}

impl ChatCall {
    fn context_too_long(&self) -> bool {
        matches!(&self.outcome, Err(e) if e.failure == FailureType::ContextTooLong)
    }

    /// How the step ended, for the journal: the answer, or the classified failure.
    fn record(&self) -> StepResult {
        let result = match &self.outcome {
            Ok(answer) => Ok((
                serde_json::to_string(answer).unwrap_or_default(),
                answer.prompt_tokens,
                answer.completion_tokens,
            )),
            Err(err) => Err(err),
        };
        step::record(&self.step, self.attempts, self.duration_ms, result)
    }
}

/// Begins step `step_no` with `request` and calls the model, or takes what the journal holds:
/// a finished answer is reused, never asked again; a journalled CONTEXT_TOO_LONG stands (the
/// same request would be refused again). With `stream`, the answer is streamed and shown
/// as it comes (the journal keeps the request as first written, without `stream`).
async fn chat_step_call(
    svc: &Worker,
    exec: &StepExec<'_>,
    provider: &OpenAiClient,
    step_no: i64,
    name: &str,
    request: &ChatRequest,
    stream: Option<&Arc<Feedback>>,
) -> Result<ChatCall, RunError> {
    let fresh = request.to_wire();
    let input = crate::llm::journal_text(&crate::llm::wire_json(&fresh));
    let key = exec.key(step_no, name);
    let step = exec
        .begin(&NewStep {
            step_no,
            step_type: StepType::Llm,
            tool_name: name,
            idempotency_key: &key,
            input: &input,
        })
        .await?;
    // On resume the journal, not today's database, is the context: send the request the
    // step was first written with so the model sees exactly the same history.
    let wire = match step
        .input
        .as_deref()
        .map(serde_json::from_str::<WireRequest>)
    {
        Some(Ok(journalled)) => journalled,
        _ => fresh,
    };
    if step.status == StepStatus::Succeeded {
        // Resumed after the call finished: reuse its journalled output, never call again.
        let output: ChatResponse = serde_json::from_str(step.output.as_deref().unwrap_or(""))
            .map_err(|e| RunError::Corrupt(format!("journalled output unreadable: {e}")))?;
        tracing::info!(step = step.step_no, "reusing the journalled model answer");
        return Ok(ChatCall {
            attempts: step.attempt,
            model: wire.model,
            outcome: Ok(output),
            duration_ms: step.duration_ms.unwrap_or_default(),
            step,
            journalled: true,
        });
    }
    if step.status == StepStatus::Failed
        && step::journalled_failure(&step) == Some(FailureType::ContextTooLong)
    {
        return Ok(ChatCall {
            attempts: step.attempt,
            model: wire.model,
            outcome: Err(CallErr {
                failure: FailureType::ContextTooLong,
                message: step.error.clone().unwrap_or_default(),
                retry: None,
                retry_after: None,
            }),
            duration_ms: step.duration_ms.unwrap_or_default(),
            step,
            journalled: true,
        });
    }
    let llm = &svc.config.llm;
    let wire_ref = &wire;
    let attempted = exec
        .attempt(&step, |key| async move {
            let answer = match stream {
                Some(feedback) => {
                    provider
                        .chat_stream(wire_ref, &key, &|text| feedback.show(text))
                        .await
                }
                None => provider.chat(wire_ref, &key).await,
            };
            answer.map_err(|e| CallErr::from_model(e, llm))
        })
        .await?;
    Ok(ChatCall {
        step,
        model: wire.model,
        outcome: attempted.result,
        attempts: attempted.attempts,
        duration_ms: attempted.duration_ms,
        journalled: false,
    })
}

/// The summary the prompt gives, and whether it folded the plan's turns: the carried one or,
/// with turns to fold, a new one made by a journalled `summary` step (step `step_no`), whose
/// completion records the newest message it covers for the conversation's later messages;
/// the carried one still when the new one could not be made.
async fn summary_of(
    svc: &Worker,
    exec: &StepExec<'_>,
    model: (&OpenAiClient, &str),
    step_no: i64,
    plan: &history::Plan<'_>,
) -> Result<(Option<String>, bool), RunError> {
    let carried = plan.carried.as_ref().map(|(text, _)| text.clone());
    if plan.fold.is_empty() {
        return Ok((carried, true));
    }
    let fold = (carried.as_deref(), plan.fold);
    match summarize_history(svc, exec, model, step_no, fold).await? {
        Some(made) => Ok((Some(made), true)),
        None => Ok((carried, false)),
    }
}

/// Folds `fold` turns (at least one), after `previous` (the summary so far), into a summary
/// with a journalled `summary` step; `None` when the summary could not be made. A summary
/// made is journalled with the id of the newest message it covers (`summary_through`).
async fn summarize_history(
    svc: &Worker,
    exec: &StepExec<'_>,
    (provider, model): (&OpenAiClient, &str),
    step_no: i64,
    (previous, fold): (Option<&str>, &[history::Turn]),
) -> Result<Option<String>, RunError> {
    let prompt = &svc.config.context.summary_prompt;
    // At most a quarter of a small window, so that the transcript has room.
    let max_tokens = svc
        .config
        .context
        .summary_max_tokens
        .min(provider.context_window / 4);
    let room = history_budget(usize::MAX, provider.context_window, max_tokens, prompt);
    let request = ChatRequest {
        model: model.to_string(),
        messages: vec![
            ChatMessage::system(prompt.clone()),
            ChatMessage::user(history::summary_request(previous, fold, room)),
        ],
        temperature: 0.0,
        max_tokens,
        tools: Vec::new(),
        tool_choice: None,
    };
    let call = chat_step_call(svc, exec, provider, step_no, SUMMARY, &request, None).await?;
    let made = match call.outcome {
        Ok(ref answer) if !answer.content.trim().is_empty() => Some(answer.content.clone()),
        Ok(_) => None,
        Err(ref err) => {
            tracing::warn!(error = %err.message, "history summary failed; leaving older turns out");
            None
        }
    };
    if !call.journalled {
        let mut record = call.record();
        record.summary_through = made.as_ref().and(fold.last().map(|t| t.message_id));
        exec.complete(&record).await?;
    }
    Ok(made)
}
