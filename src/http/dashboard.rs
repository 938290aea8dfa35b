//! The admin dashboard (`/admin`): the failure summary with its trend chart, delivery,
//! approvals, scheduler and leases, and the buttons of its delivery and scheduler panels.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde_json::{Value, json};

use super::admin::{SummaryQuery, build_summary};
use super::context::ApiContext;
use super::error::ApiError;
use super::pages::{AdminPage, LIST_LIMIT, check_csrf, query_string, render, utc};
use crate::domain::{FailureType, TaskStatus, now_ms};
use crate::store::tasks::TaskSearch;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/admin", get(dashboard))
        .route("/admin/jobs/{job}/{action}", post(job_action))
        .route("/admin/replies/{id}/retry", post(reply_retry))
}

#[derive(Debug, serde::Deserialize)]
struct DashboardQuery {
    hours: Option<i64>,
    bucket: Option<String>,
    agent: Option<String>,
    channel: Option<String>,
    failure_type: Option<String>,
    /// The outcome of a scheduler or delivery panel action, shown once in that panel.
    message: Option<String>,
    panel: Option<String>,
}

async fn dashboard(
    admin: AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Query(q): Query<DashboardQuery>,
) -> Result<Response, ApiError> {
    let hours = q.hours.unwrap_or(24).clamp(1, 24 * 400);
    let now = now_ms();
    let bucket = q.bucket.clone().unwrap_or_else(|| {
        if hours > 72 {
            "day".into()
        } else {
            "hour".into()
        }
    });
    let summary = build_summary(
        &svc,
        SummaryQuery {
            since: Some((now - hours * 3_600_000).to_string()),
            until: Some((now + 1).to_string()),
            bucket: Some(bucket.clone()),
            agent: q.agent.clone(),
            channel: q.channel.clone(),
            failure_type: q.failure_type.clone(),
        },
    )
    .await?;
    let chart = chart(&summary);
    // The summary's window and filters, carried by every count link to the task list.
    let link = query_string([
        ("since", summary["since"].as_i64().map(|v| v.to_string())),
        ("until", summary["until"].as_i64().map(|v| v.to_string())),
        ("agent", q.agent.clone().filter(|v| !v.is_empty())),
        ("channel", q.channel.clone().filter(|v| !v.is_empty())),
    ]);
    let agents: Vec<&String> = svc.config.agents.keys().collect();
    let channels = svc.channels.names();
    let failure_types: Vec<&str> = FailureType::ALL.iter().map(|f| f.as_str()).collect();
    let waiting: Vec<Value> = svc
        .store
        .find_tasks(&TaskSearch {
            status: Some(TaskStatus::WaitingHumanConfirm),
            limit: LIST_LIMIT,
            ..TaskSearch::default()
        })
        .await?
        .iter()
        .map(|t| json!({ "id": t.id, "conversation_id": t.conversation_id, "deadline": t.confirm_deadline }))
        .collect();
    let job_runs: Vec<Value> = svc
        .store
        .job_runs(None, 20)
        .await?
        .iter()
        .map(|r| json!({ "job": r.job, "instance": r.instance, "started": r.started_at, "status": r.status,
                         "scanned": r.scanned, "affected": r.affected, "error": r.error,
                         "trigger": r.trigger_kind, "actor": r.actor }))
        .collect();
    let jobs: Vec<Value> = crate::scheduler::job_states(&svc.jobs)
        .await?
        .iter()
        .map(super::jobs::job_json)
        .collect();
    let leases: Vec<Value> = svc
        .store
        .lease_holders()
        .await?
        .iter()
        .map(|(owner, tasks, until)| json!({ "owner": owner, "tasks": tasks, "until": until }))
        .collect();
    Ok(render(
        "dashboard.html",
        json!({ "s": summary, "chart": chart, "hours": hours, "bucket": bucket, "agent": q.agent,
                "channel": q.channel, "failure_type": q.failure_type, "waiting": waiting,
                "job_runs": job_runs, "jobs": jobs, "leases": leases, "csrf": admin.csrf,
                "message": q.message, "panel": q.panel, "link": link, "agents": agents,
                "channels": channels, "failure_types": failure_types }),
    ))
}

