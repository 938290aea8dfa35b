//! Store conformance: the same invariants hold on SQLite and on PostgreSQL, one file per
//! promise (intake, claims, fencing, handed replies, schema); this file holds their shared setup.

use assistd::domain::NewMessage;
use assistd::domain::{Fence, NewReply, TaskOutcome};
use assistd::domain::{ReplyType, TaskStatus};
use assistd::store::Store;

use crate::helpers::*;

mod claims;
mod fencing;
mod handoff;
mod intake;
mod plans;
mod schema;

pub(crate) async fn fresh_store() -> (TestDb, Store) {
    store_on(TestDb::new().await).await
}

/// [`store_on`] a fresh PostgreSQL database (`TestDb::postgres`), with its pool, for the
/// tests of PostgreSQL alone (compiled as ignored where no PostgreSQL server can start).
pub(crate) async fn postgres_store() -> (TestDb, Store, sqlx::PgPool) {
    let (db, store) = store_on(TestDb::postgres().await).await;
    let Store::Postgres(pool) = &store else {
        unreachable!("TestDb::postgres is PostgreSQL")
    };
    let pool = pool.clone();
    (db, store, pool)
}

/// A migrated store with the agents published, on `db`.
pub(crate) async fn store_on(db: TestDb) -> (TestDb, Store) {
    let mut cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    cfg.database.max_connections = 8;
    let store = Store::connect(&cfg.database).await.unwrap();
    store.migrate().await.unwrap();
    publish(&store, &cfg).await;
    (db, store)
}

pub(crate) async fn publish(store: &Store, cfg: &assistd::Config) {
    publish_agents(store, cfg).await.unwrap();
}

pub(crate) fn msg(conversation: &str, n: u32) -> NewMessage {
    NewMessage {
        reply_context: None,
        channel: "generic".into(),
        event_id: format!("e-{conversation}-{n}"),
        message_id: format!("m-{conversation}-{n}"),
        conversation_id: conversation.into(),
        sender_id: "u".into(),
        sender_name: None,
        text: format!("text {n}"),
        trace_context: None,
    }
}

/// One message in each of `count` conversations `{prefix}0`, `{prefix}1`, …
pub(crate) async fn ingest_conversations(store: &Store, prefix: &str, count: usize, now: i64) {
    for c in 0..count {
        store
            .ingest_message(&msg(&format!("{prefix}{c}"), 1), "default", now)
            .await
            .unwrap();
    }
}

/// Ingests message `seq` of `conversation`; the id of the task it created.
pub(crate) async fn ingest(store: &Store, conversation: &str, seq: u32, now: i64) -> i64 {
    store
        .ingest_message(&msg(conversation, seq), "default", now)
        .await
        .unwrap()
        .task_id
}

/// One task in each of conversations `a` and `b`, both claimed by `me`: their ids, and
/// the fence of each by id.
pub(crate) async fn claim_a_and_b(store: &Store, now: i64) -> (i64, i64, impl Fn(i64) -> Fence) {
    let a = ingest(store, "a", 1, now).await;
    let b = ingest(store, "b", 1, now).await;
    let claimed = store.claim_tasks("me", 2, now + LEASE, now).await.unwrap();
    let fence = move |id: i64| fence_of(claimed.iter().find(|c| c.id == id).unwrap(), "me");
    (a, b, fence)
}

/// The audit rows of task `id` that record `event`, oldest first.
pub(crate) async fn audits_of(
    store: &Store,
    id: i64,
    event: assistd::domain::AuditEvent,
) -> Vec<assistd::store::tasks::AuditRow> {
    let rows = store.task_audit(id).await.unwrap();
    rows.into_iter().filter(|e| e.event == event).collect()
}

/// The fence of a task as `owner` claimed it.
pub(crate) fn fence_of(task: &assistd::domain::TaskRow, owner: &str) -> Fence {
    Fence {
        task_id: task.id,
        owner: owner.into(),
        version: task.version,
    }
}

pub(crate) fn outcome(task_id: i64) -> TaskOutcome {
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

pub(crate) const LEASE: i64 = 30_000;

/// Waits (up to 5 s, else panics with `what`) until some session of `pool`'s database waits
/// for a lock another holds: the moment a test that holds a row or key open has the code
/// under test blocked on it. Only this test's database counts: tests run side by side on
/// one server, and another test's lock wait must not end this wait early (the code under
/// test would then not have met the held row or key at all).
pub(crate) async fn wait_for_a_lock_wait(pool: &sqlx::PgPool, what: &str) {
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{what}");
}
