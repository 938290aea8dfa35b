//! Loading: the compiled-in defaults, an optional file laid over them, then `ASSISTD_*`
//! variables; the result is validated before it is returned.

use std::path::Path;

use toml::Value;

use super::error::{ConfigError, invalid};
use super::sections::Config;

/// The defaults, with one comment per key. Shipped inside the binary so it runs from anywhere.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

const ENV_PREFIX: &str = "ASSISTD_";

impl Config {
    /// Defaults, then `file` if given, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// As [`Config::load`], with the environment given explicitly (tests).
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut merged = parse_toml(DEFAULT_TOML, "config/default.toml")?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let overlay = parse_toml(&text, &path.display().to_string())?;
            merge(&mut merged, overlay);
        }
        let mut vars: Vec<(String, String)> = env.into_iter().collect();
        vars.sort();
        for (var, raw) in vars {
            apply_env(&mut merged, &var, &raw)?;
        }
        let config: Config = serde_path_to_error::deserialize(merged).map_err(|e| {
            let key = e.path().to_string();
            invalid(&key, e.into_inner().to_string())
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The instance id: configured, else the host name, else a random one.
    pub fn instance_id(&self) -> String {
        if !self.worker.instance_id.trim().is_empty() {
            return self.worker.instance_id.trim().to_string();
        }
        std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| format!("assistd-{}", uuid::Uuid::new_v4().simple()))
    }
}

fn parse_toml(text: &str, origin: &str) -> Result<Value, ConfigError> {
    text.parse::<toml::Table>()
        .map(Value::Table)
        .map_err(|e| ConfigError::Syntax {
            path: origin.to_string(),
            message: e.to_string(),
        })
}

fn merge(base: &mut Value, overlay: Value) {
    match (base, overlay) {
        (Value::Table(base), Value::Table(overlay)) => {
            for (key, value) in overlay {
                match base.get_mut(&key) {
                    Some(existing) => merge(existing, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, overlay) => *base = overlay,
    }
}

/// Applies one `ASSISTD_SECTION__KEY=value`. The value is read as the type the key already
/// has (so a numeric secret stays a string); variables without `__` (such as
/// `ASSISTD_TEST_POSTGRES_URL`) are not configuration and are ignored.
fn apply_env(root: &mut Value, var: &str, raw: &str) -> Result<(), ConfigError> {
    let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
        return Ok(());
    };
    if !rest.contains("__") {
        return Ok(());
    }
    let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::Env {
            var: var.to_string(),
            message: "empty key segment".into(),
        });
    }
    let mut node = root;
    for (i, segment) in path.iter().enumerate() {
        let Value::Table(table) = node else {
            return Err(ConfigError::Env {
                var: var.to_string(),
                message: format!("`{}` is not a section", path[..i].join(".")),
            });
        };
        if i + 1 == path.len() {
            let value = match table.get(segment) {
                Some(existing) => {
                    typed_like(existing, raw).map_err(|message| ConfigError::Env {
                        var: var.to_string(),
                        message,
                    })?
                }
                None => Value::String(raw.to_string()),
            };
            table.insert(segment.clone(), value);
            return Ok(());
        }
        node = table
            .entry(segment.clone())
            .or_insert_with(|| Value::Table(toml::Table::new()));
    }
    Ok(())
}

