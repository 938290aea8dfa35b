//! The admin failure summary, redaction and metrics, on seeded data.

use serde_json::Value;
use wiremock::{MockServer, Request};

use crate::helpers::*;

/// Echoes, except: "fail-auth" → 401 (with an email in the error), "fail-provider" → 500.
struct ScriptedFailures;

impl ModelScript for ScriptedFailures {
    fn reply(&self, _request: &Request, body: &Value) -> ModelReply {
        let text = body.to_string();
        if text.contains("fail-auth") {
            return ModelReply::error(401, r#"{"error":"invalid key, contact ops@example.com"}"#);
        }
        if text.contains("fail-provider") {
            return ModelReply::error(500, "upstream exploded");
        }
        echo(body)
    }
}

pub async fn seeded() -> (TestApp, Vec<i64>) {
    let model = MockServer::start().await;
    model_mock(ScriptedFailures).mount(&model).await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.llm.retry.provider_error.max_attempts = 1;
    })
    .await;
    let mut ids = Vec::new();
    for (n, text) in [
        "ok one",
        "ok two",
        "ok three",
        "fail-auth a",
        "fail-auth b",
        "fail-provider",
    ]
    .iter()
    .enumerate()
    {
        ids.push(
            task_id_of(
                app.post_message(&message(&format!("dash{n}"), 1, text))
                    .await,
            )
            .await,
        );
    }
    for id in &ids {
        app.wait_replied(*id, WAIT).await;
    }
    (app, ids)
}

