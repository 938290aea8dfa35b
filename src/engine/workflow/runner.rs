//! Runs a workflow by walking its graph from `start`, numbering every model call, tool call,
//! approval gate and undo as the next step. On resume the same walk replays: a step found
//! SUCCEEDED in the journal returns its journalled output instead of being executed, so the
//! walk (and the context given to the model) comes out the same, and execution continues at
//! the first step that did not finish. A non-idempotent step found PENDING after a crash is
//! not guessed at: it becomes UNKNOWN and the task waits for a human.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::config::{AgentNode, NodeKind, ReplyNode, Workflow};
use crate::backoff;
use crate::config::ToolKind;
use crate::domain::{
    AuditEvent, FailureType, PendingKind, ReplyType, StepStatus, StepType, TaskStatus, now_ms,
    reply_key, step_key, truncate,
};
use crate::domain::{Fence, NewReply, NewStep, StepResult, StepRow, TaskOutcome};
use crate::engine::reply;
use crate::engine::task::{RunError, TaskContext, load_context, model_of};
use crate::engine::worker::Worker;
use crate::llm::{self, ChatMessage, ChatRequest, ChatResponse, Role, ToolChoice, ToolSpec};
use crate::store::StoreError;
use crate::store::workflow::NewPendingAction;

/// Longest error text kept on a step or task.
const ERROR_LIMIT: usize = 2000;

/// Why the walk stopped short of a reply node.
enum Stop {
    /// The task fails for good (after compensation).
    Failed(FailureType, String),
    /// The run ends without a terminal status (lost lease, parked, store trouble).
    Run(RunError),
}

impl Stop {
    /// The model refused the request as longer than its context window.
    fn is_context_too_long(&self) -> bool {
        matches!(self, Stop::Failed(FailureType::ContextTooLong, _))
    }
}

impl From<RunError> for Stop {
    fn from(e: RunError) -> Self {
        Stop::Run(e)
    }
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Run(RunError::Store(e))
    }
}

/// A successful call.
struct CallOk {
    output: Value,
    tokens_in: Option<i64>,
    tokens_out: Option<i64>,
}

/// A failed call and whether (and how) to try again.
struct CallErr {
    failure: FailureType,
    message: String,
    retry: Option<RetryPlan>,
    retry_after: Option<Duration>,
}

#[derive(Clone, Copy)]
struct RetryPlan {
    max_tries: u32,
    base_ms: u64,
    max_ms: u64,
}

/// How a journalled step came out.
enum StepDone {
    Ok { output: Value, compensated: bool },
    Failed(FailureType, String),
}

/// A finished compensable call, kept to undo it if the task fails later.
struct Compensable {
    step_no: i64,
    tool: String,
    args: Value,
    result: Value,
}

struct Runner<'a> {
    svc: &'a Worker,
    fence: &'a Fence,
    lost: &'a CancellationToken,
    ctx: &'a TaskContext,
    journal: HashMap<i64, StepRow>,
    step_no: i64,
    /// Node id → output, the `steps` of templates.
    outputs: Map<String, Value>,
    compensable: Vec<Compensable>,
    trace: Vec<Value>,
    /// Only replay the journal: the first step not finished in it ends the walk instead of
    /// being executed (see [`replay`]).
    replay_only: bool,
}

pub async fn run(
    svc: &Worker,
    fence: &Fence,
    lost: &CancellationToken,
    ctx: &TaskContext,
) -> Result<(), RunError> {
    let (mut runner, workflow) = Runner::prepare(svc, fence, lost, ctx, false).await?;
    match runner.walk(&workflow).await {
        Ok((reply_type, content, result)) => {
            runner.finish_success(reply_type, content, result).await
        }
        Err(Stop::Failed(failure, message)) => {
            runner.compensate().await?;
            runner.finish_failure(failure, message).await
        }
        Err(Stop::Run(e)) => Err(e),
    }
}

