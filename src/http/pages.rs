//! The admin pages (`/admin`): failure summary with a trend chart, task lists and timelines,
//! approvals, scheduler runs and leases, with resume/cancel/approve actions. Sign-in with the
//! admin token sets a stateless session cookie (HttpOnly, SameSite=Strict) signed with that
//! token, so any instance accepts it; every form carries a CSRF token derived from the
//! session; actions are audited with the admin as actor.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use axum_extra::extract::cookie::{Cookie, Key, SameSite, SignedCookieJar};

use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::context::ApiContext;
use super::error::ApiError;
use crate::domain::{FailureType, TaskStatus, now_ms};
use crate::store::tasks::{Control, TaskSearch};

const COOKIE: &str = "assistd_session";
/// Rows shown in lists.
pub(super) const LIST_LIMIT: i64 = 200;

pub fn router() -> Router<Arc<ApiContext>> {
    Router::new()
        .route("/admin/login", get(login_page).post(login))
        .route("/admin/logout", post(logout))
        .route("/admin/tasks", get(tasks_page))
        .route("/admin/tasks/{id}", get(task_page))
        .route("/admin/tasks/{id}/{action}", post(task_action))
}

fn templates() -> &'static minijinja::Environment<'static> {
    static ENV: OnceLock<minijinja::Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = minijinja::Environment::new();
        env.add_filter("when", when);
        for (name, source) in [
            (
                "layout.html",
                include_str!("../../templates/admin/layout.html"),
            ),
            (
                "login.html",
                include_str!("../../templates/admin/login.html"),
            ),
            (
                "dashboard.html",
                include_str!("../../templates/admin/dashboard.html"),
            ),
            (
                "tasks.html",
                include_str!("../../templates/admin/tasks.html"),
            ),
            ("task.html", include_str!("../../templates/admin/task.html")),
            (
                "knowledge.html",
                include_str!("../../templates/admin/knowledge.html"),
            ),
            (
                "collection.html",
                include_str!("../../templates/admin/collection.html"),
            ),
            ("console.html", include_str!("../../templates/console.html")),
        ] {
            // The templates are part of the binary and checked by the page tests.
            env.add_template(name, source).expect("valid template");
        }
        env
    })
}

