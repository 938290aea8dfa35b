//! Store conformance: the same invariants hold on SQLite and on PostgreSQL.

use std::collections::HashMap;

use assistd::domain::NewMessage;
use assistd::domain::{Fence, NewReply, NewStep, StepResult, TaskOutcome};
use assistd::domain::{ReplyType, StepStatus, StepType, TaskStatus, now_ms};
use assistd::store::Store;

use crate::helpers::*;

async fn fresh_store() -> (TestDb, Store) {
    let db = TestDb::new().await;
    let mut cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    cfg.database.max_connections = 8;
    let store = Store::connect(&cfg.database).await.unwrap();
    store.migrate().await.unwrap();
    publish(&store, &cfg).await;
    (db, store)
}

async fn publish(store: &Store, cfg: &assistd::Config) {
    publish_agents(store, cfg).await.unwrap();
}

fn msg(conversation: &str, n: u32) -> NewMessage {
    NewMessage {
        reply_context: None,
        channel: "generic".into(),
        event_id: format!("e-{conversation}-{n}"),
        message_id: format!("m-{conversation}-{n}"),
        conversation_id: conversation.into(),
        sender_id: "u".into(),
        sender_name: None,
        text: format!("text {n}"),
    }
}

/// One message in each of `count` conversations `{prefix}0`, `{prefix}1`, …
async fn ingest_conversations(store: &Store, prefix: &str, count: usize, now: i64) {
    for c in 0..count {
        store
            .ingest_message(&msg(&format!("{prefix}{c}"), 1), "default", now)
            .await
            .unwrap();
    }
}

/// Ingests message `seq` of `conversation`; the id of the task it created.
async fn ingest(store: &Store, conversation: &str, seq: u32, now: i64) -> i64 {
    store
        .ingest_message(&msg(conversation, seq), "default", now)
        .await
        .unwrap()
        .task_id
}

/// One task in each of conversations `a` and `b`, both claimed by `me`: their ids, and
/// the fence of each by id.
async fn claim_a_and_b(store: &Store, now: i64) -> (i64, i64, impl Fn(i64) -> Fence) {
    let a = ingest(store, "a", 1, now).await;
    let b = ingest(store, "b", 1, now).await;
    let claimed = store.claim_tasks("me", 2, now + LEASE, now).await.unwrap();
    let fence = move |id: i64| fence_of(claimed.iter().find(|c| c.id == id).unwrap(), "me");
    (a, b, fence)
}

/// The audit rows of task `id` that record `event`, oldest first.
async fn audits_of(
    store: &Store,
    id: i64,
    event: assistd::domain::AuditEvent,
) -> Vec<assistd::store::tasks::AuditRow> {
    let rows = store.task_audit(id).await.unwrap();
    rows.into_iter().filter(|e| e.event == event).collect()
}

/// The fence of a task as `owner` claimed it.
fn fence_of(task: &assistd::domain::TaskRow, owner: &str) -> Fence {
    Fence {
        task_id: task.id,
        owner: owner.into(),
        version: task.version,
    }
}

fn outcome(task_id: i64) -> TaskOutcome {
    TaskOutcome {
        status: TaskStatus::Succeeded,
        result: Some("ok".into()),
        trace: None,
        failure_type: None,
        error: None,
        retries: 0,
        step: None,
        reply: NewReply {
            idempotency_key: assistd::domain::reply_key(task_id, 0),
            channel: "generic".into(),
            conversation_id: "c".into(),
            in_reply_to: "m".into(),
            reply_type: ReplyType::Text,
            content: r#"{"text":"ok"}"#.into(),
        },
        audit_summary: "done".into(),
    }
}

