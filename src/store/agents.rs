//! Agents and their immutable versions. A version row is never updated after insert.

use super::{Store, StoreError, StoreResult, on_pool, write_tx};
use crate::domain::AuditEvent;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AgentVersionRow {
    pub id: i64,
    pub agent_id: i64,
    pub agent_name: String,
    pub version_no: i64,
    pub mode: String,
    pub definition: String,
    pub created_at: i64,
}

/// What publishing a definition did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub agent_id: i64,
    pub version_id: i64,
    pub version_no: i64,
    /// False when the definition equalled the current version, so nothing was written.
    pub created: bool,
}

const VERSION_COLUMNS: &str = "v.id, v.agent_id, a.name AS agent_name, v.version_no, v.mode, \
     v.definition, v.created_at";

impl Store {
    /// Makes `definition` the current version of agent `name`: a no-op when it already is,
    /// else a new immutable version numbered one above the last. Safe when several instances
    /// publish at start-up together: the loser of the race sees the winner's row.
    pub async fn publish_agent_version(
        &self,
        name: &str,
        mode: &str,
        definition: &str,
        now: i64,
    ) -> StoreResult<Published> {
        let mut tries = 0;
        loop {
            match self.try_publish(name, mode, definition, now).await {
                Err(StoreError::UniqueViolation(_)) if tries < 3 => tries += 1,
                other => return other,
            }
        }
    }

    async fn try_publish(
        &self,
        name: &str,
        mode: &str,
        definition: &str,
        now: i64,
    ) -> StoreResult<Published> {
        let published = write_tx!(self, tx => {
            sqlx::query(
                "INSERT INTO agent (name, created_at, updated_at) VALUES ($1, $2, $2) \
                 ON CONFLICT (name) DO NOTHING",
            )
            .bind(name)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            let (agent_id,): (i64,) = sqlx::query_as("SELECT id FROM agent WHERE name = $1")
                .bind(name)
                .fetch_one(&mut *tx)
                .await?;
            let latest: Option<(i64, i64, String)> = sqlx::query_as(
                "SELECT id, version_no, definition FROM agent_version WHERE agent_id = $1 \
                 ORDER BY version_no DESC LIMIT 1",
            )
            .bind(agent_id)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some((version_id, version_no, current)) = &latest
                && current == definition
            {
                return Ok(Published {
                    agent_id,
                    version_id: *version_id,
                    version_no: *version_no,
                    created: false,
                });
            }
            let version_no = latest.map(|l| l.1).unwrap_or(0) + 1;
            let (version_id,): (i64,) = sqlx::query_as(
                "INSERT INTO agent_version (agent_id, version_no, mode, definition, created_at) \
                 VALUES ($1, $2, $3, $4, $5) RETURNING id",
            )
            .bind(agent_id)
            .bind(version_no)
            .bind(mode)
            .bind(definition)
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query("UPDATE agent SET current_version_id = $1, updated_at = $2 WHERE id = $3")
                .bind(version_id)
                .bind(now)
                .bind(agent_id)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO audit_log (task_id, event, actor, summary, risk_flag, created_at) \
                 VALUES (NULL, $1, 'system', $2, $3, $4)",
            )
            .bind(AuditEvent::AgentVersionPublished)
            .bind(format!("agent {name} version {version_no} published"))
            .bind(false)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            Published { agent_id, version_id, version_no, created: true }
        });
        Ok(published)
    }

    /// The version new tasks of agent `name` are created for.
    pub async fn current_agent_version(&self, name: &str) -> StoreResult<Option<AgentVersionRow>> {
        let sql = format!(
            "SELECT {VERSION_COLUMNS} FROM agent a JOIN agent_version v \
             ON v.id = a.current_version_id WHERE a.name = $1"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, AgentVersionRow>(&sql).bind(name).fetch_optional(pool).await?
        }))
    }

    pub async fn agent_version(&self, id: i64) -> StoreResult<Option<AgentVersionRow>> {
        let sql = format!(
            "SELECT {VERSION_COLUMNS} FROM agent_version v JOIN agent a ON a.id = v.agent_id \
             WHERE v.id = $1"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, AgentVersionRow>(&sql).bind(id).fetch_optional(pool).await?
        }))
    }
}

/// One agent with its current version number.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AgentSummary {
    pub name: String,
    pub current_version: Option<i64>,
    pub versions: i64,
    pub updated_at: i64,
}

impl Store {
    pub async fn list_agents(&self) -> StoreResult<Vec<AgentSummary>> {
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, AgentSummary>(
                "SELECT a.name, cv.version_no AS current_version, \
                 (SELECT COUNT(*) FROM agent_version v WHERE v.agent_id = a.id) AS versions, \
                 a.updated_at FROM agent a \
                 LEFT JOIN agent_version cv ON cv.id = a.current_version_id ORDER BY a.name",
            )
            .fetch_all(pool)
            .await?
        }))
    }

    pub async fn agent_version_by_no(
        &self,
        name: &str,
        version_no: i64,
    ) -> StoreResult<Option<AgentVersionRow>> {
        let sql = format!(
            "SELECT {VERSION_COLUMNS} FROM agent_version v JOIN agent a ON a.id = v.agent_id \
             WHERE a.name = $1 AND v.version_no = $2"
        );
        Ok(on_pool!(self, pool => {
            sqlx::query_as::<_, AgentVersionRow>(&sql)
                .bind(name)
                .bind(version_no)
                .fetch_optional(pool)
                .await?
        }))
    }
}
