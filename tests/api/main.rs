//! Integration tests: the real HTTP app against a real database (SQLite, or PostgreSQL when
//! ASSISTD_TEST_POSTGRES_URL is set), with mock model and reply receiver.

mod helpers;

mod admin_pages;
mod approvals;
mod bench_smoke;
mod big_outputs;
mod binary;
mod browser;
mod conformance;
mod control;
mod crash;
mod dashboard;
mod declines;
mod deploy;
mod examples;
mod jobs;
mod knowledge;
mod knowledge_hybrid;
mod knowledge_ingest;
mod knowledge_recall;
mod knowledge_workflow;
mod lifecycle;
mod mcp;
mod metrics;
mod model_contract;
mod model_failures;
mod outage;
mod pipeline;
mod placeholder_crash;
mod platforms;
mod poison;
mod progress;
mod providers;
mod real_model;
mod reply_delivery;
mod scheduler;
mod secrets;
mod security;
mod strict_embeddings;
mod strict_model;
mod telemetry;
mod webhook_errors;
mod workflow_crash;
mod workflow_history;
mod workflows;