const LEASE: i64 = 30_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_are_refused_by_the_database() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let first = store
        .ingest_message(&msg("c", 1), "default", now)
        .await
        .unwrap();
    assert!(!first.duplicate);
    let again = store
        .ingest_message(&msg("c", 1), "default", now)
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(again.task_id, first.task_id);
    let mut same_event = msg("c", 2);
    same_event.event_id = "e-c-1".into();
    let dup = store
        .ingest_message(&same_event, "default", now)
        .await
        .unwrap();
    assert!(dup.duplicate);
    assert_eq!(store.intake_row_counts().await.unwrap(), (1, 1, 1));
    // Unknown agent: nothing written.
    assert!(
        store
            .ingest_message(&msg("c", 9), "nobody", now)
            .await
            .is_err()
    );
    assert_eq!(store.intake_row_counts().await.unwrap(), (1, 1, 1));
    store.close().await;
    db.drop_db().await;
}

/// Group commit: one batch holding new messages, a retry of one of them, the same message
/// under another event id, a message stored before, and a message for an agent with no
/// version. Each gets its own answer; only the last writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_message_as_if_it_came_alone() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let earlier = store
        .ingest_message(&msg("old", 1), "default", now)
        .await
        .unwrap();
    let a = msg("c", 1);
    let b = msg("c", 2);
    let retry_of_a = msg("c", 1);
    let mut b_other_event = msg("c", 2);
    b_other_event.event_id = "another-event-for-c-2".into();
    let stored_before = msg("old", 1);
    let orphan = msg("c", 3);
    let d = msg("d", 1);
    let batch = [
        (&a, "default"),
        (&b, "default"),
        (&retry_of_a, "default"),
        (&b_other_event, "default"),
        (&stored_before, "default"),
        (&orphan, "nobody"),
        (&d, "default"),
    ];
    let results = store.ingest_batch(&batch, now).await.unwrap();
    assert_eq!(results.len(), batch.len());
    let ok = |i: usize| *results[i].as_ref().unwrap();
    assert!(!ok(0).duplicate && !ok(1).duplicate && !ok(6).duplicate);
    assert_ne!(ok(0).task_id, ok(1).task_id);
    assert_eq!(
        ok(2),
        assistd::domain::Ingested {
            task_id: ok(0).task_id,
            duplicate: true
        }
    );
    assert_eq!(
        ok(3),
        assistd::domain::Ingested {
            task_id: ok(1).task_id,
            duplicate: true
        }
    );
    assert_eq!(
        ok(4),
        assistd::domain::Ingested {
            task_id: earlier.task_id,
            duplicate: true
        }
    );
    assert!(matches!(
        results[5],
        Err(assistd::store::StoreError::NotFound)
    ));
    assert!(
        ok(0).task_id < ok(1).task_id && ok(1).task_id < ok(6).task_id,
        "arrival order kept"
    );
    // earlier + a, b, d: messages, tasks and TASK_CREATED rows.
    assert_eq!(store.intake_row_counts().await.unwrap(), (4, 4, 4));
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_ingest_of_one_message_makes_one_task() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .ingest_message(&msg("c", 1), "default", now)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut fresh = 0;
    let mut ids = Vec::new();
    for h in handles {
        let r = h.await.unwrap();
        fresh += usize::from(!r.duplicate);
        ids.push(r.task_id);
    }
    assert_eq!(fresh, 1);
    assert!(ids.iter().all(|i| *i == ids[0]));
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_take_the_oldest_task_of_each_conversation_only() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let a1 = ingest(&store, "a", 1, now).await;
    let a2 = ingest(&store, "a", 2, now).await;
    let b1 = ingest(&store, "b", 1, now).await;
    let claimed = store.claim_tasks("w1", 10, now + LEASE, now).await.unwrap();
    let ids: Vec<i64> = claimed.iter().map(|c| c.id).collect();
    assert_eq!(ids, [a1, b1]);
    // The snapshot of the agent version was copied into the task at claim.
    let task = store.task(a1).await.unwrap().unwrap();
    assert_eq!(task.status, TaskStatus::Running);
    assert!(task.workflow_snapshot.unwrap().contains("system_prompt"));
    assert!(
        store
            .claim_tasks("w2", 10, now + LEASE, now)
            .await
            .unwrap()
            .is_empty()
    );

    let fence = Fence {
        task_id: a1,
        owner: "w1".into(),
        version: claimed[0].version,
    };
    assert!(store.finish_task(&fence, &outcome(a1), now).await.unwrap());
    let next = store.claim_tasks("w2", 10, now + LEASE, now).await.unwrap();
    assert_eq!(next.iter().map(|c| c.id).collect::<Vec<_>>(), [a2]);
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_never_run_two_tasks_of_one_conversation() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    for conv in 0..4 {
        for n in 0..5 {
            store
                .ingest_message(&msg(&format!("c{conv}"), n), "default", now)
                .await
                .unwrap();
        }
    }
    let handles: Vec<_> = (0..8)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .claim_tasks(&format!("w{w}"), 3, now + LEASE, now)
                    .await
                    .unwrap_or_default()
            })
        })
        .collect();
    let mut claimed = Vec::new();
    for h in handles {
        claimed.extend(h.await.unwrap());
    }
    let mut per_conversation: HashMap<String, usize> = HashMap::new();
    for c in &claimed {
        let t = store.task(c.id).await.unwrap().unwrap();
        *per_conversation.entry(t.conversation_id).or_default() += 1;
    }
    assert!(
        per_conversation.values().all(|n| *n == 1),
        "{per_conversation:?}"
    );
    assert_eq!(claimed.len(), 4);
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_lost_its_lease_cannot_write() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let id = ingest(&store, "c", 1, now).await;
    let first = store
        .claim_tasks("old", 1, now + 1_000, now)
        .await
        .unwrap()
        .remove(0);
    let old = Fence {
        task_id: id,
        owner: "old".into(),
        version: first.version,
    };
    // Not expired yet: nobody else can take it.
    assert!(
        store
            .claim_tasks("new", 1, now + LEASE, now + 500)
            .await
            .unwrap()
            .is_empty()
    );
    // Expired: another instance takes it over.
    let later = now + 2_000;
    let second = store
        .claim_tasks("new", 1, later + LEASE, later)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(second.id, id);
    assert_eq!(second.claim_count, 2);
    let claims: Vec<String> = audits_of(&store, id, assistd::domain::AuditEvent::TaskRunning)
        .await
        .into_iter()
        .map(|e| e.summary)
        .collect();
    assert_eq!(
        claims,
        ["claimed by old", "claimed by new (claim 2, resumed)"],
        "each claim audited, a takeover as a resume"
    );
    let new = Fence {
        task_id: id,
        owner: "new".into(),
        version: second.version,
    };

    assert!(!store.renew_lease(&old, later + LEASE, later).await.unwrap());
    let key = format!("{id}:1:chat");
    let step = NewStep {
        step_no: 1,
        step_type: StepType::Llm,
        tool_name: "chat",
        idempotency_key: &key,
        input: "{}",
    };
    assert!(
        store
            .begin_step(&old, &step, later)
            .await
            .unwrap()
            .is_none()
    );
    let row = store.begin_step(&new, &step, later).await.unwrap().unwrap();
    assert_eq!(row.status, StepStatus::Pending);
    // The begin returns only the new row's id; the rest is built from what it wrote.
    assert_eq!(
        store.task_steps(id).await.unwrap(),
        vec![row.clone()],
        "the begun step is the journalled row"
    );
    assert!(!store.record_step_attempt(&old, row.id, 1).await.unwrap());

    let mut done = outcome(id);
    done.step = Some(StepResult {
        step_id: row.id,
        attempts: 1,
        status: StepStatus::Succeeded,
        output: Some("{}".into()),
        error: None,
        tokens_in: None,
        tokens_out: None,
        duration_ms: 1,
    });
    assert!(
        !store.finish_task(&old, &done, later).await.unwrap(),
        "the old owner's result is refused"
    );
    assert!(
        store.task_reply(id).await.unwrap().is_none(),
        "and wrote no reply"
    );
    assert!(store.finish_task(&new, &done, later).await.unwrap());
    assert!(
        !store.finish_task(&new, &done, later).await.unwrap(),
        "finishing twice is refused"
    );
    let reply = store.task_reply(id).await.unwrap().unwrap();
    assert_eq!(reply.idempotency_key, format!("agent-task-{id}"));
    assert_eq!(
        store.task_steps(id).await.unwrap()[0].status,
        StepStatus::Succeeded
    );
    store.close().await;
    db.drop_db().await;
}

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
    let (db, store) = fresh_store().await;
    if db.is_postgres() {
        // PostgreSQL plans depend on table statistics; the partial indexes exist in both.
        store.close().await;
        db.drop_db().await;
        return;
    }
    let pick = assistd::store::tasks::claim_pick_sql(store.dialect());
    let plan = store.explain(&pick).await.unwrap().join(" | ");
    assert!(plan.contains("agent_task_pending"), "{plan}");
    assert!(plan.contains("agent_task_running"), "{plan}");
    assert!(plan.contains("agent_task_active_conversation"), "{plan}");
    assert!(
        plan.split(" | ")
            .all(|step| !step.starts_with("SCAN") || step.contains("USING")),
        "no full table scan: {plan}"
    );
    let plan = store
        .explain(
            "SELECT id FROM outbound_reply WHERE status = 'PENDING' AND next_attempt_at <= 1 \
             ORDER BY next_attempt_at LIMIT 5",
        )
        .await
        .unwrap()
        .join(" | ");
    assert!(plan.contains("outbound_reply_due"), "{plan}");
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_task_back_to_pending_waits_while_a_newer_one_runs() {
    // A FAILED task resumed (or an approved one) is older than a task of its conversation
    // that is RUNNING now: claiming it would break one-RUNNING-per-conversation.
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let a = ingest(&store, "c", 1, now).await;
    let b = ingest(&store, "c", 2, now).await;
    let other = ingest(&store, "d", 1, now).await;
    let first = store.claim_tasks("w", 10, now + LEASE, now).await.unwrap();
    assert_eq!(first.iter().map(|c| c.id).collect::<Vec<_>>(), [a, other]);
    let fence_a = Fence {
        task_id: a,
        owner: "w".into(),
        version: first[0].version,
    };
    let mut failed = outcome(a);
    failed.status = TaskStatus::Failed;
    failed.failure_type = Some(assistd::domain::FailureType::AuthFailed);
    assert!(store.finish_task(&fence_a, &failed, now).await.unwrap());
    let running_b = store.claim_tasks("w", 10, now + LEASE, now).await.unwrap();
    assert_eq!(running_b.iter().map(|c| c.id).collect::<Vec<_>>(), [b]);
    assert_eq!(
        store.resume_task(a, "admin", now).await.unwrap(),
        assistd::store::tasks::Control::Done
    );
    let none = store
        .claim_tasks("w", 10, now + LEASE, now)
        .await
        .expect("the claim does not fail");
    assert!(none.is_empty(), "{none:?}");
    let fence_b = Fence {
        task_id: b,
        owner: "w".into(),
        version: running_b[0].version,
    };
    assert!(store.finish_task(&fence_b, &outcome(b), now).await.unwrap());
    let resumed = store.claim_tasks("w", 10, now + LEASE, now).await.unwrap();
    assert_eq!(resumed.iter().map(|c| c.id).collect::<Vec<_>>(), [a]);
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
    let dialect = if db.is_postgres() {
        "postgres"
    } else {
        "sqlite"
    };
    let older = tempfile::tempdir().unwrap();
    for file in ["0001_initial.sql", "0002_platform_callbacks.sql"] {
        let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("migrations")
            .join(dialect)
            .join(file);
        std::fs::copy(from, older.path().join(file)).unwrap();
    }
    let migrator = sqlx::migrate::Migrator::new(older.path()).await.unwrap();
    match &store {
        Store::Sqlite(pool, _) => migrator.run(pool).await.unwrap(),
        Store::Postgres(pool) => migrator.run(pool).await.unwrap(),
    }
    publish(&store, &cfg).await;
    let now = now_ms();
    let id = ingest(&store, "upgrade", 1, now).await;
    let claimed = store.claim_tasks("me", 1, now + LEASE, now).await.unwrap();
    assert_eq!(claimed[0].id, id);
    let fence = fence_of(&claimed[0], "me");
    let set_stored = "UPDATE agent_task SET current_step = 9 WHERE id = $1";
    match &store {
        Store::Sqlite(pool, _) => {
            sqlx::query(set_stored)
                .bind(id)
                .execute(pool)
                .await
                .unwrap();
        }
        Store::Postgres(pool) => {
            sqlx::query(set_stored)
                .bind(id)
                .execute(pool)
                .await
                .unwrap();
        }
    }

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

/// The messages of a claim's tasks come back from one read (the worker's batch read), each
/// the message its task was created for; ids that name no message are left out. The claim
/// audited each of its tasks once, under the task's own id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_messages_are_read_in_one_statement() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    ingest_conversations(&store, "mr", 5, now).await;
    let claimed = store.claim_tasks("me", 5, now + LEASE, now).await.unwrap();
    let mut ids: Vec<i64> = claimed.iter().map(|t| t.message_id).collect();
    ids.push(i64::MAX);
    let messages = store.messages(&ids).await.unwrap();
    assert_eq!(messages.len(), 5);
    for task in &claimed {
        let m = messages.iter().find(|m| m.id == task.message_id).unwrap();
        assert_eq!(m.conversation_id, task.conversation_id);
        assert_eq!(
            m.external_message_id,
            format!("m-{}-1", task.conversation_id)
        );
    }
    assert!(store.messages(&[]).await.unwrap().is_empty());
    for task in &claimed {
        let running = audits_of(&store, task.id, assistd::domain::AuditEvent::TaskRunning).await;
        assert_eq!(running.len(), 1, "{running:?}");
        assert_eq!(running[0].task_id, Some(task.id));
        assert_eq!(
            (running[0].actor.as_str(), running[0].summary.as_str()),
            ("me", "claimed by me")
        );
    }
    store.close().await;
    db.drop_db().await;
}

