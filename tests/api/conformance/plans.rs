//! Plans under stale statistics: a table that grew since PostgreSQL last analyzed it (every
//! table, in a burst) must not turn a batch's key lookups into scans of the whole table.

use assistd::store::intake::unseen_messages_sql;
use assistd::store::rollups::reply_counts;
use assistd::store::summary::OUTBOX_BACKLOG;
use assistd::store::tasks::claim_pick_sql;
use assistd::store::writes::{reply_write_sql, step_write_sql};

use super::schema::seed_history;
use super::*;

/// Issue 35 part 2: statistics taken at 200 tasks, then 20,000 more tasks that ran and
/// finished (each leaving a dead entry in the partial indexes over RUNNING tasks, as no task
/// update is HOT), with a step and a delivered answer each, and no vacuum or analyze since.
/// Every statement of a finishing batch, of a step's begin and of the message intake still
/// finds its rows by their keys: the finish through the primary key (before: a bitmap scan
/// of `agent_task_one_running_per_conversation`, visiting every dead entry's page), the
/// step, reply and message keys through their unique indexes, a live placeholder through
/// its partial index (before: a sequential scan of the table, hashed, per batch).
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_finds_its_rows_by_key_under_stale_statistics_on_postgres() {
    let (db, store, pool) = postgres_store().await;
    for table in ["agent_task", "agent_step", "outbound_reply", "im_message"] {
        sqlx::query(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }
    seed_history(&store, &db.url, 200, 200, 200).await;
    for sql in [
        "ANALYZE",
        "INSERT INTO im_message (channel, external_event_id, external_message_id, \
         conversation_id, sender_id, text, received_at) SELECT 'generic', 'e' || g, 'm' || g, \
         'c' || g, 'u', 'hi', 1 FROM generate_series(201, 20200) g",
        "INSERT INTO agent_task (agent_id, agent_version_id, task_type, channel, \
         conversation_id, message_id, trigger_user, status, owner, version, run_after, \
         created_at, updated_at, lease_expire) SELECT (SELECT id FROM agent LIMIT 1), \
         (SELECT id FROM agent_version LIMIT 1), 'conversation_reply', 'generic', \
         m.conversation_id, m.id, 'u', 'RUNNING', 'w', 1, 0, 1, 1, 9 FROM im_message m \
         WHERE m.id > 200 ORDER BY m.id",
        "UPDATE agent_task SET status = 'SUCCEEDED', version = 2, finished_at = 2 \
         WHERE status = 'RUNNING'",
        "INSERT INTO agent_step (task_id, step_no, step_type, tool_name, idempotency_key, \
         input, status, attempt, created_at, tokens_in, tokens_out) SELECT id, 1, 'llm', '', \
         'agent-task-' || id || '-step-1', '{\"model\":\"m\"}', 'SUCCEEDED', 1, 1, 1, 1 \
         FROM agent_task WHERE id > 200",
        "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
         in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at, \
         sent_at) SELECT id, 'agent-task-' || id, 'generic', conversation_id, 'm', 'text', \
         'answer', 'SENT', 1, 1, 1, 2 FROM agent_task WHERE id > 200",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    // One row of every field the statements read, for a task deep in the history.
    let row = r#"'[{"task_id": 12345, "owner": "w", "version": 1, "step_id": 12345,
        "step_no": 2, "step_type": "llm", "tool_name": "", "idempotency_key": "k",
        "input": "in", "status": "SUCCEEDED", "output": "out", "error": null,
        "step_status": "SUCCEEDED", "step_error": null, "tokens_in": 1, "tokens_out": 1,
        "duration_ms": 1, "attempts": 1, "result": "r", "failure_type": null,
        "retries": 0, "trace": null, "channel": "generic", "conversation_id": "c12345",
        "in_reply_to": "m", "reply_type": "text", "content": "a", "hand_until": 5,
        "reply_id": 12345, "platform_message_id": null, "placeholder": 0,
        "ord": 0, "event_id": "e-new", "message_id": "m-new", "sender_id": "u",
        "sender_name": "u", "text": "hi", "reply_context": null, "trace_context": null,
        "up_to": 12345, "lim": 11}]'"#;
    let dialect = store.dialect();
    let mut statements: Vec<&str> = step_write_sql(dialect).to_vec();
    statements.extend(reply_write_sql(dialect));
    statements.extend(unseen_messages_sql(dialect));
    statements.push(assistd::store::intake::conversation_histories_sql(dialect));
    assert_eq!(statements.len(), 7);
    // The finish first: it is the statement the running indexes' dead entries cost most.
    statements.sort_by_key(|sql| !sql.starts_with("WITH fin AS"));
    for sql in statements {
        let sql = sql
            .replace("$1", row)
            .replace("$2", "2")
            .replace("$3", "'PENDING'");
        let plan = store.explain(&sql).await.unwrap().join("\n");
        for table in ["agent_task", "agent_step", "outbound_reply", "im_message"] {
            assert!(
                !plan.contains(&format!("Seq Scan on {table}")),
                "{sql}\n{plan}"
            );
        }
        for running in [
            "agent_task_one_running_per_conversation",
            "agent_task_running",
        ] {
            assert!(!plan.contains(running), "{sql}\n{plan}");
        }
        if sql.starts_with("WITH fin AS") {
            assert!(plan.contains("agent_task_pkey"), "{sql}\n{plan}");
        }
        if sql.starts_with("WITH rep AS") {
            // Placeholders replaced and replies inserted in one statement, each by key.
            for part in ["Update on outbound_reply", "Insert on outbound_reply"] {
                assert!(plan.contains(part), "{sql}\n{plan}");
            }
        }
        if sql.starts_with("UPDATE outbound_reply SET status") {
            // The mark probes for another pending reply of each marked one's conversation
            // through the conversation's pending index (it finds the marked rows, which are
            // PENDING, by id in a PENDING partial index: bounded by the backlog, not by the
            // history).
            let probe = "using outbound_reply_conversation_pending on outbound_reply o";
            assert!(plan.contains(probe), "{sql}\n{plan}");
        }
        if sql.starts_with("SELECT v.task_id, h.id") {
            assert!(plan.contains("im_message_conversation"), "{sql}\n{plan}");
        }
    }
    store.close().await;
    db.drop_db().await;
}

