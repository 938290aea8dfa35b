//! What one model call in flight costs the HTTP client alone: a child process (this binary,
//! `connections-child`) holds N chat-completion requests open against the mock model with
//! a reqwest client built as assistd builds its model client, and its resident memory is
//! read before and while they are open. Set against `in-flight`'s memory per task, the rest
//! is what assistd itself holds per task.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use crate::harness::*;
use crate::*;

pub(crate) async fn connections(args: &Args) -> anyhow::Result<()> {
    let n = args.n.max(1);
    // Long enough for every request to be open at once when the memory is read.
    let mocks = start_mocks(Duration::from_millis(args.model_latency_ms.max(5_000))).await?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("connections-child")
        .arg("--n")
        .arg(n.to_string())
        .env(
            "ASSISTD_BENCH_MODEL_URL",
            format!("http://{}/v1/chat/completions", mocks.addr),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    // The child's runtime and client are up once it waits on its input.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = child.id();
    let baseline = rss_kib(pid, "VmRSS:");
    if let Some(stdin) = child.stdin.as_mut() {
        stdin.write_all(b"go\n")?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while mocks.max_in_flight.load(Ordering::Relaxed) < n {
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!(
                "only {} of {n} requests open",
                mocks.max_in_flight.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let open = rss_kib(pid, "VmRSS:");
    let _ = child.kill();
    let _ = child.wait();
    mocks.stop.cancel();
    println!(
        "scenario=connections db={} n={n} baseline_rss={:.1}MiB open_rss={:.1}MiB rss_per_open_request={:.1}KiB",
        db_name(args.db),
        baseline as f64 / 1024.0,
        open as f64 / 1024.0,
        open.saturating_sub(baseline) as f64 / n as f64
    );
    Ok(())
}

/// The child: waits for a line on its input, then sends `n` chat completions at once and
/// waits for the answers.
pub(crate) async fn child(args: &Args) -> anyhow::Result<()> {
    let url = std::env::var("ASSISTD_BENCH_MODEL_URL")?;
    // As `llm::OpenAiClient` builds its client.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .connect_timeout(Duration::from_secs(10))
        .build()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..args.n {
        let (http, url) = (http.clone(), url.clone());
        calls.spawn(async move {
            let body = json!({"model": "bench", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": format!("question {i}")}]});
            http.post(&url).json(&body).send().await?.bytes().await
        });
    }
    while let Some(done) = calls.join_next().await {
        done??;
    }
    Ok(())
}
