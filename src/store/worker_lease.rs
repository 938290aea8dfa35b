//! The workers' lease (`worker.exclusive`, issue 35 part 3): on PostgreSQL, a session-level
//! advisory lock held on a connection of its own, outside the pool. Only the instance that
//! holds it runs workers, outbox, ingester and scheduler; the others take webhooks and stand
//! by. PostgreSQL releases the lock the moment the holder's session ends (a crash, a kill, a
//! lost connection), so a standby's next try takes it over. The lock only decides who claims:
//! every write a worker makes stays fenced on its task's lease, so two holders for a moment
//! (a connection the server has not yet noticed is gone) cost work, never a duplicate.

use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::{PgConnection, PgPool};

/// The advisory lock's key, one per database: `hashtext('assistd.workers')` would do as well,
/// but a constant is the same on every PostgreSQL version.
pub const WORKER_LEASE_KEY: i64 = 0x6173_7369_7374_6431; // "assistd1"

/// One instance's connection for the workers' lease: tries it while standing by and, once
/// held, checks that the session (and with it the lock) is still there.
pub struct WorkerLease {
    pool: PgPool,
    /// Every connect and statement here ends within this (`database.acquire_timeout_secs`).
    timeout: Duration,
    conn: Option<PgConnection>,
    held: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("{0}")]
    Database(#[from] sqlx::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl WorkerLease {
    pub fn new(pool: PgPool, timeout: Duration) -> WorkerLease {
        WorkerLease {
            pool,
            timeout,
            conn: None,
            held: false,
        }
    }

    /// Whether this instance holds the lease (as of the last [`try_take`](Self::try_take) or
    /// [`check`](Self::check)).
    pub fn held(&self) -> bool {
        self.held
    }

    /// Tries to take the lease without waiting: `Ok(true)` when this session holds it now.
    /// A failure drops the connection, so the next try starts on a fresh one.
    pub async fn try_take(&mut self) -> Result<bool, LeaseError> {
        let result = self.bounded(Self::take_on).await;
        self.settle(result)
    }

    /// Whether the lease is still held: a round trip on the session that holds it. An error
    /// means the session is gone or unreachable, and the lease with it (or soon).
    pub async fn check(&mut self) -> Result<bool, LeaseError> {
        if !self.held {
            return Ok(false);
        }
        let result = self
            .bounded(|conn| {
                Box::pin(async move {
                    sqlx::query_scalar::<_, bool>(
                        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                         AND pid = pg_backend_pid() AND granted \
                         AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1)",
                    )
                    .bind(WORKER_LEASE_KEY)
                    .fetch_one(conn)
                    .await
                })
            })
            .await;
        self.settle(result)
    }

    /// Gives the lease up (a clean stop): closing the session releases the lock at once.
    pub async fn release(&mut self) {
        self.held = false;
        if let Some(conn) = self.conn.take() {
            let _ = tokio::time::timeout(self.timeout, conn.close()).await;
        }
    }

    fn take_on(conn: &mut PgConnection) -> futures_util::future::BoxFuture<'_, sqlx::Result<bool>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
                .bind(WORKER_LEASE_KEY)
                .fetch_one(conn)
                .await
        })
    }

    /// Runs `op` on the lease's connection (opened if need be), within the timeout.
    async fn bounded<F>(&mut self, op: F) -> Result<bool, LeaseError>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
        ) -> futures_util::future::BoxFuture<'c, sqlx::Result<bool>>,
    {
        let timeout = self.timeout;
        let pool = self.pool.clone();
        let conn = &mut self.conn;
        tokio::time::timeout(timeout, async move {
            if conn.is_none() {
                *conn = Some(PgConnection::connect_with(&pool.connect_options()).await?);
            }
            // Opened just above if it was not open.
            let c = conn.as_mut().expect("connection opened");
            Ok::<_, LeaseError>(op(c).await?)
        })
        .await
        .unwrap_or(Err(LeaseError::Timeout(timeout)))
    }

    fn settle(&mut self, result: Result<bool, LeaseError>) -> Result<bool, LeaseError> {
        match result {
            Ok(held) => {
                self.held = held;
                Ok(held)
            }
            Err(e) => {
                self.held = false;
                // A half-open session may still hold the lock on the server; dropping the
                // connection closes it from this side.
                self.conn = None;
                Err(e)
            }
        }
    }
}