/// What a resume rebuilds before it executes anything: the task, its message and agent
/// snapshot, the parsed workflow, the step journal, and the walk replayed through every
/// finished step (outputs, template context, model transcripts). Writes nothing and calls
/// nothing; returns how many journalled steps were replayed. Used to measure resume cost
/// (`assistd-bench context`).
pub async fn replay(svc: &Worker, task_id: i64) -> Result<i64, RunError> {
    let ctx = load_context(svc, task_id).await?;
    // Fenced on an impossible version: should the walk reach a write, it cannot land.
    let fence = Fence {
        task_id,
        owner: String::new(),
        version: -1,
    };
    let lost = CancellationToken::new();
    let (mut runner, workflow) = Runner::prepare(svc, &fence, &lost, &ctx, true).await?;
    match runner.walk(&workflow).await {
        Ok(_) | Err(Stop::Failed(..)) | Err(Stop::Run(RunError::Parked)) => Ok(runner.step_no),
        Err(Stop::Run(e)) => Err(e),
    }
}

impl<'a> Runner<'a> {
    /// The task's snapshotted workflow, parsed, and a runner over its step journal.
    async fn prepare(
        svc: &'a Worker,
        fence: &'a Fence,
        lost: &'a CancellationToken,
        ctx: &'a TaskContext,
        replay_only: bool,
    ) -> Result<(Runner<'a>, Workflow), RunError> {
        let raw = ctx
            .agent
            .workflow
            .as_ref()
            .ok_or_else(|| RunError::Corrupt("workflow agent without a workflow".into()))?;
        let workflow = Workflow::parse(raw, &svc.tools, !ctx.agent.approvers.is_empty())
            .map_err(|e| RunError::Corrupt(format!("snapshotted workflow is invalid: {e}")))?;
        let journal = svc
            .store
            .task_steps(fence.task_id)
            .await?
            .into_iter()
            .map(|s| (s.step_no, s))
            .collect();
        let runner = Runner {
            svc,
            fence,
            lost,
            ctx,
            journal,
            step_no: 0,
            outputs: Map::new(),
            compensable: Vec::new(),
            trace: Vec::new(),
            replay_only,
        };
        Ok((runner, workflow))
    }

    fn template_context(&self) -> Value {
        let m = &self.ctx.message;
        json!({
            "message": {
                "text": m.text,
                "sender_id": m.sender_id,
                "sender_name": m.sender_name,
                "conversation_id": m.conversation_id,
                "message_id": m.external_message_id,
            },
            "steps": self.outputs,
        })
    }

    fn render(&self, template: &str) -> Result<String, Stop> {
        crate::tools::render(template, &self.template_context())
            .map_err(|e| Stop::Failed(FailureType::Unknown, e.message))
    }

