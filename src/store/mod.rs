//! The database: the only module that holds SQL. One portable statement where SQLite and
//! PostgreSQL agree (both take `$N` parameters), a dialect branch only where they do not
//! (claim with `SKIP LOCKED`, `NOTIFY`). Every write transaction on SQLite starts with
//! `BEGIN IMMEDIATE`, and no network call ever happens while a transaction is open.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::config::DatabaseConfig;

pub mod agents;
pub mod blobs;
pub mod context;
pub mod group;
pub mod intake;
pub mod jobs;
pub mod journal;
pub mod knowledge;
pub mod knowledge_ingest;
pub mod lifecycle;
pub mod notify;
pub mod outbox;
pub mod rollups;
pub(crate) mod sql;
pub mod summary;
pub mod tasks;
pub mod text;
pub mod worker_lease;
pub mod workflow;
pub mod writes;

/// The channel PostgreSQL `NOTIFY`s when a task becomes claimable.
pub const TASK_NOTIFY_CHANNEL: &str = "assistd_task";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database is busy (another writer held the lock too long)")]
    Busy,
    #[error("unique constraint violated: {0}")]
    UniqueViolation(String),
    #[error("not found")]
    NotFound,
    #[error("database error: {0}")]
    Database(sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// No connection could be had (pool timed out, server gone): worth a retry later.
    #[error("database unavailable: {0}")]
    Unavailable(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if matches!(
            e,
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_)
        ) {
            return StoreError::Unavailable(e.to_string());
        }
        if let sqlx::Error::Database(db) = &e {
            // PostgreSQL: connection trouble (08), the server going away or not taking
            // connections (57), out of resources (53), the database closed to connections.
            if db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some()
                && let Some(code) = db.code()
                && (["08", "53", "57"]
                    .iter()
                    .any(|class| code.starts_with(class))
                    || (code == "55000" && db.message().contains("accepting connections")))
            {
                return StoreError::Unavailable(db.message().to_string());
            }
            if db.is_unique_violation() {
                return StoreError::UniqueViolation(db.message().to_string());
            }
            // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
                && let Some(code) = db.code()
                && let Ok(n) = code.parse::<i64>()
                && matches!(n & 0xff, 5 | 6)
            {
                return StoreError::Busy;
            }
        }
        StoreError::Database(e)
    }
}

