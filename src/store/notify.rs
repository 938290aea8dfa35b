//! PostgreSQL `LISTEN` for new tasks: intake's `pg_notify` (sent on commit, from any
//! instance) wakes this instance's workers at once instead of at their next poll.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::TASK_NOTIFY_CHANNEL;
use crate::wake::Wake;

/// Wakes the workers on PostgreSQL `NOTIFY` from any instance's intake. Polling remains the
/// fallback, so a dropped listener connection only delays work.
pub async fn listen_for_tasks(pool: sqlx::PgPool, wake: Arc<Wake>, shutdown: CancellationToken) {
    loop {
        let listener = async {
            let mut l = sqlx::postgres::PgListener::connect_with(&pool).await?;
            l.listen(TASK_NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            l = listener => match l {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN failed; polling until it works");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(5)) => continue,
                        _ = shutdown.cancelled() => return,
                    }
                }
            },
            _ = shutdown.cancelled() => return,
        };
        loop {
            tokio::select! {
                n = listener.try_recv() => match n {
                    Ok(Some(_)) => wake.tasks.notify_one(),
                    // Connection lost and re-established: notifications may have been missed.
                    Ok(None) => wake.tasks.notify_one(),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection failed");
                        break;
                    }
                },
                _ = shutdown.cancelled() => return,
            }
        }
    }
}