/// Several batches at once (PostgreSQL runs several journal writers, and two instances
/// during a takeover) naming the same task rows in opposite orders: none deadlocks or fails,
/// and every write lands. Each batch locks its task rows in id order before writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_batches_over_the_same_tasks_do_not_deadlock() {
    use assistd::store::writes::{WriteOp, WriteOut};
    let (db, store) = fresh_store().await;
    let now = now_ms();
    ingest_conversations(&store, "dl", 24, now).await;
    let claimed = store.claim_tasks("me", 24, now + LEASE, now).await.unwrap();
    assert_eq!(claimed.len(), 24);
    let fences: Vec<Fence> = claimed.iter().map(|t| fence_of(t, "me")).collect();
    let mut batches = tokio::task::JoinSet::new();
    for b in 0..8usize {
        let store = store.clone();
        let mut order = fences.clone();
        if b % 2 == 1 {
            order.reverse();
        }
        batches.spawn(async move {
            let mut ops = Vec::new();
            for f in &order {
                ops.push(WriteOp::RenewLease {
                    fence: f.clone(),
                    lease_until: now + LEASE + b as i64,
                });
                let key = format!("{}:{b}:dl", f.task_id);
                ops.push(WriteOp::begin_step(
                    f,
                    &NewStep {
                        step_no: 1 + b as i64,
                        step_type: StepType::Tool,
                        tool_name: "dl",
                        idempotency_key: &key,
                        input: "{}",
                    },
                ));
            }
            store.apply_writes(&ops, now).await
        });
    }
    while let Some(out) = batches.join_next().await {
        let out = out
            .unwrap()
            .expect("no batch fails (deadlock or otherwise)");
        assert!(out.iter().all(|o| match o {
            WriteOut::Done(landed) => *landed,
            WriteOut::Step(row) => row.is_some(),
        }));
    }
    for f in &fences {
        assert_eq!(store.task_steps(f.task_id).await.unwrap().len(), 8);
    }
    store.close().await;
    db.drop_db().await;
}

