//! Issue 32, part 4: an outage is answered quickly and honestly. With PostgreSQL stopped
//! for 20 s under a steady stream of webhooks, webhooks were held up to 20.3 s and then
//! answered 200 (a failed group commit re-applied its operations one by one, each waiting
//! out its own connection timeout). Now every webhook is answered within the acquire
//! timeout (503 with `Retry-After` while the database is away), nothing is acknowledged that
//! is not committed, and after the restart every message is answered once. The database is a
//! private cluster this test starts and stops; the server is the real binary.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::binary::{RealServer, server_envs};
use crate::helpers::*;
use crate::private_pg::PrivateCluster;

/// One webhook of the stream: message `n`, how it was answered and how long that took.
struct Sent {
    n: u32,
    status: u16,
    took: Duration,
    task_id: Option<i64>,
    retry_after: Option<String>,
}

async fn send(server: &RealServer, n: u32) -> Sent {
    let start = Instant::now();
    let resp = server
        .post_message_with(
            &message(&format!("outage-{}", n % 8), n, &format!("question {n}")),
            &[],
        )
        .await;
    let took = start.elapsed();
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    Sent {
        n,
        status,
        took,
        task_id: body["task_id"].as_i64(),
        retry_after,
    }
}

#[cfg_attr(
    not(assistd_has_postgres_server),
    ignore = "needs a PostgreSQL server to start privately (apt-get install postgresql); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_are_answered_503_within_the_acquire_timeout_while_postgresql_is_down() {
    const ACQUIRE_SECS: u64 = 2;
    let cluster = PrivateCluster::start();
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let db = TestDb::external(cluster.url());
    let workdir = tempfile::tempdir().unwrap();
    let acquire = ACQUIRE_SECS.to_string();
    let envs = server_envs(
        &db,
        &model.uri(),
        &receiver.uri(),
        &[
            ("ASSISTD_DATABASE__ACQUIRE_TIMEOUT_SECS", &acquire),
            ("ASSISTD_OUTBOX__BACKOFF_MAX_MS", "1000"),
            ("ASSISTD_WORKER__POLL_INTERVAL_MS", "200"),
        ],
    );
    let server = RealServer::start(&envs, workdir.path()).await;

    // A steady stream, one message every 150 ms, each on its own: 3 s up, 20 s down, 4 s up.
    let server = std::sync::Arc::new(server);
    let stream = {
        let server = server.clone();
        tokio::spawn(async move {
            let mut sends = tokio::task::JoinSet::new();
            let end = Instant::now() + Duration::from_secs(27);
            let mut n = 0;
            while Instant::now() < end {
                n += 1;
                let server = server.clone();
                sends.spawn(async move { send(&server, n).await });
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            sends.join_all().await
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.stop();
    tokio::time::sleep(Duration::from_secs(20)).await;
    cluster.start_again();
    let mut sent = stream.await.unwrap();
    sent.sort_by_key(|s| s.n);

    let limit = Duration::from_secs(ACQUIRE_SECS + 1);
    let slow: Vec<(u32, u16, Duration)> = sent
        .iter()
        .filter(|s| s.took > limit)
        .map(|s| (s.n, s.status, s.took))
        .collect();
    assert!(slow.is_empty(), "answers slower than {limit:?}: {slow:?}");
    let unavailable: Vec<&Sent> = sent.iter().filter(|s| s.status == 503).collect();
    assert!(
        unavailable.len() > 20,
        "the outage was answered 503: {} of {}",
        unavailable.len(),
        sent.len()
    );
    assert!(
        unavailable
            .iter()
            .all(|s| s.retry_after.as_deref() == Some(acquire.as_str())),
        "every 503 says when to come back"
    );
    let odd: Vec<(u32, u16)> = sent
        .iter()
        .filter(|s| s.status != 200 && s.status != 503)
        .map(|s| (s.n, s.status))
        .collect();
    assert!(odd.is_empty(), "neither 200 nor 503: {odd:?}");

    // The platform retries what got 503; every message then has its task, and each task is
    // answered once.
    let mut tasks: BTreeMap<u32, i64> = sent
        .iter()
        .filter_map(|s| s.task_id.map(|t| (s.n, t)))
        .collect();
    for s in &unavailable {
        let deadline = Instant::now() + WAIT;
        loop {
            let again = send(&server, s.n).await;
            if let Some(task) = again.task_id {
                tasks.insert(s.n, task);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "message {} is refused still",
                s.n
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_eq!(tasks.len(), sent.len());
    let want: BTreeSet<String> = tasks.values().map(|t| format!("agent-task-{t}")).collect();
    assert_eq!(want.len(), sent.len(), "one task per message");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let keys: Vec<String> = received_replies(&receiver)
            .await
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let got: BTreeSet<String> = keys.iter().cloned().collect();
        assert_eq!(got.len(), keys.len(), "a message was answered twice");
        if got == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} messages answered",
            got.len(),
            want.len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
