//! Runs a workflow by walking its graph from `start`, numbering every model call, tool call,
//! approval gate and undo as the next step. On resume the same walk replays: a step found
//! SUCCEEDED in the journal returns its journalled output instead of being executed, so the
//! walk (and the context given to the model) comes out the same, and execution continues at
//! the first step that did not finish. A non-idempotent step found PENDING after a crash is
//! not guessed at: it becomes UNKNOWN and the task waits for a human.

use crate::engine::feedback::PROGRESS_WAIT;
use std::collections::HashMap;

use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use crate::definition::workflow::{LlmNode, NodeKind, ReplyNode, Workflow};
use crate::domain::{FailureType, PendingKind, ReplyType};
use crate::domain::{Fence, StepRow};
use crate::engine::reply;
use crate::engine::task::{RunError, TaskContext, load_context};
use crate::engine::worker::Worker;
use crate::llm::ChatMessage;
use crate::store::StoreError;

/// Why the walk stopped short of a reply node.
pub(super) enum Stop {
    /// The task fails for good (after compensation).
    Failed(FailureType, String),
    /// The run ends without a terminal status (lost lease, parked, store trouble).
    Run(RunError),
}

impl Stop {
    /// The model refused the request as longer than its context window.
    pub(super) fn is_context_too_long(&self) -> bool {
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
pub(super) struct CallOk {
    pub(super) output: Value,
    pub(super) tokens_in: Option<i64>,
    pub(super) tokens_out: Option<i64>,
}

/// How a journalled step came out.
pub(super) enum StepDone {
    Ok { output: Value, compensated: bool },
    Failed(FailureType, String),
}

/// A finished compensable call, kept to undo it if the task fails later.
pub(super) struct Compensable {
    pub(super) step_no: i64,
    pub(super) tool: String,
    pub(super) args: Value,
    pub(super) result: Value,
}

pub(super) struct Runner<'a> {
    pub(super) svc: &'a Worker,
    pub(super) fence: &'a Fence,
    pub(super) lost: &'a CancellationToken,
    pub(super) ctx: &'a TaskContext,
    pub(super) journal: HashMap<i64, StepRow>,
    pub(super) step_no: i64,
    /// Node id → output, the `steps` of templates.
    pub(super) outputs: Map<String, Value>,
    pub(super) compensable: Vec<Compensable>,
    pub(super) trace: Vec<Value>,
    /// Only replay the journal: the first step not finished in it ends the walk instead of
    /// being executed (see [`replay`]).
    pub(super) replay_only: bool,
    /// The agent's model name (token metrics).
    pub(super) model: String,
    /// A human declined what the task waited for (rejected, or let the deadline pass):
    /// the run undoes its compensable steps and ends CANCELLED with that notice.
    pub(super) declined: Option<Declined>,
    /// The conversation's earlier exchanges that fit the history budget, oldest first:
    /// `history` in templates and the turns before the prompt in `llm` and `agent` calls.
    pub(super) history: Vec<ChatMessage>,
    /// The group chat's messages not addressed to the bot before the question, as (who,
    /// text) (`channels.<platform>.group_context`): `group_context` in templates, and one
    /// message after the history in `llm` and `agent` calls.
    pub(super) chatter: Vec<(String, String)>,
    /// The tools this task may use: the configured ones and its pinned MCP tools.
    pub(super) tools: std::sync::Arc<crate::tools::task_tools::TaskTools>,
}

/// A declined approval met in the journal.
#[derive(Debug, Clone)]
pub(super) struct Declined {
    pub(super) expired: bool,
    /// The approver who rejected (empty for an expiry).
    pub(super) by: String,
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
    pub(super) async fn prepare(
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
        // A version published before MCP tools were pinned runs on the servers' list as it
        // is now.
        let pinned = if ctx.agent.mcp_tools.is_empty() {
            svc.tools.resolve_mcp(Some(raw))
        } else {
            ctx.agent.mcp_tools.clone()
        };
        let search = crate::engine::knowledge::search_tool(
            svc.knowledge.clone(),
            ctx.agent.knowledge.clone(),
        );
        let tools = crate::tools::task_tools::TaskTools::new(svc.tools.clone(), &pinned)
            .map_err(|e| RunError::Corrupt(format!("snapshotted MCP tools are invalid: {e}")))?
            .with_knowledge(
                &ctx.agent.knowledge,
                svc.config.knowledge.max_results,
                Some(search),
            );
        let workflow = Workflow::parse(raw, &tools, !ctx.agent.approvers.is_empty())
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
            model: crate::engine::task::model_of(svc, &ctx.agent)
                .map(|(_, model)| model)
                .unwrap_or_default(),
            declined: None,
            history: Vec::new(),
            chatter: Vec::new(),
            tools: std::sync::Arc::new(tools),
        };
        let mut runner = runner;
        runner.history = runner.recent_history().await?;
        runner.chatter = crate::engine::single_turn::group_chatter(svc, ctx).await?;
        Ok((runner, workflow))
    }

