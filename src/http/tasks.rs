//! The task API: everything an admin needs to answer "what happened to this message?".

use std::sync::Arc;

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::HeaderMap;
use axum::http::request::Parts;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use super::context::ApiContext;
use super::error::ApiError;
use crate::domain::{TaskStatus, truncate};
use crate::redaction::redact;
use crate::store::tasks::Control;

/// Longest step input/output shown by the API, in bytes.
const STEP_TEXT_LIMIT: usize = 4000;

/// Most tasks one list request returns.
const LIST_LIMIT_MAX: i64 = 500;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/api/tasks", get(list_tasks))
        .route("/api/tasks/{id}", get(get_task))
        .route("/api/tasks/{id}/confirm", post(confirm_task))
        .route("/api/tasks/{id}/{action}", post(task_action))
}

/// The actor recorded in audit events for admin actions: `X-Assistd-Actor` when given.
pub fn actor(headers: &HeaderMap) -> String {
    let name = headers
        .get("x-assistd-actor")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .unwrap_or("admin");
    format!("admin:{name}")
}

fn parse_id(id: &str) -> Result<i64, ApiError> {
    id.parse()
        .map_err(|_| ApiError::BadRequest("task id must be an integer".into()))
}

fn control_result(id: i64, action: &str, control: Control, allowed: &str) -> Result<(), ApiError> {
    match control {
        Control::Done => Ok(()),
        Control::NotFound => Err(ApiError::NotFound(format!("no task {id}"))),
        Control::Conflict(status) => Err(ApiError::Conflict(format!(
            "task {id} is {status}; {action} applies to {allowed}"
        ))),
        Control::Purged => Err(ApiError::Conflict(format!(
            "task {id}'s message and step bodies were removed by retention; it cannot {action}"
        ))),
    }
}

/// The admin actions on a task's life, by the name in `POST /api/tasks/{id}/{action}` and
/// on the admin task page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskAction {
    Cancel,
    Resume,
    Pause,
    Unpause,
    Restart,
}

impl TaskAction {
    pub fn parse(name: &str) -> Option<TaskAction> {
        Some(match name {
            "cancel" => TaskAction::Cancel,
            "resume" => TaskAction::Resume,
            "pause" => TaskAction::Pause,
            "unpause" => TaskAction::Unpause,
            "restart" => TaskAction::Restart,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            TaskAction::Cancel => "cancel",
            TaskAction::Resume => "resume",
            TaskAction::Pause => "pause",
            TaskAction::Unpause => "unpause",
            TaskAction::Restart => "restart",
        }
    }

    /// The tasks the action applies to, for the 409 text.
    fn applies_to(self) -> &'static str {
        match self {
            TaskAction::Cancel => "PENDING, RUNNING, WAITING_HUMAN_CONFIRM or PAUSED tasks",
            TaskAction::Resume => "FAILED tasks and tasks CANCELLED by an error",
            TaskAction::Pause => "PENDING or RUNNING tasks",
            TaskAction::Unpause => "PAUSED tasks and RUNNING tasks asked to pause",
            TaskAction::Restart => "SUCCEEDED, FAILED or CANCELLED tasks",
        }
    }

    /// Carries the action out for `actor` (audited by the store).
    pub async fn run(
        self,
        svc: &crate::control::TaskControl,
        id: i64,
        actor: &str,
    ) -> crate::store::StoreResult<Control> {
        use crate::control as c;
        match self {
            TaskAction::Cancel => c::cancel_task(svc, id, actor).await,
            TaskAction::Resume => c::resume_task(svc, id, actor).await,
            TaskAction::Pause => c::pause_task(svc, id, actor).await,
            TaskAction::Unpause => c::unpause_task(svc, id, actor).await,
            TaskAction::Restart => c::restart_task(svc, id, actor).await,
        }
    }
}

/// `POST /api/tasks/{id}/{action}`: the task as it is after the action, or 404/409.
async fn task_action(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path((id, action)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let action = TaskAction::parse(&action)
        .ok_or_else(|| ApiError::NotFound(format!("no task action {action}")))?;
    let id = parse_id(&id)?;
    let control = action.run(&svc.control, id, &actor(&headers)).await?;
    control_result(id, action.name(), control, action.applies_to())?;
    task_json(&svc, id).await.map(Json)
}

/// A human decision: `{"decision": "approve"|"reject", "approver": "<user id>"}`, with
/// `"request"` naming the request it decides (`<task>.<step>.<run>.<digest>`, as the task
/// API's `pending_actions[].request` and the cards show it); without it, whatever request
/// is open is decided.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionBody {
    pub decision: String,
    pub approver: String,
    #[serde(default)]
    pub request: Option<String>,
}

