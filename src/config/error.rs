//! The configuration error, naming the offending key, and the small checks that make one.

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

pub(super) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

pub(super) fn positive(key: &str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(invalid(key, "must be greater than 0"));
    }
    Ok(())
}

pub(super) fn http_url(key: &str, value: &str) -> Result<(), ConfigError> {
    if crate::channels::platform::is_http_url(value) {
        Ok(())
    } else {
        Err(invalid(key, format!("`{value}` is not an http(s) URL")))
    }
}
