//! Group commit: callers queue an operation and wait for its answer; writer tasks take
//! whatever is queued (up to a batch size) and apply it in one transaction. Under load the
//! operations that arrive while one batch commits make up the next, so transactions (and,
//! on SQLite, the single writer's lock hand-offs and WAL commits) are shared; a lone
//! operation goes at once, nothing waits for a batch to fill. If a batch fails, each of its
//! operations is applied alone, so one bad operation fails only itself; if it fails because
//! the database cannot be had, every operation of it fails at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::{StoreError, StoreResult};

type Apply<Op, Out> = Arc<
    dyn for<'a> Fn(
            &'a [Op],
        )
            -> Pin<Box<dyn Future<Output = StoreResult<Vec<StoreResult<Out>>>> + Send + 'a>>
        + Send
        + Sync,
>;

type Job<Op, Out> = (Op, oneshot::Sender<StoreResult<Out>>);

pub struct GroupCommit<Op, Out> {
    /// One queue shared by every writer, or one per writer when operations are routed by
    /// key (`start_by_key`).
    queues: Vec<mpsc::Sender<Job<Op, Out>>>,
    key: Option<fn(&Op) -> u64>,
}

impl<Op: Send + Sync + 'static, Out: Send + 'static> GroupCommit<Op, Out> {
    /// Starts `writers` writer tasks on the current runtime; they stop when this is dropped.
    /// `apply` commits a batch and answers each operation, in order. The writers take from
    /// one queue, so any writer may commit any operation.
    pub fn start(
        name: &'static str,
        writers: usize,
        batch_max: usize,
        apply: Apply<Op, Out>,
    ) -> Self {
        Self::spawn(name, writers, batch_max, None, apply)
    }

    /// As `start`, but each writer has its own queue and an operation goes to the writer of
    /// `key(op) % writers`: operations of one key are never in two batches committing at
    /// once, so batches never wait on each other's row locks (nor deadlock) over them.
    pub fn start_by_key(
        name: &'static str,
        writers: usize,
        batch_max: usize,
        key: fn(&Op) -> u64,
        apply: Apply<Op, Out>,
    ) -> Self {
        Self::spawn(name, writers, batch_max, Some(key), apply)
    }

    fn spawn(
        name: &'static str,
        writers: usize,
        batch_max: usize,
        key: Option<fn(&Op) -> u64>,
        apply: Apply<Op, Out>,
    ) -> Self {
        let batch_max = batch_max.max(1);
        let writers = writers.max(1);
        let count = if key.is_some() { writers } else { 1 };
        let mut queues = Vec::with_capacity(count);
        let mut receivers = Vec::with_capacity(count);
        for _ in 0..count {
            let (jobs, queue) = mpsc::channel(batch_max * 4 * writers / count);
            queues.push(jobs);
            receivers.push(Arc::new(tokio::sync::Mutex::new(queue)));
        }
        for writer in 0..writers {
            let queue = receivers[writer % count].clone();
            tokio::spawn(write_batches(name, queue, batch_max, apply.clone()));
        }
        GroupCommit { queues, key }
    }

