//! assistd: durable AI assistant replies for chat platforms.
//!
//! A webhook commits a message and its task; a worker answers it with a journalled model
//! call; the outbox posts exactly one reply. See README.md and docs/.

pub mod agents;
pub mod app;
pub mod backoff;
pub mod channels;
pub mod config;
pub mod control;
pub mod definition;
pub mod domain;
pub mod engine;
pub mod http;
pub mod intake;
pub mod knowledge;
pub mod llm;
pub mod metrics;
pub mod outbox;
pub mod redaction;
pub mod reports;
pub mod scheduler;
pub mod store;
pub mod telemetry;
pub mod templating;
pub mod tools;
pub mod wake;

pub use app::App;
pub use config::Config;