impl DecisionBody {
    pub fn approve(&self) -> Result<bool, ApiError> {
        match self.decision.as_str() {
            "approve" => Ok(true),
            "reject" => Ok(false),
            other => Err(ApiError::BadRequest(format!(
                "field `decision` is `{other}`; expected approve or reject"
            ))),
        }
    }
}

/// Maps a decision result to the HTTP answer shared by the API and the card webhook.
pub async fn decision_response(
    svc: &ApiContext,
    id: i64,
    result: crate::control::DecisionResult,
) -> Result<Json<Value>, ApiError> {
    use crate::control::DecisionResult;
    match result {
        DecisionResult::Resumed | DecisionResult::Cancelled => task_json(svc, id).await.map(Json),
        DecisionResult::NotFound => Err(ApiError::NotFound(format!("no task {id}"))),
        DecisionResult::NotWaiting(status) => Err(ApiError::Conflict(format!(
            "task {id} is {status} and waits for no decision"
        ))),
        DecisionResult::Forbidden => Err(ApiError::Forbidden(
            "this approver may not decide this request".into(),
        )),
        DecisionResult::Expired => Err(ApiError::Conflict(format!(
            "the approval request of task {id} is past its deadline"
        ))),
        DecisionResult::Stale(reason) => Err(ApiError::Conflict(format!(
            "this decision is for a request of task {id} that is no longer open: {reason}"
        ))),
    }
}

async fn confirm_task(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(id): Path<String>,
    body: Result<Json<DecisionBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    let Json(body) = body.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    if body.approver.trim().is_empty() {
        return Err(ApiError::BadRequest(
            "field `approver` must not be empty".into(),
        ));
    }
    let approve = body.approve()?;
    let request = match body.request.as_deref() {
        None => None,
        Some(token) => Some(
            crate::domain::ApprovalRef::parse_token(token).ok_or_else(|| {
                ApiError::BadRequest(
                    "field `request` must be `<task>.<step>.<run>.<digest>` as the task shows it"
                        .into(),
                )
            })?,
        ),
    };
    if request.as_ref().is_some_and(|r| r.task_id != id) {
        return Err(ApiError::BadRequest(format!(
            "field `request` names another task than {id}"
        )));
    }
    let result = crate::control::decide(
        &svc.control,
        id,
        request.as_ref(),
        approve,
        body.approver.trim(),
        true,
    )
    .await?;
    decision_response(&svc, id, result).await
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    status: Option<String>,
    conversation: Option<String>,
    limit: Option<String>,
    /// `true`: only tasks with a risk-flagged audit event.
    risk: Option<String>,
}

async fn list_tasks(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Query(query): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let status = match query.status.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(TaskStatus::parse(&s.to_ascii_uppercase()).ok_or_else(|| {
            ApiError::BadRequest(format!(
                "unknown status `{s}`; one of {}",
                TaskStatus::ALL
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?),
    };
    let limit = super::error::parse_limit(query.limit.as_deref(), 50, LIST_LIMIT_MAX)?;
    let conversation = query.conversation.as_deref().filter(|c| !c.is_empty());
    let risky = match query.risk.as_deref() {
        None | Some("") | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "`risk` is `{other}`; expected true or false"
            )));
        }
    };
    let tasks = svc
        .store
        .find_tasks(&crate::store::tasks::TaskSearch {
            status,
            conversation_id: conversation.map(str::to_string),
            risky,
            limit,
            ..Default::default()
        })
        .await?;
    Ok(Json(json!({
        "tasks": tasks.iter().map(|t| json!({
            "id": t.id,
            "status": t.status,
            "failure_type": t.failure_type,
            "channel": t.channel,
            "conversation_id": t.conversation_id,
            "agent_version_id": t.agent_version_id,
            "retry_count": t.retry_count,
            "created_at": t.created_at,
            "finished_at": t.finished_at,
        })).collect::<Vec<_>>(),
    })))
}

/// Proof that the request carried `Authorization: Bearer <admin token>`.
pub struct AdminAuth;

impl FromRequestParts<Arc<ApiContext>> for AdminAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        svc: &Arc<ApiContext>,
    ) -> Result<Self, Self::Rejection> {
        let given = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::Unauthorized("missing bearer token".into()))?;
        if bool::from(given.trim().as_bytes().ct_eq(svc.admin_token.as_bytes())) {
            Ok(AdminAuth)
        } else {
            Err(ApiError::Unauthorized("wrong bearer token".into()))
        }
    }
}

async fn get_task(
    _auth: AdminAuth,
    State(svc): State<Arc<ApiContext>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    task_json(&svc, parse_id(&id)?).await.map(Json)
}

