//! The admin pages (sign-in, summary, timeline, actions with CSRF) and the chat console,
//! through HTTP as a browser would use them.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::MockServer;

use crate::helpers::*;

pub(crate) fn browser() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

pub(crate) async fn sign_in(app: &TestApp, http: &reqwest::Client) -> String {
    let resp = http
        .post(format!("{}/admin/login", app.addr))
        .form(&[("token", ADMIN_TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303);
    let cookie = resp.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    cookie.split(';').next().unwrap().to_string()
}

/// The HTML of the admin page at `path`, asked for with the session `cookie`.
pub(crate) async fn page_of(
    app: &TestApp,
    http: &reqwest::Client,
    cookie: &str,
    path: &str,
) -> String {
    let resp = http
        .get(format!("{}{path}", app.addr))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    resp.text().await.unwrap()
}

pub(crate) fn csrf_of(html: &str) -> String {
    let at =
        html.find("name=\"csrf\" value=\"").expect("a CSRF field") + "name=\"csrf\" value=\"".len();
    html[at..at + 64].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_sign_in_see_failures_and_resume_a_task() {
    let model = model_failing_first(1, "bad key").await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let failed = task_id_of(app.post_message(&message("pg", 1, "first")).await).await;
    app.wait_replied(failed, WAIT).await;
    let ok = task_id_of(app.post_message(&message("pg2", 1, "second")).await).await;
    app.wait_replied(ok, WAIT).await;

    let http = browser();
    let resp = http
        .get(format!("{}/admin", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303, "not signed in: redirected");
    assert_eq!(resp.headers()["location"], "/admin/login");
    let wrong = http
        .post(format!("{}/admin/login", app.addr))
        .form(&[("token", "nope")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let cookie = sign_in(&app, &http).await;

    let page = http
        .get(format!("{}/admin", app.addr))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains("id=\"total-tasks\">2<"), "two tasks counted");
    assert!(
        html.contains("id=\"failures-AUTH_FAILED\">1<"),
        "one AUTH_FAILED"
    );
    assert!(html.contains("<svg id=\"trend\""), "inline chart");
    assert!(
        !html.contains("<script src") && !html.contains("http://") && !html.contains("https://"),
        "no external assets"
    );

    let list = page_of(
        &app,
        &http,
        &cookie,
        "/admin/tasks?failure_type=AUTH_FAILED",
    )
    .await;
    assert!(list.contains(&format!("href=\"/admin/tasks/{failed}\"")));
    assert!(!list.contains(&format!("href=\"/admin/tasks/{ok}\"")));

    let timeline = page_of(&app, &http, &cookie, &format!("/admin/tasks/{failed}")).await;
    assert!(
        timeline.contains("id=\"resume\"") && timeline.contains("TASK_FAILED"),
        "{timeline}"
    );
    let csrf = csrf_of(&timeline);
    let forged = http
        .post(format!("{}/admin/tasks/{failed}/resume", app.addr))
        .header("cookie", &cookie)
        .form(&[("csrf", "0".repeat(64))])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403, "CSRF token required");
    let anonymous = http
        .post(format!("{}/admin/tasks/{failed}/resume", app.addr))
        .form(&[("csrf", csrf.clone())])
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401, "signed-in session required");
    assert_eq!(app.get_task(failed).await["status"], "FAILED");
    let resumed = http
        .post(format!("{}/admin/tasks/{failed}/resume", app.addr))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 303);
    let task = app
        .wait_task(failed, WAIT, |t| t["status"] == "SUCCEEDED")
        .await;
    let event = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_RESUMED")
        .unwrap();
    assert_eq!(event["actor"], "admin:web");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_a_channel_that_shows_replies() {
    let app = TestApp::spawn().await;
    let http = browser();
    let page = http.get(format!("{}/", app.addr)).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("id=\"send\""));
    let resp = http
        .post(format!("{}/console/messages", app.addr))
        .json(&json!({"conversation_id": "c-1", "text": "hello console"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let id = resp.json::<Value>().await.unwrap()["task_id"]
        .as_i64()
        .unwrap();
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["channel"], "console");
    let conv: Value = http
        .get(format!("{}/console/conversations/c-1", app.addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(conv["messages"][0]["answer"], "answer to: hello console");
    assert_eq!(conv["messages"][0]["task_id"], id);
    let bad = http
        .post(format!("{}/console/messages", app.addr))
        .json(&json!({"conversation_id": "c-1", "text": "  "}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let status: Value = http
        .get(format!("{}/console/status", app.addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["reachable"], true);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_names_the_setting_when_the_model_is_unreachable() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let app = TestApp::spawn_with(
        MockServer::start().await,
        accepting_receiver().await,
        move |c| {
            c.llm.base_url = format!("http://127.0.0.1:{port}/v1");
        },
    )
    .await;
    let status: Value = browser()
        .get(format!("{}/console/status", app.addr))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["reachable"], false);
    assert!(
        status["hint"]
            .as_str()
            .unwrap()
            .contains("ASSISTD_LLM__BASE_URL")
    );
    app.stop().await;
}

/// Attack (issue 17, item 7): the console checked only the peer address, so a page that
/// rebinds its DNS name to 127.0.0.1 (or anything behind a reverse proxy on this host) could
/// use it. Now the Host must be loopback and an Origin, when sent, must match it; other hosts
/// need an admin session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_refuses_rebound_hosts_and_foreign_origins() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.channels.console.enabled = true;
    })
    .await;
    let http = browser();
    let port = app.addr.rsplit(':').next().unwrap().to_string();
    let send = |host: String, origin: Option<String>, cookie: Option<String>| {
        let mut req = http
            .post(format!("{}/console/messages", app.addr))
            .header("host", host)
            .json(&json!({"conversation_id": "c-rebind", "text": "hi"}));
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        if let Some(c) = cookie {
            req = req.header("cookie", c);
        }
        req.send()
    };
    let local = format!("127.0.0.1:{port}");
    assert_eq!(send(local.clone(), None, None).await.unwrap().status(), 200);
    assert_eq!(
        send(local.clone(), Some(format!("http://{local}")), None)
            .await
            .unwrap()
            .status(),
        200
    );
    let rebound = format!("attacker.example:{port}");
    assert_eq!(
        send(rebound.clone(), None, None).await.unwrap().status(),
        403,
        "rebound DNS name"
    );
    assert_eq!(
        send(rebound.clone(), Some(format!("http://{rebound}")), None)
            .await
            .unwrap()
            .status(),
        403
    );
    assert_eq!(
        send(local.clone(), Some("http://attacker.example".into()), None)
            .await
            .unwrap()
            .status(),
        403,
        "a foreign page posting to localhost"
    );
    let page = http
        .get(format!("{}/", app.addr))
        .header("host", rebound.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 403);
    // Behind a proxy: an admin session lets the proxied host in, with a matching Origin.
    let cookie = sign_in(&app, &http).await;
    let proxied = "assistd.example.com".to_string();
    assert_eq!(
        send(
            proxied.clone(),
            Some(format!("https://{proxied}")),
            Some(cookie.clone())
        )
        .await
        .unwrap()
        .status(),
        200
    );
    assert_eq!(
        send(
            proxied,
            Some("https://attacker.example".into()),
            Some(cookie)
        )
        .await
        .unwrap()
        .status(),
        403
    );
    app.stop().await;
}

/// Issue 17, item 10 (part): admin pages cannot be framed (clickjacking), and the session
/// cookie is `Secure` when the sign-in came through an https proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_pages_refuse_framing_and_the_cookie_is_secure_behind_https() {
    let app = TestApp::spawn().await;
    let http = browser();
    for path in ["/admin/login", "/admin"] {
        let resp = http
            .get(format!("{}{path}", app.addr))
            .header("cookie", sign_in(&app, &http).await)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        assert_eq!(resp.headers()["x-frame-options"], "DENY", "{path}");
        assert!(
            resp.headers()["content-security-policy"]
                .to_str()
                .unwrap()
                .contains("frame-ancestors 'none'"),
            "{path}"
        );
    }
    let resp = http
        .post(format!("{}/admin/login", app.addr))
        .header("x-forwarded-proto", "https")
        .form(&[("token", ADMIN_TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303);
    let cookie = resp.headers()["set-cookie"].to_str().unwrap();
    assert!(cookie.contains("; Secure"), "{cookie}");
    // A wrong token of any length is refused alike.
    for wrong in ["", "x", &"y".repeat(ADMIN_TOKEN.len()), &"z".repeat(500)] {
        let resp = http
            .post(format!("{}/admin/login", app.addr))
            .form(&[("token", wrong)])
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
    }
    app.stop().await;
}

/// Attack (issue 17, item 10): a session cookie copied before its admin signed out used to
/// keep working until it expired. Signing out now ends every session; signing out needs one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookie_stops_working_when_its_admin_signs_out() {
    let app = TestApp::spawn().await;
    let http = browser();
    let copied = sign_in(&app, &http).await;
    let page = |cookie: String| {
        http.get(format!("{}/admin", app.addr))
            .header("cookie", cookie)
            .send()
    };
    assert_eq!(page(copied.clone()).await.unwrap().status(), 200);
    let stranger = http
        .post(format!("{}/admin/logout", app.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(stranger.status(), 401, "signing out needs a session");
    assert_eq!(page(copied.clone()).await.unwrap().status(), 200);
    // Issue 32: a sign-out posted without the page's CSRF token (another site's form) is
    // refused; the dashboard's own sign-out form carries it.
    let forged = http
        .post(format!("{}/admin/logout", app.addr))
        .header("cookie", copied.clone())
        .form(&[("csrf", "forged")])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403, "signing out needs the CSRF token");
    assert_eq!(page(copied.clone()).await.unwrap().status(), 200);
    let html = page(copied.clone()).await.unwrap().text().await.unwrap();
    assert!(html.contains("action=\"/admin/logout\""), "{html}");
    let out = http
        .post(format!("{}/admin/logout", app.addr))
        .header("cookie", copied.clone())
        .form(&[("csrf", csrf_of(&html))])
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), 303);
    let after = page(copied).await.unwrap();
    assert_eq!(after.status(), 303, "the copied cookie no longer signs in");
    assert_eq!(after.headers()["location"], "/admin/login");
    // A new sign-in works again.
    let fresh = sign_in(&app, &http).await;
    assert_eq!(page(fresh).await.unwrap().status(), 200);
    app.stop().await;
}

/// Issue 19, item 5: risk events carry the risk flag (here TASK_FAILED, which was written
/// without it), and the task API and the admin task list filter on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn risk_events_are_flagged_and_tasks_filter_on_them() {
    let model = model_failing_first(1, "bad key").await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let failed = task_id_of(app.post_message(&message("risk", 1, "first")).await).await;
    app.wait_replied(failed, WAIT).await;
    let ok = task_id_of(app.post_message(&message("calm", 1, "second")).await).await;
    app.wait_replied(ok, WAIT).await;
    let task = app.get_task(failed).await;
    let flagged: Vec<(&str, bool)> = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["event"].as_str().unwrap(),
                a["risk_flag"].as_bool().unwrap(),
            )
        })
        .collect();
    assert!(flagged.contains(&("TASK_FAILED", true)), "{flagged:?}");
    assert!(flagged.contains(&("TASK_CREATED", false)), "{flagged:?}");

    let list = |query: &'static str| {
        let app = &app;
        async move {
            let resp = app
                .http
                .get(format!("{}/api/tasks?{query}", app.addr))
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap();
            let ids: Vec<i64> = body["tasks"]
                .as_array()
                .map(|t| t.iter().map(|t| t["id"].as_i64().unwrap()).collect())
                .unwrap_or_default();
            (status, ids)
        }
    };
    assert_eq!(list("risk=true").await, (200, vec![failed]));
    assert_eq!(list("risk=false").await, (200, vec![ok, failed]));
    assert_eq!(list("risk=maybe").await.0, 400);

    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let page = page_of(&app, &http, &cookie, "/admin/tasks?risk=true").await;
    assert!(page.contains(&format!("/admin/tasks/{failed}\"")), "{page}");
    assert!(!page.contains(&format!("/admin/tasks/{ok}\"")), "{page}");
    app.stop().await;
}

