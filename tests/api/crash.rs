//! Crash-proof execution, proven by killing the real `assistd` process.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use assistd::domain::{AuditEvent, StepStatus, TaskStatus, now_ms};
use assistd::store::Store;
use serde_json::Value;
use wiremock::{MockServer, Request};

use crate::binary::{RealServer, free_port};
use crate::helpers::*;

/// A slow echoing model that records, per step idempotency key, when each call arrived.
#[derive(Clone)]
struct RecordingModel {
    delay: Duration,
    calls: Arc<Mutex<Vec<(String, i64)>>>,
}

impl ModelScript for RecordingModel {
    fn reply(&self, request: &Request, body: &Value) -> ModelReply {
        let key = request
            .headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        self.calls.lock().unwrap().push((key, now_ms()));
        echo(body).delayed(self.delay)
    }
}

/// The reply receiver of the crash tests: it records, in order, which message each
/// accepted reply answered (what the chat shows); when `flaky`, it refuses the first try of
/// about one reply in four (503), chosen by key, so replies are retried while later ones of
/// their conversations are ready.
#[derive(Clone)]
struct ChatReceiver {
    flaky: bool,
    refused: Arc<Mutex<HashSet<String>>>,
    accepted: Arc<Mutex<Vec<String>>>,
}

impl wiremock::Respond for ChatReceiver {
    fn respond(&self, request: &Request) -> wiremock::ResponseTemplate {
        let key = request
            .headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let hash = key
            .bytes()
            .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
        if self.flaky && hash % 4 == 0 && self.refused.lock().unwrap().insert(key) {
            return wiremock::ResponseTemplate::new(503);
        }
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        let answered = body["in_reply_to"].as_str().unwrap_or("").to_string();
        self.accepted.lock().unwrap().push(answered);
        wiremock::ResponseTemplate::new(200)
    }
}

impl ChatReceiver {
    async fn start(flaky: bool) -> (MockServer, Arc<Mutex<Vec<String>>>) {
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let receiver = MockServer::start().await;
        wiremock::Mock::given(wiremock::matchers::method("POST"))
            .and(wiremock::matchers::path("/reply"))
            .and(SignedWithTestSecret)
            .respond_with(ChatReceiver {
                flaky,
                refused: Arc::default(),
                accepted: accepted.clone(),
            })
            .mount(&receiver)
            .await;
        (receiver, accepted)
    }
}

struct Rig {
    /// The messages answered by the replies the receiver accepted, in arrival order.
    accepted: Arc<Mutex<Vec<String>>>,
    db: TestDb,
    model: MockServer,
    calls: Arc<Mutex<Vec<(String, i64)>>>,
    receiver: MockServer,
    workdir: tempfile::TempDir,
}

impl Rig {
    async fn new(model_delay: Duration) -> Rig {
        Self::with_receiver(model_delay, false).await
    }

    async fn with_receiver(model_delay: Duration, flaky: bool) -> Rig {
        let (receiver, accepted) = ChatReceiver::start(flaky).await;
        let calls = Arc::new(Mutex::new(Vec::new()));
        let model = MockServer::start().await;
        model_mock(RecordingModel {
            delay: model_delay,
            calls: calls.clone(),
        })
        .mount(&model)
        .await;
        Rig {
            accepted,
            db: TestDb::new().await,
            model,
            calls,
            receiver,
            workdir: tempfile::tempdir().unwrap(),
        }
    }

