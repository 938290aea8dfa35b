//! Group commit: callers queue an operation and wait for its answer; writer tasks take
//! whatever is queued (up to a batch size) and apply it in one transaction. Under load the
//! operations that arrive while one batch commits make up the next, so transactions (and,
//! on SQLite, the single writer's lock hand-offs and WAL commits) are shared; a lone
//! operation goes at once, nothing waits for a batch to fill. If a batch fails, each of its
//! operations is applied alone, so one bad operation fails only itself.

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
    jobs: mpsc::Sender<Job<Op, Out>>,
}

impl<Op: Send + Sync + 'static, Out: Send + 'static> GroupCommit<Op, Out> {
    /// Starts `writers` writer tasks on the current runtime; they stop when this is dropped.
    /// `apply` commits a batch and answers each operation, in order.
    pub fn start(
        name: &'static str,
        writers: usize,
        batch_max: usize,
        apply: Apply<Op, Out>,
    ) -> Self {
        let batch_max = batch_max.max(1);
        let writers = writers.max(1);
        let (jobs, queue) = mpsc::channel(batch_max * writers * 4);
        let queue = Arc::new(tokio::sync::Mutex::new(queue));
        for _ in 0..writers {
            tokio::spawn(write_batches(name, queue.clone(), batch_max, apply.clone()));
        }
        GroupCommit { jobs }
    }

    /// Queues `op` and waits until its batch committed.
    pub async fn submit(&self, op: Op) -> StoreResult<Out> {
        let (done, answer) = oneshot::channel();
        let stopped = || StoreError::Database(sqlx::Error::PoolClosed);
        self.jobs.send((op, done)).await.map_err(|_| stopped())?;
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
}