impl StoreError {
    /// The database could not be had (unavailable, or busy past the wait): a condition of
    /// the database, not of the statement, which goes away by itself.
    pub fn is_outage(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Busy)
    }

    /// The same outage again (for each caller of a failed batch; `StoreError` is not `Clone`
    /// since `sqlx::Error` is not). Anything else becomes `Unavailable` with its text.
    pub fn outage_copy(&self) -> StoreError {
        match self {
            StoreError::Busy => StoreError::Busy,
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Which database this store talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Sqlite,
    Postgres,
}

/// A pool for one of the two dialects. Cheap to clone.
#[derive(Clone, Debug)]
pub enum Store {
    Sqlite(SqlitePool, WriteGate),
    Postgres(PgPool),
}

/// This process's SQLite write transactions take turns here, first come first served,
/// instead of in SQLite's busy handler (which sleeps and retries, so a writer can lose the
/// race for the write lock many times in a row while others keep taking it).
#[derive(Clone, Debug, Default)]
pub struct WriteGate(std::sync::Arc<tokio::sync::Mutex<()>>);

/// Runs `$body` with `$pool` bound to the concrete pool; the body is compiled once per
/// dialect, so the same statement text serves both.
macro_rules! on_pool {
    ($store:expr, $pool:ident => $body:expr) => {
        match $store {
            $crate::store::Store::Sqlite($pool, _) => $body,
            $crate::store::Store::Postgres($pool) => $body,
        }
    };
}

/// Runs `$body` inside a write transaction bound to `$tx` and commits it; an early `return`
/// or `?` inside the body rolls the transaction back. SQLite takes the write lock up front
/// (`BEGIN IMMEDIATE`) so the transaction never fails half-way on lock upgrade.
macro_rules! write_tx {
    ($store:expr, $tx:ident => $body:expr) => {
        match $store {
            $crate::store::Store::Sqlite(pool, gate) => {
                let _turn = gate.0.lock().await;
                let mut $tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let out = $body;
                $tx.commit().await?;
                out
            }
            $crate::store::Store::Postgres(pool) => {
                let mut $tx = pool.begin().await?;
                let out = $body;
                $tx.commit().await?;
                out
            }
        }
    };
}

/// The PENDING replies as a statement that reads the whole backlog selects them
/// (`… WHERE <this>`), through `outbound_reply_due`: that index's predicate also names
/// `next_attempt_at` (migration 0036), which only a comparison of that column implies, so
/// no other statement walks it. Every time the column holds is at least this one.
macro_rules! pending_replies {
    () => {
        "status = 'PENDING' AND next_attempt_at >= -9223372036854775807"
    };
}

pub(crate) use {on_pool, pending_replies, write_tx};

/// Something built once per dialect on first use, e.g. the text of batched statements.
pub(super) struct PerDialect<T>([std::sync::OnceLock<T>; 2]);

impl<T> PerDialect<T> {
    pub(super) const fn new() -> Self {
        PerDialect([std::sync::OnceLock::new(), std::sync::OnceLock::new()])
    }

    pub(super) fn get(&self, dialect: Dialect, build: fn(bool) -> T) -> &T {
        let sqlite = dialect == Dialect::Sqlite;
        self.0[usize::from(sqlite)].get_or_init(|| build(sqlite))
    }
}

/// One connection to the server before the pool is made, within `deadline`
/// (`database.acquire_timeout_secs`): a server that cannot be reached is reported with its
/// address and the cause (refused, unknown host, bad password, no such database, no
/// answer), where the pool would only say it timed out. The password is never shown.
async fn reach_postgres(options: &PgConnectOptions, deadline: Duration) -> anyhow::Result<()> {
    use sqlx::{ConnectOptions, Connection};
    let target = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    let database = options.get_database().unwrap_or("(default)");
    let user = options.get_username();
    match tokio::time::timeout(deadline, options.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(anyhow::anyhow!(
            "cannot connect to PostgreSQL at {target} (database `{database}`, user `{user}`): {e}"
        )),
        Err(_) => Err(anyhow::anyhow!(
            "cannot connect to PostgreSQL at {target} (database `{database}`, user `{user}`): \
             no answer within {} s (database.acquire_timeout_secs)",
            deadline.as_secs()
        )),
    }
}

impl Store {
    /// Connects (creating a SQLite file and its folder if missing); does not migrate.
    pub async fn connect(config: &DatabaseConfig) -> anyhow::Result<Store> {
        let url = config.url.as_str();
        let acquire = Duration::from_secs(config.acquire_timeout_secs.max(1));
        if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(match config.sqlite_synchronous {
                    crate::config::SqliteSync::Normal => SqliteSynchronous::Normal,
                    crate::config::SqliteSync::Full => SqliteSynchronous::Full,
                })
                .busy_timeout(Duration::from_millis(config.sqlite_busy_timeout_ms))
                .foreign_keys(true)
                .pragma("temp_store", "memory")
                .pragma("mmap_size", config.sqlite_mmap_bytes.to_string())
                .row_buffer_size(config.sqlite_row_buffer);
            if let Some(parent) = options.get_filename().parent()
                && !parent.as_os_str().is_empty()
            {
                std::fs::create_dir_all(parent).map_err(|e| {
                    anyhow::anyhow!("cannot create database folder {}: {e}", parent.display())
                })?;
            }
            // An embedded database has no server to drop a connection: sqlx's ping before
            // every acquire (a round trip to the connection's thread) buys nothing here.
            let file = options.get_filename().display().to_string();
            let pool = SqlitePoolOptions::new()
                .max_connections(config.max_connections)
                .acquire_timeout(acquire)
                .test_before_acquire(false)
                .connect_with(options)
                .await
                .map_err(|e| anyhow::anyhow!("cannot open SQLite database {file}: {e}"))?;
            Ok(Store::Sqlite(pool, WriteGate::default()))
        } else {
            let mut options = PgConnectOptions::from_str(url)?;
            if config.statement_timeout_ms > 0 {
                // A statement stuck on a lock fails instead of holding its caller forever.
                options = options
                    .options([("statement_timeout", config.statement_timeout_ms.to_string())]);
            }
            reach_postgres(&options, acquire).await?;
            let pool = PgPoolOptions::new()
                .max_connections(config.max_connections)
                .acquire_timeout(acquire)
                .connect_with(options)
                .await?;
            Ok(Store::Postgres(pool))
        }
    }

    pub fn dialect(&self) -> Dialect {
        match self {
            Store::Sqlite(..) => Dialect::Sqlite,
            Store::Postgres(_) => Dialect::Postgres,
        }
    }

    /// Applies the dialect's migrations (idempotent; safe from several instances at once on
    /// PostgreSQL, where sqlx takes an advisory lock).
    pub async fn migrate(&self) -> StoreResult<()> {
        match self {
            Store::Sqlite(pool, _) => {
                sqlx::migrate!("migrations/sqlite").run(pool).await?;
                sqlx::query("PRAGMA optimize").execute(pool).await?;
            }
            Store::Postgres(pool) => sqlx::migrate!("migrations/postgres").run(pool).await?,
        }
        Ok(())
    }

    /// A cheap round trip, for readiness checks.
    /// Whether a write could be made now: SQLite takes the write lock (`BEGIN IMMEDIATE`,
    /// failing as busy when another process holds it past the busy timeout); PostgreSQL
    /// must not be a read-only replica.
    pub async fn ping_write(&self) -> StoreResult<()> {
        match self {
            Store::Sqlite(..) => {
                write_tx!(self, tx => {
                    sqlx::query("SELECT 1").execute(&mut *tx).await?;
                });
                Ok(())
            }
            Store::Postgres(pool) => {
                let (read_only,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
                    .fetch_one(pool)
                    .await?;
                if read_only {
                    return Err(StoreError::Unavailable(
                        "the server is a read-only replica".into(),
                    ));
                }
                Ok(())
            }
        }
    }

    pub async fn ping(&self) -> StoreResult<()> {
        on_pool!(self, pool => {
            sqlx::query("SELECT 1").execute(pool).await?;
        });
        Ok(())
    }

    pub async fn close(&self) {
        on_pool!(self, pool => pool.close().await)
    }

    /// The query plan of `sql` as text lines, for tests that prove hot statements use indexes.
    pub async fn explain(&self, sql: &str) -> StoreResult<Vec<String>> {
        use sqlx::Row;
        match self {
            Store::Sqlite(pool, _) => {
                let text = format!("EXPLAIN QUERY PLAN {sql}");
                let rows = sqlx::query(&text).fetch_all(pool).await?;
                Ok(rows.iter().map(|r| r.get::<String, _>("detail")).collect())
            }
            Store::Postgres(pool) => {
                let text = format!("EXPLAIN {sql}");
                let rows = sqlx::query(&text).fetch_all(pool).await?;
                Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default database settings, on a SQLite file `name` in `dir`.
    fn sqlite_config(dir: &tempfile::TempDir, name: &str) -> DatabaseConfig {
        let mut config = crate::config::Config::load_with_env(None, Vec::new())
            .unwrap()
            .database;
        config.url = format!("sqlite://{}/{name}", dir.path().display());
        config
    }

    #[tokio::test]
    async fn sqlite_synchronous_follows_the_config() {
        let dir = tempfile::tempdir().unwrap();
        for (choice, expected) in [
            (crate::config::SqliteSync::Normal, 1),
            (crate::config::SqliteSync::Full, 2),
        ] {
            let mut config = sqlite_config(&dir, &format!("{expected}.db"));
            config.sqlite_synchronous = choice;
            let store = Store::connect(&config).await.unwrap();
            let (level,): (i64,) = on_pool!(&store, pool => {
                sqlx::query_as("PRAGMA synchronous").fetch_one(pool).await.unwrap()
            });
            assert_eq!(level, expected, "{choice:?}");
            store.close().await;
        }
    }

    #[tokio::test]
    async fn sqlite_mmap_size_follows_the_config() {
        let dir = tempfile::tempdir().unwrap();
        for bytes in [0u64, 64 << 20] {
            let mut config = sqlite_config(&dir, &format!("mmap-{bytes}.db"));
            config.sqlite_mmap_bytes = bytes;
            let store = Store::connect(&config).await.unwrap();
            let (size,): (i64,) = on_pool!(&store, pool => {
                sqlx::query_as("PRAGMA mmap_size").fetch_one(pool).await.unwrap()
            });
            assert_eq!(size as u64, bytes);
            store.close().await;
        }
        let default = crate::config::Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(default.database.sqlite_mmap_bytes, 256 << 20);
    }

    /// The bundled SQLite is built by `.cargo/config.toml`'s flags: each connection has a page
    /// cache of its own and memory is not counted under a process-wide mutex, so the
    /// writer's thread does not wait on the readers' (docs/benchmarks.md, sixth look).
    #[tokio::test]
    async fn sqlite_is_built_without_process_wide_locks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::connect(&sqlite_config(&dir, "options.db"))
            .await
            .unwrap();
        let options: Vec<(String,)> = on_pool!(&store, pool => {
            sqlx::query_as("PRAGMA compile_options").fetch_all(pool).await.unwrap()
        });
        let options: Vec<String> = options.into_iter().map(|(o,)| o).collect();
        assert!(
            !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
            "{options:?}"
        );
        assert!(
            options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"),
            "{options:?}"
        );
        store.close().await;
    }

    /// A write transaction that finds another of this process holding SQLite's write lock
    /// waits its turn (`WriteGate`) rather than in SQLite's busy handler, so it neither
    /// fails with "database is locked" nor depends on the busy timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_waits_its_turn_however_long_the_lock_is_held() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = sqlite_config(&dir, "gate.db");
        config.sqlite_busy_timeout_ms = 1;
        let store = Store::connect(&config).await.unwrap();
        on_pool!(&store, pool => {
            sqlx::query("CREATE TABLE t (v INTEGER)").execute(pool).await.unwrap();
        });
        let write = |v: i64, hold: Duration| {
            let store = store.clone();
            async move {
                let r: StoreResult<()> = async {
                    write_tx!(&store, tx => {
                        sqlx::query("INSERT INTO t (v) VALUES ($1)")
                            .bind(v)
                            .execute(&mut *tx)
                            .await?;
                        tokio::time::sleep(hold).await;
                    });
                    Ok(())
                }
                .await;
                r
            }
        };
        let first = tokio::spawn(write(1, Duration::from_millis(300)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = tokio::spawn(write(2, Duration::ZERO));
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
        let rows: Vec<(i64,)> = on_pool!(&store, pool => {
            sqlx::query_as("SELECT v FROM t ORDER BY rowid").fetch_all(pool).await.unwrap()
        });
        assert_eq!(rows, vec![(1,), (2,)]);
        store.close().await;
    }
}