/// Issue 35 part 3: a young database, never analyzed (a new deployment, or any burst before
/// autovacuum looks), with the connection's plans generic (as PostgreSQL caches a prepared
/// statement's after five runs). Each key probe of a batch must still go by the index of
/// its whole key. Before migration 0035 every index of a message began with `channel`, so
/// on those estimates the intake's probes of a message's platform keys tied with each
/// other index: PostgreSQL took `im_message_conversation` (`channel, conversation_id, id`)
/// for the event-id probe, and the event-id key for the message-id probe, each by its first
/// column alone. Every message of the channel was read for each message taken in, until the
/// table was analyzed (in `assistd-bench instances`, the intake's insert grew to 10 ms a
/// batch, most of the database's CPU).
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_plans_of_a_young_database_find_rows_by_their_whole_key_on_postgres() {
    let (db, store, pool) = postgres_store().await;
    let row = r#"[{"task_id": 1, "owner": "w", "version": 1, "step_id": 1, "step_no": 2,
        "step_type": "llm", "tool_name": "", "idempotency_key": "k", "input": "in",
        "status": "SUCCEEDED", "output": "out", "error": null, "step_status": "SUCCEEDED",
        "step_error": null, "tokens_in": 1, "tokens_out": 1, "duration_ms": 1, "attempts": 1,
        "result": "r", "failure_type": null, "retries": 0, "trace": null,
        "channel": "generic", "conversation_id": "c1", "in_reply_to": "m",
        "reply_type": "text", "content": "a", "hand_until": 5, "reply_id": 1, "platform_message_id": null,
        "placeholder": 0, "ord": 0, "event_id": "e1",
        "message_id": "m1", "sender_id": "u", "sender_name": "u", "text": "hi",
        "reply_context": null, "trace_context": null}]"#;
    let dialect = store.dialect();
    let mut statements: Vec<&str> = step_write_sql(dialect).to_vec();
    statements.extend(reply_write_sql(dialect));
    statements.extend(unseen_messages_sql(dialect));
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut probed = 0;
    for (i, sql) in statements.iter().enumerate() {
        let args = ["$1", "$2", "$3"]
            .iter()
            .filter(|p| sql.contains(**p))
            .map(|p| match *p {
                "$1" => format!("'{row}'"),
                "$2" => "2".to_string(),
                _ => "'PENDING'".to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ");
        let plan = generic_plan(&mut conn, &format!("p{i}"), sql, &args).await;
        // A key probe filters nothing: its index condition is its whole key.
        assert!(!plan.contains("Filter: (external_"), "{sql}\n{plan}");
        assert!(!plan.contains("im_message_conversation"), "{sql}\n{plan}");
        if sql.starts_with("INSERT INTO im_message") {
            for key in ["im_message_event_key", "im_message_message_key"] {
                assert!(plan.contains(key), "{sql}\n{plan}");
            }
            probed += 1;
        }
    }
    assert_eq!(probed, 1);
    // The claim's pick: each candidate's two conversation probes go by the conversation,
    // never a walk of a whole partial index per candidate (an anti join on these estimates);
    // the loose scan of the conversations goes from one to the next by the index; the lock
    // finds each candidate by its id (not through the conversation index, whose third
    // column it is: migration 0042).
    let pick = claim_pick_sql(dialect);
    let plan = generic_plan(
        &mut conn,
        "pick(text, bigint, bigint, bigint)",
        &pick,
        "'w', 1, 2, 64",
    )
    .await;
    assert!(!plan.contains("Anti Join"), "{pick}\n{plan}");
    let by_conversation = plan
        .lines()
        .filter(|l| l.contains("Index Cond: ((channel = ") && l.contains("AND (conversation_id = "))
        .count();
    assert!(by_conversation >= 6, "{pick}\n{plan}");
    assert!(
        plan.contains(
            "Index Cond: (ROW(channel, conversation_id) > ROW(h.channel, h.conversation_id))"
        ),
        "{pick}\n{plan}"
    );
    let lock = plan
        .split("CTE due")
        .nth(1)
        .and_then(|due| due.split("LockRows").nth(1));
    let lookup: Vec<&str> = lock.unwrap_or("").lines().skip(1).take(2).collect();
    assert!(
        lookup[0].contains("agent_task_pending on") || lookup[0].contains("agent_task_pkey"),
        "{pick}\n{plan}"
    );
    assert!(lookup[1].contains("Index Cond: (id = "), "{pick}\n{plan}");
    drop(conn);
    store.close().await;
    db.drop_db().await;
}

/// `sql` prepared as `name` (with its parameter types if they cannot be inferred) on `conn`,
/// and the plan of its execution with `args`: generic if the connection forces them.
async fn generic_plan(
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    name: &str,
    sql: &str,
    args: &str,
) -> String {
    sqlx::query(&format!("PREPARE {name} AS {sql}"))
        .execute(&mut **conn)
        .await
        .unwrap();
    let name = name.split('(').next().unwrap();
    let rows: Vec<(String,)> = sqlx::query_as(&format!("EXPLAIN EXECUTE {name}({args})"))
        .fetch_all(&mut **conn)
        .await
        .unwrap();
    rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n")
}

/// Outages: a platform refused everything for a while, and a backlog of PENDING replies
/// grew after PostgreSQL last analyzed the table (statistics that say PENDING replies are
/// rare, as after any quiet week). Under custom and generic plans alike:
/// - every update a reply's holder makes to it (a failed try rescheduled, sent parts noted,
///   put back unsent, given up, sent as a new message, marked delivered) finds the row by
///   its primary key;
/// - the claim walks the due index in due order, and every probe for another pending reply
///   of a conversation (the claim's order check, the mark's `more_due`, the finish's
///   hand-over check) goes by the conversation's index;
/// - the backlog's readers (the failure summary's backlog, `/metrics`) read the due index.
///
/// Before (migration 0036 and `held_reply!`), the updates and probes walked one of the two
/// pending indexes and filtered every entry, and the claim sorted the whole backlog: per
/// statement the whole backlog, so a recovery cost the square of it.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_backlog_is_read_by_key_and_by_the_index_each_statement_names_on_postgres() {
    let (db, store, pool) = postgres_store().await;
    sqlx::query("ALTER TABLE outbound_reply SET (autovacuum_enabled = false)")
        .execute(&pool)
        .await
        .unwrap();
    seed_history(&store, &db.url, 200, 200, 200).await;
    let replies = |status: &str, key: &str, n: i64| {
        format!(
            "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
             in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at, \
             locked_by, locked_until) SELECT (SELECT min(id) FROM agent_task), '{key}-' || g, \
             'generic', 'c' || (g % 2000), 'm', 'text', '{{\"text\": \"a\"}}', '{status}', 1, \
             g, 1, 'w', 9 FROM generate_series(1, {n}) g"
        )
    };
    for sql in [
        // A history of delivered replies, analyzed; then the backlog: 20,000 replies of
        // 2,000 conversations, PENDING, leased to `w`.
        replies("SENT", "sent", 20_000),
        "ANALYZE".to_string(),
        replies("PENDING", "backlog", 20_000),
    ] {
        sqlx::query(&sql).execute(&pool).await.unwrap();
    }
    let (id,): (i64,) = sqlx::query_as("SELECT max(id) - 7 FROM outbound_reply")
        .fetch_one(&pool)
        .await
        .unwrap();
    let mark_row = format!(
        r#"'[{{"reply_id": {id}, "owner": "w", "platform_message_id": null, "placeholder": 0}}]'"#
    );
    let finish_row = r#"'[{"task_id": 5, "idempotency_key": "agent-task-5", "channel": "generic",
        "conversation_id": "c5", "in_reply_to": "m", "reply_type": "text", "content": "a",
        "hand_until": 5}]'"#;
    let held = assistd::store::outbox::held_reply_sql();
    let [insert_replies, mark] = reply_write_sql(store.dialect());
    let pick = assistd::store::outbox::reply_pick_sql(store.dialect());
    let (target, probe, due, conversation, pkey) = (
        "outbound_reply",
        "outbound_reply o",
        "outbound_reply_due",
        "outbound_reply_conversation_pending",
        "outbound_reply_pkey",
    );
    let statements: Vec<Expected> = vec![
        (
            held[0],
            format!("'2', 'refused', '{id}', 'w'"),
            vec![(target, pkey)],
        ),
        (
            held[1],
            format!("'2', 'refused', '{id}', 'w'"),
            vec![(target, pkey)],
        ),
        (
            held[2],
            format!("'1', 'p-1', '{id}', 'w'"),
            vec![(target, pkey)],
        ),
        (held[3], format!("'2', '{id}', 'w'"), vec![(target, pkey)]),
        (
            held[4],
            format!("'FAILED', 'refused', '{id}', 'w'"),
            vec![(target, pkey)],
        ),
        (
            mark,
            format!("{mark_row}, '2', 'SENT'"),
            vec![(target, pkey), (probe, conversation)],
        ),
        (
            insert_replies,
            format!("{finish_row}, '2', 'PENDING'"),
            vec![(probe, conversation)],
        ),
        (
            &pick,
            "'w', '1', '30000', '64', '0'".into(),
            vec![("outbound_reply r", due), (probe, conversation)],
        ),
        (OUTBOX_BACKLOG, String::new(), vec![(target, due)]),
        (reply_counts(true), String::new(), vec![(target, due)]),
    ];
    let mut conn = pool.acquire().await.unwrap();
    for mode in ["force_custom_plan", "force_generic_plan"] {
        sqlx::query(&format!("SET plan_cache_mode = {mode}"))
            .execute(&mut *conn)
            .await
            .unwrap();
        for (i, (sql, args, want)) in statements.iter().enumerate() {
            let plan = if args.is_empty() {
                store.explain(sql).await.unwrap().join("\n")
            } else {
                // The pick names only `$3` to `$5`: the types of all five are given.
                let types = if *sql == pick {
                    "(text, bigint, bigint, bigint, bigint)"
                } else {
                    ""
                };
                generic_plan(&mut conn, &format!("{mode}_{i}{types}"), sql, args).await
            };
            for (alias, index) in want {
                let read = scans_of(&plan, alias);
                assert!(!read.is_empty(), "{alias}: {mode}\n{sql}\n{plan}");
                for used in read {
                    assert_eq!(used, *index, "{alias}: {mode}\n{sql}\n{plan}");
                }
            }
        }
    }
    drop(conn);
    store.close().await;
    db.drop_db().await;
}

