//! Typed configuration: `config/default.toml` (compiled in) < `--config FILE` < `ASSISTD_*`
//! environment variables. Owns parsing and validation; every error names the offending key,
//! and nothing here touches the network or the database. `sections` holds the types,
//! `load` the layering, `validate` the checks, `error` the error and its small checks.

mod error;
mod knowledge;
mod load;
mod sections;
mod validate;

pub use error::ConfigError;
pub use knowledge::*;
pub use load::DEFAULT_TOML;
pub use sections::*;