    /// Queues `op` and waits until its batch committed.
    pub async fn submit(&self, op: Op) -> StoreResult<Out> {
        let (done, answer) = oneshot::channel();
        let stopped = || StoreError::Database(sqlx::Error::PoolClosed);
        let queue = self
            .key
            .map_or(0, |key| (key(&op) % self.queues.len() as u64) as usize);
        self.queues[queue]
            .send((op, done))
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

async fn write_batches<Op, Out>(
    name: &'static str,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<Job<Op, Out>>>>,
    batch_max: usize,
    apply: Apply<Op, Out>,
) {
    let mut ops: Vec<Op> = Vec::with_capacity(batch_max);
    let mut answers: Vec<oneshot::Sender<StoreResult<Out>>> = Vec::with_capacity(batch_max);
    loop {
        {
            let mut queue = queue.lock().await;
            match queue.recv().await {
                Some((op, done)) => {
                    ops.push(op);
                    answers.push(done);
                }
                None => return,
            }
            while ops.len() < batch_max {
                match queue.try_recv() {
                    Ok((op, done)) => {
                        ops.push(op);
                        answers.push(done);
                    }
                    Err(_) => break,
                }
            }
        }
        let results = match apply(&ops).await {
            Ok(results) => results,
            // The database cannot be had (unavailable, busy): no one operation caused it, and
            // trying each alone would make every caller wait out the connection timeout
            // once per operation before any is answered (a webhook held 20 s instead of a
            // quick 503). Every caller gets the outage at once.
            Err(e) if e.is_outage() => {
                tracing::warn!(error = %e, size = ops.len(), batch = name, "group commit failed: the database is unavailable");
                ops.iter().map(|_| Err(e.outage_copy())).collect()
            }
            Err(e) if ops.len() > 1 => {
                tracing::warn!(error = %e, size = ops.len(), batch = name, "group commit failed; applying one by one");
                let mut results = Vec::with_capacity(ops.len());
                for op in ops.chunks(1) {
                    results.push(match apply(op).await {
                        Ok(mut one) => one.pop().unwrap_or(Err(StoreError::NotFound)),
                        Err(e) => Err(e),
                    });
                }
                results
            }
            Err(e) => vec![Err(e)],
        };
        crate::metrics::count_group_commit(name, ops.len());
        ops.clear();
        for (done, result) in answers.drain(..).zip(results) {
            // The caller may have stopped waiting; what it queued is committed regardless.
            let _ = done.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch containing a bad operation fails as a whole; each operation is then applied
    /// alone, so only the bad one fails, and every caller gets its own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_batch_is_retried_one_by_one() {
        let batches = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
        let seen = batches.clone();
        let queue: GroupCommit<i64, i64> = GroupCommit::start(
            "test",
            1,
            64,
            Arc::new(move |ops: &[i64]| {
                let seen = seen.clone();
                Box::pin(async move {
                    seen.lock().unwrap().push(ops.len());
                    // Slow enough that the other submissions queue up behind the first.
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    if ops.contains(&13) {
                        return Err(StoreError::NotFound);
                    }
                    Ok(ops.iter().map(|n| Ok(n * 2)).collect())
                })
            }),
        );
        let queue = Arc::new(queue);
        let mut handles = Vec::new();
        for n in [1_i64, 2, 13, 4, 5] {
            let queue = queue.clone();
            handles.push(tokio::spawn(async move { (n, queue.submit(n).await) }));
        }
        for h in handles {
            let (n, result) = h.await.unwrap();
            match n {
                13 => assert!(matches!(result, Err(StoreError::NotFound))),
                n => assert_eq!(result.unwrap(), n * 2),
            }
        }
        let batches = batches.lock().unwrap().clone();
        assert!(
            batches.iter().any(|&b| b > 1),
            "submissions were grouped: {batches:?}"
        );
    }

    /// Routed by key, operations of one key never sit in two batches being applied at once,
    /// while different keys still commit in parallel.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn batches_routed_by_key_never_share_a_key_in_flight() {
        use std::collections::HashMap;
        let in_flight = Arc::new(std::sync::Mutex::new(HashMap::<i64, usize>::new()));
        let most_batches = Arc::new(std::sync::Mutex::new((0_usize, 0_usize)));
        let (seen, most) = (in_flight.clone(), most_batches.clone());
        let queue: GroupCommit<i64, i64> = GroupCommit::start_by_key(
            "test",
            4,
            8,
            |n| *n as u64 % 6,
            Arc::new(move |ops: &[i64]| {
                let (seen, most) = (seen.clone(), most.clone());
                let ops = ops.to_vec();
                Box::pin(async move {
                    let mut keys: Vec<i64> = ops.iter().map(|n| n % 6).collect();
                    keys.sort_unstable();
                    keys.dedup();
                    {
                        let mut seen = seen.lock().unwrap();
                        for k in &keys {
                            *seen.entry(*k).or_default() += 1;
                        }
                        let mut most = most.lock().unwrap();
                        most.0 = most.0.max(*seen.values().max().unwrap());
                        most.1 = most.1.max(seen.values().filter(|&&c| c > 0).count());
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    let mut seen = seen.lock().unwrap();
                    for k in &keys {
                        *seen.get_mut(k).unwrap() -= 1;
                    }
                    Ok(ops.iter().map(|n| Ok(n * 2)).collect())
                })
            }),
        );
        let queue = Arc::new(queue);
        let mut handles = Vec::new();
        for n in 0..600_i64 {
            let queue = queue.clone();
            handles.push(tokio::spawn(async move { (n, queue.submit(n).await) }));
        }
        for h in handles {
            let (n, result) = h.await.unwrap();
            assert_eq!(result.unwrap(), n * 2);
        }
        let (per_key_batches, keys_at_once) = *most_batches.lock().unwrap();
        // A key's operations can share one batch, never two batches at once.
        assert_eq!(per_key_batches, 1, "one key in two batches at once");
        assert!(keys_at_once > 1, "writers ran in parallel");
        assert!(in_flight.lock().unwrap().values().all(|&c| c == 0));
    }
}
