//! The benchmark harness keeps working: every scenario at a small N, on the test database's
//! dialect. Figures are printed, never asserted.

use std::process::Command;

/// Runs `assistd-bench` with `args` and `envs`; its standard output, once it exited with
/// success.
fn run_bench(args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_assistd-bench"))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("run assistd-bench");
    success_stdout(&out)
}

/// The standard output of a program that exited with success (else its output, failed).
fn success_stdout(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs one of `scripts/` against the PostgreSQL server at `url`, with the test build's
/// bench binary (no release build).
fn run_script(script: &str, args: &[&str], url: &str) -> std::process::Output {
    Command::new("bash")
        .arg(format!("scripts/{script}"))
        .args(args)
        .env("ASSISTD_BENCH_POSTGRES_URL", url)
        .env("ASSISTD_BENCH_BIN", env!("CARGO_BIN_EXE_assistd-bench"))
        .output()
        .expect("run the script")
}

/// The word after `key` in a bench's or script's output (`key` ends in `=` or `: `).
fn word_after<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .split(key)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {key:?} in: {stdout}"))
}

/// The test database's dialect, as the bench's `--db` names it.
fn test_db() -> &'static str {
    if std::env::var("ASSISTD_TEST_POSTGRES_URL").is_ok_and(|u| !u.is_empty()) {
        "postgres"
    } else {
        "sqlite"
    }
}

#[test]
fn every_benchmark_scenario_runs_at_small_n() {
    let db = test_db();
    let stdout = run_bench(
        &[
            "all",
            "--db",
            db,
            "--n",
            "40",
            "--concurrency",
            "4",
            "--model-latency-ms",
            "100",
            "--stream-ms",
            "1500",
        ],
        &[],
    );
    println!("{stdout}");
    for scenario in [
        "ingest",
        "end-to-end",
        "in-flight",
        "steps",
        "context",
        "recovery",
        "feedback",
        "mcp-steps",
        "instances",
        "connections",
        "history",
        "provider-limit",
        "knowledge",
    ] {
        assert!(
            stdout.contains(&format!("scenario={scenario} db={db}")),
            "{stdout}"
        );
    }
    // Two instances on one database answer every message once.
    assert!(
        stdout.contains("unanswered=0 repeated_deliveries=0"),
        "{stdout}"
    );
}

