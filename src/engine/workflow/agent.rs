//! A workflow's `agent` node: the model/tool loop (tools offered, several calls per answer,
//! the last turn without tools), the history budget and its summaries, and one model or
//! tool call as a journalled step.

use serde_json::{Value, json};

use crate::definition::ToolKind;
use crate::definition::workflow::AgentNode;
use crate::domain::{FailureType, PendingKind, StepType, truncate};
use crate::engine::reply;
use crate::engine::task::{RunError, model_of};
use crate::llm::{self, ChatMessage, ChatRequest, ChatResponse, Role, ToolChoice, ToolSpec};

use super::runner::{
    CallOk, Compensable, Runner, StepDone, Stop, cut_middle, model_view, tool_outcome,
};
use crate::engine::step::{CallErr, RetryPlan};

impl Runner<'_> {
    /// A model-driven tool loop: the model answers or asks for tools; each model call and
    /// each tool call (several in one answer too) is a step of its own; tool errors of
    /// read-only tools go back to the model. When `max_steps` model turns all asked for tools,
    /// one last turn with `tool_choice: none` makes the model answer with what it has.
    pub(super) async fn agent_loop(&mut self, id: &str, node: &AgentNode) -> Result<String, Stop> {
        let prompt = ChatMessage::user(self.render(&node.prompt)?);
        let system = ChatMessage::system(self.ctx.agent.system_prompt.clone());
        // The system prompt, the conversation's earlier exchanges (and the group's chatter),
        // the node's prompt.
        let mut head = vec![system.clone()];
        head.extend(self.context_messages());
        head.push(prompt.clone());
        let specs = self.tools.function_specs(&node.tools);
        let every = self.svc.config.context.summary_every_steps as usize;
        // Room for the loop's rounds: the history budget less the history and the prompt.
        let budget = self
            .history_budget()?
            .saturating_sub(head[1..].iter().map(llm::message_tokens).sum());
        // Messages since the last summary, in rounds (an assistant turn and its tool results).
        let mut window: Vec<ChatMessage> = Vec::new();
        let mut summary: Option<String> = None;
        let mut since_summary = 0usize;
        let first_choice = node.tool_choice.as_deref().map(ToolChoice::parse);
        for turn in 0..=node.max_steps {
            let window_tokens: usize = window.iter().map(llm::message_tokens).sum();
            if since_summary >= every || window_tokens > budget {
                let last_round = window
                    .iter()
                    .rposition(|m| m.role == Role::Assistant)
                    .unwrap_or(window.len());
                if last_round > 0 {
                    let older: Vec<ChatMessage> = window.drain(..last_round).collect();
                    summary = Some(self.fold_into_summary(summary.as_deref(), &older).await?);
                    since_summary = window.len();
                }
            }
            let mut messages = with_summary(&head, &summary);
            messages.extend(window.iter().cloned());
            let last_turn = turn == node.max_steps;
            let choice = if last_turn {
                Some(ToolChoice::None)
            } else if turn == 0 {
                first_choice.clone()
            } else {
                None
            };
            let answer = match self
                .llm_call("llm", messages, specs.clone(), choice.clone())
                .await
            {
                // Refused as too long: fold every round into the summary (or, with none yet,
                // cut the node's prompt) and ask once more.
                Err(stop) if stop.is_context_too_long() => {
                    // Without the conversation's history first of all.
                    let mut retry_head = vec![system.clone(), prompt.clone()];
                    if window.is_empty() {
                        retry_head[1] = ChatMessage::user(self.cut_to_fit(&prompt.content)?);
                    } else {
                        let older = std::mem::take(&mut window);
                        summary = Some(self.fold_into_summary(summary.as_deref(), &older).await?);
                        since_summary = 0;
                    }
                    tracing::warn!(
                        node = id,
                        "the model refused the context as too long; asking again with it shrunk"
                    );
                    let messages = with_summary(&retry_head, &summary);
                    self.llm_call("llm", messages, specs.clone(), choice)
                        .await?
                }
                other => other?,
            };
            since_summary += 1;
            if answer.tool_calls.is_empty() || last_turn {
                if answer.truncated() {
                    tracing::warn!(node = id, "the model's answer was cut at max_tokens");
                }
                return reply::answer_text(&answer, &self.ctx.agent.fallback_text).map_err(
                    |(f, m)| {
                        Stop::Failed(
                            f,
                            format!("agent node `{id}`, model turn {}: {m}", turn + 1),
                        )
                    },
                );
            }
            if answer.truncated() {
                // Calls cut off mid-arguments are not run; the model is told and asked again.
                tracing::warn!(node = id, "tool calls cut at max_tokens; asking again");
            }
            window.push(ChatMessage::assistant_calls(
                answer.content.clone(),
                answer.tool_calls.clone(),
            ));
            let (results, ran) = self.run_calls(node, &answer).await?;
            since_summary += ran;
            window.extend(results);
        }
        unreachable!("the last turn returns")
    }

    /// Runs the tool calls of one model answer in order, each a step of its own: one `tool`
    /// message per call (an error the model can act on where a call was refused or failed),
    /// and how many calls ran.
    pub(super) async fn run_calls(
        &mut self,
        node: &AgentNode,
        answer: &ChatResponse,
    ) -> Result<(Vec<ChatMessage>, usize), Stop> {
        let mut results = Vec::with_capacity(answer.tool_calls.len());
        let mut ran = 0;
        for call in &answer.tool_calls {
            // The function name offered for `<server>.<tool>` is `<server>__<tool>`.
            let name = node
                .tools
                .iter()
                .find(|t| crate::tools::mcp::function_name(t) == call.function.name)
                .cloned()
                .unwrap_or_else(|| call.function.name.clone());
            let outcome = if !node.tools.contains(&name) {
                Err(format!("tool `{name}` is not available here"))
            } else if answer.truncated() {
                Err("the call was cut off at max_tokens; make it shorter".to_string())
            } else {
                match serde_json::from_str::<Value>(if call.function.arguments.trim().is_empty() {
                    "{}"
                } else {
                    &call.function.arguments
                }) {
                    Err(e) => Err(format!("arguments are not JSON: {e}")),
                    Ok(args) => {
                        ran += 1;
                        self.tool_call(&name, args).await?
                    }
                }
            };
            let content = match outcome {
                Ok(output) => model_view(
                    &output.to_string(),
                    self.svc.config.journal.model_view_bytes,
                ),
                Err(error) => json!({ "error": error }).to_string(),
            };
            results.push(ChatMessage::tool_result(call.id.clone(), content));
        }
        Ok((results, ran))
    }

    /// The agent's history budget (`context.history_token_budget`, less where the provider's
    /// context window leaves less room after `max_tokens` and the system prompt).
    pub(super) fn history_budget(&self) -> Result<usize, Stop> {
        let agent = &self.ctx.agent;
        let (provider, _) = model_of(self.svc, agent)?;
        Ok(llm::history_budget(
            self.svc.config.context.history_token_budget,
            provider.context_window,
            agent.max_tokens,
            &agent.system_prompt,
        ))
    }

    /// `prompt` cut to what the context window leaves (and at least to half, since the model
    /// refused it whole): its head and tail, with a note of the cut between them.
    pub(super) fn cut_to_fit(&self, prompt: &str) -> Result<String, Stop> {
        let agent = &self.ctx.agent;
        let (provider, _) = model_of(self.svc, agent)?;
        let room = llm::history_budget(
            usize::MAX,
            provider.context_window,
            agent.max_tokens,
            &agent.system_prompt,
        );
        // Bytes the estimate allows (a token per three bytes, less the message overhead).
        let bytes = room
            .saturating_sub(8)
            .saturating_mul(3)
            .min(prompt.len() / 2);
        Ok(cut_middle(prompt, bytes))
    }

    /// Folds `older` messages into the rolling summary (a journalled step) and keeps it on the
    /// task; returns the new summary.
    pub(super) async fn fold_into_summary(
        &mut self,
        previous: Option<&str>,
        older: &[ChatMessage],
    ) -> Result<String, Stop> {
        let text = self.summarize(previous, older).await?;
        if !self
            .svc
            .journal
            .set_context_summary(self.fence, &text)
            .await?
        {
            return Err(Stop::Run(RunError::LostLease));
        }
        Ok(text)
    }

    /// A journalled model call that folds `older` messages into the rolling summary.
    pub(super) async fn summarize(
        &mut self,
        previous: Option<&str>,
        older: &[ChatMessage],
    ) -> Result<String, Stop> {
        let mut text = String::new();
        if let Some(p) = previous {
            text.push_str(&format!("Summary so far:\n{p}\n\n"));
        }
        text.push_str("Steps since then:\n");
        for m in older {
            let calls: Vec<String> = m
                .tool_calls
                .iter()
                .map(|c| format!("{}({})", c.function.name, c.function.arguments))
                .collect();
            let body = if calls.is_empty() {
                m.content.clone()
            } else {
                format!("calls {}", calls.join(", "))
            };
            text.push_str(&format!("{}: {}\n", m.role, truncate(&body, 2000)));
        }
        let messages = vec![
            ChatMessage::system(self.svc.config.context.summary_prompt.clone()),
            ChatMessage::user(text),
        ];
        Ok(self
            .llm_call("summary", messages, Vec::new(), None)
            .await?
            .content)
    }

    /// One journalled model call (`name` is the step's name: `llm` or `summary`). The step's
    /// input is the request body exactly as sent.
    pub(super) async fn llm_call(
        &mut self,
        name: &str,
        messages: Vec<ChatMessage>,
        tools: Vec<ToolSpec>,
        tool_choice: Option<ToolChoice>,
    ) -> Result<ChatResponse, Stop> {
        let agent = &self.ctx.agent;
        let (provider, model) = model_of(self.svc, agent)?;
        let request = ChatRequest {
            model,
            messages,
            temperature: agent.temperature,
            max_tokens: agent.max_tokens,
            tools,
            tool_choice,
        }
        .to_wire();
        let input = crate::llm::wire_json(&request);
        let svc = self.svc;
        let request_ref = &request;
        let done = self
            .journal(StepType::Llm, name, &input, true, move |key| async move {
                match provider.chat(request_ref, &key).await {
                    Ok(answer) => Ok(CallOk {
                        tokens_in: answer.prompt_tokens,
                        tokens_out: answer.completion_tokens,
                        output: serde_json::to_value(&answer).unwrap_or(Value::Null),
                    }),
                    Err(e) => Err(CallErr {
                        retry: RetryPlan::for_model(&svc.config.llm, e.failure_type),
                        failure: e.failure_type,
                        message: e.message,
                        retry_after: e.retry_after,
                    }),
                }
            })
            .await?;
        match done {
            StepDone::Ok { output, .. } => serde_json::from_value(output).map_err(|e| {
                Stop::Run(RunError::Corrupt(format!(
                    "journalled model answer unreadable: {e}"
                )))
            }),
            StepDone::Failed(failure, message) => Err(Stop::Failed(failure, message)),
        }
    }

    /// One journalled tool call: irreversible tools pass an approval gate first; a failure
    /// is `Ok(Err(..))` for read-only tools (the caller may hand it on) and a stop for the
    /// others.
    pub(super) async fn tool_call(
        &mut self,
        name: &str,
        args: Value,
    ) -> Result<Result<Value, String>, Stop> {
        let svc = self.svc;
        let tools = self.tools.clone();
        let tools = &*tools;
        let tool = tools
            .get(name)
            .ok_or_else(|| {
                Stop::Failed(FailureType::ToolFailed, format!("no tool named `{name}`"))
            })?
            .clone();
        if let Err(e) = tools.check_args(name, &args) {
            return Ok(Err(format!("invalid arguments for `{name}`: {e}")));
        }
        if tool.kind == ToolKind::Irreversible {
            let message = format!(
                "Run `{name}` ({}) with {}?",
                if tool.description.is_empty() {
                    "irreversible"
                } else {
                    &tool.description
                },
                truncate(&args.to_string(), 500)
            );
            self.gate(
                PendingKind::Tool,
                &format!("confirm:{name}"),
                &args,
                message,
                self.ctx.agent.approvers.clone(),
                self.ctx.agent.confirm_deadline_secs,
            )
            .await?;
        }
        let tooling = &svc.config.tooling;
        let plan = RetryPlan {
            max_tries: if tool.kind == ToolKind::ReadOnly {
                tooling.read_only_attempts
            } else {
                1
            },
            base_ms: tooling.retry_backoff_base_ms,
            max_ms: tooling.retry_backoff_max_ms,
            patience: None,
        };
        let args_ref = &args;
        let done = self
            .journal(
                StepType::Tool,
                name,
                &args,
                tool.is_idempotent(),
                move |key| async move {
                    tool_outcome(tools.call(name, args_ref, &key).await, plan)
                },
            )
            .await?;
        match done {
            StepDone::Ok {
                output,
                compensated,
            } => {
                if tool.kind == ToolKind::Compensable && !compensated {
                    self.compensable.push(Compensable {
                        step_no: self.step_no,
                        tool: name.to_string(),
                        args: args.clone(),
                        result: output.clone(),
                    });
                }
                Ok(Ok(output))
            }
            StepDone::Failed(_, message) if tool.kind == ToolKind::ReadOnly => Ok(Err(message)),
            StepDone::Failed(failure, message) => Err(Stop::Failed(failure, message)),
        }
    }
}

/// The node's head (system prompt and prompt) and, when there is one, the summary so far.
fn with_summary(head: &[ChatMessage], summary: &Option<String>) -> Vec<ChatMessage> {
    let mut messages = head.to_vec();
    if let Some(s) = summary {
        messages.push(ChatMessage::user(format!(
            "Summary of the work so far:\n{s}"
        )));
    }
    messages
}
