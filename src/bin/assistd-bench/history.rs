//! `history`: the admin read paths over a long history. N finished tasks of the last day, each
//! with its message and its delivered answer (one in ten failed, with one of seven errors), are written straight into
//! the database; then the failure summary (`GET /api/admin/failure-summary`, the dashboard's query,
//! over the default 24-hour window: every seeded task) and `/metrics` (its database gauges)
//! are each fetched 100 times: p50, p99 and max.

use std::time::{Duration, Instant};

use sqlx::Connection;

use assistd::config::Role;

use crate::harness::*;
use crate::*;

/// The seeding statements, the same text for both dialects: `$1` N, `$2` now (ms), `$3` the
/// spacing of the messages (ms); (tasks) `$1` agent id, `$2` its version id, `$3`..`$4` the
/// messages' ids; (replies) `$1`..`$2` the tasks' ids. Message `i` names task `i`, as
/// intake would (`im_message.task_id`); the ids are given, so PostgreSQL's sequences are
/// moved past them afterwards.
const MESSAGES: &str = "WITH RECURSIVE n(i) AS (SELECT CAST(1 AS BIGINT) UNION ALL \
     SELECT i + 1 FROM n WHERE i < $1) \
     INSERT INTO im_message (id, task_id, channel, external_event_id, external_message_id, \
     conversation_id, sender_id, text, received_at) \
     SELECT i, i, 'generic', 'h-e-' || CAST(i AS TEXT), 'h-m-' || CAST(i AS TEXT), \
     'h-c-' || CAST(i % 1000 AS TEXT), 'u', 'history message ' || CAST(i AS TEXT), \
     $2 - i * $3 FROM n";
const TASKS: &str = "INSERT INTO agent_task (id, agent_id, agent_version_id, task_type, channel, \
     conversation_id, message_id, trigger_user, status, failure_type, error_msg, run_after, \
     created_at, updated_at, finished_at) \
     SELECT m.task_id, $1, $2, 'conversation_reply', m.channel, m.conversation_id, m.id, \
     m.sender_id, \
     CASE WHEN m.id % 10 = 0 THEN 'FAILED' ELSE 'SUCCEEDED' END, \
     CASE WHEN m.id % 10 = 0 THEN 'PROVIDER_ERROR' END, \
     CASE WHEN m.id % 10 = 0 THEN 'model call failed: HTTP 50' || CAST(m.id % 7 AS TEXT) END, \
     m.received_at, m.received_at, m.received_at + 1000, m.received_at + 1000 \
     FROM im_message m WHERE m.channel = 'generic' AND m.external_event_id LIKE 'h-e-%' \
     AND m.id > $3 AND m.id <= $4";
const REPLIES: &str = "INSERT INTO outbound_reply (task_id, idempotency_key, channel, \
     conversation_id, in_reply_to, reply_type, content, status, attempts, next_attempt_at, \
     created_at, sent_at) \
     SELECT t.id, 'agent-task-' || CAST(t.id AS TEXT), t.channel, t.conversation_id, \
     'h', 'text', '{\"text\": \"ok\"}', 'SENT', 1, t.finished_at, t.finished_at, \
     t.finished_at + 500 FROM agent_task t WHERE t.id > $1 AND t.id <= $2";

/// Rows seeded per transaction.
const CHUNK: usize = 20_000;