/// Renders a page (HTML auto-escaped by the `.html` name).
pub fn render(name: &str, context: Value) -> Response {
    match templates()
        .get_template(name)
        .and_then(|t| t.render(minijinja::value::Serde(&context)))
    {
        // No page of ours may be framed (clickjacking of the admin actions).
        Ok(html) => (
            [
                (header::X_FRAME_OPTIONS, "DENY"),
                (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            Html(html),
        )
            .into_response(),
        Err(e) => ApiError::Internal(anyhow::anyhow!("template {name}: {e}")).into_response(),
    }
}

fn sign(key: &str, data: &str) -> String {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut mac =
        Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("HMAC takes any key length");
    mac.update(data.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// The key that signs session cookies, derived from the admin token (SHA-512, so any token
/// length gives the 64 bytes `Key` takes): a new token ends every session.
fn cookie_key(token: &str) -> Key {
    use sha2::Digest;
    let mut master = sha2::Sha512::new();
    master.update(b"assistd admin session cookie:");
    master.update(token.as_bytes());
    Key::from(&master.finalize())
}

/// The session cookie's value before signing: `<expiry ms>.<epoch>`. The signed jar
/// (`axum-extra`) adds and checks the signature.
fn session_value(expires: i64, epoch: i64) -> String {
    format!("{expires}.{epoch}")
}

/// A session is good while it has not expired and was signed in under the current epoch
/// (signing out moves the epoch on). `value` is the verified value of the signed cookie.
fn session_valid(value: &str, now: i64, epoch: i64) -> bool {
    let Some((expires, signed_epoch)) = value.split_once('.') else {
        return false;
    };
    let (Ok(expires), Ok(signed_epoch)) = (expires.parse::<i64>(), signed_epoch.parse::<i64>())
    else {
        return false;
    };
    expires > now && signed_epoch == epoch
}

/// The verified value of the session cookie of `headers` when it is a valid session now.
async fn valid_session(svc: &ApiContext, headers: &HeaderMap) -> Option<String> {
    let jar = SignedCookieJar::from_headers(headers, cookie_key(&svc.admin_token));
    let value = jar.get(COOKIE)?.value().to_string();
    // Without the epoch no session can be trusted (a signed-out one might pass).
    let epoch = svc.store.admin_session_epoch().await.ok()?;
    session_valid(&value, now_ms(), epoch).then_some(value)
}

fn csrf_for(token: &str, session: &str) -> String {
    sign(token, &format!("csrf:{session}"))
}

/// Whether the request carries a valid admin session cookie.
pub async fn has_admin_session(svc: &ApiContext, headers: &HeaderMap) -> bool {
    valid_session(svc, headers).await.is_some()
}

/// A signed-in admin; pages without one redirect to the sign-in form.
pub struct AdminPage {
    pub(super) csrf: String,
}

impl FromRequestParts<Arc<ApiContext>> for AdminPage {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        svc: &Arc<ApiContext>,
    ) -> Result<Self, Self::Rejection> {
        match valid_session(svc, &parts.headers).await {
            Some(value) => Ok(AdminPage {
                csrf: csrf_for(&svc.admin_token, &value),
            }),
            _ if parts.method == axum::http::Method::GET => {
                Err(Redirect::to("/admin/login").into_response())
            }
            _ => Err(ApiError::Unauthorized("sign in at /admin/login".into()).into_response()),
        }
    }
}

async fn login_page() -> Response {
    render("login.html", json!({}))
}

async fn login(
    State(svc): State<Arc<ApiContext>>,
    headers: HeaderMap,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    let given = form.get("token").map(String::as_str).unwrap_or("");
    // Compared as MACs of equal length, so the time taken tells nothing of the token's length.
    let digest = |t: &str| sign("assistd-admin-login", t);
    if !bool::from(
        digest(given)
            .as_bytes()
            .ct_eq(digest(&svc.admin_token).as_bytes()),
    ) {
        let mut page = render("login.html", json!({ "error": "wrong admin token" }));
        *page.status_mut() = StatusCode::UNAUTHORIZED;
        return page;
    }
    let hours = svc.config.admin.session_hours.max(1) as i64;
    let epoch = match svc.store.admin_session_epoch().await {
        Ok(epoch) => epoch,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let value = session_value(now_ms() + hours * 3_600_000, epoch);
    // Behind an https proxy the cookie must not travel over plain http.
    let secure = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|p| p.eq_ignore_ascii_case("https"));
    let jar = SignedCookieJar::new(cookie_key(&svc.admin_token)).add(
        Cookie::build((COOKIE, value))
            .path("/")
            .http_only(true)
            .same_site(SameSite::Strict)
            .max_age(time::Duration::hours(hours))
            .secure(secure),
    );
    (jar, Redirect::to("/admin")).into_response()
}

/// Signing out ends every admin session (a copied cookie stops working too); only a signed-in
/// admin can do it, from one of its pages (CSRF token), so another site cannot sign it out.
async fn logout(
    State(svc): State<Arc<ApiContext>>,
    admin: AdminPage,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    if let Err(e) = check_csrf(&admin, &form) {
        return e.into_response();
    }
    if let Err(e) = svc.store.end_admin_sessions().await {
        return ApiError::from(e).into_response();
    }
    let jar =
        SignedCookieJar::new(cookie_key(&svc.admin_token)).remove(Cookie::build(COOKIE).path("/"));
    (jar, Redirect::to("/admin/login")).into_response()
}

/// A URL query of the pairs that have a value (`a=1&b=x`, encoded).
pub(super) fn query_string<'a>(
    pairs: impl IntoIterator<Item = (&'a str, Option<String>)>,
) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))))
        .finish()
}

