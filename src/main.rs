//! The `assistd` command line: `serve` (default), `migrate`, `knowledge add` and
//! `rollups rebuild`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use assistd::config::Config;

#[derive(Parser)]
#[command(
    name = "assistd",
    version,
    about = "Durable AI assistant backend for chat platforms"
)]
struct Cli {
    /// TOML file laid over config/default.toml (environment variables still win).
    #[arg(long, global = true, env = "ASSISTD_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP server, workers, reply outbox and scheduler (the default).
    Serve {
        /// all, api (webhooks and APIs) or worker (workers, outbox, scheduler).
        #[arg(long, env = "ASSISTD_ROLE")]
        role: Option<assistd::config::Role>,
    },
    /// Apply database migrations and exit.
    Migrate,
    /// Knowledge bases (docs/knowledge.md).
    Knowledge {
        #[command(subcommand)]
        command: KnowledgeCommand,
    },
    /// The counts of finished tasks and replies behind /metrics (docs/operations.md).
    Rollups {
        #[command(subcommand)]
        command: RollupsCommand,
    },
}

#[derive(Subcommand)]
enum RollupsCommand {
    /// Count them again from the tasks and replies kept (after an upgrade or a repair).
    Rebuild,
}

#[derive(Subcommand)]
enum KnowledgeCommand {
    /// Add files to a collection (created when missing): folders are walked recursively
    /// (.txt, .md, .markdown, .html, .htm, .pdf); a file's id is its path as given or below the
    /// folder given, so adding it again replaces it.
    Add {
        /// The collection.
        name: String,
        /// Files and folders.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("assistd: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(Command::Serve { role: Some(role) }) = &cli.command {
        config.server.role = *role;
    }
    // One instance id for the exported spans and the leases (the fallback is random).
    config.worker.instance_id = config.instance_id();
    let telemetry = match assistd::telemetry::init(&config, &config.worker.instance_id) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("assistd: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("assistd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command.unwrap_or(Command::Serve { role: None }) {
            Command::Serve { .. } => serve(config).await,
            Command::Migrate => migrate(config).await,
            Command::Knowledge {
                command: KnowledgeCommand::Add { name, paths },
            } => add_knowledge(config, &name, &paths).await,
            Command::Rollups {
                command: RollupsCommand::Rebuild,
            } => rebuild_rollups(config).await,
        }
    });
    drop(runtime);
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("assistd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let app = assistd::App::build(config).await?;
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received; finishing work in flight");
        trigger.cancel();
    });
    app.run_until_stopped(shutdown).await
}

async fn rebuild_rollups(config: Config) -> anyhow::Result<()> {
    let store = assistd::store::Store::connect(&config.database).await?;
    store.migrate().await?;
    let started = std::time::Instant::now();
    store.rebuild_rollups().await?;
    let counts = store.metric_counts().await?;
    store.close().await;
    let tasks: i64 = counts.tasks_by_status.iter().map(|(_, n)| n).sum();
    println!(
        "rollups rebuilt in {:.1} s: {tasks} tasks counted",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn migrate(config: Config) -> anyhow::Result<()> {
    let store = assistd::store::Store::connect(&config.database).await?;
    store.migrate().await?;
    store.close().await;
    tracing::info!("migrations applied");
    Ok(())
}

async fn add_knowledge(config: Config, name: &str, paths: &[PathBuf]) -> anyhow::Result<()> {
    let store = assistd::store::Store::connect(&config.database).await?;
    store.migrate().await?;
    let llm = std::sync::Arc::new(assistd::llm::ModelClients::new(&config.llm)?);
    let knowledge =
        assistd::knowledge::Knowledge::new(store.clone(), std::sync::Arc::new(config), llm);
    let report =
        assistd::knowledge::add_files(&knowledge, name, paths, |line| println!("{line}")).await;
    store.close().await;
    let report = report?;
    println!(
        "{name}: {} added, {} replaced, {} unchanged, {} failed; {} chunks written",
        report.added, report.replaced, report.unchanged, report.failed, report.chunks
    );
    if report.failed > 0 {
        anyhow::bail!("{} file(s) could not be added", report.failed);
    }
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