/// Writes the history through its own connection (the server's pool is the app's).
async fn seed(db: &BenchDb, kind: Db, n: usize) -> anyhow::Result<()> {
    let now = assistd::domain::now_ms();
    // Spread over 23 hours, inside the summary's default window.
    let spacing = (23 * 3_600_000 / n.max(1) as i64).max(1);
    macro_rules! run {
        ($conn:expr) => {{
            let mut conn = $conn;
            let (agent, version): (i64, i64) =
                sqlx::query_as("SELECT id, current_version_id FROM agent WHERE name = 'default'")
                    .fetch_one(&mut conn)
                    .await?;
            sqlx::query(MESSAGES)
                .bind(n as i64)
                .bind(now)
                .bind(spacing)
                .execute(&mut conn)
                .await?;
            // In transactions of CHUNK rows, as tasks finish in real life: one statement
            // for all would update each rollup row N times in one transaction, whose
            // versions nothing can prune until it ends.
            let (last,): (i64,) = sqlx::query_as("SELECT COALESCE(MAX(id), 0) FROM im_message")
                .fetch_one(&mut conn)
                .await?;
            for lo in (0..last).step_by(CHUNK) {
                sqlx::query(TASKS)
                    .bind(agent)
                    .bind(version)
                    .bind(lo)
                    .bind(lo + CHUNK as i64)
                    .execute(&mut conn)
                    .await?;
            }
            let (last,): (i64,) = sqlx::query_as("SELECT COALESCE(MAX(id), 0) FROM agent_task")
                .fetch_one(&mut conn)
                .await?;
            for lo in (0..last).step_by(CHUNK) {
                sqlx::query(REPLIES)
                    .bind(lo)
                    .bind(lo + CHUNK as i64)
                    .execute(&mut conn)
                    .await?;
            }
            // Steady state: the seeding left the rollup tables many dead versions long
            // (a finishing transaction's few are pruned as it goes), and no statistics are
            // fresh yet (autovacuum's work).
            if matches!(kind, Db::Postgres) {
                sqlx::query(
                    "SELECT setval('im_message_id_seq', (SELECT MAX(id) FROM im_message)), \
                     setval('agent_task_id_seq', (SELECT MAX(id) FROM agent_task))",
                )
                .execute(&mut conn)
                .await?;
                sqlx::query("VACUUM FULL task_rollup, reply_rollup, latency_rollup, token_rollup")
                    .execute(&mut conn)
                    .await?;
                sqlx::query("VACUUM ANALYZE").execute(&mut conn).await?;
            }
            conn.close().await?;
        }};
    }
    match kind {
        Db::Sqlite => run!(sqlx::SqliteConnection::connect(&db.url).await?),
        Db::Postgres => run!(sqlx::PgConnection::connect(&db.url).await?),
    }
    Ok(())
}

/// `rounds` GETs of `url`: the sorted times, and the last body.
async fn timed(
    http: &reqwest::Client,
    url: &str,
    rounds: usize,
) -> anyhow::Result<(Vec<Duration>, String)> {
    let mut times = Vec::with_capacity(rounds);
    let mut body = String::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let resp = http.get(url).bearer_auth("bench-admin").send().await?;
        anyhow::ensure!(resp.status().is_success(), "{url}: {}", resp.status());
        body = resp.text().await?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok((times, body))
}

pub(crate) async fn history(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    // API only: no workers or outbox reading the seeded rows.
    let server = start_server(bench_config(&db.url, &mocks, Role::Api, 16)?).await?;
    let started = Instant::now();
    seed(&db, args.db, args.n).await?;
    let seeding = started.elapsed();
    let http = reqwest::Client::new();
    let rounds = 100;
    let base = format!("http://{}", server.addr);
    let (summary, body) =
        timed(&http, &format!("{base}/api/admin/failure-summary"), rounds).await?;
    let parsed: serde_json::Value = serde_json::from_str(&body)?;
    let tasks: i64 = ["SUCCEEDED", "FAILED"]
        .iter()
        .filter_map(|s| parsed["totals"]["by_status"][s].as_i64())
        .sum();
    anyhow::ensure!(
        tasks == args.n as i64,
        "the summary counted {tasks} of {} tasks",
        args.n
    );
    let (metrics, _) = timed(&http, &format!("{base}/metrics"), rounds).await?;
    let ms = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1000.0);
    println!(
        "scenario=history db={} n={} seeded_in={:.1}s summary_p50={:.1}ms summary_p99={:.1}ms \
         summary_max={:.1}ms metrics_p50={:.1}ms metrics_p99={:.1}ms metrics_max={:.1}ms",
        db_name(args.db),
        args.n,
        seeding.as_secs_f64(),
        percentile(&summary, 0.50),
        percentile(&summary, 0.99),
        ms(summary.last()),
        percentile(&metrics, 0.50),
        percentile(&metrics, 0.99),
        ms(metrics.last()),
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}