    pub(super) fn template_context(&self) -> Value {
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
            "history": self.history.iter().map(|m| json!({
                "role": m.role.as_str(),
                "text": m.content,
            })).collect::<Vec<_>>(),
            "group_context": self.chatter.iter().map(|(who, text)| json!({
                "sender": who,
                "text": text,
            })).collect::<Vec<_>>(),
        })
    }

    /// What a model call sees before its node's prompt: the conversation's earlier
    /// exchanges, then the group's chatter since (one message).
    pub(super) fn context_messages(&self) -> impl Iterator<Item = ChatMessage> + '_ {
        let chatter = crate::engine::single_turn::chatter_message(&self.chatter);
        self.history.iter().cloned().chain(chatter)
    }

    /// An `llm` node: one model call (the history before the prompt), its text as the
    /// node's output.
    async fn llm_node(&mut self, id: &str, n: &LlmNode) -> Result<(), Stop> {
        let prompt = self.render(&n.prompt)?;
        let system = ChatMessage::system(self.ctx.agent.system_prompt.clone());
        let mut messages = vec![system.clone()];
        messages.extend(self.context_messages());
        messages.push(ChatMessage::user(prompt.clone()));
        let answer = match self.llm_call("llm", messages, Vec::new(), None).await {
            // Refused as too long: once more, with the prompt cut to fit.
            Err(stop) if stop.is_context_too_long() => {
                let cut = self.cut_to_fit(&prompt)?;
                tracing::warn!(node = %id, "the model refused the prompt as too long; asking again with it cut, without the history");
                let messages = vec![system, ChatMessage::user(cut)];
                self.llm_call("llm", messages, Vec::new(), None).await?
            }
            other => other?,
        };
        let text = reply::answer_text(&answer, &self.ctx.agent.fallback_text)
            .map_err(|(f, m)| Stop::Failed(f, format!("node `{id}`: {m}")))?;
        self.outputs.insert(id.to_string(), json!({ "text": text }));
        Ok(())
    }

    /// Sends a node's progress line to the chat when the node starts for the first time (a
    /// replayed node was shown in its own run). Awaited, so lines arrive in order and before
    /// the answer, but bounded by [`PROGRESS_WAIT`]: a slow receiver costs a node at most
    /// that, and a failure only a log line.
    async fn show_progress(&self, id: &str, template: &str, first_step: i64) {
        if self.replay_only || self.journal.contains_key(&first_step) {
            return;
        }
        let text = match self.render(template) {
            Ok(text) => text,
            Err(Stop::Failed(_, error)) => {
                tracing::warn!(node = id, error = %error, "progress line not rendered");
                return;
            }
            Err(Stop::Run(_)) => return,
        };
        // Where the platform can edit, the line shows in the run's placeholder.
        if let Some(feedback) = self
            .ctx
            .feedback
            .as_ref()
            .filter(|f| f.shows_progress_lines())
        {
            feedback.show(&text);
        }
        let task = &self.ctx.task;
        let update = crate::channels::platform::Progress {
            key: format!(
                "{}-progress-{first_step}",
                crate::domain::reply_key(task.id, task.resume_count)
            ),
            task_id: self.ctx.task.id,
            conversation_id: self.ctx.task.conversation_id.clone(),
            in_reply_to: self.ctx.message.external_message_id.clone(),
            revision: first_step,
            text,
        };
        let sent = self.svc.channels.progress(&self.ctx.task.channel, &update);
        match tokio::time::timeout(PROGRESS_WAIT, sent).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(node = id, error = %e, "progress line not shown"),
            Err(_) => tracing::debug!(node = id, "progress line not shown in time"),
        }
    }

    /// The conversation's earlier exchanges (the agent's `history_messages` at most), the
    /// newest that fit the history budget as single-turn agents count it; older ones are
    /// left out (a workflow does not fold them into a summary step, so that its journal keeps
    /// the node steps only).
    async fn recent_history(&self) -> Result<Vec<ChatMessage>, RunError> {
        let mut turns = crate::engine::history::conversation_turns(self.svc, self.ctx).await?;
        // The last turn is this task's own message, which the node prompts carry.
        turns.pop();
        let budget = self.history_budget().unwrap_or(0);
        let keep = crate::engine::history::whole_exchanges(&turns, budget);
        let kept = turns.split_off(turns.len() - keep);
        Ok(kept.into_iter().map(|t| t.message).collect())
    }

    pub(super) fn render(&self, template: &str) -> Result<String, Stop> {
        crate::tools::render(template, &self.template_context())
            .map_err(|e| Stop::Failed(FailureType::Unknown, e.message))
    }

    pub(super) fn render_value(&self, value: &Value) -> Result<Value, Stop> {
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
    pub(super) async fn walk(
        &mut self,
        workflow: &Workflow,
    ) -> Result<(ReplyType, Value, String), Stop> {
        let mut id = workflow.start.clone();
        loop {
            let node = workflow
                .node(&id)
                .cloned()
                .ok_or_else(|| Stop::Run(RunError::Corrupt(format!("unknown node `{id}`"))))?;
            let first_step = self.step_no + 1;
            if let Some(progress) = &node.progress {
                self.show_progress(&id, progress, first_step).await;
            }
            let next = match &node.kind {
                NodeKind::Llm(n) => {
                    self.llm_node(&id, n).await?;
                    Some(n.next.clone())
                }
                NodeKind::Tool(n) => {
                    let args = self.render_value(&n.args)?;
                    self.tool_node(&id, &n.tool, args).await?;
                    Some(n.next.clone())
                }
                NodeKind::Retrieve(n) => {
                    let args = retrieve_args(&self.render(&n.query)?, n);
                    self.tool_node(&id, crate::definition::KNOWLEDGE_SEARCH, args)
                        .await?;
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

    pub(super) fn compose_reply(
        &self,
        node: &ReplyNode,
    ) -> Result<(ReplyType, Value, String), Stop> {
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
}

/// At most `bytes` of `text`: two thirds from its head and one third from its tail, with a
/// note of how much was cut between them (on character boundaries).
pub(super) fn cut_middle(text: &str, bytes: usize) -> String {
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

/// What a model is shown of a tool output: the whole when it is at most `bytes`, else its
/// head and tail with a note saying it was shortened and how long the whole is (the
/// journal and templates keep the whole).
pub(super) fn model_view(output: &str, bytes: usize) -> String {
    if output.len() <= bytes {
        return output.to_string();
    }
    let floor = |mut i: usize| {
        while !output.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let head = floor(bytes * 3 / 4);
    let tail = floor(output.len() - bytes / 4).max(head);
    format!(
        "{}\n[… shortened for the model: this tool output is {} bytes in all; {} bytes from \
         its middle are left out …]\n{}",
        &output[..head],
        output.len(),
        tail - head,
        &output[tail..]
    )
}

pub(super) fn parse_output(text: Option<&str>) -> Value {
    text.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or(Value::Null)
}

pub(super) fn node_type(kind: &NodeKind) -> &'static str {
    match kind {
        NodeKind::Llm(_) => "llm",
        NodeKind::Tool(_) => "tool",
        NodeKind::Retrieve(_) => "retrieve",
        NodeKind::Agent(_) => "agent",
        NodeKind::Condition(_) => "condition",
        NodeKind::HumanConfirm(_) => "human_confirm",
        NodeKind::Reply(_) => "reply",
    }
}

impl Runner<'_> {
    /// A `tool` or `retrieve` node: the tool's result is the node's output; a failure
    /// (after the tool's retries) ends the run.
    async fn tool_node(&mut self, id: &str, tool: &str, args: Value) -> Result<(), Stop> {
        match self.tool_call(tool, args).await? {
            Ok(output) => {
                self.outputs.insert(id.to_string(), output);
                Ok(())
            }
            Err(message) => Err(Stop::Failed(FailureType::ToolFailed, message)),
        }
    }
}

/// A `retrieve` node's `knowledge.search` arguments; the search takes 4096 bytes of
/// question, so a longer one is cut.
fn retrieve_args(query: &str, n: &crate::definition::workflow::RetrieveNode) -> Value {
    let mut end = query.len().min(4096);
    while !query.is_char_boundary(end) {
        end -= 1;
    }
    let mut args = json!({ "query": &query[..end] });
    if let Some(collection) = &n.collection {
        args["collection"] = json!(collection);
    }
    if let Some(k) = n.k {
        args["k"] = json!(k);
    }
    args
}

/// A tool call's result as a step outcome: a failure retried per `plan` when the tool says
/// another try may help.
pub(super) fn tool_outcome(
    result: Result<Value, crate::tools::ToolError>,
    plan: crate::engine::step::RetryPlan,
) -> Result<CallOk, crate::engine::step::CallErr> {
    match result {
        Ok(output) => Ok(CallOk {
            output,
            tokens_in: None,
            tokens_out: None,
        }),
        Err(e) => Err(crate::engine::step::CallErr {
            failure: FailureType::ToolFailed,
            retry: e.retryable.then_some(plan),
            message: e.message,
            retry_after: None,
        }),
    }
}

impl Runner<'_> {
    /// A FAILED step that a human declined (`Store::decline_to_worker` wrote its output):
    /// remembered for the finish, and the stop that ends the walk.
    pub(super) fn declined_stop(&mut self, row: &StepRow) -> Option<Stop> {
        let output = parse_output(row.output.as_deref());
        let declined = output.get("declined").and_then(Value::as_str)?;
        let failure = output
            .get("failure_type")
            .and_then(Value::as_str)
            .and_then(FailureType::parse)
            .unwrap_or(FailureType::Cancelled);
        self.declined = Some(Declined {
            expired: declined == "expired",
            by: output
                .get("by")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        });
        Some(Stop::Failed(
            failure,
            row.error.clone().unwrap_or_else(|| declined.to_string()),
        ))
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