/// Issue 23: the dashboard's count links keep its window and filters, its filters are
/// selects of the known values, and the task list pages past its limit and searches by
/// conversation id and message text (case-insensitive, `%` taken literally).
/// The task ids a task-list page lists, in its order.
fn listed(html: &str) -> Vec<i64> {
    html.match_indices("class=\"task-link\">#")
        .map(|(at, m)| {
            let rest = &html[at + m.len()..];
            rest[..rest.find('<').unwrap()].parse().unwrap()
        })
        .collect()
}

/// The task list's text search goes through the trigram index (migration 0024) and folds
/// case by Unicode on both databases; Chinese is found by any substring, a two-character
/// word included (matched without the index).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_search_folds_unicode_case_and_finds_chinese() {
    let app = TestApp::spawn().await;
    let mut ids = Vec::new();
    for (n, text) in [
        "Ärger im Büro: die Straße ist gesperrt",
        "怎么申请报销？",
        "ΣΟΦΊΑ asks about the \"quoted\" travel policy",
        "nothing to see",
    ]
    .iter()
    .enumerate()
    {
        let id = task_id_of(app.post_message(&message(&format!("ts{n}"), 1, text)).await).await;
        app.wait_replied(id, WAIT).await;
        ids.push(id);
    }
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let search = async |q: &str| -> Vec<i64> {
        let resp = http
            .get(format!("{}/admin/tasks", app.addr))
            .query(&[("q", q)])
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{q}");
        listed(&resp.text().await.unwrap())
    };
    assert_eq!(search("ärger").await, [ids[0]], "lower case finds upper");
    assert_eq!(search("BÜRO").await, [ids[0]], "upper case finds lower");
    assert_eq!(search("straße").await, [ids[0]]);
    assert_eq!(search("σοφία").await, [ids[2]], "Greek folds too");
    assert_eq!(search("申请报销").await, [ids[1]]);
    assert_eq!(search("报销").await, [ids[1]], "a two-character word");
    assert_eq!(
        search("\"quoted\" travel").await,
        [ids[2]],
        "quotes taken literally"
    );
    assert!(
        search("büro die").await.is_empty(),
        "a substring, not words"
    );
    assert!(search("报销申请").await.is_empty());
    // Retention empties a text: it is no longer found.
    let now = assistd::domain::now_ms();
    app.store().purge_finished(now + 1, 100, now).await.unwrap();
    assert!(search("ärger").await.is_empty());
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_list_keeps_the_dashboard_filters_pages_and_searches() {
    let app = TestApp::spawn().await;
    let mut ids = Vec::new();
    for (n, text) in [
        "Alpha one",
        "beta 100% sure",
        "alpha two",
        "gamma",
        "ALPHA three",
    ]
    .iter()
    .enumerate()
    {
        let id = task_id_of(app.post_message(&message(&format!("tl{n}"), 1, text)).await).await;
        app.wait_replied(id, WAIT).await;
        ids.push(id);
    }
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let get = |path: String| {
        let (http, cookie, addr) = (http.clone(), cookie.clone(), app.addr.clone());
        async move {
            let resp = http
                .get(format!("{addr}{path}"))
                .header("cookie", &cookie)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{path}");
            resp.text().await.unwrap()
        }
    };

    // The dashboard: selects, and count links carrying the window and the filters.
    let dash = get("/admin?channel=generic&agent=default".into()).await;
    assert!(dash.contains("<select name=\"agent\""), "{dash}");
    assert!(
        dash.contains("<option value=\"generic\" selected>generic</option>"),
        "{dash}"
    );
    assert!(
        dash.contains("<option value=\"AUTH_FAILED\">AUTH_FAILED</option>"),
        "{dash}"
    );
    let at = dash
        .find("href=\"/admin/tasks?status=SUCCEEDED&amp;")
        .expect("a count link");
    let href = &dash[at + 6..];
    let href = href[..href.find('"').unwrap()].replace("&amp;", "&");
    for part in ["since=", "until=", "agent=default", "channel=generic"] {
        assert!(href.contains(part), "{href}");
    }
    assert_eq!(listed(&get(href.clone()).await).len(), 5);
    let elsewhere = href.replace("channel=generic", "channel=slack");
    assert!(listed(&get(elsewhere).await).is_empty());
    assert!(
        listed(&get("/admin/tasks?status=SUCCEEDED&since=0&until=1".into()).await).is_empty(),
        "outside the window"
    );

    // Two per page, newest first, each page linking the next.
    let page1 = get("/admin/tasks?limit=2".into()).await;
    assert_eq!(listed(&page1), [ids[4], ids[3]]);
    let at = page1.find("id=\"older\" href=\"").unwrap() + "id=\"older\" href=\"".len();
    let next = page1[at..at + page1[at..].find('"').unwrap()].replace("&amp;", "&");
    let page2 = get(next).await;
    assert_eq!(listed(&page2), [ids[2], ids[1]]);
    let page3 = get(format!("/admin/tasks?limit=2&before={}", ids[1])).await;
    assert_eq!(listed(&page3), [ids[0]]);
    assert!(!page3.contains("id=\"older\""), "the last page");
    let full_last = get(format!("/admin/tasks?limit=2&before={}", ids[2])).await;
    assert_eq!(listed(&full_last), [ids[1], ids[0]]);
    assert!(
        !full_last.contains("id=\"older\""),
        "a full last page links no empty page"
    );

    // Search: message text in any case, a literal %, and the conversation id.
    assert_eq!(
        listed(&get("/admin/tasks?q=alpha".into()).await),
        [ids[4], ids[2], ids[0]]
    );
    assert_eq!(listed(&get("/admin/tasks?q=0%25".into()).await), [ids[1]]);
    assert!(listed(&get("/admin/tasks?q=%25%25".into()).await).is_empty());
    assert_eq!(
        listed(&get("/admin/tasks?conversation=tl3".into()).await),
        [ids[3]]
    );
    let bad = http
        .get(format!("{}/admin/tasks?before=x", app.addr))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    app.stop().await;
}

