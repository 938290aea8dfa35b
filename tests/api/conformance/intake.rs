//! Intake: duplicates refused by the database, a batch answering each message as if alone, concurrent ingest of one message.

use assistd::domain::now_ms;

use super::*;

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
    let results = store.ingest_batch(&batch, now, true).await.unwrap();
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

/// Issue 35 part 2: on PostgreSQL a batch whose keys are new is inserted plainly (`NOT
/// EXISTS`, no speculative insertion). The same message committed by another transaction
/// while that insert runs fails it on the unique key; the batch then goes again the way that
/// skips stored keys, and the message is the other one's duplicate, written once.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_committed_meanwhile_by_another_intake_is_a_duplicate_on_postgres() {
    let (db, store, pool) = postgres_store().await;
    let now = now_ms();
    // The other intake: the same message, inserted and not yet committed.
    let mut other = pool.begin().await.unwrap();
    let (theirs,): (i64,) = sqlx::query_as(
        "INSERT INTO im_message (channel, external_event_id, external_message_id, \
         conversation_id, sender_id, text, received_at, task_id) \
         VALUES ('generic', 'e-c-1', 'm-c-1', 'c', 'u', 'text 1', 1, \
         nextval('agent_task_id_seq')) RETURNING task_id",
    )
    .fetch_one(&mut *other)
    .await
    .unwrap();
    let ingesting = {
        let store = store.clone();
        tokio::spawn(async move { store.ingest_message(&msg("c", 1), "default", now).await })
    };
    wait_for_a_lock_wait(&pool, "the intake never waited for the other's key").await;
    other.commit().await.unwrap();
    let ours = ingesting.await.unwrap().unwrap();
    assert!(ours.duplicate, "{ours:?}");
    assert_eq!(ours.task_id, theirs);
    let (messages, tasks): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM im_message), (SELECT COUNT(*) FROM agent_task)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (messages, tasks),
        (1, 0),
        "nothing of the failed insert stayed"
    );
    // A new message after it goes the plain way, and lands.
    let next = store
        .ingest_message(&msg("c", 2), "default", now)
        .await
        .unwrap();
    assert!(!next.duplicate);
    store.close().await;
    db.drop_db().await;
}

/// A claim's conversations read in one statement (`conversation_histories`) are the rows
/// each task would read alone (`conversation_history`): the same messages, oldest first,
/// with the answers of the tasks that succeeded, cut at the task's own message and at its
/// limit, never another conversation's (nor one of the same id on another channel). On
/// SQLite, where the statement walks each conversation back one message at a time, every
/// step is a probe of the conversation index, never a scan of the messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_read_together_equal_each_read_alone() {
    use assistd::store::intake::HistoryWant;
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let mut tasks = Vec::new();
    for (conversation, n) in [("c", 1), ("d", 1), ("c", 2), ("c", 3), ("d", 2), ("c", 4)] {
        let ingested = store
            .ingest_message(&msg(conversation, n), "default", now)
            .await
            .unwrap();
        tasks.push(store.task(ingested.task_id).await.unwrap().unwrap());
    }
    // `c` on another channel, in between; two answers and a failure.
    let mut elsewhere = msg("c", 9);
    elsewhere.channel = "slack".into();
    store
        .ingest_message(&elsewhere, "default", now)
        .await
        .unwrap();
    for (task, status) in [(0, "SUCCEEDED"), (2, "FAILED"), (3, "SUCCEEDED")] {
        let sql = format!(
            "UPDATE agent_task SET status = '{status}', result = 'answer {}' WHERE id = {}",
            tasks[task].message_id, tasks[task].id
        );
        crate::poison::exec_sql(&db.url, &sql).await;
    }
    let limits = [1i64, 2, 3, 10, 2, 3];
    let wants: Vec<HistoryWant<'_>> = tasks
        .iter()
        .zip(limits)
        .map(|(task, limit)| HistoryWant {
            task_id: task.id,
            channel: &task.channel,
            conversation_id: &task.conversation_id,
            up_to_message: task.message_id,
            limit,
        })
        .collect();
    let together = store.conversation_histories(&wants).await.unwrap();
    assert_eq!(together.len(), wants.len());
    for want in &wants {
        let alone = store
            .conversation_history(
                want.channel,
                want.conversation_id,
                want.up_to_message,
                want.limit,
            )
            .await
            .unwrap();
        let read = |h: &[assistd::store::intake::HistoryEntry]| {
            h.iter()
                .map(|e| (e.message_id, e.text.clone(), e.answer.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            read(&together[&want.task_id]),
            read(&alone),
            "task {}",
            want.task_id
        );
    }
    // The fourth message of `c` with room for three: its conversation's last three, in order.
    let texts: Vec<&str> = together[&tasks[5].id]
        .iter()
        .map(|e| e.text.as_str())
        .collect();
    assert_eq!(texts, ["text 2", "text 3", "text 4"]);
    let answers: Vec<Option<&str>> = together[&tasks[5].id]
        .iter()
        .map(|e| e.answer.as_deref())
        .collect();
    let answer = format!("answer {}", tasks[3].message_id);
    assert_eq!(answers, [None, Some(answer.as_str()), None]);
    // The third message of `c` with room for ten: the walk ends at the conversation's first.
    assert_eq!(together[&tasks[3].id].len(), 3);
    assert!(store.conversation_histories(&[]).await.unwrap().is_empty());
    if store.dialect() == assistd::store::Dialect::Sqlite {
        let sql = assistd::store::intake::conversation_histories_sql(store.dialect());
        let plan = store.explain(sql).await.unwrap().join("\n");
        assert!(
            plan.contains("SEARCH m USING COVERING INDEX im_message_conversation"),
            "{plan}"
        );
        assert!(
            !plan
                .lines()
                .any(|l| l.contains("SCAN m") || l.contains("SCAN im_message")),
            "{plan}"
        );
    }
    store.close().await;
    db.drop_db().await;
}