impl TestApp {
    async fn summary(&self, query: &str) -> reqwest::Response {
        self.http
            .get(format!("{}/api/admin/failure-summary?{query}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_summary_matches_seeded_tasks() {
    let (app, _) = seeded().await;
    let s: Value = app.summary("bucket=hour").await.json().await.unwrap();
    let totals = &s["totals"];
    assert_eq!(totals["tasks"], 6);
    assert_eq!(totals["by_status"]["SUCCEEDED"], 3);
    assert_eq!(totals["by_status"]["FAILED"], 3);
    assert_eq!(totals["by_failure_type"]["AUTH_FAILED"], 2);
    assert_eq!(totals["by_failure_type"]["PROVIDER_ERROR"], 1);
    assert_eq!(totals["success_rate"], 0.5);
    let buckets = s["buckets"].as_array().unwrap();
    assert!(!buckets.is_empty());
    assert_eq!(
        buckets
            .iter()
            .map(|b| b["tasks"].as_i64().unwrap())
            .sum::<i64>(),
        6
    );
    assert_eq!(s["by_agent"][0]["agent"], "default");
    assert_eq!(s["by_agent"][0]["version"], 1);
    assert_eq!(s["latency_ms"]["count"], 6);
    assert!(s["latency_ms"]["p50"].as_i64().unwrap() <= s["latency_ms"]["p95"].as_i64().unwrap());
    let auth = &s["top_errors"]["AUTH_FAILED"][0];
    assert_eq!(auth["count"], 2);
    let msg = auth["message"].as_str().unwrap();
    assert!(
        msg.contains("401") && msg.contains("[email]") && !msg.contains("ops@example.com"),
        "{msg}"
    );

    let only_auth: Value = app
        .summary("failure_type=auth_failed&bucket=day")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(only_auth["totals"]["tasks"], 2);
    let other_channel: Value = app.summary("channel=slack").await.json().await.unwrap();
    assert_eq!(other_channel["totals"]["tasks"], 0);
    let none_yet: Value = app
        .summary("since=1000&until=2000")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(none_yet["totals"]["tasks"], 0);
    assert!(none_yet["totals"]["success_rate"].is_null());
    assert_eq!(app.summary("bucket=week").await.status(), 400);
    assert_eq!(app.summary("since=5&until=4").await.status(), 400);
    assert_eq!(app.summary("failure_type=NOPE").await.status(), 400);
    let url = format!("{}/api/admin/failure-summary", app.addr);
    assert_eq!(app.http.get(&url).send().await.unwrap().status(), 401);
    assert_eq!(
        app.http
            .get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_summaries_are_redacted() {
    let (app, ids) = seeded().await;
    let task = app.get_task(ids[3]).await;
    let failed = task["audit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["event"] == "TASK_FAILED")
        .unwrap();
    let summary = failed["summary"].as_str().unwrap();
    assert!(
        summary.contains("[email]") && !summary.contains("ops@example.com"),
        "{summary}"
    );
    app.stop().await;
}

/// Issue 23: with the reply receiver down, a task that succeeded is not "answered": the
/// summary shows its answer pending, the outbox backlog and its age, the platform's
/// panel and the failing reply; an admin's "retry delivery now" (API, and the page's
/// button with CSRF) sends it at once, audited, and then it counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undelivered_answer_is_not_counted_as_answered_until_a_retry_delivers_it() {
    let (app, id, reply) = an_answer_the_receiver_refused().await;

    let s: Value = app.summary("").await.json().await.unwrap();
    let totals = &s["totals"];
    assert_eq!(totals["by_status"]["SUCCEEDED"], 1, "{s:#}");
    assert_eq!(totals["answers"]["PENDING"], 1, "{s:#}");
    assert_eq!(totals["success_rate"], 0.0, "not answered: {s:#}");
    assert_eq!(totals["answered"], 0);
    assert_eq!(totals["outcome_success_rate"], 1.0);
    let delivery = &s["delivery"];
    assert_eq!(delivery["backlog"], 1);
    assert!(delivery["oldest_pending_age_ms"].as_i64().unwrap() >= 0);
    assert_eq!(delivery["by_channel"][0]["channel"], "generic");
    assert_eq!(delivery["by_channel"][0]["PENDING"], 1);
    assert_eq!(delivery["by_channel"][0]["backlog"], 1);
    assert_eq!(delivery["stuck"][0]["id"], reply);
    assert!(
        delivery["stuck"][0]["last_error"]
            .as_str()
            .unwrap()
            .contains("503"),
        "{delivery:#}"
    );

    // The page shows it, with a retry button that needs the page's CSRF token.
    let http = crate::admin_pages::browser();
    let cookie = crate::admin_pages::sign_in(&app, &http).await;
    let page = crate::admin_pages::page_of(&app, &http, &cookie, "/admin").await;
    assert!(page.contains("id=\"answers-pending\">1<"), "{page}");
    assert!(page.contains(&format!("id=\"retry-{reply}\"")), "{page}");
    let retry_page = format!("{}/admin/replies/{reply}/retry", app.addr);
    let forged = http
        .post(&retry_page)
        .header("cookie", &cookie)
        .form(&[("csrf", "0".repeat(64))])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403, "no retry without the page's token");
    let retry_api = format!("{}/api/admin/replies/{reply}/retry", app.addr);
    assert_eq!(
        app.http.post(&retry_api).send().await.unwrap().status(),
        401
    );

    // The receiver is back; the admin retries from the page.
    receiver_accepts_again(&app.receiver).await;
    let csrf = crate::admin_pages::csrf_of(&page);
    let done = http
        .post(&retry_page)
        .header("cookie", &cookie)
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(done.status(), 303);
    let to = done.headers()["location"].to_str().unwrap();
    assert!(to.contains("panel=delivery"), "{to}");
    app.wait_replied(id, WAIT).await;

    let s: Value = app.summary("").await.json().await.unwrap();
    assert_eq!(s["totals"]["answers"]["DELIVERED"], 1, "{s:#}");
    assert_eq!(s["totals"]["success_rate"], 1.0);
    assert_eq!(s["totals"]["answered"], 1);
    assert_eq!(s["delivery"]["backlog"], 0);
    assert_eq!(s["delivery"]["stuck"], serde_json::json!([]));
    let trail: Value = app
        .http
        .get(format!(
            "{}/api/admin/audit?target_type=reply&target_id={reply}",
            app.addr
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let events = crate::jobs::events(&trail);
    assert!(
        events.contains(&("REPLY_RETRIED".into(), "admin:web".into())),
        "{events:?}"
    );
    assert!(events.iter().any(|(e, _)| e == "REPLY_SENT"), "{events:?}");

    // Delivered: a second retry is refused; no such reply is 404.
    let again = app
        .http
        .post(&retry_api)
        .bearer_auth(ADMIN_TOKEN)
        .header("X-Assistd-Actor", "carol")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
    let none = app
        .http
        .post(format!("{}/api/admin/replies/999999/retry", app.addr))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(none.status(), 404);
    assert_eq!(
        receiver_posts(&app).await,
        2,
        "one failed try, one delivery"
    );
    app.stop().await;
}

async fn receiver_posts(app: &TestApp) -> usize {
    app.receiver.received_requests().await.unwrap().len()
}

/// Issue 23: tokens and an estimated cost per agent and model, from `llm.prices`, on the
/// summary (read from the journal) and in /metrics (this instance's counters); a model
/// without a price shows its tokens and no cost. Refused: a negative price, naming the key.
#[cfg_attr(
    not(assistd_has_prometheus),
    ignore = "needs Python's prometheus-client (pip install 'prometheus-client>=0.20,<1'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_estimated_cost_per_agent_and_model() {
    let app = TestApp::spawn_with(echo_model().await, accepting_receiver().await, |c| {
        c.llm.model = "priced-model-23".into();
        c.llm.prices.insert(
            "priced-model-23".into(),
            assistd::config::ModelPrice {
                prompt_per_million: 2.0,
                completion_per_million: 10.0,
            },
        );
    })
    .await;
    let (mut prompt, mut completion) = (0, 0);
    for n in 0..2 {
        let id = task_id_of(
            app.post_message(&message(&format!("tok{n}"), 1, "count me"))
                .await,
        )
        .await;
        let task = app.wait_replied(id, WAIT).await;
        prompt += task["steps"][0]["tokens_in"].as_i64().unwrap();
        completion += task["steps"][0]["tokens_out"].as_i64().unwrap();
    }
    assert!(prompt > 0 && completion > 0);
    let cost = (prompt as f64 * 2.0 + completion as f64 * 10.0) / 1e6;
    let s: Value = app.summary("").await.json().await.unwrap();
    let tokens = &s["tokens"];
    assert_eq!(tokens["currency"], "USD");
    let row = &tokens["by_agent_model"][0];
    assert_eq!(row["agent"], "default", "{tokens:#}");
    assert_eq!(row["model"], "priced-model-23");
    assert_eq!(row["calls"], 2);
    assert_eq!(row["prompt_tokens"], prompt);
    assert_eq!(row["completion_tokens"], completion);
    assert!(
        (row["estimated_cost"].as_f64().unwrap() - cost).abs() < 1e-12,
        "{row}"
    );
    let m = crate::metrics::scrape(&app.addr).await;
    let shown = m
        .sample(
            "assistd_model_estimated_cost_total",
            &[
                ("agent", "default"),
                ("model", "priced-model-23"),
                ("currency", "USD"),
            ],
        )
        .unwrap_or_else(|| panic!("{m:?}"));
    assert!((shown - cost).abs() < 1e-12, "{shown}");
    app.stop().await;

    // Unpriced: tokens, no cost.
    let app = TestApp::spawn().await;
    let id = task_id_of(app.post_message(&message("tok-free", 1, "hi")).await).await;
    app.wait_replied(id, WAIT).await;
    let s: Value = app.summary("").await.json().await.unwrap();
    assert_eq!(s["tokens"]["by_agent_model"][0]["model"], "test-model");
    assert!(s["tokens"]["by_agent_model"][0]["estimated_cost"].is_null());
    assert_eq!(s["tokens"]["estimated_cost"], 0.0);
    let m = crate::metrics::scrape(&app.addr).await;
    let tokens = [
        ("agent", "default"),
        ("model", "test-model"),
        ("kind", "completion"),
    ];
    assert!(
        m.sample("assistd_model_tokens_total", &tokens).is_some(),
        "{m:?}"
    );
    let priced = m.samples("assistd_model_estimated_cost_total");
    assert!(
        priced.iter().all(|(l, _)| l["model"] != "test-model"),
        "{m:?}"
    );
    app.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prices.toml");
    std::fs::write(
        &file,
        "[llm.prices.\"m\"]\nprompt_per_million = -1.0\ncompletion_per_million = 1.0\n",
    )
    .unwrap();
    let err = assistd::config::Config::load_with_env(Some(&file), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("llm.prices.m.prompt_per_million"), "{err}");
}

/// An app whose reply receiver answers 503 (until a test mounts a 200 of higher priority),
/// with a backoff so long that only a retry can deliver, and one task that succeeded and
/// whose answer failed once: (app, task id, reply id).
pub(crate) async fn an_answer_the_receiver_refused() -> (TestApp, i64, i64) {
    use wiremock::matchers::{method, path};
    use wiremock::{Mock, ResponseTemplate};
    let receiver = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .respond_with(ResponseTemplate::new(503))
        .with_priority(5)
        .mount(&receiver)
        .await;
    let app = TestApp::spawn_with(echo_model().await, receiver, |c| {
        c.outbox.backoff_base_ms = 600_000;
        c.outbox.backoff_max_ms = 600_000;
    })
    .await;
    let id = task_id_of(app.post_message(&message("c-down", 1, "hello")).await).await;
    let task = app
        .wait_task(id, WAIT, |t| {
            t["status"] == "SUCCEEDED" && t["replies"][0]["last_error"].is_string()
        })
        .await;
    let reply = task["replies"][0]["id"].as_i64().unwrap();
    (app, id, reply)
}

/// A resumed task's answer is its `-r<n>` reply (`domain::reply_key`, repeated in SQL by
/// the summary): until that one is delivered the task is not answered, even though the
/// first run's failure notice was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_task_is_answered_only_by_its_resumed_answer() {
    use wiremock::matchers::{header, method, path};
    use wiremock::{Mock, ResponseTemplate};
    let model = model_failing_first(1, "").await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("c-resumed", 1, "again")).await).await;
    let failed = app.wait_replied(id, WAIT).await;
    assert_eq!(failed["status"], "FAILED");
    let resumed_key = format!("agent-task-{id}-r1");
    Mock::given(method("POST"))
        .and(path("/reply"))
        .and(SignedWithTestSecret)
        .and(header("idempotency-key", resumed_key.as_str()))
        .respond_with(ResponseTemplate::new(503))
        .with_priority(1)
        .mount(&app.receiver)
        .await;
    assert_eq!(app.control(id, "resume").await.status(), 200);
    app.wait_task(id, WAIT, |t| {
        t["status"] == "SUCCEEDED"
            && t["reply"]["idempotency_key"] == resumed_key
            && t["reply"]["attempts"].as_i64().unwrap_or(0) >= 1
    })
    .await;
    let s: Value = app.summary("").await.json().await.unwrap();
    let totals = &s["totals"];
    assert_eq!(totals["answers"]["PENDING"], 1, "{s:#}");
    assert!(
        totals["answers"]["DELIVERED"].is_null() || totals["answers"]["DELIVERED"] == 0,
        "{s:#}"
    );
    assert_eq!(totals["success_rate"], 0.0, "{s:#}");
    app.stop().await;
}