    fn render_value(&self, value: &Value) -> Result<Value, Stop> {
        Ok(match value {
            Value::String(s) => Value::String(self.render(s)?),
            Value::Array(items) => Value::Array(
                items
                    .iter()
                    .map(|v| self.render_value(v))
                    .collect::<Result<_, _>>()?,
            ),
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| Ok((k.clone(), self.render_value(v)?)))
                    .collect::<Result<_, Stop>>()?,
            ),
            other => other.clone(),
        })
    }

    /// Walks the graph to its reply node; returns the reply and the task result.
    async fn walk(&mut self, workflow: &Workflow) -> Result<(ReplyType, Value, String), Stop> {
        let mut id = workflow.start.clone();
        loop {
            let node = workflow
                .node(&id)
                .cloned()
                .ok_or_else(|| Stop::Run(RunError::Corrupt(format!("unknown node `{id}`"))))?;
            let first_step = self.step_no + 1;
            let next = match &node.kind {
                NodeKind::Llm(n) => {
                    let prompt = self.render(&n.prompt)?;
                    let system = ChatMessage::system(self.ctx.agent.system_prompt.clone());
                    let messages = vec![system.clone(), ChatMessage::user(prompt.clone())];
                    let answer = match self.llm_call("llm", messages, Vec::new(), None).await {
                        // Refused as too long: once more, with the prompt cut to fit.
                        Err(stop) if stop.is_context_too_long() => {
                            let cut = self.cut_to_fit(&prompt)?;
                            tracing::warn!(node = %id, "the model refused the prompt as too long; asking again with it cut");
                            let messages = vec![system, ChatMessage::user(cut)];
                            self.llm_call("llm", messages, Vec::new(), None).await?
                        }
                        other => other?,
                    };
                    let text = reply::answer_text(&answer, &self.ctx.agent.fallback_text)
                        .map_err(|(f, m)| Stop::Failed(f, format!("node `{id}`: {m}")))?;
                    self.outputs.insert(id.clone(), json!({ "text": text }));
                    Some(n.next.clone())
                }
                NodeKind::Tool(n) => {
                    let args = self.render_value(&n.args)?;
                    match self.tool_call(&n.tool, args).await? {
                        Ok(output) => {
                            self.outputs.insert(id.clone(), output);
                        }
                        Err(message) => return Err(Stop::Failed(FailureType::ToolFailed, message)),
                    }
                    Some(n.next.clone())
                }
                NodeKind::Agent(n) => {
                    let text = self.agent_loop(&id, n).await?;
                    self.outputs.insert(id.clone(), json!({ "text": text }));
                    Some(n.next.clone())
                }
                NodeKind::Condition(n) => {
                    let context = self.template_context();
                    let mut chosen = n.default.clone();
                    for branch in &n.branches {
                        let holds =
                            crate::templating::is_true(&branch.when, &context).map_err(|e| {
                                Stop::Failed(FailureType::Unknown, format!("node `{id}`: {e}"))
                            })?;
                        if holds {
                            chosen = branch.next.clone();
                            break;
                        }
                    }
                    self.outputs.insert(id.clone(), json!({ "branch": chosen }));
                    Some(chosen)
                }
                NodeKind::HumanConfirm(n) => {
                    let message = self.render(&n.message)?;
                    let approvers = n
                        .approvers
                        .clone()
                        .filter(|a| !a.is_empty())
                        .unwrap_or_else(|| self.ctx.agent.approvers.clone());
                    let deadline = n
                        .deadline_secs
                        .unwrap_or(self.ctx.agent.confirm_deadline_secs);
                    let decision = self
                        .gate(
                            PendingKind::Confirm,
                            "confirm",
                            &json!({}),
                            message,
                            approvers,
                            deadline,
                        )
                        .await?;
                    self.outputs.insert(id.clone(), decision);
                    Some(n.next.clone())
                }
                NodeKind::Reply(n) => {
                    self.trace.push(json!({ "node": id, "type": "reply" }));
                    return self.compose_reply(n);
                }
            };
            self.trace.push(json!({
                "node": id,
                "type": node_type(&node.kind),
                "steps": [first_step, self.step_no],
            }));
            id = next.unwrap_or_default();
        }
    }

    fn compose_reply(&self, node: &ReplyNode) -> Result<(ReplyType, Value, String), Stop> {
        if let Some(card) = &node.card {
            let card = self.render_value(card)?;
            let text = match &node.text {
                Some(t) => self.render(t)?,
                None => card
                    .get("title")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            };
            let result = card.to_string();
            return Ok((
                ReplyType::Card,
                json!({ "text": text, "card": card }),
                result,
            ));
        }
        let text = self.render(node.text.as_deref().unwrap_or_default())?;
        if text.trim().is_empty() {
            // Never an empty chat message: the user gets the failure notice instead.
            return Err(Stop::Failed(
                FailureType::InvalidResponse,
                "the reply rendered an empty message".into(),
            ));
        }
        let (reply_type, content) = reply::compose_answer(&text);
        Ok((reply_type, content, text))
    }

    /// A model-driven tool loop: the model answers or asks for tools; each model call and
    /// each tool call (several in one answer too) is a step of its own; tool errors of
    /// read-only tools go back to the model. When `max_steps` model turns all asked for tools,
    /// one last turn with `tool_choice: none` makes the model answer with what it has.
    async fn agent_loop(&mut self, id: &str, node: &AgentNode) -> Result<String, Stop> {
        let prompt = self.render(&node.prompt)?;
        let head = vec![
            ChatMessage::system(self.ctx.agent.system_prompt.clone()),
            ChatMessage::user(prompt),
        ];
        let specs = self.svc.tools.function_specs(&node.tools);
        let every = self.svc.config.context.summary_every_steps as usize;
        // Room for the loop's rounds: the history budget less the node's prompt.
        let budget = self
            .history_budget()?
            .saturating_sub(llm::message_tokens(&head[1]));
        // Messages since the last summary, in rounds (an assistant turn and its tool results).
        let mut window: Vec<ChatMessage> = Vec::new();
        let mut summary: Option<String> = None;
        let mut since_summary = 0usize;
        let first_choice = node.tool_choice.as_deref().map(ToolChoice::parse);
        let with_summary = |head: &[ChatMessage], summary: &Option<String>| {
            let mut messages = head.to_vec();
            if let Some(s) = summary {
                messages.push(ChatMessage::user(format!(
                    "Summary of the work so far:\n{s}"
                )));
            }
            messages
        };
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
                    let mut retry_head = head.clone();
                    if window.is_empty() {
                        retry_head[1] = ChatMessage::user(self.cut_to_fit(&head[1].content)?);
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
            for call in &answer.tool_calls {
                let name = call.function.name.clone();
                let outcome = if !node.tools.contains(&name) {
                    Err(format!("tool `{name}` is not available here"))
                } else if answer.truncated() {
                    Err("the call was cut off at max_tokens; make it shorter".to_string())
                } else {
                    match serde_json::from_str::<Value>(
                        if call.function.arguments.trim().is_empty() {
                            "{}"
                        } else {
                            &call.function.arguments
                        },
                    ) {
                        Err(e) => Err(format!("arguments are not JSON: {e}")),
                        Ok(args) => {
                            since_summary += 1;
                            self.tool_call(&name, args).await?
                        }
                    }
                };
                let content = match outcome {
                    Ok(output) => output.to_string(),
                    Err(error) => json!({ "error": error }).to_string(),
                };
                window.push(ChatMessage::tool_result(call.id.clone(), content));
            }
        }
        unreachable!("the last turn returns")
    }

    /// The agent's history budget (`context.history_token_budget`, less where the provider's
    /// context window leaves less room after `max_tokens` and the system prompt).
    fn history_budget(&self) -> Result<usize, Stop> {
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
    fn cut_to_fit(&self, prompt: &str) -> Result<String, Stop> {
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
    async fn fold_into_summary(
        &mut self,
        previous: Option<&str>,
        older: &[ChatMessage],
    ) -> Result<String, Stop> {
        let text = self.summarize(previous, older).await?;
        if !self
            .svc
            .store
            .set_context_summary(self.fence, &text, now_ms())
            .await?
        {
            return Err(Stop::Run(RunError::LostLease));
        }
        Ok(text)
    }

    /// A journalled model call that folds `older` messages into the rolling summary.
    async fn summarize(
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
    async fn llm_call(
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
                        retry: svc
                            .config
                            .llm
                            .retry
                            .policy(e.failure_type)
                            .map(|p| RetryPlan {
                                max_tries: p.max_attempts,
                                base_ms: p.backoff_base_ms,
                                max_ms: p.backoff_max_ms,
                            }),
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
    async fn tool_call(&mut self, name: &str, args: Value) -> Result<Result<Value, String>, Stop> {
        let svc = self.svc;
        let tool = svc
            .tools
            .get(name)
            .ok_or_else(|| {
                Stop::Failed(FailureType::ToolFailed, format!("no tool named `{name}`"))
            })?
            .clone();
        if let Err(e) = svc.tools.check_args(name, &args) {
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
        };
        let args_ref = &args;
        let done = self
            .journal(
                StepType::Tool,
                name,
                &args,
                tool.is_idempotent(),
                move |key| async move {
                    match svc.tools.call(name, args_ref, &key).await {
                        Ok(output) => Ok(CallOk {
                            output,
                            tokens_in: None,
                            tokens_out: None,
                        }),
                        Err(e) => Err(CallErr {
                            failure: FailureType::ToolFailed,
                            retry: e.retryable.then_some(plan),
                            message: e.message,
                            retry_after: None,
                        }),
                    }
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

    /// An approval gate: passes when the journal holds the approval, else parks the task.
    async fn gate(
        &mut self,
        kind: PendingKind,
        name: &str,
        args: &Value,
        message: String,
        approvers: Vec<String>,
        deadline_secs: u64,
    ) -> Result<Value, Stop> {
        self.step_no += 1;
        let step_no = self.step_no;
        if let Some(row) = self.journal.get(&step_no) {
            self.expect_name(row, name)?;
            match row.status {
                StepStatus::Succeeded => {
                    return Ok(parse_output(row.output.as_deref()));
                }
                StepStatus::Failed => {
                    return Err(Stop::Failed(
                        FailureType::Cancelled,
                        row.error.clone().unwrap_or_else(|| "rejected".into()),
                    ));
                }
                _ => {}
            }
        }
        let key = step_key(self.fence.task_id, step_no, name);
        let input = args.to_string();
        let now = now_ms();
        let action = NewPendingAction {
            step_no,
            kind,
            tool_name: name.to_string(),
            args: input.clone(),
            approvers,
            message: message.clone(),
            deadline: now + (deadline_secs as i64) * 1000,
        };
        let card = self.approval_card(&action);
        let parked = self
            .svc
            .store
            .park_for_confirmation(
                self.fence,
                &NewStep {
                    step_no,
                    step_type: StepType::Human,
                    tool_name: name,
                    idempotency_key: &key,
                    input: &input,
                },
                &action,
                &card,
                now,
            )
            .await?;
        if !parked {
            return Err(Stop::Run(RunError::LostLease));
        }
        self.svc.wake.replies.notify_one();
        Err(Stop::Run(RunError::Parked))
    }

    /// The approval request sent to the chat: a card with Approve/Reject actions whose
    /// callback is the channel's actions webhook.
    fn approval_card(&self, action: &NewPendingAction) -> NewReply {
        let task = &self.ctx.task;
        let value = |decision: &str| json!({ "task_id": task.id, "step_no": action.step_no, "decision": decision });
        let card = json!({
            "card_type": "approval_request",
            "title": "Approval needed",
            "message": action.message,
            "kind": action.kind.as_str(),
            "tool": action.tool_name,
            "args": serde_json::from_str::<Value>(&action.args).unwrap_or(Value::Null),
            "approvers": action.approvers,
            "deadline": action.deadline,
            "actions": [
                { "id": "approve", "label": "Approve", "callback": "/webhooks/generic/actions", "value": value("approve") },
                { "id": "reject", "label": "Reject", "callback": "/webhooks/generic/actions", "value": value("reject") },
            ],
        });
        NewReply {
            idempotency_key: format!(
                "{}-confirm-{}",
                reply_key(task.id, task.resume_count),
                action.step_no
            ),
            channel: task.channel.clone(),
            conversation_id: task.conversation_id.clone(),
            in_reply_to: self.ctx.message.external_message_id.clone(),
            reply_type: ReplyType::Card,
            content:
                json!({ "text": format!("Approval needed: {}", action.message), "card": card })
                    .to_string(),
        }
    }

    fn expect_name(&self, row: &StepRow, name: &str) -> Result<(), Stop> {
        if row.tool_name != name {
            return Err(Stop::Run(RunError::Corrupt(format!(
                "journal diverged at step {}: expected `{name}`, found `{}`",
                row.step_no, row.tool_name
            ))));
        }
        Ok(())
    }

    /// Runs `call` as the next step, or replays it from the journal.
    async fn journal<F, Fut>(
        &mut self,
        step_type: StepType,
        name: &str,
        input: &Value,
        idempotent: bool,
        call: F,
    ) -> Result<StepDone, Stop>
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = Result<CallOk, CallErr>>,
    {
        self.step_no += 1;
        let step_no = self.step_no;
        let key = step_key(self.fence.task_id, step_no, name);
        if let Some(row) = self.journal.get(&step_no).cloned() {
            self.expect_name(&row, name)?;
            match row.status {
                StepStatus::Succeeded | StepStatus::Compensated => {
                    return Ok(StepDone::Ok {
                        output: parse_output(row.output.as_deref()),
                        compensated: row.status == StepStatus::Compensated,
                    });
                }
                StepStatus::Failed => {
                    let output = parse_output(row.output.as_deref());
                    let failure = output
                        .get("failure_type")
                        .and_then(Value::as_str)
                        .and_then(FailureType::parse)
                        .unwrap_or(FailureType::Unknown);
                    return Ok(StepDone::Failed(failure, row.error.unwrap_or_default()));
                }
                StepStatus::Pending if !idempotent => {
                    return Err(self.park_unknown(&row).await);
                }
                // Idempotent and interrupted, or UNKNOWN and approved: run it again.
                StepStatus::Pending | StepStatus::Unknown => {}
            }
        }
        if self.replay_only {
            // The resume point: a real run would execute this step.
            self.step_no -= 1;
            return Err(Stop::Run(RunError::Parked));
        }
        let input_text = input.to_string();
        let row = self
            .svc
            .journal
            .begin_step(
                self.fence,
                &NewStep {
                    step_no,
                    step_type,
                    tool_name: name,
                    idempotency_key: &key,
                    input: &input_text,
                },
            )
            .await?
            .ok_or(Stop::Run(RunError::LostLease))?;
        let started = Instant::now();
        let mut attempt = row.attempt;
        let mut tries = 0u32;
        let result = loop {
            attempt += 1;
            tries += 1;
            // The first try is fenced by `begin_step` and counted with the result;
            // retries are recorded as they start.
            if tries > 1
                && !self
                    .svc
                    .store
                    .record_step_attempt(self.fence, row.id, attempt)
                    .await?
            {
                return Err(Stop::Run(RunError::LostLease));
            }
            let outcome = tokio::select! {
                r = call(key.clone()) => r,
                _ = self.lost.cancelled() => return Err(Stop::Run(RunError::LostLease)),
            };
            match outcome {
                Ok(ok) => break Ok(ok),
                Err(err) => match err.retry.filter(|p| tries < p.max_tries) {
                    Some(plan) => {
                        let wait = backoff::delay(
                            tries,
                            plan.base_ms,
                            plan.max_ms,
                            err.retry_after,
                            Duration::from_secs(self.svc.config.llm.retry_after_max_secs),
                        );
                        tracing::warn!(step = step_no, name, attempt, error = %err.message, "step failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = self.lost.cancelled() => return Err(Stop::Run(RunError::LostLease)),
                        }
                    }
                    None => break Err(err),
                },
            }
        };
        crate::metrics::STEP_SECONDS.observe(started.elapsed());
        let duration_ms = started.elapsed().as_millis() as i64;
        let (record, done) = match result {
            Ok(ok) => (
                StepResult {
                    step_id: row.id,
                    attempts: attempt,
                    status: StepStatus::Succeeded,
                    output: Some(ok.output.to_string()),
                    error: None,
                    tokens_in: ok.tokens_in,
                    tokens_out: ok.tokens_out,
                    duration_ms,
                },
                StepDone::Ok {
                    output: ok.output,
                    compensated: false,
                },
            ),
            Err(err) => {
                let message = truncate(&err.message, ERROR_LIMIT);
                (
                    StepResult {
                        step_id: row.id,
                        attempts: attempt,
                        status: StepStatus::Failed,
                        output: Some(
                            json!({ "failure_type": err.failure.as_str(), "error": message })
                                .to_string(),
                        ),
                        error: Some(message.clone()),
                        tokens_in: None,
                        tokens_out: None,
                        duration_ms,
                    },
                    StepDone::Failed(err.failure, message),
                )
            }
        };
        if !self.svc.journal.complete_step(self.fence, &record).await? {
            return Err(Stop::Run(RunError::LostLease));
        }
        Ok(done)
    }

    async fn park_unknown(&self, row: &StepRow) -> Stop {
        let now = now_ms();
        let agent = &self.ctx.agent;
        let action = NewPendingAction {
            step_no: row.step_no,
            kind: PendingKind::UnknownStep,
            tool_name: row.tool_name.clone(),
            args: row.input.clone().unwrap_or_else(|| "null".into()),
            approvers: agent.approvers.clone(),
            message: format!(
                "`{}` was interrupted by a crash and may or may not have happened. Approve to run it again, reject to cancel the task.",
                row.tool_name
            ),
            deadline: now + (agent.confirm_deadline_secs as i64) * 1000,
        };
        let card = self.approval_card(&action);
        tracing::warn!(step = row.step_no, tool = %row.tool_name, "interrupted non-idempotent step; waiting for a human");
        match self
            .svc
            .store
            .park_unknown_step(self.fence, row.id, &action, &card, now)
            .await
        {
            Ok(true) => {
                self.svc.wake.replies.notify_one();
                Stop::Run(RunError::Parked)
            }
            Ok(false) => Stop::Run(RunError::LostLease),
            Err(e) => Stop::Run(RunError::Store(e)),
        }
    }

    /// Undoes the finished compensable steps, newest first; each undo is a journalled step.
    async fn compensate(&mut self) -> Result<(), RunError> {
        let svc = self.svc;
        let tooling = &svc.config.tooling;
        let plan = RetryPlan {
            max_tries: tooling.read_only_attempts,
            base_ms: tooling.retry_backoff_base_ms,
            max_ms: tooling.retry_backoff_max_ms,
        };
        while let Some(done) = self.compensable.pop() {
            let input = json!({ "args": done.args, "result": done.result });
            let (tool, args, result) = (&done.tool, &done.args, &done.result);
            let outcome = self
                .journal(
                    StepType::Undo,
                    &format!("undo:{tool}"),
                    &input,
                    true,
                    move |key| async move {
                        match svc.tools.undo(tool, args, result, &key).await {
                            Ok(output) => Ok(CallOk {
                                output,
                                tokens_in: None,
                                tokens_out: None,
                            }),
                            Err(e) => Err(CallErr {
                                failure: FailureType::ToolFailed,
                                retry: e.retryable.then_some(plan),
                                message: e.message,
                                retry_after: None,
                            }),
                        }
                    },
                )
                .await;
            match outcome {
                Ok(StepDone::Ok { .. }) => {
                    if !svc
                        .store
                        .mark_step_compensated(self.fence, done.step_no, now_ms())
                        .await?
                    {
                        return Err(RunError::LostLease);
                    }
                }
                Ok(StepDone::Failed(_, message)) => {
                    tracing::error!(step = done.step_no, tool = %done.tool, error = %message, "compensation failed");
                    svc.store
                        .audit(
                            Some(self.fence.task_id),
                            AuditEvent::TaskFailed,
                            &self.fence.owner,
                            &format!(
                                "undo of step {} ({}) failed: {message}",
                                done.step_no, done.tool
                            ),
                            true,
                            now_ms(),
                        )
                        .await?;
                }
                Err(Stop::Run(e)) => return Err(e),
                Err(Stop::Failed(_, message)) => {
                    return Err(RunError::Corrupt(format!(
                        "compensation stopped: {message}"
                    )));
                }
            }
        }
        Ok(())
    }

    fn trace_json(&self) -> String {
        json!({ "nodes": self.trace, "steps": self.step_no }).to_string()
    }

    async fn finish_success(
        &mut self,
        reply_type: ReplyType,
        content: Value,
        result: String,
    ) -> Result<(), RunError> {
        let task = &self.ctx.task;
        let outcome = TaskOutcome {
            status: TaskStatus::Succeeded,
            result: Some(result),
            trace: Some(self.trace_json()),
            failure_type: None,
            error: None,
            retries: 0,
            step: None,
            reply: NewReply {
                idempotency_key: reply_key(task.id, task.resume_count),
                channel: task.channel.clone(),
                conversation_id: task.conversation_id.clone(),
                in_reply_to: self.ctx.message.external_message_id.clone(),
                reply_type,
                content: content.to_string(),
            },
            audit_summary: format!("workflow finished after {} step(s)", self.step_no),
        };
        self.finish(outcome).await
    }

    async fn finish_failure(
        &mut self,
        failure: FailureType,
        message: String,
    ) -> Result<(), RunError> {
        tracing::warn!(failure_type = %failure, error = %message, "workflow failed");
        let task = &self.ctx.task;
        let notice =
            reply::failure_notice(&self.svc.config.replies.failure_notice, task.id, failure);
        let outcome = TaskOutcome {
            status: TaskStatus::Failed,
            result: None,
            trace: Some(self.trace_json()),
            failure_type: Some(failure),
            error: Some(truncate(&message, ERROR_LIMIT)),
            retries: 0,
            step: None,
            reply: NewReply {
                idempotency_key: reply_key(task.id, task.resume_count),
                channel: task.channel.clone(),
                conversation_id: task.conversation_id.clone(),
                in_reply_to: self.ctx.message.external_message_id.clone(),
                reply_type: ReplyType::Text,
                content: notice.to_string(),
            },
            audit_summary: format!("{failure}: {}", truncate(&message, 300)),
        };
        self.finish(outcome).await
    }

    async fn finish(&mut self, outcome: TaskOutcome) -> Result<(), RunError> {
        if !self.svc.journal.finish_task(self.fence, &outcome).await? {
            return Err(RunError::LostLease);
        }
        tracing::info!(status = %outcome.status, steps = self.step_no, "workflow task finished");
        self.svc.wake.replies.notify_one();
        Ok(())
    }
}

/// At most `bytes` of `text`: two thirds from its head and one third from its tail, with a
/// note of how much was cut between them (on character boundaries).
fn cut_middle(text: &str, bytes: usize) -> String {
    if text.len() <= bytes {
        return text.to_string();
    }
    let floor = |mut i: usize| {
        while !text.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let head = floor(bytes * 2 / 3);
    let tail = floor(text.len() - (bytes - bytes * 2 / 3));
    let tail = if tail < head { head } else { tail };
    format!(
        "{}\n[… {} bytes cut to fit the model's context window …]\n{}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
}

fn parse_output(text: Option<&str>) -> Value {
    text.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or(Value::Null)
}

fn node_type(kind: &NodeKind) -> &'static str {
    match kind {
        NodeKind::Llm(_) => "llm",
        NodeKind::Tool(_) => "tool",
        NodeKind::Agent(_) => "agent",
        NodeKind::Condition(_) => "condition",
        NodeKind::HumanConfirm(_) => "human_confirm",
        NodeKind::Reply(_) => "reply",
    }
}

#[cfg(test)]
mod tests {
    use super::cut_middle;

    #[test]
    fn a_cut_keeps_head_and_tail_on_character_boundaries() {
        let text = format!("start {} end", "é".repeat(200));
        let cut = cut_middle(&text, 90);
        assert!(cut.starts_with("start ") && cut.ends_with(" end"), "{cut}");
        assert!(cut.contains("bytes cut to fit"), "{cut}");
        assert!(cut.len() < text.len());
        assert_eq!(cut_middle("short", 90), "short");
    }
}