/// `YYYY-MM-DD HH:MM:SS` UTC for milliseconds since the epoch (`jiff`); empty when out of
/// range.
pub fn utc(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| t.strftime("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_default()
}

/// The `when` filter: milliseconds since the epoch as `<time datetime="…Z">… UTC</time>`,
/// which the layout's script shows in the viewer's own time zone (UTC kept as the
/// tooltip); empty for none.
fn when(ms: Option<i64>) -> minijinja::Value {
    match ms.and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok()) {
        None => minijinja::Value::from(""),
        Some(t) => minijinja::Value::from_safe_string(format!(
            "<time datetime=\"{t}\">{} UTC</time>",
            t.strftime("%Y-%m-%d %H:%M:%S")
        )),
    }
}

#[derive(Debug, serde::Deserialize)]
struct TasksQuery {
    status: Option<String>,
    failure_type: Option<String>,
    conversation: Option<String>,
    /// `true`: only tasks with a risk-flagged audit event.
    risk: Option<String>,
    agent: Option<String>,
    channel: Option<String>,
    /// Created at or after / before (UTC milliseconds), as the dashboard's links carry.
    since: Option<String>,
    until: Option<String>,
    /// The next page: tasks older than this id.
    before: Option<String>,
    /// Words in the message's text.
    q: Option<String>,
    /// Tasks per page (at most, and by default, `LIST_LIMIT`).
    limit: Option<String>,
}

async fn tasks_page(
    _admin: AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Query(q): Query<TasksQuery>,
) -> Result<Response, ApiError> {
    let given = |v: &Option<String>| {
        v.as_deref()
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    };
    let number = |field: &str, v: &Option<String>| -> Result<Option<i64>, ApiError> {
        given(v)
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| ApiError::BadRequest(format!("`{field}` must be a number")))
            })
            .transpose()
    };
    let search = TaskSearch {
        status: given(&q.status).as_deref().and_then(TaskStatus::parse),
        failure_type: given(&q.failure_type)
            .as_deref()
            .and_then(FailureType::parse),
        conversation_id: given(&q.conversation),
        risky: q.risk.as_deref() == Some("true"),
        agent: given(&q.agent),
        channel: given(&q.channel),
        since: number("since", &q.since)?,
        until: number("until", &q.until)?,
        before_id: number("before", &q.before)?,
        text: given(&q.q),
        limit: number("limit", &q.limit)?
            .unwrap_or(LIST_LIMIT)
            .clamp(1, LIST_LIMIT),
    };
    // One row more than the page tells whether there is an older page (below its last id).
    let mut rows = svc
        .store
        .find_tasks(&TaskSearch {
            limit: search.limit + 1,
            ..search.clone()
        })
        .await?;
    let more = rows.len() as i64 > search.limit;
    rows.truncate(search.limit as usize);
    let older = more.then(|| rows.last().map(|t| t.id)).flatten();
    let tasks: Vec<Value> = rows
        .iter()
        .map(|t| json!({ "id": t.id, "status": t.status, "failure_type": t.failure_type, "channel": t.channel,
                         "conversation_id": t.conversation_id, "created": t.created_at }))
        .collect();
    // The filters as a query string, for the next page's link (without `before`).
    let filters = query_string([
        ("status", search.status.map(|s| s.as_str().to_string())),
        (
            "failure_type",
            search.failure_type.map(|f| f.as_str().to_string()),
        ),
        ("conversation", search.conversation_id.clone()),
        ("risk", search.risky.then(|| "true".to_string())),
        ("agent", search.agent.clone()),
        ("channel", search.channel.clone()),
        ("since", search.since.map(|v| v.to_string())),
        ("until", search.until.map(|v| v.to_string())),
        ("q", search.text.clone()),
        (
            "limit",
            (search.limit != LIST_LIMIT).then(|| search.limit.to_string()),
        ),
    ]);
    Ok(render(
        "tasks.html",
        json!({ "tasks": tasks, "status": search.status.map(|s| s.as_str()),
                "failure_type": search.failure_type.map(|f| f.as_str()), "risk": search.risky,
                "conversation": search.conversation_id, "q": search.text, "agent": search.agent,
                "channel": search.channel, "since": search.since, "until": search.until,
                "older": older, "filters": filters }),
    ))
}