/// Group commit of worker writes: one transaction carrying the writes of two tasks, one of
/// them from a worker that lost its task. Each write is fenced on its own: the stale one is
/// refused and writes nothing, the others land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_sharing_a_transaction_are_fenced_one_by_one() {
    use assistd::store::writes::{WriteOp, WriteOut};
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let (a, b, fence) = claim_a_and_b(&store, now).await;
    let stale = Fence {
        version: fence(b).version - 1,
        ..fence(b)
    };
    let step = |key: &'static str| NewStep {
        step_no: 1,
        step_type: StepType::Llm,
        tool_name: "chat",
        idempotency_key: key,
        input: "{}",
    };
    let ops = [
        WriteOp::begin_step(&fence(a), &step("a:1:chat")),
        WriteOp::begin_step(&stale, &step("b:1:chat")),
        WriteOp::FinishTask {
            fence: stale.clone(),
            outcome: Box::new(outcome(b)),
        },
        WriteOp::FinishTask {
            fence: fence(a),
            outcome: Box::new(outcome(a)),
        },
    ];
    let out = store.apply_writes(&ops, now).await.unwrap();
    assert!(matches!(&out[0], WriteOut::Step(Some(row)) if row.task_id == a));
    assert!(matches!(out[1], WriteOut::Step(None)));
    assert!(matches!(out[2], WriteOut::Done(false)));
    assert!(matches!(out[3], WriteOut::Done(true)));
    assert!(store.task_reply(a).await.unwrap().is_some());
    assert!(
        store.task_reply(b).await.unwrap().is_none(),
        "the stale finish wrote nothing"
    );
    assert_eq!(
        store.task(b).await.unwrap().unwrap().status,
        TaskStatus::Running
    );
    assert_eq!(store.task_steps(b).await.unwrap().len(), 0);
    assert_eq!(
        store.task(a).await.unwrap().unwrap().status,
        TaskStatus::Succeeded
    );

    // Completing a step: fenced in the same statement as the write.
    let row = store
        .begin_step(&fence(b), &step("b:1:chat"), now)
        .await
        .unwrap()
        .unwrap();
    let result = |status| StepResult {
        step_id: row.id,
        attempts: 1,
        status,
        output: Some("{}".into()),
        error: None,
        tokens_in: None,
        tokens_out: None,
        duration_ms: 1,
    };
    let out = store
        .apply_writes(
            &[
                WriteOp::CompleteStep {
                    fence: stale.clone(),
                    step: result(StepStatus::Failed),
                },
                WriteOp::CompleteStep {
                    fence: fence(b),
                    step: result(StepStatus::Succeeded),
                },
            ],
            now,
        )
        .await
        .unwrap();
    assert!(matches!(out[0], WriteOut::Done(false)));
    assert!(matches!(out[1], WriteOut::Done(true)));
    assert_eq!(
        store.task_steps(b).await.unwrap()[0].status,
        StepStatus::Succeeded
    );

    // A stale write and a current one naming the same row, stale first: each answer is its
    // own (the batch applies them in separate rounds of the same statement).
    let out = store
        .apply_writes(
            &[
                WriteOp::begin_step(
                    &stale,
                    &NewStep {
                        step_no: 2,
                        ..step("b:2:chat")
                    },
                ),
                WriteOp::RenewLease {
                    fence: stale.clone(),
                    lease_until: now + LEASE,
                },
                WriteOp::begin_step(
                    &fence(b),
                    &NewStep {
                        step_no: 2,
                        ..step("b:2:chat")
                    },
                ),
                WriteOp::RenewLease {
                    fence: fence(b),
                    lease_until: now + 2 * LEASE,
                },
            ],
            now,
        )
        .await
        .unwrap();
    assert!(matches!(out[0], WriteOut::Step(None)));
    assert!(matches!(out[1], WriteOut::Done(false)));
    assert!(matches!(&out[2], WriteOut::Step(Some(row)) if row.step_no == 2 && row.task_id == b));
    assert!(matches!(out[3], WriteOut::Done(true)));
    let task = store.task(b).await.unwrap().unwrap();
    assert_eq!(task.lease_expire, Some(now + 2 * LEASE));
    assert_eq!(task.current_step, 2);
    store.close().await;
    db.drop_db().await;
}

