//! Fencing: a worker that lost its lease cannot write; group-committed writes fenced one by one, without deadlocks, a failing batch landing each good write once.

use assistd::domain::{Fence, NewStep, StepResult};
use assistd::domain::{StepStatus, StepType, TaskStatus, now_ms};

use assistd::store::Dialect;
use assistd::store::writes::WriteOp;

use super::*;

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
        summary_through: None,
    });
    assert!(
        !store.finish_task(&old, &done, later).await.unwrap(),
        "the old owner's result is refused"
    );
    assert!(
        store.task_reply(id).await.unwrap().is_none(),
        "and wrote no reply"
    );
    assert_eq!(
        store.task_steps(id).await.unwrap()[0].status,
        StepStatus::Pending,
        "nor completed the step"
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

/// A takeover committing while a stale owner's step write is under way (PostgreSQL, read
/// committed): the stale begin, completion and finish (with its last step) wait for it and
/// then see the new owner, so nothing lands. The fence check locks the task row (`FOR
/// SHARE`); a plain `EXISTS` reads the statement's snapshot, taken before the takeover
/// committed, and lets the stale row in.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_write_racing_a_takeover_does_not_land() {
    let (db, store, pool) = postgres_store().await;
    let now = now_ms();
    let stale = claimed_fences(&store, "race", 3, "old", now).await;
    // The second and third tasks' steps are begun while still owned, to race their
    // completion: alone, and with the task's finish (PostgreSQL completes a finishing
    // task's last step in the finish's statement, fenced by the task's update).
    let mut begun = Vec::new();
    for fence in &stale[1..] {
        let key = format!("{}:1:chat", fence.task_id);
        let row = store.begin_step(fence, &llm_step(&key), now).await.unwrap();
        begun.push(row.unwrap().id);
    }
    for (n, fence) in stale.iter().enumerate() {
        // Another instance's takeover, not yet committed.
        let mut takeover = pool.begin().await.unwrap();
        sqlx::query("UPDATE agent_task SET owner = 'new', version = version + 1 WHERE id = $1")
            .bind(fence.task_id)
            .execute(&mut *takeover)
            .await
            .unwrap();
        let writer = store.clone();
        let fence = fence.clone();
        let step = StepResult {
            step_id: if n == 0 { 0 } else { begun[n - 1] },
            attempts: 1,
            status: StepStatus::Succeeded,
            output: Some("{}".into()),
            error: None,
            tokens_in: Some(10),
            tokens_out: Some(5),
            duration_ms: 1,
            summary_through: None,
        };
        let write = tokio::spawn(async move {
            if n == 0 {
                let key = format!("{}:1:chat", fence.task_id);
                let row = writer.begin_step(&fence, &llm_step(&key), now).await;
                row.unwrap().is_some()
            } else if n == 1 {
                let out = WriteOp::CompleteStep { fence, step };
                writer.apply_one(out, now).await.unwrap().done()
            } else {
                let mut done = outcome(fence.task_id);
                done.step = Some(step);
                writer.finish_task(&fence, &done, now).await.unwrap()
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        takeover.commit().await.unwrap();
        assert!(!write.await.unwrap(), "the stale write {n} was refused");
    }
    let steps = store.task_steps(stale[0].task_id).await.unwrap();
    assert!(steps.is_empty(), "no stale step row: {steps:?}");
    for fence in &stale[1..] {
        let steps = store.task_steps(fence.task_id).await.unwrap();
        assert_eq!(
            (steps[0].status, steps[0].tokens_in),
            (StepStatus::Pending, None),
            "the stale completion did not land"
        );
    }
    let task = store.task(stale[2].task_id).await.unwrap().unwrap();
    assert_eq!(
        task.status,
        TaskStatus::Running,
        "the stale finish did not land"
    );
    assert!(store.task_reply(stale[2].task_id).await.unwrap().is_none());
    store.close().await;
    db.drop_db().await;
}

/// A slow run's placeholder and its task's finish, racing (PostgreSQL, read committed): the
/// finish replaces a placeholder under its reply key and otherwise inserts its reply where
/// no row is (no `ON CONFLICT`), so no placeholder may land between the two. Queued while a
/// finish holds the task row, the placeholder waits for it and then sees the task finished:
/// nothing queued (with the former key-share lock it landed at once). Queued first and
/// committed while the finish waits, it is what the finish then replaces: one row, the answer.
#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs PostgreSQL: ASSISTD_TEST_POSTGRES_URL, or a server to start privately (apt-get install postgresql); .ci/run has both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placeholder_racing_its_tasks_finish_leaves_one_reply() {
    use assistd::store::outbox::NewPlaceholder;
    let (db, store, pool) = postgres_store().await;
    let now = now_ms();
    let fences = claimed_fences(&store, "ph", 2, "me", now).await;
    let keys: Vec<String> = fences
        .iter()
        .map(|f| assistd::domain::reply_key(f.task_id, 0))
        .collect();
    fn placeholder(key: &str) -> NewPlaceholder<'_> {
        NewPlaceholder {
            key,
            channel: "generic",
            conversation_id: "c",
            in_reply_to: "m",
            content: r#"{"text":"Thinking…"}"#,
        }
    }

    // 1. A finish in flight holds the first task's row.
    let mut finish = pool.begin().await.unwrap();
    sqlx::query("UPDATE agent_task SET status = 'SUCCEEDED', version = version + 1 WHERE id = $1")
        .bind(fences[0].task_id)
        .execute(&mut *finish)
        .await
        .unwrap();
    let queue = {
        let (store, fence, key) = (store.clone(), fences[0].clone(), keys[0].clone());
        tokio::spawn(async move {
            let queued = store
                .queue_placeholder(&fence, &placeholder(&key), now)
                .await;
            queued.unwrap()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!queue.is_finished(), "the placeholder waits for the finish");
    finish.commit().await.unwrap();
    assert!(!queue.await.unwrap(), "and then queues nothing");
    assert!(
        store
            .task_replies(fences[0].task_id)
            .await
            .unwrap()
            .is_empty()
    );

    // 2. A placeholder being queued holds the second task's row in share mode.
    let mut queued = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM agent_task WHERE id = $1 FOR SHARE")
        .bind(fences[1].task_id)
        .execute(&mut *queued)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO outbound_reply (task_id, idempotency_key, channel, conversation_id, \
         in_reply_to, reply_type, content, status, attempts, next_attempt_at, created_at, \
         placeholder) VALUES ($1, $2, 'generic', 'c', 'm', 'text', $3, 'PENDING', 0, $4, $4, 1)",
    )
    .bind(fences[1].task_id)
    .bind(&keys[1])
    .bind(r#"{"text":"Thinking…"}"#)
    .bind(now)
    .execute(&mut *queued)
    .await
    .unwrap();
    let finishing = {
        let (store, fence) = (store.clone(), fences[1].clone());
        tokio::spawn(async move {
            let done = store
                .finish_task(&fence, &outcome(fence.task_id), now)
                .await;
            done.unwrap()
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !finishing.is_finished(),
        "the finish waits for the placeholder"
    );
    queued.commit().await.unwrap();
    assert!(finishing.await.unwrap(), "and then finishes");
    let replies = store.task_replies(fences[1].task_id).await.unwrap();
    assert_eq!(replies.len(), 1, "{replies:?}");
    let reply = &replies[0];
    assert_eq!(
        (
            reply.idempotency_key.as_str(),
            reply.content.as_str(),
            reply.placeholder,
            reply.edit,
            reply.send_key.as_deref(),
        ),
        (keys[1].as_str(), r#"{"text":"ok"}"#, false, false, None),
        "the placeholder became the answer"
    );
    store.close().await;
    db.drop_db().await;
}

/// `n` new conversations' tasks, claimed by `owner`: their fences.
async fn claimed_fences(
    store: &Store,
    prefix: &str,
    n: usize,
    owner: &str,
    now: i64,
) -> Vec<Fence> {
    ingest_conversations(store, prefix, n, now).await;
    let claimed = store.claim_tasks(owner, n, now + LEASE, now).await.unwrap();
    assert_eq!(claimed.len(), n);
    claimed.iter().map(|t| fence_of(t, owner)).collect()
}

fn llm_step(key: &str) -> NewStep<'_> {
    NewStep {
        step_no: 1,
        step_type: StepType::Llm,
        tool_name: "chat",
        idempotency_key: key,
        input: "{}",
    }
}

/// Many writes at once to the same tasks, in opposite orders, through the journal with four
/// writers (PostgreSQL runs several; a lease renewal of a task can arrive beside its step
/// write): every write lands and PostgreSQL detects no deadlock. Batches do not lock their
/// task rows first; the journal gives each writer its own share of the tasks, so two
/// batches committing at once never hold the same row. (With one shared queue, as before,
/// this run deadlocks on PostgreSQL: the batch is rolled back and applied one by one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writes_over_the_same_tasks_do_not_deadlock() {
    use assistd::store::journal::Journal;
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let fences = claimed_fences(&store, "dl", 24, "me", now).await;
    let deadlocks_before = deadlocks(&store).await;
    let mut cfg = test_config(&db.url, "http://127.0.0.1:9", "http://127.0.0.1:9/reply");
    cfg.worker.group_commit_writers = 4;
    cfg.worker.group_commit_max = 64;
    let journal = std::sync::Arc::new(Journal::start(store.clone(), &cfg.worker));
    let mut writes = tokio::task::JoinSet::new();
    for b in 0..8usize {
        let mut order = fences.clone();
        if b % 2 == 1 {
            order.reverse();
        }
        for f in order {
            let journal = journal.clone();
            writes.spawn(async move {
                let renewed = journal.renew_lease(&f, now + LEASE + b as i64);
                let key = format!("{}:{b}:dl", f.task_id);
                let step = NewStep {
                    step_no: 1 + b as i64,
                    step_type: StepType::Tool,
                    tool_name: "dl",
                    idempotency_key: &key,
                    input: "{}",
                };
                let (renewed, begun) = tokio::join!(renewed, journal.begin_step(&f, &step));
                (renewed.unwrap(), begun.unwrap().is_some())
            });
        }
    }
    while let Some(out) = writes.join_next().await {
        assert_eq!(out.unwrap(), (true, true), "every write lands");
    }
    for f in &fences {
        assert_eq!(store.task_steps(f.task_id).await.unwrap().len(), 8);
    }
    // PostgreSQL counts deadlocks per database; its statistics reach the view within a
    // second of the transaction's end.
    if let Some(before) = deadlocks_before {
        tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
        assert_eq!(
            deadlocks(&store).await,
            Some(before),
            "no deadlock was detected"
        );
    }
    store.close().await;
    db.drop_db().await;
}

/// PostgreSQL's count of deadlocks detected in this database (`None` on SQLite).
async fn deadlocks(store: &Store) -> Option<i64> {
    let Store::Postgres(pool) = store else {
        return None;
    };
    let (n,): (i64,) =
        sqlx::query_as("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(pool)
            .await
            .unwrap();
    Some(n)
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
            hand_until: Some(now + 60_000),
        },
        // Handed to its instance's outbox (PostgreSQL): leased at insert.
        WriteOp::FinishTask {
            fence: fence(a),
            outcome: Box::new(outcome(a)),
            hand_until: Some(now + 60_000),
        },
    ];
    let out = store.apply_writes(&ops, now).await.unwrap();
    assert!(matches!(&out[0], WriteOut::Step(Some(row)) if row.task_id == a));
    assert!(matches!(out[1], WriteOut::Step(None)));
    assert!(matches!(out[2], WriteOut::Done(false)));
    // PostgreSQL inserts the reply leased to the finishing instance and returns it; SQLite
    // leaves it to a claim.
    if store.dialect() == Dialect::Postgres {
        assert!(
            matches!(&out[3], WriteOut::Handed(r) if r.task_id == a && r.attempts == 1),
            "{:?}",
            out[3]
        );
    } else {
        assert!(matches!(out[3], WriteOut::Done(true)));
    }
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
        summary_through: None,
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
            hand_until: None,
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

/// Issue 35 part 2: marking a reply delivered says whether a claim may now find a reply of
/// its conversation due (`WriteOut::Sent { more_due }`), so the outbox claims after a
/// delivery only then. Two answers of one conversation: the second waits behind the first;
/// marking the first says one is due, marking the second says none is. A mark by an
/// instance that no longer holds the lease lands nothing and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_a_reply_sent_says_whether_its_conversation_has_another_due() {
    use assistd::store::writes::WriteOut;
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let (a, b, fence) = claim_a_and_b(&store, now).await;
    // Both answers in conversation "c" (`outcome`), a's first.
    let finishes = [a, b].map(|id| WriteOp::FinishTask {
        fence: fence(id),
        outcome: Box::new(outcome(id)),
        hand_until: None,
    });
    let out = store.apply_writes(&finishes, now).await.unwrap();
    assert!(out.into_iter().all(WriteOut::done));
    let claim = |owner: &'static str| {
        let store = store.clone();
        async move {
            store
                .claim_due_replies(owner, 10, now_ms() + LEASE, now_ms(), 0)
                .await
                .unwrap()
        }
    };
    let first = claim("me").await;
    assert_eq!(
        first.iter().map(|r| r.task_id).collect::<Vec<_>>(),
        [a],
        "b's answer waits behind a's"
    );
    let out = mark_sent(&store, &first[0], "someone-else").await;
    assert!(matches!(out, WriteOut::Done(false)), "{out:?}");
    let out = mark_sent(&store, &first[0], "me").await;
    assert!(
        matches!(out, WriteOut::Sent { more_due: true }),
        "b's answer is due now: {out:?}"
    );
    let second = claim("me").await;
    assert_eq!(second.iter().map(|r| r.task_id).collect::<Vec<_>>(), [b]);
    let out = mark_sent(&store, &second[0], "me").await;
    assert!(
        matches!(out, WriteOut::Sent { more_due: false }),
        "nothing left in the conversation: {out:?}"
    );
    store.close().await;
    db.drop_db().await;
}

/// The other way a claim may find a reply due after a delivery: a placeholder that went out
/// after the answer took its row stays PENDING (to be edited into the answer), and its mark
/// says so (`more_due`), though no other reply of the conversation is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_a_placeholder_the_answer_took_over_says_it_is_due_again() {
    use assistd::store::outbox::NewPlaceholder;
    use assistd::store::writes::WriteOut;
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let fence = claimed_fences(&store, "ph-over", 1, "me", now)
        .await
        .remove(0);
    let key = assistd::domain::reply_key(fence.task_id, 0);
    let placeholder = NewPlaceholder {
        key: &key,
        channel: "generic",
        conversation_id: "c",
        in_reply_to: "m",
        content: r#"{"text":"Thinking…"}"#,
    };
    assert!(
        store
            .queue_placeholder(&fence, &placeholder, now)
            .await
            .unwrap()
    );
    let sending = store
        .claim_due_replies("me", 10, now_ms() + LEASE, now_ms(), 0)
        .await
        .unwrap();
    assert_eq!(sending.len(), 1);
    assert!(sending[0].placeholder);
    // The answer lands while the placeholder is being sent: it takes the row.
    let finish = WriteOp::FinishTask {
        fence: fence.clone(),
        outcome: Box::new(outcome(fence.task_id)),
        hand_until: None,
    };
    let out = store.apply_writes(&[finish], now_ms()).await.unwrap();
    assert!(matches!(out[0], WriteOut::Done(true)), "{:?}", out[0]);
    let out = mark_sent(&store, &sending[0], "me").await;
    assert!(
        matches!(out, WriteOut::Sent { more_due: true }),
        "the answer is due, to edit the placeholder: {out:?}"
    );
    let edit = store
        .claim_due_replies("me", 10, now_ms() + LEASE, now_ms(), 0)
        .await
        .unwrap();
    assert_eq!(edit.len(), 1);
    assert!(edit[0].edit && !edit[0].placeholder, "{:?}", edit[0]);
    assert_eq!(edit[0].content, r#"{"text":"ok"}"#);
    store.close().await;
    db.drop_db().await;
}

/// `owner`'s mark of `reply` as delivered (with a platform message id), applied alone.
async fn mark_sent(
    store: &Store,
    reply: &assistd::domain::ReplyRow,
    owner: &str,
) -> assistd::store::writes::WriteOut {
    let op = WriteOp::mark_reply_sent(reply, owner, Some("platform-id"));
    store.apply_writes(&[op], now_ms()).await.unwrap().remove(0)
}