async fn task_page(
    admin: AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Path(id): Path<i64>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let mut task = super::tasks::task_json(&svc, id).await?;
    let passages = retrieved_passages(&task, true);
    redact_bodies(&mut task);
    Ok(render(
        "task.html",
        json!({ "t": task, "passages": passages, "csrf": admin.csrf,
                "message": q.get("message"), "raw": false }),
    ))
}

/// The passages the task's `knowledge.search` steps found (a single-turn agent's list, or
/// a workflow's `{"passages": [...]}`), each with the step it came from; their text through
/// the redaction unless the page is shown raw.
fn retrieved_passages(task: &Value, redacted: bool) -> Vec<Value> {
    let mut out = Vec::new();
    let steps = task["steps"].as_array().into_iter().flatten();
    for step in steps.filter(|s| s["tool"] == crate::definition::KNOWLEDGE_SEARCH) {
        let Some(output) = step["output"].as_str() else {
            continue;
        };
        let Ok(output) = serde_json::from_str::<Value>(output) else {
            continue;
        };
        let list = output.get("passages").unwrap_or(&output);
        for p in list.as_array().into_iter().flatten() {
            let text: String = p["text"].as_str().unwrap_or("").chars().take(600).collect();
            let text = if redacted {
                crate::redaction::redact(&text).to_string()
            } else {
                text
            };
            out.push(json!({
                "step_no": step["step_no"], "n": p["n"], "title": p["title"],
                "heading": p["heading"], "url": p["source_url"], "score": p["score"],
                "document_id": p["document_id"], "collection": p["collection"], "text": text,
            }));
        }
    }
    out
}

/// The task page's bodies (message text, step inputs and outputs) through the audit's
/// redaction: the page is for finding what went wrong, not for reading people's messages.
/// "Show raw" (`raw_task_page`) shows them as they are, audited.
fn redact_bodies(task: &mut Value) {
    let redact = |v: &mut Value| {
        if let Some(text) = v.as_str() {
            *v = json!(crate::redaction::redact(text));
        }
    };
    redact(&mut task["message"]["text"]);
    for step in task["steps"].as_array_mut().into_iter().flatten() {
        redact(&mut step["input"]);
        redact(&mut step["output"]);
    }
}

/// "Show raw": the task page unredacted, for the admin who asked (CSRF), with a
/// TASK_VIEWED_RAW audit row naming them, before anything is shown.
async fn raw_task_page(svc: &ApiContext, admin: &AdminPage, id: i64) -> Result<Response, ApiError> {
    let task = super::tasks::task_json(svc, id).await?;
    svc.store
        .audit(
            Some(id),
            None,
            crate::domain::AuditEvent::TaskViewedRaw,
            "admin:web",
            "task page shown unredacted",
            false,
            now_ms(),
        )
        .await?;
    let passages = retrieved_passages(&task, false);
    Ok(render(
        "task.html",
        json!({ "t": task, "passages": passages, "csrf": admin.csrf, "message": null,
                "raw": true }),
    ))
}