    fn env(&self, instance: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            ("ASSISTD_DATABASE__URL", self.db.url.as_str()),
            ("ASSISTD_DATABASE__MAX_CONNECTIONS", "8"),
            ("ASSISTD_CHANNELS__GENERIC__SECRET", SECRET),
            ("ASSISTD_ADMIN__TOKEN", ADMIN_TOKEN),
            ("ASSISTD_WORKER__INSTANCE_ID", instance),
            ("ASSISTD_WORKER__LEASE_SECS", "3"),
            ("ASSISTD_WORKER__POLL_INTERVAL_MS", "100"),
            ("ASSISTD_OUTBOX__POLL_INTERVAL_MS", "100"),
            ("ASSISTD_OUTBOX__BACKOFF_BASE_MS", "50"),
            ("ASSISTD_OUTBOX__BACKOFF_MAX_MS", "300"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        env.push((
            "ASSISTD_LLM__BASE_URL".into(),
            format!("{}/v1", self.model.uri()),
        ));
        env.push((
            "ASSISTD_CHANNELS__GENERIC__REPLY_URL".into(),
            format!("{}/reply", self.receiver.uri()),
        ));
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }

    async fn store(&self) -> Store {
        let cfg = test_config(
            &self.db.url,
            "http://127.0.0.1:9",
            "http://127.0.0.1:9/reply",
        );
        Store::connect(&cfg.database).await.unwrap()
    }

    /// Waits until the model has had `n` calls; `what` names the stall in the failure.
    async fn wait_calls(&self, n: usize, what: &str) {
        let deadline = Instant::now() + WAIT;
        while self.calls.lock().unwrap().len() < n {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every one of `messages` has a reply at the receiver.
    async fn wait_all_replied(&self, messages: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let answered: HashSet<String> = self.accepted.lock().unwrap().iter().cloned().collect();
            if answered.len() >= messages {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {messages} messages answered",
                answered.len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The promises, checked after the dust settles: one key per message, every task
    /// terminal, conversations processed in order, no finished step re-executed.
    async fn check_promises(&self, messages: usize) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let replies = received_replies(&self.receiver).await;
        let mut keys_per_message: HashMap<String, HashSet<String>> = HashMap::new();
        for (key, body) in &replies {
            let msg = body["in_reply_to"].as_str().unwrap().to_string();
            keys_per_message.entry(msg).or_default().insert(key.clone());
        }
        assert_eq!(keys_per_message.len(), messages, "every message answered");
        for (msg, keys) in &keys_per_message {
            assert_eq!(
                keys.len(),
                1,
                "message {msg} answered under several keys: {keys:?}"
            );
        }
        let store = self.store().await;
        let mut by_conversation: BTreeMap<String, Vec<_>> = BTreeMap::new();
        let tasks = store.list_tasks(None, None, 10_000).await.unwrap();
        assert_eq!(tasks.len(), messages, "one task per message");
        for t in tasks {
            assert_eq!(
                t.status,
                TaskStatus::Succeeded,
                "task {} is {}",
                t.id,
                t.status
            );
            by_conversation
                .entry(t.conversation_id.clone())
                .or_default()
                .push(t);
        }
        // Order is read from the audit log, whose ids follow commit order: the next task of
        // a conversation is claimed only after the previous one's terminal commit.
        for tasks in by_conversation.values_mut() {
            tasks.sort_by_key(|t| t.id);
            for pair in tasks.windows(2) {
                let done = store.task_audit(pair[0].id).await.unwrap();
                let done = done
                    .iter()
                    .find(|a| a.event == AuditEvent::TaskSucceeded)
                    .unwrap()
                    .id;
                let next = store.task_audit(pair[1].id).await.unwrap();
                let first_run = next
                    .iter()
                    .find(|a| a.event == AuditEvent::TaskRunning)
                    .unwrap()
                    .id;
                assert!(
                    first_run > done,
                    "task {} started before task {} of its conversation finished",
                    pair[1].id,
                    pair[0].id
                );
            }
        }
        // Replies reached the chat in task order: per conversation, the first accepted
        // arrival of each task's reply (a re-send after a crash repeats the same key later)
        // comes after the first accepted arrival of every older task's reply.
        let mut first_arrival: HashMap<String, usize> = HashMap::new();
        for (i, msg) in self.accepted.lock().unwrap().iter().enumerate() {
            first_arrival.entry(msg.clone()).or_insert(i);
        }
        for tasks in by_conversation.values() {
            let mut arrived = Vec::new();
            for t in tasks {
                let msg = store.message(t.message_id).await.unwrap().unwrap();
                arrived.push((t.id, first_arrival[&msg.external_message_id]));
            }
            for pair in arrived.windows(2) {
                assert!(
                    pair[0].1 < pair[1].1,
                    "the reply to task {} reached the chat before the reply to task {} of its \
                     conversation",
                    pair[1].0,
                    pair[0].0
                );
            }
        }
        // A model call for a step that had already SUCCEEDED would be a re-executed step.
        let mut finished: HashMap<String, i64> = HashMap::new();
        for t in by_conversation.values().flatten() {
            for s in store.task_steps(t.id).await.unwrap() {
                assert_eq!(s.status, StepStatus::Succeeded);
                finished.insert(s.idempotency_key.clone(), s.finished_at.unwrap());
            }
        }
        let calls = self.calls.lock().unwrap().clone();
        let mut reruns = 0;
        for (key, at) in &calls {
            let done = finished
                .get(key)
                .unwrap_or_else(|| panic!("call with unknown step key {key}"));
            assert!(
                at < done,
                "step {key} was called at {at}, after it SUCCEEDED at {done}"
            );
        }
        let distinct: HashSet<&String> = calls.iter().map(|(k, _)| k).collect();
        reruns += calls.len() - distinct.len();
        println!(
            "crash check: {messages} messages, {} replies delivered ({} distinct keys), {} model calls ({} re-runs of interrupted steps)",
            replies.len(),
            replies.iter().map(|(k, _)| k).collect::<HashSet<_>>().len(),
            calls.len(),
            reruns
        );
        store.close().await;
    }
}

/// Posts like an IM platform: retries until the webhook answers 200.
async fn deliver(http: &reqwest::Client, addr_port: u16, body: &Value) {
    let raw = serde_json::to_vec(body).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ts = now_ms() / 1000;
        let sig = assistd::channels::generic::sign(SECRET, ts, &raw);
        let sent = http
            .post(format!("http://127.0.0.1:{addr_port}/webhooks/generic"))
            .header("X-Assistd-Timestamp", ts.to_string())
            .header("X-Assistd-Signature", sig)
            .body(raw.clone())
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        if let Ok(r) = sent
            && r.status() == 200
        {
            return;
        }
        assert!(Instant::now() < deadline, "webhook never accepted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_loses_and_duplicates_nothing() {
    const CONVERSATIONS: u32 = 20;
    const PER_CONVERSATION: u32 = 10;
    // The receiver also refuses some first tries, so replies are retried while later ones
    // of their conversations are ready: they must still reach the chat in order.
    // A refused reply is tried again after about a second, longer than the next task of its
    // conversation takes.
    let rig = Rig::with_receiver(Duration::from_millis(300), true).await;
    let port = free_port();
    let env = rig.env(
        "crash-instance",
        &[
            ("ASSISTD_OUTBOX__BACKOFF_BASE_MS", "1000"),
            ("ASSISTD_OUTBOX__BACKOFF_MAX_MS", "2000"),
        ],
    );
    let mut server = RealServer::start_on(port, &env, rig.workdir.path()).await;

    // The IM keeps delivering while the process is killed and restarted underneath it.
    let sender = tokio::spawn(async move {
        let http = reqwest::Client::new();
        for n in 0..PER_CONVERSATION {
            for c in 0..CONVERSATIONS {
                deliver(
                    &http,
                    port,
                    &message(&format!("conv{c}"), n, &format!("q{n} of conv{c}")),
                )
                .await;
            }
        }
    });
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    println!("kill schedule seed {seed}");
    for round in 0..3 {
        let wait = Duration::from_millis(rng.u64(300..1500));
        tokio::time::sleep(wait).await;
        println!("round {round}: SIGKILL after {wait:?}");
        server.kill();
        server = RealServer::start_on(port, &env, rig.workdir.path()).await;
    }
    sender.await.unwrap();
    rig.wait_all_replied(
        (CONVERSATIONS * PER_CONVERSATION) as usize,
        Duration::from_secs(90),
    )
    .await;
    assert_eq!(server.terminate(), Some(0));
    rig.check_promises((CONVERSATIONS * PER_CONVERSATION) as usize)
        .await;
    rig.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_unfinished_tasks_to_the_restarted_instance() {
    let rig = Rig::new(Duration::from_secs(2)).await;
    let port = free_port();
    // No grace: whatever is in flight at SIGTERM is stopped and its lease released.
    let env = rig.env(
        "graceful-instance",
        &[("ASSISTD_WORKER__SHUTDOWN_GRACE_SECS", "0")],
    );
    let server = RealServer::start_on(port, &env, rig.workdir.path()).await;
    let http = reqwest::Client::new();
    for c in 0..10 {
        deliver(&http, port, &message(&format!("g{c}"), 0, "slow question")).await;
    }
    // Wait until all ten model calls are in flight.
    let deadline = Instant::now() + WAIT;
    while rig.calls.lock().unwrap().len() < 10 {
        assert!(Instant::now() < deadline, "tasks never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(server.terminate(), Some(0), "SIGTERM exits 0");
    let store = rig.store().await;
    let running = store
        .list_tasks(Some(TaskStatus::Running), None, 100)
        .await
        .unwrap();
    assert_eq!(running.len(), 10);
    assert!(
        running.iter().all(|t| t.lease_expire.unwrap() <= now_ms()),
        "leases were released at shutdown"
    );
    store.close().await;

    let restarted = Instant::now();
    let calls_before = rig.calls.lock().unwrap().len();
    let server = RealServer::start_on(port, &env, rig.workdir.path()).await;
    let deadline = Instant::now() + WAIT;
    while rig.calls.lock().unwrap().len() == calls_before {
        assert!(Instant::now() < deadline, "nothing resumed after restart");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!(
        "graceful restart: first resumed step {} ms after the restart began (includes process start)",
        restarted.elapsed().as_millis()
    );
    rig.wait_all_replied(10, WAIT).await;
    assert_eq!(server.terminate(), Some(0));
    rig.check_promises(10).await;
    rig.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_takes_over_after_the_lease_expires() {
    let rig = Rig::new(Duration::from_secs(1)).await;
    let port_a = free_port();
    let a = RealServer::start_on(port_a, &rig.env("instance-a", &[]), rig.workdir.path()).await;
    deliver_conversations(port_a, "t", 6, 2).await;
    rig.wait_calls(6, "instance a never started").await;
    a.kill();
    let killed = Instant::now();
    let b = RealServer::start(&rig.env("instance-b", &[]), rig.workdir.path()).await;
    rig.wait_all_replied(12, WAIT).await;
    println!(
        "takeover: all answered {} ms after instance a died",
        killed.elapsed().as_millis()
    );
    let store = rig.store().await;
    let tasks = store.list_tasks(None, None, 100).await.unwrap();
    let taken_over = tasks.iter().filter(|t| t.claim_count > 1).count();
    assert!(taken_over >= 1, "instance b resumed instance a's tasks");
    assert!(
        tasks
            .iter()
            .all(|t| t.owner.as_deref() == Some("instance-b") || t.claim_count == 1)
    );
    store.close().await;
    assert_eq!(b.terminate(), Some(0));
    rig.check_promises(12).await;
    rig.db.drop_db().await;
}

/// `name{instance="…"}`'s value in the `/metrics` of the server on `port`, if present.
async fn instance_metric(port: u16, name: &str, instance: &str) -> Option<i64> {
    let text = metrics_text(&format!("http://127.0.0.1:{port}"))
        .await
        .ok()?;
    metric_sum(&text, &format!("{name}{{instance=\"{instance}\""))
}

/// The sessions holding the workers' lease (PostgreSQL's advisory lock).
async fn lease_holders(pg: &sqlx::PgPool) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
         AND ((classid::bigint << 32) | objid::bigint) = $1",
    )
    .bind(assistd::store::worker_lease::WORKER_LEASE_KEY)
    .fetch_all(pg)
    .await
    .unwrap()
}

/// Sends `per` messages in each of `conversations` conversations (`{prefix}{c}`) to `port`.
async fn deliver_conversations(port: u16, prefix: &str, conversations: usize, per: u32) {
    let http = reqwest::Client::new();
    for c in 0..conversations {
        for n in 0..per {
            deliver(
                &http,
                port,
                &message(&format!("{prefix}{c}"), n, "question"),
            )
            .await;
        }
    }
}

/// Waits until `name{instance}` on `port` is `want`.
async fn wait_metric(port: u16, name: &str, instance: &str, want: i64) {
    let deadline = Instant::now() + WAIT;
    while instance_metric(port, name, instance).await != Some(want) {
        assert!(
            Instant::now() < deadline,
            "{name}{{instance={instance}}} on :{port} never became {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 35 part 3, `worker.exclusive`: of two real instances on one PostgreSQL only the
/// holder of the workers' lease claims; the standby's webhooks hand their tasks over. SIGKILL
/// the holder and the standby takes the lease (PostgreSQL ends the dead session's lock) and
/// finishes everything, each message answered once and in order. Then the lease's own
/// session is cut under the new holder (`pg_terminate_backend`, a lost connection): it stops
/// its workers and the lease ends with exactly one instance again. On SQLite the key has no
/// effect: both instances run workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_lease_passes_to_the_standby_when_its_holder_dies() {
    const LEASE: &str = "assistd_worker_lease";
    const CLAIMS: &str = "assistd_task_claims_total";
    let rig = Rig::new(Duration::from_secs(1)).await;
    let postgres = rig.db.url.starts_with("postgres");
    let exclusive = [
        ("ASSISTD_WORKER__EXCLUSIVE", "true"),
        ("ASSISTD_WORKER__STANDBY_POLL_MS", "200"),
    ];
    let (port_a, port_b) = (free_port(), free_port());
    let a = RealServer::start_on(port_a, &rig.env("lease-a", &exclusive), rig.workdir.path()).await;
    let b_dir = tempfile::tempdir().unwrap();
    if !postgres {
        let b = RealServer::start_on(port_b, &rig.env("lease-b", &exclusive), b_dir.path()).await;
        // Both claim at their start: no lease decides on SQLite.
        for (port, instance) in [(port_a, "lease-a"), (port_b, "lease-b")] {
            let deadline = Instant::now() + WAIT;
            while instance_metric(port, CLAIMS, instance).await.is_none() {
                assert!(Instant::now() < deadline, "{instance} never claimed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(instance_metric(port, LEASE, instance).await, None);
        }
        let http = reqwest::Client::new();
        deliver(&http, port_b, &message("lease-sqlite", 0, "question")).await;
        rig.wait_all_replied(1, WAIT).await;
        assert_eq!(a.terminate(), Some(0));
        assert_eq!(b.terminate(), Some(0));
        rig.check_promises(1).await;
        rig.db.drop_db().await;
        return;
    }
    wait_metric(port_a, LEASE, "lease-a", 1).await;
    let b = RealServer::start_on(port_b, &rig.env("lease-b", &exclusive), b_dir.path()).await;
    wait_metric(port_b, LEASE, "lease-b", 0).await;

    // Webhooks at the standby: the holder answers them.
    deliver_conversations(port_b, "lease", 3, 2).await;
    rig.wait_calls(3, "the holder never took the tasks").await;
    assert_eq!(
        instance_metric(port_b, CLAIMS, "lease-b").await,
        None,
        "the standby claimed"
    );
    assert_eq!(instance_metric(port_b, LEASE, "lease-b").await, Some(0));

    // The holder dies mid-answer: the standby takes the lease and finishes everything.
    a.kill();
    let killed = Instant::now();
    wait_metric(port_b, LEASE, "lease-b", 1).await;
    println!(
        "worker lease: standby took it {} ms after the holder died",
        killed.elapsed().as_millis()
    );
    rig.wait_all_replied(6, WAIT).await;
    assert!(instance_metric(port_b, CLAIMS, "lease-b").await.unwrap() > 0);
    let store = rig.store().await;
    let tasks = store.list_tasks(None, None, 100).await.unwrap();
    assert!(
        tasks.iter().any(|t| t.claim_count > 1),
        "the new holder resumed the dead one's tasks"
    );
    assert!(
        tasks
            .iter()
            .all(|t| t.owner.as_deref() == Some("lease-b") || t.claim_count == 1),
        "a task finished after the kill by another instance than the new holder"
    );
    store.close().await;

    // The holder's lease session is cut (a lost connection): it stops its workers and stands
    // by, and the lease is held by exactly one instance again.
    let a = RealServer::start_on(port_a, &rig.env("lease-a", &exclusive), rig.workdir.path()).await;
    wait_metric(port_a, LEASE, "lease-a", 0).await;
    let pg = sqlx::PgPool::connect(&rig.db.url).await.unwrap();
    let cut = lease_holders(&pg).await;
    assert_eq!(cut.len(), 1, "one session holds the lease: {cut:?}");
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(cut[0])
        .fetch_one(&pg)
        .await
        .unwrap();
    assert!(terminated);
    let deadline = Instant::now() + WAIT;
    loop {
        let held = (
            instance_metric(port_a, LEASE, "lease-a").await,
            instance_metric(port_b, LEASE, "lease-b").await,
        );
        let holders = lease_holders(&pg).await;
        // The cut session is gone, the instance that had it noticed, and one holds it anew.
        if holders.len() == 1
            && holders[0] != cut[0]
            && matches!(held, (Some(1), Some(0)) | (Some(0), Some(1)))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no single holder after the cut: {held:?} {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    deliver(
        &reqwest::Client::new(),
        port_a,
        &message("lease-after-cut", 0, "question"),
    )
    .await;
    rig.wait_all_replied(7, WAIT).await;
    pg.close().await;
    let b_log = std::fs::read_to_string(b_dir.path().join("assistd.log")).unwrap();
    assert!(b_log.contains("standing by again"), "{b_log}");
    assert_eq!(a.terminate(), Some(0));
    assert_eq!(b.terminate(), Some(0));
    rig.check_promises(7).await;
    rig.db.drop_db().await;
}