fn typed_like(existing: &Value, raw: &str) -> Result<Value, String> {
    let raw_t = raw.trim();
    match existing {
        Value::Integer(_) => raw_t
            .parse::<i64>()
            .map(Value::Integer)
            .map_err(|_| format!("`{raw}` is not an integer")),
        Value::Float(_) => raw_t
            .parse::<f64>()
            .map(Value::Float)
            .map_err(|_| format!("`{raw}` is not a number")),
        Value::Boolean(_) => match raw_t.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Value::Boolean(true)),
            "false" | "0" | "no" | "off" => Ok(Value::Boolean(false)),
            _ => Err(format!("`{raw}` is not true or false")),
        },
        Value::Table(_) | Value::Array(_) => {
            Err("a section cannot be set from one variable; set its keys".into())
        }
        _ => Ok(Value::String(raw.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn sqlite_durability_is_a_choice_of_two() {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(c.database.sqlite_synchronous, SqliteSync::Full);
        let c = Config::load_with_env(
            None,
            env(&[("ASSISTD_DATABASE__SQLITE_SYNCHRONOUS", "normal")]),
        )
        .unwrap();
        assert_eq!(c.database.sqlite_synchronous, SqliteSync::Normal);
        let err = Config::load_with_env(
            None,
            env(&[("ASSISTD_DATABASE__SQLITE_SYNCHRONOUS", "sometimes")]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("database.sqlite_synchronous"), "{err}");
    }

    /// A count setting: `default` unless `var` says otherwise, and 0 rejected naming `key`.
    fn check_count_setting(var: &str, key: &str, default: u64, read: fn(&Config) -> u64) {
        let c = Config::load_with_env(None, Vec::new()).unwrap();
        assert_eq!(read(&c), default, "{key}");
        let other = (default * 2).to_string();
        let c = Config::load_with_env(None, env(&[(var, other.as_str())])).unwrap();
        assert_eq!(read(&c), default * 2, "{key}");
        let err = Config::load_with_env(None, env(&[(var, "0")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{err}");
    }

    /// Issue 17, item 10: listening beyond loopback needs a strong admin token.
    #[test]
    fn a_public_listen_needs_a_strong_admin_token() {
        let public = |token: &str| {
            Config::load_with_env(
                None,
                env(&[
                    ("ASSISTD_SERVER__LISTEN", "0.0.0.0:8787"),
                    ("ASSISTD_ADMIN__TOKEN", token),
                ]),
            )
        };
        for weak in ["", "change-me-too", &"x".repeat(31)] {
            let err = public(weak).unwrap_err().to_string();
            assert!(err.contains("admin.token"), "{err}");
        }
        assert!(public(&"k".repeat(32)).is_ok());
        // On loopback a generated token is fine.
        assert!(Config::load_with_env(None, Vec::new()).is_ok());
    }

    /// The shipped docker-compose file listens publicly, so it must not carry a weak default.
    #[test]
    fn docker_compose_demands_an_admin_token() {
        let compose = std::fs::read_to_string("docker-compose.yml").unwrap();
        let line = compose
            .lines()
            .find(|l| l.trim_start().starts_with("ASSISTD_ADMIN__TOKEN:"))
            .expect("the compose file sets the admin token");
        assert!(
            line.contains(":?"),
            "no default, a required variable: {line}"
        );
    }

    #[test]
    fn the_listen_backlog_is_set_and_must_hold_a_connection() {
        check_count_setting(
            "ASSISTD_SERVER__LISTEN_BACKLOG",
            "server.listen_backlog",
            1024,
            |c| c.server.listen_backlog as u64,
        );
    }

    #[test]
    fn the_sqlite_row_buffer_is_set_and_must_hold_a_row() {
        check_count_setting(
            "ASSISTD_DATABASE__SQLITE_ROW_BUFFER",
            "database.sqlite_row_buffer",
            256,
            |c| c.database.sqlite_row_buffer as u64,
        );
    }

    #[test]
    fn the_outbox_claim_wait_is_set_and_must_be_positive() {
        check_count_setting(
            "ASSISTD_OUTBOX__CLAIM_WAIT_MS",
            "outbox.claim_wait_ms",
            20,
            |c| c.outbox.claim_wait_ms,
        );
    }

    #[test]
    fn defaults_load_and_env_overrides_keep_types() {
        let c = Config::load_with_env(
            None,
            env(&[
                ("ASSISTD_WORKER__CONCURRENCY", "8"),
                ("ASSISTD_CHANNELS__GENERIC__SECRET", "12345"),
                ("ASSISTD_TEST_POSTGRES_URL", "postgres://ignored"),
                ("ASSISTD_LLM__RETRY__RATE_LIMITED__MAX_ATTEMPTS", "9"),
            ]),
        )
        .unwrap();
        assert_eq!(c.llm.retry.rate_limited.max_attempts, 9);
        assert_eq!(c.worker.concurrency, 8);
        assert_eq!(c.channels.generic.secret, "12345");
        assert_eq!(c.server.listen, "127.0.0.1:8787");
        assert_eq!(c.llm.base_url, "http://127.0.0.1:11434/v1");
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::load_with_env(None, env(&[("ASSISTD_WORKER__CONCURRENCY", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ASSISTD_WORKER__CONCURRENCY"), "{e}");
        let e = Config::load_with_env(None, env(&[("ASSISTD_WORKER__CONCURRENCY", "0")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("worker.concurrency"), "{e}");
        let e = Config::load_with_env(None, env(&[("ASSISTD_LLM__BASE_URL", "nope")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("llm.base_url"), "{e}");
        let e = Config::load_with_env(None, env(&[("ASSISTD_SERVER__LISTNE", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("listne"), "{e}");
    }

    #[test]
    fn an_enabled_platform_needs_its_secrets() {
        let e = Config::load_with_env(None, env(&[("ASSISTD_CHANNELS__SLACK__ENABLED", "true")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("channels.slack.signing_secret"), "{e}");
        let e = Config::load_with_env(
            None,
            env(&[
                ("ASSISTD_CHANNELS__TELEGRAM__ENABLED", "true"),
                ("ASSISTD_CHANNELS__TELEGRAM__BOT_TOKEN", "t"),
                ("ASSISTD_CHANNELS__TELEGRAM__SECRET_TOKEN", "s"),
                ("ASSISTD_CHANNELS__TELEGRAM__AGENT", "ghost"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("channels.telegram.agent"), "{e}");
    }

    #[test]
    fn file_overlays_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[llm]\nmodel = \"qwen\"\n[log]\nformat = \"json\"\n").unwrap();
        let c = Config::load_with_env(Some(&path), Vec::new()).unwrap();
        assert_eq!(c.llm.model, "qwen");
        assert_eq!(c.log.format, LogFormat::Json);
        assert_eq!(c.llm.timeout_secs, 60);
        std::fs::write(&path, "[log]\nformat = \"xml\"\n").unwrap();
        let e = Config::load_with_env(Some(&path), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("log.format"), "{e}");
    }
}
