//! The rollups behind `/metrics` (issue 35, migration 0022): after a random mix of
//! outcomes (answers, model failures, cancellations, pauses), reply retries, resumes of
//! failed tasks, restarts of finished ones, a restart, retention and folding, the counts read from the rollups and the
//! live rows equal a recount of every row kept; a damaged rollup is mended by a rebuild.

use std::time::{Duration, Instant};

use reqwest::Method;

use crate::helpers::*;
use crate::strict_model::{ModelReply, last_content, model_mock};

/// Answers, except: a question with "fail" in it is refused (a deterministic failure) and
/// one with "slow" takes a second.
fn mixed(body: &serde_json::Value) -> ModelReply {
    let asked = last_content(body);
    if asked.contains("fail") {
        ModelReply::error(400, r#"{"error":{"message":"bad request"}}"#)
    } else if asked.contains("slow") {
        ModelReply::text(format!("answer to: {asked}")).delayed(Duration::from_secs(1))
    } else {
        ModelReply::text(format!("answer to: {asked}"))
    }
}

/// Waits until no task or reply is live any more (letting go tasks a pause reached late: a
/// pause asked of a run takes effect at its next step), then checks the rollups against a
/// recount.
async fn settled_and_equal(app: &TestApp, when: &str) {
    let store = app.store();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let paused = store
            .list_tasks(Some(assistd::domain::TaskStatus::Paused), None, 100)
            .await
            .unwrap();
        for task in paused {
            task_action(app, task.id, "unpause").await;
        }
        let counted = store.metric_counts_recounted().await.unwrap();
        let live_tasks = counted
            .tasks_by_status
            .iter()
            .any(|(s, _)| !s.is_terminal());
        let pending = counted
            .replies_by_status
            .iter()
            .any(|(s, _)| s.as_str() == "PENDING");
        if !live_tasks && !pending {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{when}: never settled: {counted:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counted = format!("{:?}", store.metric_counts_recounted().await.unwrap());
    let rolled = format!("{:?}", store.metric_counts().await.unwrap());
    assert_eq!(rolled, counted, "{when}");
    println!("{when}: {rolled}");
}

/// Every rollup cell's sums over its slots (the cells that sum to something), as text.
async fn cells(store: &assistd::store::Store) -> Vec<String> {
    let tables = [
        (
            "task_rollup",
            "agent_id, agent_version_id, channel, status, failure_type, delivery",
            "tasks, takeovers",
        ),
        ("reply_rollup", "channel, status, placeholder", "replies"),
        (
            "token_rollup",
            "agent_id, channel, failure_type, model",
            "calls, prompt_tokens, completion_tokens",
        ),
        (
            "latency_rollup",
            "agent_id, channel, failure_type, le",
            "answers",
        ),
    ];
    let mut all = Vec::new();
    for (table, cell, counts) in tables {
        let text = |list: &str, sum: bool| {
            list.split(", ")
                .map(|c| {
                    if sum {
                        format!("CAST(SUM({c}) AS TEXT)")
                    } else {
                        format!("CAST({c} AS TEXT)")
                    }
                })
                .collect::<Vec<_>>()
                .join(" || '|' || ")
        };
        let nonzero: Vec<String> = counts
            .split(", ")
            .map(|c| format!("SUM({c}) <> 0"))
            .collect();
        let sql = format!(
            "SELECT '{table}|' || CAST(hour AS TEXT) || '|' || {} || '|' || {} FROM {table} \
             GROUP BY hour, {cell} HAVING {} ORDER BY 1",
            text(cell, false),
            text(counts, true),
            nonzero.join(" OR ")
        );
        let rows: Vec<String> = match store {
            assistd::store::Store::Sqlite(pool, _) => {
                sqlx::query_scalar(&sql).fetch_all(pool).await.unwrap()
            }
            assistd::store::Store::Postgres(pool) => {
                sqlx::query_scalar(&sql).fetch_all(pool).await.unwrap()
            }
        };
        all.extend(rows);
    }
    all
}

/// The failure summary of the last hours (to the end of this one).
async fn summary(app: &TestApp) -> serde_json::Value {
    let now = assistd::domain::now_ms();
    let path = format!(
        "/api/admin/failure-summary?bucket=hour&since={}&until={}",
        now - 3 * 3_600_000,
        now + 3_600_000
    );
    let (status, body) = app.admin_call(Method::GET, &path, None).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// The rollups the triggers kept equal what a rebuild counts from history: cell by cell,
/// and as the failure summary shows them.
async fn kept_equal_rebuilt(app: &TestApp, when: &str) {
    settled_and_equal(app, when).await;
    let (kept, kept_summary) = (cells(app.store()).await, summary(app).await);
    app.store().rebuild_rollups().await.unwrap();
    let (rebuilt, rebuilt_summary) = (cells(app.store()).await, summary(app).await);
    assert_eq!(kept, rebuilt, "{when}: rollup cells");
    assert_eq!(kept_summary, rebuilt_summary, "{when}: failure summary");
    assert!(
        kept.iter().any(|c| c.starts_with("token_rollup|")),
        "{when}: {kept:?}"
    );
    assert!(
        kept.iter().any(|c| c.starts_with("latency_rollup|")),
        "{when}: {kept:?}"
    );
}

async fn task_action(app: &TestApp, id: i64, action: &str) {
    let path = format!("/api/tasks/{id}/{action}");
    // 409 when the task is no longer in a state the action applies to: part of the mix.
    let (status, body) = app.admin_call(Method::POST, &path, None).await;
    assert!(
        status == 200 || status == 409,
        "{action} {id}: {status} {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollups_equal_a_recount_after_a_random_mix() {
    let seed = fastrand::u64(..);
    println!("seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let model = wiremock::MockServer::start().await;
    model_mock(mixed).mount(&model).await;
    // The first replies are refused and retried.
    let app = TestApp::spawn_with(model, receiver_refusing_first(3, 503).await, |c| {
        c.outbox.backoff_base_ms = 10;
    })
    .await;
    let kinds = ["ok", "fail", "slow", "ok slow", "fail again"];
    let mut ids = Vec::new();
    for n in 0..24 {
        let text = kinds[rng.usize(..kinds.len())];
        let conversation = format!("mix-{}", rng.usize(..6));
        let posted = app.post_message(&message(&conversation, n, text)).await;
        ids.push(task_id_of(posted).await);
        if rng.u8(..10) == 0 {
            task_action(&app, ids[rng.usize(..ids.len())], "cancel").await;
        }
        if rng.u8(..10) == 0 {
            task_action(&app, ids[rng.usize(..ids.len())], "pause").await;
        }
    }
    // Paused tasks are let go again, so that everything finishes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in &ids {
        if app.get_task(*id).await["status"] == "PAUSED" {
            task_action(&app, *id, "unpause").await;
        }
    }
    kept_equal_rebuilt(&app, "after the mix").await;

    // Failed tasks resumed (they fail again or, cancelled ones aside, are answered).
    for id in &ids {
        if app.get_task(*id).await["status"] == "FAILED" {
            task_action(&app, *id, "resume").await;
        }
    }
    kept_equal_rebuilt(&app, "after the resumes").await;

    // Finished tasks run again from their first step (their model calls superseded).
    for id in ids.iter().filter(|_| rng.bool()) {
        task_action(&app, *id, "restart").await;
    }
    kept_equal_rebuilt(&app, "after the restarts").await;

    // A restart on the same database, and a few more messages.
    let (db, model, receiver) = app.stop_keeping_db().await;
    let reply_url = format!("{}/reply", receiver.uri());
    let config = test_config(&db.url, &model.uri(), &reply_url);
    let app = TestApp::spawn_config(db, model, receiver, config).await;
    for n in 100..106 {
        let text = kinds[rng.usize(..kinds.len())];
        task_id_of(app.post_message(&message("mix-after", n, text)).await).await;
    }
    kept_equal_rebuilt(&app, "after the restart").await;

    // Retention keeps rows and their states: the counts do not move.
    let now = assistd::domain::now_ms();
    let (_, purged) = app
        .store()
        .purge_finished(now + 1, 1000, now)
        .await
        .unwrap();
    assert!(purged > 0);
    kept_equal_rebuilt(&app, "after retention").await;

    // Folding finished hours into one row per cell changes no sum and leaves no
    // per-connection row behind.
    app.store().fold_rollups(now / 3_600_000 + 1).await.unwrap();
    kept_equal_rebuilt(&app, "after folding").await;
    let per_connection = "SELECT COUNT(*) FROM task_rollup WHERE slot <> 0";
    let left: i64 = match app.store() {
        assistd::store::Store::Sqlite(pool, _) => sqlx::query_scalar(per_connection)
            .fetch_one(pool)
            .await
            .unwrap(),
        assistd::store::Store::Postgres(pool) => sqlx::query_scalar(per_connection)
            .fetch_one(pool)
            .await
            .unwrap(),
    };
    assert_eq!(left, 0);

    // A damaged rollup differs from the recount until it is rebuilt.
    let damage = "DELETE FROM task_rollup WHERE status = 'SUCCEEDED'";
    match app.store() {
        assistd::store::Store::Sqlite(pool, _) => {
            sqlx::query(damage).execute(pool).await.unwrap();
        }
        assistd::store::Store::Postgres(pool) => {
            sqlx::query(damage).execute(pool).await.unwrap();
        }
    }
    let rolled = app.store().metric_counts().await.unwrap();
    let counted = app.store().metric_counts_recounted().await.unwrap();
    assert_ne!(format!("{rolled:?}"), format!("{counted:?}"));
    app.store().rebuild_rollups().await.unwrap();
    settled_and_equal(&app, "after the rebuild").await;
    app.stop().await;
}

/// Migration 0037: the rollup triggers' helpers are inlined into the queries that call them
/// (no function call per row), and they give what they gave as functions: an answer's key
/// as `domain::reply_key` spells it, and a latency's bucket as the smallest bound of
/// `latency_bound` at or above it, else the largest.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollup_helpers_are_inlined_and_keep_their_values() {
    let db = TestDb::postgres().await;
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = assistd::store::Store::connect(&cfg.database).await.unwrap();
    store.migrate().await.unwrap();
    let assistd::store::Store::Postgres(pool) = &store else {
        panic!("a PostgreSQL store");
    };
    for (task, resumes) in [(7_i64, 0_i64), (7, 2), (123_456_789_012, 11)] {
        let key: String = sqlx::query_scalar("SELECT answer_key($1, $2)")
            .bind(task)
            .bind(resumes)
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(key, assistd::domain::reply_key(task, resumes));
    }
    let bounds: Vec<i64> = sqlx::query_scalar("SELECT le FROM latency_bound ORDER BY le")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut waits: Vec<Option<i64>> = vec![None, Some(-5), Some(0), Some(i64::MAX)];
    for le in &bounds {
        waits.extend([Some(le - 1), Some(*le), Some(le + 1)]);
    }
    for waited in waits {
        let (inlined, counted): (i64, i64) = sqlx::query_as(
            "SELECT latency_le($1), COALESCE((SELECT MIN(le) FROM latency_bound WHERE le >= $1), \
             (SELECT MAX(le) FROM latency_bound))",
        )
        .bind(waited)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(inlined, counted, "waited {waited:?}");
    }
    // Inlined: the plan computes the expressions; a function call would be named in it.
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN (VERBOSE, COSTS OFF) SELECT answer_key(id, resume_count), \
         latency_le(created_at) FROM agent_task",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("agent-task-"), "{plan}");
    assert!(
        !plan.contains("answer_key(") && !plan.contains("latency_le("),
        "{plan}"
    );
    store.close().await;
    db.drop_db().await;
}

/// Issue 35: a model call's model is read from its journalled request's first bytes. The
/// journal writes `model` first (in a conversation the request after it grows with every
/// answer kept in its history), and the rollups read the model without parsing what follows:
/// a request cut short right after its model still names it. Requests journalled before
/// (the model after the messages), names with escaped quotes, retention's kept model and
/// text that is not JSON read as before; what the triggers keep equals a rebuild.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_model_is_read_from_the_start_of_its_journalled_request() {
    let app = TestApp::spawn().await;
    let long = "报销流程怎么走？".repeat(500);
    let first = task_id_of(app.post_message(&message("long", 0, &long)).await).await;
    app.wait_replied(first, Duration::from_secs(20)).await;
    let second = task_id_of(app.post_message(&message("long", 1, "谢谢")).await).await;
    app.wait_replied(second, Duration::from_secs(20)).await;
    let steps = app.store().task_steps(second).await.unwrap();
    let input = steps[0].input.as_deref().unwrap();
    let model = &app.config.llm.model;
    assert!(
        input.starts_with(&format!(r#"{{"model":"{model}","#)),
        "{}",
        input.chars().take(80).collect::<String>()
    );
    // The same JSON as a body the model got, the first answer in its history.
    let journalled: serde_json::Value = serde_json::from_str(input).unwrap();
    let sent = model_bodies(&app.model).await;
    assert!(sent.contains(&journalled), "{} bodies sent", sent.len());
    assert!(input.contains(&format!("answer to: {long}")));
    kept_equal_rebuilt(&app, "after a long conversation").await;
    let cells = cells(app.store()).await;
    assert!(
        cells
            .iter()
            .any(|c| c.starts_with("token_rollup|") && c.contains(&format!("|{model}|"))),
        "{cells:?}"
    );

    let read = assistd::store::rollups::step_model(app.store().dialect(), "$1");
    let read = format!("SELECT {read}");
    let cut_short = format!(
        r#"{{"model":"m","messages":[{{"content":"{}"#,
        "x".repeat(100_000)
    );
    let cases: [(Option<&str>, Option<&str>); 9] = [
        (
            Some(r#"{"model":"llama3.2","messages":[]}"#),
            Some("llama3.2"),
        ),
        (Some(&cut_short), Some("m")),
        (
            Some(r#"{"messages":[{"role":"user","content":"hi"}],"model":"before"}"#),
            Some("before"),
        ),
        (
            Some(r#"{"model":"a \"quoted\", m\\odel","messages":[]}"#),
            Some(r#"a "quoted", m\odel"#),
        ),
        (Some(r#"{"model":"模型","messages":[]}"#), Some("模型")),
        (Some(r#"{"model":"kept"}"#), Some("kept")),
        (Some(r#"{"model" : "kept"}"#), Some("kept")),
        (Some("not json"), None),
        (None, None),
    ];
    for (input, expected) in cases {
        let got: Option<String> = match app.store() {
            assistd::store::Store::Sqlite(pool, _) => sqlx::query_scalar(&read)
                .bind(input)
                .fetch_one(pool)
                .await
                .unwrap(),
            assistd::store::Store::Postgres(pool) => sqlx::query_scalar(&read)
                .bind(input)
                .fetch_one(pool)
                .await
                .unwrap(),
        };
        let shown = input.map(|i| i.chars().take(60).collect::<String>());
        assert_eq!(got.as_deref(), expected, "{shown:?}");
    }
    app.stop().await;
}
