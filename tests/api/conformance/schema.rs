//! Schema: agent versions, indexes used by the hot statements, upgrades of older databases.

use crate::helpers::*;
use assistd::domain::NewStep;
use assistd::domain::{StepType, now_ms};
use assistd::store::Store;
use assistd::store::tasks::{ProviderFilter, claim_pick_sql_for};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_agent_definition_becomes_a_new_version() {
    let (db, store) = fresh_store().await;
    let mut cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    // Unchanged: still version 1.
    publish(&store, &cfg).await;
    assert_eq!(
        store
            .current_agent_version("default")
            .await
            .unwrap()
            .unwrap()
            .version_no,
        1
    );
    let now = now_ms();
    let t1 = ingest(&store, "c", 1, now).await;
    cfg.agents.get_mut("default").unwrap().system_prompt = "You are terse.".into();
    publish(&store, &cfg).await;
    let v2 = store
        .current_agent_version("default")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(v2.version_no, 2);
    assert!(v2.definition.contains("You are terse."));
    let t2 = ingest(&store, "c", 2, now).await;
    let task1 = store.task(t1).await.unwrap().unwrap();
    let task2 = store.task(t2).await.unwrap().unwrap();
    assert_ne!(task1.agent_version_id, task2.agent_version_id);
    assert_eq!(task2.agent_version_id, v2.id);
    // Version 1 is untouched.
    let v1 = store
        .agent_version(task1.agent_version_id)
        .await
        .unwrap()
        .unwrap();
    assert!(!v1.definition.contains("You are terse."));
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_statements_use_indexes_on_sqlite() {
    // SQLite in every run (PostgreSQL plans depend on table statistics: see the tests
    // below).
    let (db, store) = store_on(TestDb::sqlite()).await;
    let pick = assistd::store::tasks::claim_pick_sql(store.dialect());
    let plan = store.explain(&pick).await.unwrap().join(" | ");
    assert!(plan.contains("agent_task_pending"), "{plan}");
    assert!(plan.contains("agent_task_running"), "{plan}");
    assert!(plan.contains("agent_task_pending_conversation"), "{plan}");
    assert!(
        plan.contains("agent_task_one_running_per_conversation"),
        "{plan}"
    );
    // Tables are read through indexes; only the pick's own CTEs (and their aliases) are
    // scanned whole.
    let ctes = ["w", "x", "ok", "heads", "h", "f", "s"];
    assert!(
        plan.split(" | ").all(|step| !step.starts_with("SCAN")
            || step.contains("USING")
            || ctes.contains(&step["SCAN ".len()..].trim())),
        "no full table scan: {plan}"
    );
    // The loose scan of a backlog's conversations: the next conversation of the channel,
    // else the next channel, each one search of the pending tasks' conversation index.
    assert!(
        plan.contains("SCAN p USING COVERING INDEX agent_task_pending_conversation"),
        "{plan}"
    );
    for next in ["(channel=? AND conversation_id>?)", "(channel>?)"] {
        assert!(
            plan.contains(&format!("agent_task_pending_conversation {next}")),
            "{plan}"
        );
    }
    // A claim limited to a named provider reads that provider's pending tasks; one limited
    // to the default provider (not in that index, migration 0029) reads the pending ones.
    let only = |name: &str| ProviderFilter::Only(name.into());
    let named = claim_pick_sql_for(store.dialect(), &only("local"));
    let plan = store.explain(&named).await.unwrap().join(" | ");
    assert!(plan.contains("INDEX agent_task_pending_provider"), "{plan}");
    let default = claim_pick_sql_for(store.dialect(), &only(""));
    let plan = store.explain(&default).await.unwrap().join(" | ");
    assert!(plan.contains("INDEX agent_task_pending "), "{plan}");
    assert!(!plan.contains("agent_task_pending_provider"), "{plan}");
    let pick = assistd::store::outbox::reply_pick_sql(store.dialect());
    let plan = store.explain(&pick).await.unwrap().join(" | ");
    assert!(plan.contains("outbound_reply_due"), "{plan}");
    // The order check reads the conversation's pending replies through their index.
    assert!(
        plan.contains("outbound_reply_conversation_pending"),
        "{plan}"
    );
    store.close().await;
    db.drop_db().await;
}

/// PostgreSQL (`store`, at `url`): the test agent published, then `messages` messages over
/// `conversations` conversations, each with its task (ids 1, 2, …): the first `finished`
/// SUCCEEDED, the rest PENDING; the tasks analysed.
pub(super) async fn seed_history(
    store: &Store,
    url: &str,
    messages: i64,
    finished: i64,
    conversations: i64,
) {
    let Store::Postgres(pool) = store else {
        panic!("a PostgreSQL store");
    };
    let cfg = test_config(url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    publish(store, &cfg).await;
    for sql in [
        format!(
            "INSERT INTO im_message (channel, external_event_id, external_message_id, \
             conversation_id, sender_id, text, received_at) SELECT 'generic', 'e' || g, \
             'm' || g, 'c' || (g % {conversations}), 'u', 'hi', 1 \
             FROM generate_series(1, {messages}) g"
        ),
        format!(
            "INSERT INTO agent_task (agent_id, agent_version_id, task_type, channel, \
             conversation_id, message_id, trigger_user, status, run_after, created_at, \
             updated_at, finished_at) SELECT (SELECT id FROM agent LIMIT 1), \
             (SELECT id FROM agent_version LIMIT 1), 'conversation_reply', 'generic', \
             m.conversation_id, m.id, 'u', \
             CASE WHEN m.id <= {finished} THEN 'SUCCEEDED' ELSE 'PENDING' END, 0, 1, 1, \
             CASE WHEN m.id <= {finished} THEN 2 END FROM im_message m ORDER BY m.id"
        ),
        "ANALYZE agent_task".to_string(),
    ] {
        sqlx::query(&sql).execute(pool).await.unwrap();
    }
}

/// Issue 22: on PostgreSQL, with a long history of finished tasks and a few pending ones,
/// the claim walks its partial indexes, not the primary key past every finished task (the
/// plan the `OR` form got: 23 ms per claim at 100,000 finished tasks).
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_reads_no_finished_history_on_postgres() {
    let (db, store) = store_on(TestDb::postgres().await).await;
    seed_history(&store, &db.url, 30_100, 30_000, 5_000).await;
    let pick = assistd::store::tasks::claim_pick_sql(store.dialect())
        .replace("$3", "10")
        .replace("$4", "64");
    let plan = store.explain(&pick).await.unwrap().join("\n");
    assert!(plan.contains("agent_task_pending"), "{plan}");
    // The expired-lease branch reads running tasks through the one-per-conversation index
    // (migration 0028 dropped `agent_task_running`, an entry per claim): its first scan.
    let expired = plan.split("CTE expired").nth(1).expect("an expired CTE");
    let first_scan = expired.lines().find(|l| l.contains("Scan")).unwrap_or("");
    assert!(
        first_scan.contains("Index Scan using agent_task_one_running_per_conversation"),
        "{plan}"
    );
    assert!(!plan.contains("agent_task_pkey"), "{plan}");
    store.close().await;
    db.drop_db().await;
}

/// Issue 35 part 2: 5,000 pending tasks round ten conversations, each with a task running
/// (a backlog behind them, as in a busy team after an outage), and one conversation with a
/// single task at the end. The claim finds that task reading a bounded number of the others:
/// its walk of the oldest `2 × limit` due tasks, then one probe per conversation; before,
/// every pending task was read with two probes each, per claim (4,990 loops of each probe
/// here, 21.5 ms per claim in `statements-by-message.sh`).
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_behind_a_backlog_reads_each_conversation_once_on_postgres() {
    let (db, store, pool) = super::postgres_store().await;
    seed_history(&store, &db.url, 5_000, 0, 10).await;
    for sql in [
        "UPDATE agent_task SET status = 'RUNNING', owner = 'w', lease_expire = 9e15 \
         WHERE id <= 10",
        "UPDATE agent_task SET conversation_id = 'late' WHERE id = 5000",
        "ANALYZE agent_task",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let pick = assistd::store::tasks::claim_pick_sql(store.dialect())
        .replace("$3", "10")
        .replace("$4", "64");
    let picked: Vec<i64> = sqlx::query_scalar(&pick).fetch_all(&pool).await.unwrap();
    assert_eq!(picked, [5000]);
    let analyzed = || async {
        let rows: Vec<(String,)> = sqlx::query_as(&format!("EXPLAIN (ANALYZE, COSTS OFF) {pick}"))
            .fetch_all(&pool)
            .await
            .unwrap();
        rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n")
    };
    let plan = analyzed().await;
    let loops = plan
        .split("loops=")
        .skip(1)
        .filter_map(|rest| rest.split(')').next()?.parse::<u64>().ok());
    assert!(loops.max().unwrap_or(0) <= 2 * 64 + 11, "{plan}");
    // Every pending task in a conversation of its own: the walk reads no further than the
    // 64 it takes (as the pick before this one), and the loose scan does not start.
    for sql in [
        "UPDATE agent_task SET status = 'SUCCEEDED' WHERE status = 'RUNNING'",
        "UPDATE agent_task SET conversation_id = 'own' || id",
        "ANALYZE agent_task",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let picked: Vec<i64> = sqlx::query_scalar(&pick).fetch_all(&pool).await.unwrap();
    assert_eq!(picked, (11..75).collect::<Vec<i64>>());
    let plan = analyzed().await;
    let walk = plan
        .lines()
        .find(|l| l.contains("using agent_task_pending on agent_task t "));
    assert!(walk.is_some_and(|l| l.contains(" rows=64 ")), "{plan}");
    let heads = plan.lines().find(|l| l.contains("on agent_task p "));
    assert!(
        heads.is_some_and(|l| l.contains("never executed")),
        "{plan}"
    );
    store.close().await;
    db.drop_db().await;
}

/// Issue 35 part 2 (migration 0031): the default provider's pending tasks have no entry in
/// `agent_task_pending_provider`, and a claim limited to a named provider still finds that
/// provider's pending tasks through it on PostgreSQL, past a long history and the default
/// provider's backlog.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_providers_claim_reads_its_index_on_postgres() {
    let (db, store) = store_on(TestDb::postgres().await).await;
    seed_history(&store, &db.url, 32_000, 30_000, 5_000).await;
    let Store::Postgres(pool) = &store else {
        panic!("a PostgreSQL store");
    };
    for sql in [
        "UPDATE agent_task SET provider = 'local' WHERE id > 31990",
        "ANALYZE agent_task",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
    let pick = |name: &str| {
        claim_pick_sql_for(store.dialect(), &ProviderFilter::Only(name.into()))
            .replace("$3", "10")
            .replace("$4", "64")
            .replace("$5", &format!("'{name}'"))
    };
    let plan = store.explain(&pick("local")).await.unwrap().join("\n");
    let due = plan.split("CTE expired").next().unwrap_or("");
    // The first read of a table (the walk's).
    let first_scan = due.lines().find(|l| l.contains("Scan using")).unwrap_or("");
    assert!(
        first_scan.contains("using agent_task_pending_provider"),
        "{plan}"
    );
    assert!(!plan.contains("agent_task_pkey"), "{plan}");
    // Both claims find exactly their provider's tasks.
    let local: Vec<i64> = sqlx::query_scalar(&pick("local"))
        .fetch_all(pool)
        .await
        .unwrap();
    assert!(
        !local.is_empty() && local.iter().all(|&id| id > 31_990),
        "{local:?}"
    );
    let default: Vec<i64> = sqlx::query_scalar(&pick("")).fetch_all(pool).await.unwrap();
    assert!(
        !default.is_empty() && default.iter().all(|&id| id <= 31_990),
        "{default:?}"
    );
    // The default provider's pending tasks have no entry in the index.
    let definition: String =
        sqlx::query_scalar("SELECT pg_get_indexdef('agent_task_pending_provider'::regclass)")
            .fetch_one(pool)
            .await
            .unwrap();
    assert!(definition.contains("provider <> ''::text"), "{definition}");
    store.close().await;
    db.drop_db().await;
}

/// Issue 35 part 2 (migration 0032): `agent_step` has no index over its surrogate `id` on
/// PostgreSQL, and the batched step writes (begin, completion, a finish with its last step)
/// find their rows through the task's `(task_id, step_no)` index, never by a scan of every
/// step ever journalled; ids stay unique (the sequence).
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_writes_find_their_rows_through_the_task_on_postgres() {
    use assistd::store::writes::step_write_sql;
    let (db, store, pool) = postgres_store().await;
    seed_history(&store, &db.url, 20_000, 20_000, 20_000).await;
    for sql in [
        "INSERT INTO agent_step (task_id, step_no, step_type, tool_name, idempotency_key, \
         input, status, attempt, created_at) SELECT t, k, 'llm', '', 'k' || t || '-' || k, \
         'in', 'SUCCEEDED', 1, 1 FROM generate_series(1, 20000) t, generate_series(1, 3) k",
        "ANALYZE agent_step",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let indexes: Vec<String> =
        sqlx::query_scalar("SELECT indexname FROM pg_indexes WHERE tablename = 'agent_step'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(indexes, ["agent_step_task_id_step_no_key"]);
    let distinct: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT id) FROM agent_step")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(distinct, 60_000);
    // One row of every field the three statements read, for a task deep in the history.
    let row = r#"'[{"task_id": 12345, "owner": "w", "version": 1, "step_id": 37034,
        "step_no": 4, "step_type": "llm", "tool_name": "", "idempotency_key": "k",
        "input": "in", "status": "SUCCEEDED", "output": "out", "error": null,
        "step_status": "SUCCEEDED", "step_error": null, "tokens_in": 1, "tokens_out": 1,
        "duration_ms": 1, "attempts": 1, "result": "r", "failure_type": null,
        "retries": 0, "trace": null}]'"#;
    for sql in step_write_sql(store.dialect()) {
        let sql = sql
            .replace("$1", row)
            .replace("$2", "2")
            .replace("$3", "'PENDING'");
        let plan = store.explain(&sql).await.unwrap().join("\n");
        assert!(!plan.contains("Seq Scan on agent_step"), "{sql}\n{plan}");
        if sql.contains("UPDATE agent_step") || sql.contains("FROM agent_step") {
            assert!(
                plan.contains("agent_step_task_id_step_no_key"),
                "{sql}\n{plan}"
            );
        }
    }
    store.close().await;
    db.drop_db().await;
}

/// Issue 35 (migration 0029): on PostgreSQL a task's audit rows are found through the BRIN
/// summaries of `audit_log_task` (no B-tree entry per row), risky ones through the partial
/// `audit_log_risky`; both reads return exactly the rows they did, with rows of old tasks
/// (an approval answered later) written among new ones.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_audit_rows_are_found_through_the_brin_summaries_on_postgres() {
    use assistd::store::tasks::{RISKY_FILTER, TaskSearch, task_audit_sql};
    let (db, store, pool) = postgres_store().await;
    // 20,000 finished tasks with four audit rows each, written interleaved as workers do
    // (a task's rows among its neighbours'); every 2,000th task's last row comes at the
    // very end (answered late) and is risky.
    seed_history(&store, &db.url, 20_000, 20_000, 20_000).await;
    for sql in [
        "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, created_at, \
         target_type, target_id) SELECT t, 'TASK_CREATED', 'w', 'step ' || k, false, 1, 'task', \
         t::text FROM generate_series(1, 20000) t, generate_series(1, 4) k \
         WHERE NOT (k = 4 AND t % 2000 = 0) ORDER BY t + 7 * k, k",
        "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, created_at, \
         target_type, target_id) SELECT t, 'TASK_FAILED', 'w', 'step 4', true, 2, \
         'task', t::text FROM generate_series(2000, 20000, 2000) s(t) ORDER BY s.t",
        "SELECT brin_summarize_new_values('audit_log_task')",
        "ANALYZE audit_log",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let plan = store
        .explain(&task_audit_sql().replace("$1", "4000"))
        .await
        .unwrap()
        .join("\n");
    assert!(
        plan.contains("Bitmap Index Scan on audit_log_task"),
        "{plan}"
    );
    for task in [1, 3999, 4000, 20000] {
        let rows = store.task_audit(task).await.unwrap();
        let steps: Vec<&str> = rows.iter().map(|r| r.summary.as_str()).collect();
        assert_eq!(
            steps,
            ["step 1", "step 2", "step 3", "step 4"],
            "task {task}"
        );
        assert!(rows.iter().all(|r| r.task_id == Some(task)));
        assert!(rows.windows(2).all(|w| w[0].id < w[1].id));
        assert_eq!(rows[3].risk_flag, task % 2000 == 0, "task {task}");
    }
    let risky_list =
        format!("SELECT id FROM agent_task WHERE true{RISKY_FILTER} ORDER BY id DESC LIMIT 50");
    let plan = store.explain(&risky_list).await.unwrap().join("\n");
    assert!(plan.contains("audit_log_risky"), "{plan}");
    let risky = store
        .find_tasks(&TaskSearch {
            risky: true,
            limit: 50,
            ..TaskSearch::default()
        })
        .await
        .unwrap();
    let ids: Vec<i64> = risky.iter().map(|t| t.id).collect();
    assert_eq!(ids, (1..=10).rev().map(|k| k * 2000).collect::<Vec<i64>>());
    store.close().await;
    db.drop_db().await;
}

/// A database made by an earlier release (migrations up to 0002, a `current_step` column
/// on the task) upgrades in place: 0003 drops the column, and the task's current step is
/// then read from its journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_database_upgrades_to_the_current_step_read_from_the_journal() {
    let db = TestDb::new().await;
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = Store::connect(&cfg.database).await.unwrap();
    // The schema as the release before 0003 left it: its migration files, applied alone.
    migrate_up_to(&store, &db, "0002").await;
    publish(&store, &cfg).await;
    let now = now_ms();
    // A message and its task claimed as that release wrote them (today's intake and claim
    // write columns it did not have), with a stored current step the upgrade must stop
    // reading.
    let statements = [
        "INSERT INTO im_message (channel, external_event_id, external_message_id, \
         conversation_id, sender_id, text, received_at) \
         VALUES ('generic', 'e-up', 'm-up', 'upgrade', 'u', 'hi', $1)",
        "INSERT INTO agent_task (agent_id, agent_version_id, task_type, channel, \
         conversation_id, message_id, trigger_user, status, current_step, version, owner, \
         lease_expire, run_after, created_at, updated_at) \
         SELECT v.agent_id, v.id, 'conversation_reply', 'generic', 'upgrade', \
         (SELECT MAX(id) FROM im_message), 'u', 'RUNNING', 9, 1, 'me', $1 + 60000, $1, $1, $1 \
         FROM agent_version v JOIN agent a ON a.id = v.agent_id WHERE a.name = 'default'",
    ];
    let id = run_sql(&store, &statements, now).await;
    let fence = Fence {
        task_id: id,
        owner: "me".into(),
        version: 1,
    };

    store.migrate().await.unwrap();
    assert_eq!(store.task(id).await.unwrap().unwrap().current_step, 0);
    let step = NewStep {
        step_no: 3,
        step_type: StepType::Tool,
        tool_name: "t",
        idempotency_key: "upgrade:3:t",
        input: "{}",
    };
    assert!(
        store
            .apply_one(
                assistd::store::writes::WriteOp::begin_step(&fence, &step),
                now
            )
            .await
            .unwrap()
            .step()
            .is_some()
    );
    assert_eq!(store.task(id).await.unwrap().unwrap().current_step, 3);
    store.close().await;
    db.drop_db().await;
}

/// Applies the migration files of `db`'s dialect numbered up to `last` (e.g. "0002") alone,
/// as an earlier release left the schema.
async fn migrate_up_to(store: &Store, db: &TestDb, last: &str) {
    let dialect = if db.is_postgres() {
        "postgres"
    } else {
        "sqlite"
    };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations")
        .join(dialect);
    let older = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.as_str() <= last || name.starts_with(last) {
            std::fs::copy(dir.join(&name), older.path().join(&name)).unwrap();
        }
    }
    let migrator = sqlx::migrate::Migrator::new(older.path()).await.unwrap();
    match store {
        Store::Sqlite(pool, _) => migrator.run(pool).await.unwrap(),
        Store::Postgres(pool) => migrator.run(pool).await.unwrap(),
    }
}

/// Runs `statements` (each may bind `now` as $1) and returns the newest task's id.
async fn run_sql(store: &Store, statements: &[&str], now: i64) -> i64 {
    let newest = "SELECT MAX(id) FROM agent_task";
    match store {
        Store::Sqlite(pool, _) => {
            for sql in statements {
                sqlx::query(sql).bind(now).execute(pool).await.unwrap();
            }
            sqlx::query_scalar(newest).fetch_one(pool).await.unwrap()
        }
        Store::Postgres(pool) => {
            for sql in statements {
                sqlx::query(sql).bind(now).execute(pool).await.unwrap();
            }
            sqlx::query_scalar(newest).fetch_one(pool).await.unwrap()
        }
    }
}

/// A conversation summary kept on its task by migration 0040 (SQLite 0032) is carried over
/// after the upgrade that reads it from its `summary` step (0041, SQLite 0033).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_kept_on_its_task_before_the_upgrade_is_carried_over_after_it() {
    let db = TestDb::new().await;
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = Store::connect(&cfg.database).await.unwrap();
    let last = if db.is_postgres() { "0040" } else { "0032" };
    migrate_up_to(&store, &db, last).await;
    publish(&store, &cfg).await;
    let output = r#"{"content":"summary before the upgrade","finish_reason":"stop","prompt_tokens":9,"completion_tokens":4}"#;
    let step = format!(
        "INSERT INTO agent_step (task_id, step_no, step_type, tool_name, idempotency_key, \
         input, output, status, attempt, created_at, finished_at) \
         SELECT MAX(id), 1, 'llm', 'summary', 'up-summary', '{{}}', '{output}', 'SUCCEEDED', 1, \
         $1, $1 FROM agent_task"
    );
    let statements = [
        "INSERT INTO im_message (channel, external_event_id, external_message_id, \
         conversation_id, sender_id, text, received_at) \
         VALUES ('generic', 'e-sum', 'm-sum', 'upgrade', 'u', 'hi', $1)",
        "INSERT INTO agent_task (agent_id, agent_version_id, task_type, channel, \
         conversation_id, message_id, trigger_user, status, version, run_after, created_at, \
         updated_at, finished_at, context_summary, summary_through) \
         SELECT v.agent_id, v.id, 'conversation_reply', 'generic', 'upgrade', \
         (SELECT MAX(id) FROM im_message), 'u', 'SUCCEEDED', 1, $1, $1, $1, $1, \
         'summary before the upgrade', (SELECT MAX(id) FROM im_message) \
         FROM agent_version v JOIN agent a ON a.id = v.agent_id WHERE a.name = 'default'",
        "UPDATE im_message SET task_id = (SELECT MAX(id) FROM agent_task) WHERE $1 > 0",
        &step,
    ];
    let id = run_sql(&store, &statements, now_ms()).await;
    let message = store.task(id).await.unwrap().unwrap().message_id;

    store.migrate().await.unwrap();
    let carried = store
        .conversation_summary("generic", "upgrade", (message, message + 1), id + 1)
        .await
        .unwrap();
    let (output, through) = carried.expect("the summary is carried over");
    assert!(output.contains("summary before the upgrade"), "{output}");
    assert_eq!(through, message);
    store.close().await;
    db.drop_db().await;
}
