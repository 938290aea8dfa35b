//! Handed replies (issue 35 part 2, PostgreSQL): a finished task's reply committed leased to
//! its own instance, first attempt counted, and handed to that instance's outbox. When the
//! outbox stops before it starts such a reply, the reply goes back uncounted, so no claim
//! reads it as a send in doubt and no reply is stranded under a lease nobody works on.

use std::sync::Arc;

use assistd::domain::{ReplyStatus, now_ms};
use assistd::store::journal::Journal;
use assistd::wake::Wake;
use tokio::sync::Semaphore;

use super::*;

/// `task`'s reply as the database holds it: status, attempts, lease holder, due time.
async fn reply_state(pool: &sqlx::PgPool, task: i64) -> (String, i64, Option<String>, i64) {
    sqlx::query_as(
        "SELECT status, attempts, locked_by, next_attempt_at FROM outbound_reply \
         WHERE task_id = $1",
    )
    .bind(task)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Both ways a handed reply meets a stopped outbox, through the real journal and wake:
/// 1. handed while the outbox ran and still queued when it stopped (what `run_outbox`
///    returns to the store at its end, through `defer_reply`);
/// 2. the outbox stopping while the finish that reserved its slot is still committing (the
///    journal puts the reply back itself).
///
/// Either way the reply is PENDING, unleased, due, with no attempt counted, every slot is
/// freed, and another instance's claim takes both as first attempts.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_handed_as_the_outbox_stops_goes_back_uncounted_on_postgres() {
    let (db, store, pool) = postgres_store().await;
    let now = now_ms();
    let (a, b, fence) = claim_a_and_b(&store, now).await;
    let cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    let wake = Arc::new(Wake::default());
    let journal =
        Arc::new(Journal::start(store.clone(), &cfg.worker).with_handoff(wake.clone(), 60));
    let slots = Arc::new(Semaphore::new(4));
    // Replies in two conversations, so neither waits for the other (a reply is only handed
    // when no older one of its conversation is pending).
    let reply_in = |task: i64, conversation: &str| {
        let mut o = outcome(task);
        o.reply.conversation_id = conversation.into();
        o
    };

    // 1. Handed, not taken, then the outbox stops.
    wake.outbox_started(slots.clone());
    assert!(
        journal
            .finish_task(&fence(a), &reply_in(a, "ca"))
            .await
            .unwrap()
    );
    let (status, attempts, holder, _) = reply_state(&pool, a).await;
    assert_eq!(
        (status.as_str(), attempts, holder.as_deref()),
        ("PENDING", 1, Some("me")),
        "committed leased to its instance, its attempt counted"
    );
    assert_eq!(slots.available_permits(), 3, "its slot stays reserved");
    let queued = wake.outbox_stopped();
    assert_eq!(queued.iter().map(|r| r.task_id).collect::<Vec<_>>(), [a]);
    // What the outbox does with its queue as it stops (`outbox::put_back`).
    for reply in &queued {
        assert!(store.defer_reply(reply, "me", now_ms()).await.unwrap());
    }
    drop(queued);

    // 2. The finish has reserved its slot and waits on task b's row; the outbox stops
    // meanwhile.
    wake.outbox_started(slots.clone());
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM agent_task WHERE id = $1 FOR UPDATE")
        .bind(b)
        .execute(&mut *holder)
        .await
        .unwrap();
    let finishing = {
        let (journal, fence, outcome) = (journal.clone(), fence(b), reply_in(b, "cb"));
        tokio::spawn(async move { journal.finish_task(&fence, &outcome).await })
    };
    wait_for_a_lock_wait(&pool, "the finish never waited for the row").await;
    assert_eq!(slots.available_permits(), 3, "the finish reserved a slot");
    assert!(wake.outbox_stopped().is_empty());
    holder.rollback().await.unwrap();
    assert!(
        finishing.await.unwrap().unwrap(),
        "the finish itself landed"
    );
    assert_eq!(
        store.task(b).await.unwrap().unwrap().status,
        TaskStatus::Succeeded
    );

    // Both replies back in the queue, uncounted and due, every slot free.
    assert_eq!(slots.available_permits(), 4);
    for task in [a, b] {
        let (status, attempts, holder, due) = reply_state(&pool, task).await;
        assert_eq!(
            (status.as_str(), attempts, holder),
            ("PENDING", 0, None),
            "task {task}"
        );
        assert!(due <= now_ms(), "task {task} is due");
    }
    let claimed = store
        .claim_due_replies("other", 10, now_ms() + 60_000, now_ms(), 0)
        .await
        .unwrap();
    let mut got: Vec<(i64, i64, ReplyStatus)> = claimed
        .iter()
        .map(|r| (r.task_id, r.attempts, r.status))
        .collect();
    got.sort_by_key(|g| g.0);
    assert_eq!(
        got,
        [(a, 1, ReplyStatus::Pending), (b, 1, ReplyStatus::Pending)],
        "first attempts, by another instance"
    );
    store.close().await;
    db.drop_db().await;
}