async fn task_action(
    admin: AdminPage,
    State(svc): State<Arc<ApiContext>>,
    Path((id, action)): Path<(i64, String)>,
    Form(form): Form<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    check_csrf(&admin, &form)?;
    if action == "raw" {
        return raw_task_page(&svc, &admin, id).await;
    }
    let actor = "admin:web";
    let outcome: Option<String> = match action.as_str() {
        "confirm" => {
            let approve = form.get("decision").map(String::as_str) == Some("approve");
            let approver = form
                .get("approver")
                .map(|a| a.trim())
                .filter(|a| !a.is_empty())
                .unwrap_or("admin");
            // The request this page showed: a page older than a restart or a new request
            // decides nothing.
            let request = match form.get("request") {
                None => None,
                Some(token) => Some(crate::domain::ApprovalRef::parse_token(token).ok_or_else(
                    || ApiError::BadRequest("field `request` names no approval request".into()),
                )?),
            };
            match crate::control::decide(
                &svc.control,
                id,
                request.as_ref(),
                approve,
                approver,
                true,
            )
            .await?
            {
                crate::control::DecisionResult::Resumed
                | crate::control::DecisionResult::Cancelled => None,
                crate::control::DecisionResult::Forbidden => {
                    Some(format!("{approver} may not decide this request"))
                }
                crate::control::DecisionResult::Stale(reason) => {
                    Some(format!("not decided: this page is out of date ({reason})"))
                }
                other => Some(format!("not decided: {other:?}")),
            }
        }
        other => match super::tasks::TaskAction::parse(other) {
            Some(action) => conflict_text(action.run(&svc.control, id, actor).await?),
            None => return Err(ApiError::NotFound(format!("no action {other}"))),
        },
    };
    let target = match outcome {
        None => format!("/admin/tasks/{id}"),
        Some(message) => format!(
            "/admin/tasks/{id}?message={}",
            url::form_urlencoded::byte_serialize(message.as_bytes()).collect::<String>()
        ),
    };
    Ok(Redirect::to(&target).into_response())
}

/// A form post must carry the page's CSRF token (compared in constant time).
pub(super) fn check_csrf(
    admin: &AdminPage,
    form: &HashMap<String, String>,
) -> Result<(), ApiError> {
    let given = form.get("csrf").map(String::as_str).unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(admin.csrf.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::Forbidden("missing or wrong CSRF token".into()))
    }
}

fn conflict_text(control: Control) -> Option<String> {
    match control {
        Control::Done => None,
        Control::NotFound => Some("no such task".into()),
        Control::Conflict(status) => Some(format!("not possible while the task is {status}")),
        Control::Purged => Some("retention removed this task's bodies; it cannot run again".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_and_dates() {
        let v = session_value(2_000, 3);
        assert!(session_valid(&v, 1_000, 3));
        assert!(!session_valid(&v, 2_001, 3), "expired");
        assert!(!session_valid(&v, 1_000, 4), "signed out since");
        assert!(!session_valid("3000.deadbeef", 1_000, 3));
        // The signed jar: the value comes back only under the key that signed it, unaltered.
        let jar = SignedCookieJar::new(cookie_key("tok")).add(Cookie::new(COOKIE, v.clone()));
        let set = jar.get(COOKIE).unwrap();
        let signed = jar.into_response();
        let header = signed.headers()[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .to_string();
        let sent = header.split(';').next().unwrap().to_string();
        let read = |token: &str, cookie: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::COOKIE, cookie.parse().unwrap());
            SignedCookieJar::from_headers(&headers, cookie_key(token))
                .get(COOKIE)
                .map(|c| c.value().to_string())
        };
        assert_eq!(set.value(), v);
        assert_eq!(read("tok", &sent).as_deref(), Some(v.as_str()));
        assert_eq!(read("other", &sent), None, "signed with another token");
        let forged = sent.replace(".3", ".4");
        assert_eq!(read("tok", &forged), None, "a value changed after signing");
        assert_eq!(
            read("tok", &format!("{COOKIE}=9999999999999.3")),
            None,
            "unsigned"
        );
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(1_700_000_000_000), "2023-11-14 22:13:20");
        assert_eq!(
            when(Some(1_700_000_000_000)).to_string(),
            "<time datetime=\"2023-11-14T22:13:20Z\">2023-11-14 22:13:20 UTC</time>"
        );
        assert_eq!(when(None).to_string(), "");
        for name in [
            "login.html",
            "dashboard.html",
            "tasks.html",
            "task.html",
            "console.html",
        ] {
            assert!(templates().get_template(name).is_ok(), "{name}");
        }
    }
}
