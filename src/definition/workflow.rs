//! The workflow format (docs/workflows.md): nodes joined by `next` ids, checked when a
//! version is published so that a task never meets a broken graph. Every error names the
//! node and the field.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;
use serde_json::Value;

use super::ToolCatalog;

/// Most model/tool rounds an `agent` node may take.
pub const MAX_AGENT_STEPS: u32 = 100;

#[derive(Debug, Clone)]
pub struct Workflow {
    pub start: String,
    pub nodes: Vec<Node>,
    index: HashMap<String, usize>,
}

#[derive(Debug, Clone)]
pub struct Node {
    pub id: String,
    pub kind: NodeKind,
    /// Optional template of a progress line shown to the chat as the node starts
    /// ("Looking up ticket T-42…"); see `channels.generic.progress`.
    pub progress: Option<String>,
}

#[derive(Debug, Clone)]
pub enum NodeKind {
    Llm(LlmNode),
    Tool(ToolNode),
    Agent(AgentNode),
    Condition(ConditionNode),
    HumanConfirm(HumanConfirmNode),
    Reply(ReplyNode),
    Retrieve(RetrieveNode),
}

/// Searches the agent's knowledge collections (`knowledge.search`, journalled like a tool
/// step); its output is `passages`, `found` and `text` (the passages numbered, for a prompt).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrieveNode {
    /// Template of the question searched for.
    pub query: String,
    /// One of the agent's collections (all of them when absent).
    #[serde(default)]
    pub collection: Option<String>,
    /// Passages at most (`knowledge.top_k` when absent).
    #[serde(default)]
    pub k: Option<u32>,
    pub next: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmNode {
    /// Template of the user message.
    pub prompt: String,
    pub next: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolNode {
    pub tool: String,
    /// JSON whose string leaves are templates.
    #[serde(default = "empty_object")]
    pub args: Value,
    pub next: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentNode {
    pub prompt: String,
    pub tools: Vec<String>,
    /// `auto` (default), `required`, `none`, or a tool name; applies to the node's first
    /// model turn, later turns use `auto`.
    #[serde(default)]
    pub tool_choice: Option<String>,
    #[serde(default = "default_max_steps")]
    pub max_steps: u32,
    pub next: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConditionNode {
    pub branches: Vec<Branch>,
    pub default: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Branch {
    /// A template expression, e.g. `steps.lookup.status == "open"`.
    pub when: String,
    pub next: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HumanConfirmNode {
    /// Template of the question shown to the approver.
    pub message: String,
    /// Overrides the agent's approvers.
    #[serde(default)]
    pub approvers: Option<Vec<String>>,
    /// Overrides the agent's confirm_deadline_secs.
    #[serde(default)]
    pub deadline_secs: Option<u64>,
    pub next: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplyNode {
    #[serde(default)]
    pub text: Option<String>,
    /// Card JSON whose string leaves are templates; needs `card_type`.
    #[serde(default)]
    pub card: Option<Value>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

fn default_max_steps() -> u32 {
    8
}

impl Workflow {
    pub fn node(&self, id: &str) -> Option<&Node> {
        self.index.get(id).map(|i| &self.nodes[*i])
    }

    /// Parses and checks a workflow against the tools that exist. `has_approvers` says
    /// whether the agent names approvers (a human_confirm node needs some).
    pub fn parse(
        value: &Value,
        tools: &dyn ToolCatalog,
        has_approvers: bool,
    ) -> Result<Workflow, String> {
        let object = value.as_object().ok_or("workflow must be a JSON object")?;
        for key in object.keys() {
            if key != "start" && key != "nodes" {
                return Err(format!(
                    "workflow: unknown field `{key}` (expected start, nodes)"
                ));
            }
        }
        let start = object
            .get("start")
            .and_then(Value::as_str)
            .ok_or("workflow: missing string field `start`")?
            .to_string();
        let raw_nodes = object
            .get("nodes")
            .and_then(Value::as_array)
            .ok_or("workflow: missing array field `nodes`")?;
        let mut nodes = Vec::new();
        let mut index = HashMap::new();
        for (i, raw) in raw_nodes.iter().enumerate() {
            let mut node = parse_node(raw, i)?;
            if let NodeKind::Agent(n) = &mut node.kind {
                n.tools = tools
                    .expand(&n.tools)
                    .map_err(|e| format!("node `{}`: field `tools`: {e}", node.id))?;
            }
            if index.insert(node.id.clone(), nodes.len()).is_some() {
                return Err(format!("node `{}`: duplicate id", node.id));
            }
            nodes.push(node);
        }
        let workflow = Workflow {
            start,
            nodes,
            index,
        };
        workflow.check(tools, has_approvers)?;
        Ok(workflow)
    }

    // long: one check per workflow rule, each naming the node; a flat list.
    fn check(&self, tools: &dyn ToolCatalog, has_approvers: bool) -> Result<(), String> {
        if self.node(&self.start).is_none() {
            return Err(format!(
                "workflow: `start` names unknown node `{}`",
                self.start
            ));
        }
        let outputs: Vec<(String, bool)> = self
            .nodes
            .iter()
            .map(|n| {
                let model = matches!(n.kind, NodeKind::Llm(_) | NodeKind::Agent(_));
                (n.id.clone(), model)
            })
            .collect();
        let sample = crate::templating::sample_context(&outputs);
        let template = |id: &str, field: &str, text: &str| template(&sample, id, field, text);
        let templates_in =
            |id: &str, field: &str, value: &Value| templates_in(&sample, id, field, value);
        for node in &self.nodes {
            let id = &node.id;
            if let Some(progress) = &node.progress {
                if matches!(node.kind, NodeKind::Condition(_) | NodeKind::Reply(_)) {
                    return Err(format!(
                        "node `{id}`: field `progress` applies to llm, tool, agent and human_confirm nodes"
                    ));
                }
                template(id, "progress", progress)?;
            }
            let target = |field: &str, next: &str| -> Result<(), String> {
                if self.node(next).is_none() {
                    return Err(format!(
                        "node `{id}`: field `{field}` names unknown node `{next}`"
                    ));
                }
                Ok(())
            };
            match &node.kind {
                NodeKind::Llm(n) => {
                    template(id, "prompt", &n.prompt)?;
                    target("next", &n.next)?;
                }
                NodeKind::Retrieve(n) => {
                    if !tools.has(super::KNOWLEDGE_SEARCH) {
                        return Err(format!(
                            "node `{id}`: a retrieve node needs the agent's `knowledge = [...]`"
                        ));
                    }
                    template(id, "query", &n.query)?;
                    target("next", &n.next)?;
                }
                NodeKind::Tool(n) => {
                    if !tools.has(&n.tool) {
                        return Err(format!(
                            "node `{id}`: field `tool` names unknown tool `{}`",
                            n.tool
                        ));
                    }
                    templates_in(id, "args", &n.args)?;
                    target("next", &n.next)?;
                }
                NodeKind::Agent(n) => {
                    template(id, "prompt", &n.prompt)?;
                    if n.tools.is_empty() {
                        return Err(format!(
                            "node `{id}`: field `tools` must name at least one tool"
                        ));
                    }
                    for tool in &n.tools {
                        if !tools.has(tool) {
                            return Err(format!(
                                "node `{id}`: field `tools` names unknown tool `{tool}`"
                            ));
                        }
                    }
                    match n.tool_choice.as_deref() {
                        None | Some("auto" | "required" | "none") => {}
                        Some(name) if n.tools.iter().any(|t| t == name) => {}
                        Some(other) => {
                            return Err(format!(
                                "node `{id}`: field `tool_choice` is `{other}`; expected auto, required, none or one of the node's tools"
                            ));
                        }
                    }
                    if !(1..=MAX_AGENT_STEPS).contains(&n.max_steps) {
                        return Err(format!(
                            "node `{id}`: field `max_steps` must be 1 to {MAX_AGENT_STEPS}"
                        ));
                    }
                    target("next", &n.next)?;
                }
                NodeKind::Condition(n) => {
                    if n.branches.is_empty() {
                        return Err(format!("node `{id}`: field `branches` must not be empty"));
                    }
                    for (i, b) in n.branches.iter().enumerate() {
                        crate::templating::dry_run_expression(&b.when, &sample)
                            .map_err(|e| format!("node `{id}`: field `branches[{i}].when`: {e}"))?;
                        target(&format!("branches[{i}].next"), &b.next)?;
                    }
                    target("default", &n.default)?;
                }
                NodeKind::HumanConfirm(n) => {
                    template(id, "message", &n.message)?;
                    let own = n.approvers.as_ref().is_some_and(|a| !a.is_empty());
                    if !own && !has_approvers {
                        return Err(format!(
                            "node `{id}`: field `approvers` is empty and the agent names no approvers"
                        ));
                    }
                    target("next", &n.next)?;
                }
                NodeKind::Reply(n) => {
                    match (&n.text, &n.card) {
                        (None, None) => {
                            return Err(format!(
                                "node `{id}`: a reply needs field `text` or `card`"
                            ));
                        }
                        (Some(t), _) => template(id, "text", t)?,
                        _ => {}
                    }
                    if let Some(card) = &n.card {
                        if card.get("card_type").and_then(Value::as_str).is_none() {
                            return Err(format!("node `{id}`: field `card` needs a `card_type`"));
                        }
                        templates_in(id, "card", card)?;
                    }
                }
            }
        }
        self.check_acyclic_and_reachable()
    }

    fn successors<'a>(&'a self, node: &'a Node) -> Vec<&'a str> {
        match &node.kind {
            NodeKind::Llm(n) => vec![&n.next],
            NodeKind::Tool(n) => vec![&n.next],
            NodeKind::Retrieve(n) => vec![&n.next],
            NodeKind::Agent(n) => vec![&n.next],
            NodeKind::HumanConfirm(n) => vec![&n.next],
            NodeKind::Condition(n) => n
                .branches
                .iter()
                .map(|b| b.next.as_str())
                .chain(std::iter::once(n.default.as_str()))
                .collect(),
            NodeKind::Reply(_) => vec![],
        }
    }

    fn check_acyclic_and_reachable(&self) -> Result<(), String> {
        // Iterative DFS with colours: grey = on the current path.
        let mut state: HashMap<&str, u8> = HashMap::new();
        let mut stack: Vec<(&str, usize)> = vec![(self.start.as_str(), 0)];
        state.insert(&self.start, 1);
        while let Some((id, child)) = stack.pop() {
            let node = self
                .node(id)
                .ok_or_else(|| format!("unknown node `{id}`"))?;
            let next = self.successors(node);
            if child < next.len() {
                stack.push((id, child + 1));
                let to = next[child];
                match state.get(to) {
                    Some(1) => {
                        return Err(format!(
                            "node `{id}`: edge to `{to}` makes a cycle (loops belong inside an agent node)"
                        ));
                    }
                    Some(_) => {}
                    None => {
                        state.insert(to, 1);
                        stack.push((to, 0));
                    }
                }
            } else {
                state.insert(id, 2);
            }
        }
        let unreachable: HashSet<&str> = self
            .nodes
            .iter()
            .map(|n| n.id.as_str())
            .filter(|id| !state.contains_key(id))
            .collect();
        if let Some(id) = self
            .nodes
            .iter()
            .map(|n| n.id.as_str())
            .find(|id| unreachable.contains(id))
        {
            return Err(format!("node `{id}`: not reachable from `{}`", self.start));
        }
        Ok(())
    }
}

fn parse_node(raw: &Value, position: usize) -> Result<Node, String> {
    let mut object = raw
        .as_object()
        .cloned()
        .ok_or_else(|| format!("nodes[{position}]: must be an object"))?;
    let id = match object.remove("id") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 64 => s,
        _ => {
            return Err(format!(
                "nodes[{position}]: field `id` must be a string of 1 to 64 characters"
            ));
        }
    };
    let kind = match object.remove("type") {
        Some(Value::String(s)) => s,
        _ => return Err(format!("node `{id}`: missing string field `type`")),
    };
    let progress = match object.remove("progress") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 500 => Some(s),
        Some(_) => {
            return Err(format!(
                "node `{id}`: field `progress` must be a template of 1 to 500 characters"
            ));
        }
    };
    let rest = Value::Object(object);
    fn spec<T: serde::de::DeserializeOwned>(id: &str, rest: Value) -> Result<T, String> {
        serde_json::from_value(rest).map_err(|e| format!("node `{id}`: {e}"))
    }
    let kind = match kind.as_str() {
        "llm" => NodeKind::Llm(spec(&id, rest)?),
        "tool" => NodeKind::Tool(spec(&id, rest)?),
        "agent" => NodeKind::Agent(spec(&id, rest)?),
        "condition" => NodeKind::Condition(spec(&id, rest)?),
        "human_confirm" => NodeKind::HumanConfirm(spec(&id, rest)?),
        "reply" => NodeKind::Reply(spec(&id, rest)?),
        "retrieve" => NodeKind::Retrieve(spec(&id, rest)?),
        other => {
            return Err(format!(
                "node `{id}`: field `type` is `{other}`; expected llm, tool, agent, condition, human_confirm, reply or retrieve"
            ));
        }
    };
    Ok(Node { id, kind, progress })
}

fn template(sample: &minijinja::Value, id: &str, field: &str, text: &str) -> Result<(), String> {
    crate::templating::dry_run_template(text, sample)
        .map_err(|e| format!("node `{id}`: field `{field}`: {e}"))
}

fn templates_in(
    sample: &minijinja::Value,
    id: &str,
    field: &str,
    value: &Value,
) -> Result<(), String> {
    match value {
        Value::String(s) => template(sample, id, field, s),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| templates_in(sample, id, &format!("{field}[{i}]"), v)),
        Value::Object(map) => map
            .iter()
            .try_for_each(|(k, v)| templates_in(sample, id, &format!("{field}.{k}"), v)),
        _ => Ok(()),
    }
}