/// Group commit over the real database: a batch that fails as a whole (here one step begin
/// breaks the journal's unique step number) is rolled back entirely and each operation is
/// applied again alone, so the bad one fails by itself and the others land exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_batch_of_worker_writes_lands_each_good_write_once() {
    use std::sync::{Arc, Mutex};

    use assistd::store::group::GroupCommit;
    use assistd::store::writes::{WriteOp, WriteOut};
    use assistd::store::{StoreError, StoreResult};

    let (db, store) = fresh_store().await;
    let now = now_ms();
    let (a, b, fence) = claim_a_and_b(&store, now).await;

    // Batches as applied, by size; the first is held so the rest queue up behind it.
    let sizes = Arc::new(Mutex::new(Vec::<usize>::new()));
    let queue: GroupCommit<WriteOp, WriteOut> = {
        let (store, sizes) = (store.clone(), sizes.clone());
        GroupCommit::start(
            "test",
            1,
            64,
            Arc::new(move |ops: &[WriteOp]| {
                let (store, sizes) = (store.clone(), sizes.clone());
                Box::pin(async move {
                    let first = {
                        let mut sizes = sizes.lock().unwrap();
                        sizes.push(ops.len());
                        sizes.len() == 1
                    };
                    if first {
                        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    }
                    let out = store.apply_writes(ops, now_ms()).await?;
                    Ok(out.into_iter().map(Ok).collect())
                })
            }),
        )
    };
    let queue = Arc::new(queue);
    let step = |no: i64, key: &'static str| NewStep {
        step_no: no,
        step_type: StepType::Llm,
        tool_name: "chat",
        idempotency_key: key,
        input: "{}",
    };
    let ops = [
        // Held in its batch while the rest queue up.
        WriteOp::RenewLease {
            fence: fence(b),
            lease_until: now + LEASE,
        },
        WriteOp::begin_step(&fence(a), &step(1, "a:1:chat")),
        // Step 1 of task `a` again under another key: breaks the unique (task, step number).
        WriteOp::begin_step(&fence(a), &step(1, "a:1:other")),
        WriteOp::FinishTask {
            fence: fence(b),
            outcome: Box::new(outcome(b)),
        },
    ];
    // Queued in this order: each submission is given a moment to enter the queue.
    let mut handles = Vec::new();
    for op in ops {
        let queue = queue.clone();
        handles.push(tokio::spawn(async move { queue.submit(op).await }));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut results: Vec<StoreResult<WriteOut>> = Vec::new();
    for handle in handles {
        results.push(handle.await.unwrap());
    }
    assert_eq!(
        *sizes.lock().unwrap(),
        vec![1, 3, 1, 1, 1],
        "the three queued writes went as one batch, then one by one"
    );
    let mut results = results.into_iter();
    assert!(results.next().unwrap().unwrap().done(), "lease renewed");
    let begun = results.next().unwrap().unwrap().step().expect("good begin");
    assert_eq!(begun.idempotency_key, "a:1:chat");
    assert!(
        matches!(results.next().unwrap(), Err(StoreError::UniqueViolation(_))),
        "the bad begin fails alone"
    );
    assert!(results.next().unwrap().unwrap().done(), "finish landed");

    let steps = store.task_steps(a).await.unwrap();
    assert_eq!(steps, vec![begun], "one step 1 for task a, the good one");
    assert_eq!(
        store.task(b).await.unwrap().unwrap().status,
        TaskStatus::Succeeded
    );
    assert!(store.task_reply(b).await.unwrap().is_some());
    let finished = audits_of(&store, b, assistd::domain::AuditEvent::TaskSucceeded).await;
    assert_eq!(finished.len(), 1, "the finish was audited once");
    store.close().await;
    db.drop_db().await;
}