/// A statement, its arguments, and the index each alias of its table must be read through.
type Expected<'a> = (&'a str, String, Vec<(&'a str, &'a str)>);

/// The indexes through which `plan` reads the table as `alias` (`outbound_reply` or
/// `outbound_reply o`): an index scan's, a bitmap heap scan's bitmap index, or `Seq Scan`.
fn scans_of<'a>(plan: &'a str, alias: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = plan.lines().collect();
    let on = format!(" on {alias}  (");
    let mut read = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        if !line.contains("Scan") || !line.contains(&on) {
            continue;
        }
        let index = if line.contains("Seq Scan") {
            "Seq Scan"
        } else if line.contains("Bitmap Heap Scan") {
            lines[n..]
                .iter()
                .find_map(|l| l.split("Bitmap Index Scan on ").nth(1))
                .map_or("", |rest| rest.split_whitespace().next().unwrap_or(""))
        } else {
            line.split("using ")
                .nth(1)
                .map_or("", |rest| rest.split_whitespace().next().unwrap_or(""))
        };
        read.push(index);
    }
    read
}

/// The same on SQLite (its migration 0030 gives the pending indexes the same predicates),
/// with every connection opened after the `ANALYZE`, as after a restart whose
/// `PRAGMA optimize` analyzed the table while the backlog was small. A held reply and a
/// marked one are found by rowid (before 0030 the mark walked the due index), the claim
/// walks the due index, the probes the conversation's, and no backlog reader scans the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_backlog_is_read_by_key_and_by_the_index_each_statement_names_on_sqlite() {
    let (db, store) = store_on(TestDb::sqlite()).await;
    let task = store
        .ingest_message(&msg("c", 1), "default", 1)
        .await
        .unwrap()
        .task_id;
    let Store::Sqlite(pool, _) = &store else {
        unreachable!("TestDb::sqlite is SQLite")
    };
    let replies = |status: &str, key: &str| {
        format!(
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 20000) \
             INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
             in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at, \
             locked_by) SELECT {task}, '{key}-' || n, 'generic', 'c' || (n % 2000), 'm', \
             'text', '{{}}', '{status}', 1, n, 1, 'w' FROM g"
        )
    };
    for sql in [
        replies("SENT", "sent"),
        "ANALYZE".into(),
        replies("PENDING", "backlog"),
    ] {
        sqlx::query(&sql).execute(pool).await.unwrap();
    }
    // Connections opened since read the statistics (as after a restart, whose
    // `PRAGMA optimize` analyzed the table while the backlog was small).
    store.close().await;
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let store = Store::connect(&cfg.database).await.unwrap();
    let dialect = store.dialect();
    let held = assistd::store::outbox::held_reply_sql();
    let [insert_replies, mark] = reply_write_sql(dialect);
    let pick = assistd::store::outbox::reply_pick_sql(dialect);
    let (rowid, due, conversation) = (
        "SEARCH outbound_reply USING INTEGER PRIMARY KEY",
        "SEARCH r USING INDEX outbound_reply_due",
        "SEARCH o USING COVERING INDEX outbound_reply_conversation_pending (channel=? AND conversation_id=?",
    );
    let statements: Vec<(&str, Vec<&str>)> = vec![
        (held[0], vec![rowid]),
        (held[1], vec![rowid]),
        (held[2], vec![rowid]),
        (held[3], vec![rowid]),
        (held[4], vec![rowid]),
        (mark, vec![rowid, conversation]),
        (insert_replies, vec![]),
        (&pick, vec![due, conversation]),
        (OUTBOX_BACKLOG, vec![]),
        (reply_counts(true), vec![]),
    ];
    for (sql, want) in statements {
        let plan = store.explain(sql).await.unwrap().join("\n");
        for step in want {
            assert!(plan.contains(step), "{step}\n{sql}\n{plan}");
        }
        // No statement reads the whole table, and no probe walks an index.
        for line in plan.lines() {
            assert!(!line.starts_with("SCAN o "), "{sql}\n{plan}");
            if line.starts_with("SCAN outbound_reply") || line.starts_with("SCAN r ") {
                assert!(
                    line.contains("INDEX outbound_reply_due")
                        || line.contains("INDEX outbound_reply_conversation_pending"),
                    "{sql}\n{plan}"
                );
            }
        }
    }
    store.close().await;
    db.drop_db().await;
}