/// The side-by-side script (issue 22) parses, and refuses a database it does not know
/// before building anything. Running it needs the peer's release build, so CI does not.
#[test]
fn the_compare_peers_script_parses_and_checks_its_arguments() {
    let script = "scripts/compare-peers.sh";
    let parsed = Command::new("bash").args(["-n", script]).output().unwrap();
    assert!(parsed.status.success(), "{parsed:?}");
    let refused = Command::new("bash")
        .args([script, "mysql"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let no_url = Command::new("bash")
        .args([script, "postgres"])
        .env_remove("ASSISTD_BENCH_POSTGRES_URL")
        .output()
        .unwrap();
    assert!(!no_url.status.success());
    assert!(
        String::from_utf8_lossy(&no_url.stderr).contains("ASSISTD_BENCH_POSTGRES_URL"),
        "{no_url:?}"
    );
}

/// The before/after script parses, and refuses a PostgreSQL comparison without the bench's
/// database URL before running anything.
#[test]
fn the_compare_builds_script_parses_and_checks_its_arguments() {
    let script = "scripts/compare-builds.sh";
    let parsed = Command::new("bash").args(["-n", script]).output().unwrap();
    assert!(parsed.status.success(), "{parsed:?}");
    let no_url = Command::new("bash")
        .args([script, "/bin/false", "/bin/false", "postgres", "10", "1"])
        .env_remove("ASSISTD_BENCH_POSTGRES_URL")
        .output()
        .unwrap();
    assert!(!no_url.status.success());
    let stderr = String::from_utf8_lossy(&no_url.stderr);
    assert!(stderr.contains("ASSISTD_BENCH_POSTGRES_URL"), "{stderr}");
}

/// `ASSISTD_BENCH_ANSWER_CHARS`: end to end with 10,000-character answers (TOASTed on
/// PostgreSQL, through the rollup triggers), every message answered.
#[test]
fn end_to_end_runs_with_long_answers() {
    let db = test_db();
    let stdout = run_bench(
        &["end-to-end", "--db", db, "--n", "40", "--concurrency", "4"],
        &[("ASSISTD_BENCH_ANSWER_CHARS", "10000")],
    );
    let shortest: usize = word_after(&stdout, "shortest_reply_bytes=")
        .parse()
        .unwrap();
    assert!(shortest >= 10_000, "{stdout}");
}

/// `ASSISTD_BENCH_CONVERSATIONS`: 60 messages round 3 conversations with 2,000-character
/// answers (~680 tokens an exchange), so each conversation outgrows the history budget
/// (3,000 tokens) at its sixth message. A summary before every message from there on would be
/// 60 + 3 × 15 = 105 model calls; carried over, a fold keeps half the budget and the next
/// message reuses it: a summary every other message, 60 + 3 × 8 = 84.
#[test]
fn a_long_conversation_in_the_bench_carries_its_summary_over() {
    let db = test_db();
    let stdout = run_bench(
        &["end-to-end", "--db", db, "--n", "60", "--concurrency", "3"],
        &[
            ("ASSISTD_BENCH_ANSWER_CHARS", "2000"),
            ("ASSISTD_BENCH_CONVERSATIONS", "3"),
        ],
    );
    let calls: usize = word_after(&stdout, "model_calls=").parse().unwrap();
    assert!((61..=90).contains(&calls), "{stdout}");
    assert_eq!(word_after(&stdout, "model_refusals="), "0", "{stdout}");
}

/// The same with 10,000-character answers (~3,300 tokens, over the history budget alone):
/// every message from the second folds, and no request the mock model gets (each summary with
/// the summary so far and an exchange, each answer with a summary and the question) exceeds
/// its 8,192-token window.
#[test]
fn a_conversation_of_long_answers_stays_within_the_model_window() {
    let db = test_db();
    let stdout = run_bench(
        &["end-to-end", "--db", db, "--n", "30", "--concurrency", "3"],
        &[
            ("ASSISTD_BENCH_ANSWER_CHARS", "10000"),
            ("ASSISTD_BENCH_CONVERSATIONS", "3"),
        ],
    );
    let calls: usize = word_after(&stdout, "model_calls=").parse().unwrap();
    assert_eq!(calls, 30 + 27, "{stdout}");
    assert_eq!(word_after(&stdout, "model_refusals="), "0", "{stdout}");
}

/// Issue 35 part 2: a PostgreSQL run merges the GIN pending lists (the messages' trigram
/// index) before it ends, so the WAL its scripts measure around it (`compare-builds.sh`,
/// `compare-peers.sh`, `wal-by-relation.sh`) includes the entries a short run would
/// otherwise leave in the list for a later vacuum. The kept database's trigram index has
/// no pending entry left after a run of 40 messages (each wrote its entries to the list).
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_run_merges_its_gin_pending_lists_before_it_ends() {
    use sqlx::Connection;
    let db = crate::helpers::TestDb::postgres().await;
    let admin = db.url.clone();
    let stdout = tokio::task::spawn_blocking(move || {
        let args = [
            "end-to-end",
            "--db",
            "postgres",
            "--n",
            "40",
            "--concurrency",
            "4",
        ];
        run_bench(
            &args,
            &[
                ("ASSISTD_BENCH_POSTGRES_URL", admin.as_str()),
                ("ASSISTD_BENCH_KEEP_DB", "1"),
            ],
        )
    })
    .await
    .unwrap();
    let kept = word_after(&stdout, "kept_database=").to_string();
    let mut url = reqwest::Url::parse(&db.url).unwrap();
    url.set_path(&format!("/{kept}"));
    let mut conn = sqlx::PgConnection::connect(url.as_str()).await.unwrap();
    let messages: i64 = sqlx::query_scalar("SELECT count(*) FROM im_message")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        .execute(&mut conn)
        .await
        .unwrap();
    let (pages, tuples): (i32, i64) = sqlx::query_as(
        "SELECT pending_pages, pending_tuples FROM pgstatginindex('im_message_trigram')",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query(&format!("DROP DATABASE {kept} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.unwrap();
    assert_eq!(messages, 40, "{stdout}");
    assert_eq!((pages, tuples), (0, 0), "{stdout}");
    db.drop_db().await;
}

/// Issue 35 part 2: `scripts/statements-by-message.sh` reads `pg_stat_statements` for one
/// end-to-end run's database: against a server with the library loaded it prints the run's
/// statements, transactions, execution time and WAL per message, then a line per statement
/// (the message intake among them), and drops the database it kept; against a server
/// without the library it refuses, saying how to load it, before it builds or runs anything.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs a PostgreSQL server to start privately (apt-get install postgresql); .ci/run has it"
)]
#[test]
fn the_statements_script_reports_a_runs_statements_per_message() {
    use crate::private_pg::PrivateCluster;
    let script = |cluster: &PrivateCluster, top: &str| {
        run_script("statements-by-message.sh", &["40", top], &cluster.url())
    };
    let plain = PrivateCluster::start();
    let refused = script(&plain, "10");
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("shared_preload_libraries"),
        "{refused:?}"
    );
    drop(plain);

    let cluster = PrivateCluster::start_with("-c shared_preload_libraries=pg_stat_statements");
    let listed = |top: &str| {
        let stdout = success_stdout(&script(&cluster, top));
        let statements: f64 = word_after(&stdout, "per message (N = 40): ")
            .parse()
            .unwrap();
        assert!(statements > 0.0, "{stdout}");
        let header = stdout.lines().nth(1).unwrap_or_default();
        assert!(header.trim_start().starts_with("calls"), "{stdout}");
        let lines: Vec<String> = stdout.lines().skip(2).map(str::to_string).collect();
        // Costliest first: the execution time (third column) never rises down the list.
        let ms: Vec<f64> = lines
            .iter()
            .map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap())
            .collect();
        assert!(ms.windows(2).all(|w| w[0] >= w[1]), "{stdout}");
        lines
    };
    // The costliest three (start-up's DDL among them at this N), then every statement.
    assert_eq!(listed("3").len(), 3);
    let all = listed("1000");
    assert!(all.len() > 3, "{all:?}");
    assert!(
        all.iter().any(|l| l.contains("INSERT INTO im_message")),
        "{all:?}"
    );
    assert_no_database_left(&cluster);
}

/// A script that kept a bench database dropped it: the cluster holds only its own.
fn assert_no_database_left(cluster: &crate::private_pg::PrivateCluster) {
    let left = Command::new("psql")
        .args([
            &cluster.url(),
            "-Atc",
            "SELECT count(*) FROM pg_database WHERE datname NOT IN ('postgres', 'template0', 'template1')",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&left.stdout).trim(),
        "0",
        "{left:?}"
    );
}

/// Issue 35 part 2: `scripts/wal-by-relation.sh` reads one end-to-end run's WAL with
/// `pg_walinspect` and prints it per message by relation (the messages' table among them)
/// with a total, and drops the database it kept.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs a PostgreSQL server to start privately (apt-get install postgresql); .ci/run has it"
)]
#[test]
fn the_wal_script_reports_a_runs_wal_per_message_by_relation() {
    let cluster = crate::private_pg::PrivateCluster::start();
    let stdout = success_stdout(&run_script("wal-by-relation.sh", &["40"], &cluster.url()));
    let row = |name: &str| -> (f64, f64) {
        let line = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} row: {stdout}"));
        let mut figures = line.split_whitespace().skip(1).map(|w| w.parse().unwrap());
        (figures.next().unwrap(), figures.next().unwrap())
    };
    let (records, bytes) = row("TOTAL");
    let (message_records, message_bytes) = row("im_message");
    assert!(records > 0.0 && bytes > 0.0, "{stdout}");
    assert!(message_records > 0.0 && message_bytes < bytes, "{stdout}");
    assert_no_database_left(&cluster);
}