/// Issue 23: the task page shows message text and step bodies through the audit's
/// redaction; "Show raw" (CSRF) shows them as they are and leaves a TASK_VIEWED_RAW audit
/// row naming the admin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_page_redacts_bodies_and_showing_them_raw_is_audited() {
    let app = TestApp::spawn().await;
    let text = "please mail bob.smith@example.com about it";
    let id = task_id_of(app.post_message(&message("raw", 1, text)).await).await;
    app.wait_replied(id, WAIT).await;
    let http = browser();
    let cookie = sign_in(&app, &http).await;
    let page = page_of(&app, &http, &cookie, &format!("/admin/tasks/{id}")).await;
    assert!(!page.contains("bob.smith@example.com"), "{page}");
    assert!(page.contains("[email]"), "{page}");
    assert!(page.contains("id=\"show-raw\""), "{page}");
    let raw_url = format!("{}/admin/tasks/{id}/raw", app.addr);
    let forged = http
        .post(&raw_url)
        .header("cookie", &cookie)
        .form(&[("csrf", "f".repeat(64))])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);
    let task = app.get_task(id).await;
    let audit = |task: &Value| -> Vec<String> {
        task["audit"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                format!(
                    "{} {}",
                    a["event"].as_str().unwrap(),
                    a["actor"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert!(
        !audit(&task)
            .iter()
            .any(|e| e.starts_with("TASK_VIEWED_RAW"))
    );
    let raw = http
        .post(&raw_url)
        .header("cookie", &cookie)
        .form(&[("csrf", csrf_of(&page).as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 200);
    let raw = raw.text().await.unwrap();
    assert!(raw.contains("bob.smith@example.com"), "{raw}");
    assert!(raw.contains("id=\"raw-banner\""), "{raw}");
    let task = app.get_task(id).await;
    assert!(
        audit(&task).contains(&"TASK_VIEWED_RAW admin:web".to_string()),
        "{:?}",
        audit(&task)
    );
    app.stop().await;
}