/// Most bars the trend chart draws.
const CHART_BARS_MAX: i64 = 800;

/// Stacked bars (succeeded / the rest) for every bucket of the summary's range, empty ones
/// included, as coordinates for the inline SVG.
fn chart(summary: &Value) -> Value {
    const WIDTH: f64 = 720.0;
    const HEIGHT: f64 = 160.0;
    let width_ms = if summary["bucket"] == "day" {
        86_400_000
    } else {
        3_600_000
    };
    let since = summary["since"].as_i64().unwrap_or(0);
    let until = summary["until"].as_i64().unwrap_or(since + width_ms);
    let first = since.div_euclid(width_ms) * width_ms;
    let count = ((until - first + width_ms - 1) / width_ms).clamp(1, CHART_BARS_MAX);
    let by_start: HashMap<i64, &Value> = summary["buckets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| b["start"].as_i64().map(|s| (s, b)))
        .collect();
    let max = by_start
        .values()
        .filter_map(|b| b["tasks"].as_i64())
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let slot = WIDTH / count as f64;
    let bars: Vec<Value> = (0..count)
        .map(|i| {
            let start = first + i * width_ms;
            let b = by_start.get(&start);
            let total = b.and_then(|b| b["tasks"].as_i64()).unwrap_or(0);
            let ok = b.and_then(|b| b["answered"].as_i64()).unwrap_or(0);
            let bad = total - ok;
            let ok_h = ok as f64 / max * HEIGHT;
            let bad_h = bad as f64 / max * HEIGHT;
            json!({
                "x": (i as f64 * slot).round(), "w": (slot - 1.0).max(1.0).round(),
                "ok_y": (HEIGHT - ok_h).round(), "ok_h": ok_h.round(),
                "bad_y": (HEIGHT - ok_h - bad_h).round(), "bad_h": bad_h.round(),
                "ok": ok, "bad": bad, "label": format!("{} UTC", utc(start)),
            })
        })
        .collect();
    // The axes: the window's ends (UTC) along the bottom, the tallest bar's count at the top.
    json!({ "width": WIDTH, "height": HEIGHT, "bars": bars, "max": max as i64,
            "from": format!("{} UTC", utc(first)), "to": format!("{} UTC", utc(until)) })
}

/// The scheduler panel's buttons: run a job now, switch it on or off (CSRF, audited).
async fn job_action(
    admin: AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Path((job, action)): Path<(String, String)>,
    Form(form): Form<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    check_csrf(&admin, &form)?;
    let actor = "admin:web";
    let result = match action.as_str() {
        "run" => super::jobs::run_job_now(&svc, &job, actor).await.map(|r| {
            format!(
                "{job}: {} (scanned {}, affected {})",
                r["status"].as_str().unwrap_or("?"),
                r["scanned"],
                r["affected"]
            )
        }),
        "enable" | "disable" => super::jobs::switch_job_to(&svc, &job, action == "enable", actor)
            .await
            .map(|_| {
                format!(
                    "{job} switched {}",
                    if action == "enable" { "on" } else { "off" }
                )
            }),
        other => return Err(ApiError::NotFound(format!("no action {other}"))),
    };
    let message = match result {
        Ok(text) => text,
        Err(ApiError::Conflict(text)) => text,
        Err(e) => return Err(e),
    };
    Ok(Redirect::to(&format!(
        "/admin?message={}#scheduler",
        url::form_urlencoded::byte_serialize(message.as_bytes()).collect::<String>()
    ))
    .into_response())
}

/// The delivery panel's "Retry now" button (CSRF, audited as the web admin).
async fn reply_retry(
    admin: AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Path(id): Path<i64>,
    Form(form): Form<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    check_csrf(&admin, &form)?;
    let message = match super::admin::retry_reply_now(&svc, id, "admin:web").await {
        Ok(_) => format!("reply {id} is being sent again now"),
        Err(ApiError::Conflict(text) | ApiError::NotFound(text)) => text,
        Err(e) => return Err(e),
    };
    Ok(Redirect::to(&format!(
        "/admin?panel=delivery&message={}#delivery",
        url::form_urlencoded::byte_serialize(message.as_bytes()).collect::<String>()
    ))
    .into_response())
}
