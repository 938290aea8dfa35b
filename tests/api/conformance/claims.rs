//! Claims: the oldest task of each conversation only, never two of one conversation, an older task back to pending waits, the claimed tasks' messages in one read.

use assistd::domain::Fence;
use assistd::domain::{TaskStatus, now_ms};
use std::collections::HashMap;

use super::*;

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

/// A claim limited to one provider's tasks (issue 32, `ProviderFilter`) keeps the rules of
/// every claim: only the oldest task of a conversation, never two of one conversation
/// running, and expired leases taken over; another provider's filter takes none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_one_providers_tasks_keeps_one_running_per_conversation() {
    use assistd::store::tasks::ProviderFilter;
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let p1 = ingest(&store, "p", 1, now).await;
    let _p2 = ingest(&store, "p", 2, now).await;
    let q1 = ingest(&store, "q", 1, now).await;
    // The default agent's tasks carry the default provider ("").
    let only = |name: &str| ProviderFilter::Only(name.into());
    let claim = |owner: &'static str, at: i64, filter: ProviderFilter| {
        let store = store.clone();
        async move {
            let claimed = store
                .claim_tasks_of(owner, 10, at + LEASE, at, &filter)
                .await
                .unwrap();
            claimed.iter().map(|c| c.id).collect::<Vec<_>>()
        }
    };
    assert!(claim("w", now, only("elsewhere")).await.is_empty());
    assert!(
        claim("w", now, ProviderFilter::Except(vec![String::new()]))
            .await
            .is_empty()
    );
    assert_eq!(claim("w", now, only("")).await, [p1, q1]);
    assert!(
        claim("w", now, only("")).await.is_empty(),
        "the conversation's second task waits for its first"
    );
    let later = now + LEASE + 1;
    assert_eq!(
        claim(
            "w2",
            later,
            ProviderFilter::Except(vec!["elsewhere".into()])
        )
        .await,
        [p1, q1],
        "expired leases are taken over"
    );
    store.close().await;
    db.drop_db().await;
}

/// A busy conversation's backlog ahead of everything else (a team channel after an outage):
/// the claim still takes the oldest task of every other conversation, in every channel, oldest
/// first, and no second task of the busy one. With a limit of 3 the claim's first read (the
/// six oldest due tasks) is all of the busy conversation, so the rest are found by the loose
/// scan of the conversations with pending tasks, across channels that sort before and after
/// the busy one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_behind_a_conversations_backlog_takes_every_other_conversations_oldest_task() {
    let (db, store) = fresh_store().await;
    let now = now_ms();
    let mut busy = Vec::new();
    for n in 1..=20 {
        busy.push(ingest(&store, "busy", n, now).await);
    }
    let mut behind = Vec::new();
    for (channel, conversation) in [("zeta", "q0"), ("generic", "q1"), ("alpha", "q2")] {
        for n in 1..=2 {
            let message = assistd::domain::NewMessage {
                channel: channel.into(),
                ..msg(conversation, n)
            };
            let task = store
                .ingest_message(&message, "default", now)
                .await
                .unwrap();
            behind.push(task.task_id);
        }
    }
    let claim = || async {
        let claimed = store.claim_tasks("w", 3, now + LEASE, now).await.unwrap();
        claimed.iter().map(|c| c.id).collect::<Vec<_>>()
    };
    assert_eq!(claim().await, [busy[0], behind[0], behind[2]]);
    // Only the busy conversation's backlog and the second tasks of the others are left
    // among the oldest: the loose scan finds the one conversation with nothing running.
    assert_eq!(claim().await, [behind[4]]);
    assert!(claim().await.is_empty());
    let fence = Fence {
        task_id: busy[0],
        owner: "w".into(),
        version: store.task(busy[0]).await.unwrap().unwrap().version,
    };
    assert!(
        store
            .finish_task(&fence, &outcome(busy[0]), now)
            .await
            .unwrap()
    );
    assert_eq!(claim().await, [busy[1]]);
    store.close().await;
    db.drop_db().await;
}