/// Everything about one task: the answer to "what happened to this message?".
pub async fn task_json(svc: &ApiContext, id: i64) -> Result<Value, ApiError> {
    let store = &svc.store;
    let task = store
        .task(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no task {id}")))?;
    let version = store.agent_version(task.agent_version_id).await?;
    let message = store.message(task.message_id).await?;
    let steps = store.task_steps(id).await?;
    let superseded = store.superseded_steps(id).await?;
    let replies = store.task_replies(id).await?;
    let audit = store.task_audit(id).await?;
    let actions = store.task_pending_actions(id).await?;
    let reply_json = |r: &crate::domain::ReplyRow| {
        json!({
            "id": r.id,
            "idempotency_key": r.idempotency_key,
            "status": r.status,
            "type": r.reply_type,
            "attempts": r.attempts,
            "last_error": r.last_error.as_deref().map(redact),
            "sent_at": r.sent_at,
            "content": serde_json::from_str::<Value>(&r.content).unwrap_or(Value::Null),
            "platform_message_id": r.platform_message_id,
            // Still the run's placeholder; `edit`: the answer replaces its message.
            "placeholder": r.placeholder,
            "edit": r.edit,
        })
    };
    Ok(json!({
        "id": task.id,
        "status": task.status,
        "failure_type": task.failure_type,
        "error": task.error_msg.as_deref().map(redact),
        "result": task.result,
        "task_type": task.task_type,
        "agent": version.as_ref().map(|v| json!({
            "name": v.agent_name,
            "version": v.version_no,
            "version_id": v.id,
        })),
        "channel": task.channel,
        "conversation_id": task.conversation_id,
        "message": message.map(|m| json!({
            "id": m.external_message_id,
            "event_id": m.external_event_id,
            "sender_id": m.sender_id,
            "text": truncate(&m.text, STEP_TEXT_LIMIT),
            "received_at": m.received_at,
        })),
        "retry_count": task.retry_count,
        "resume_count": task.resume_count,
        "restart_count": task.restart_count,
        "pause_requested": task.pause_requested,
        "claim_count": task.claim_count,
        "run_aborts": task.run_aborts,
        "owner": task.owner,
        "version": task.version,
        "current_step": task.current_step,
        "created_at": task.created_at,
        "started_at": task.started_at,
        "finished_at": task.finished_at,
        "steps": steps.iter().map(step_json).collect::<Vec<_>>(),
        "superseded_steps": superseded.iter().map(|s| {
            let mut v = step_json(&s.step);
            v["restart_no"] = json!(s.restart_no);
            v["superseded_at"] = json!(s.superseded_at);
            v
        }).collect::<Vec<_>>(),
        "reply": replies.last().map(reply_json),
        "replies": replies.iter().map(reply_json).collect::<Vec<_>>(),
        "context_summary": task.context_summary,
        "trace": task.trace.as_deref().and_then(|t| serde_json::from_str::<Value>(t).ok()),
        "confirm_deadline": task.confirm_deadline,
        "pending_actions": actions.iter().map(pending_action_json).collect::<Vec<_>>(),
        "audit": audit.iter().map(|a| json!({
            "id": a.id,
            "event": a.event,
            "actor": a.actor,
            "summary": a.summary,
            "risk_flag": a.risk_flag,
            "target_type": a.target_type,
            "target_id": a.target_id,
            "at": a.created_at,
        })).collect::<Vec<_>>(),
    }))
}

/// One journalled step as the task API shows it (bodies truncated, errors redacted).
fn step_json(s: &crate::domain::StepRow) -> Value {
    json!({
        "step_no": s.step_no,
        "type": s.step_type,
        "tool": s.tool_name,
        "idempotency_key": s.idempotency_key,
        "status": s.status,
        "attempts": s.attempt,
        "input": s.input.as_deref().map(|t| truncate(t, STEP_TEXT_LIMIT)),
        "output": s.output.as_deref().map(|t| truncate(t, STEP_TEXT_LIMIT)),
        "error": s.error.as_deref().map(redact),
        "tokens_in": s.tokens_in,
        "tokens_out": s.tokens_out,
        "duration_ms": s.duration_ms,
    })
}

/// A pending action as the task API shows it; `request` is what a decision names.
fn pending_action_json(a: &crate::store::workflow::PendingActionRow) -> Value {
    let request = crate::domain::ApprovalRef::new(a.task_id, a.restart_no, a.step_no, &a.args);
    json!({
        "id": a.id,
        "request": request.token(),
        "run": a.restart_no,
        "step_no": a.step_no,
        "kind": a.kind,
        "tool": a.tool_name,
        "args": serde_json::from_str::<Value>(&a.args).unwrap_or(Value::Null),
        "approvers": serde_json::from_str::<Value>(&a.approvers).unwrap_or(Value::Null),
        "message": a.message,
        "decision": a.decision,
        "decided_by": a.decided_by,
        "deadline": a.deadline,
    })
}
