//! One function per scenario: ingest, end-to-end, in-flight, recovery, steps and context.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;

use assistd::config::Role;

use crate::harness::*;
use crate::*;

pub(crate) async fn ingest(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    // Intake only: no workers competing for the database.
    let server = start_server(bench_config(&db.url, &mocks, Role::Api, 256)?).await?;
    let started = Instant::now();
    let mut latencies = send_messages(server.addr, args.n, args.concurrency, "ingest").await?;
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    println!(
        "scenario=ingest db={} n={} concurrency={} rate={:.0}/s p50={:.2}ms p99={:.2}ms",
        db_name(args.db),
        args.n,
        args.concurrency,
        args.n as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99)
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

pub(crate) async fn end_to_end(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let server = start_server(bench_config(&db.url, &mocks, Role::All, 256)?).await?;
    let started = Instant::now();
    send_messages(server.addr, args.n, args.concurrency, "e2e").await?;
    wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed();
    println!(
        "scenario=end-to-end db={} n={} concurrency={} rate={:.0}/s wall={:.2}s \
         shortest_reply_bytes={} model_calls={} model_refusals={}",
        db_name(args.db),
        args.n,
        args.concurrency,
        args.n as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        mocks.shortest_reply.load(Ordering::Relaxed),
        mocks.model_calls.load(Ordering::Relaxed),
        mocks.model_refusals.load(Ordering::Relaxed)
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

/// `n` messages sent to a child `assistd` (so its memory is measured alone: the mock model,
/// which holds a connection per call, and the load generator stay in this process) with
/// `concurrency` worker slots and the `extra` settings, until every one is answered.
struct ChildRun {
    db: BenchDb,
    mocks: Mocks,
    started: Instant,
    /// Until the last webhook was answered, and until the last reply.
    ingest: Duration,
    wall: Duration,
    acks: Vec<Duration>,
    /// The child's resident memory before the messages, and at its peak (KiB).
    baseline_kib: u64,
    peak_kib: u64,
}

impl ChildRun {
    async fn run(
        args: &Args,
        concurrency: usize,
        extra: &[(&str, String)],
        prefix: &str,
    ) -> anyhow::Result<ChildRun> {
        let db = BenchDb::new(args.db).await?;
        let mocks = start_mocks(Duration::from_millis(args.model_latency_ms)).await?;
        let port = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await?
            .local_addr()?
            .port();
        let mut child = spawn_child(
            &db.url,
            &mocks,
            port,
            0,
            concurrency,
            None,
            "bench-child",
            extra,
        )?;
        wait_ready(port).await?;
        let pid = child.id();
        let baseline_kib = rss_kib(pid, "VmRSS:");
        let started = Instant::now();
        let addr = format!("127.0.0.1:{port}").parse()?;
        let mut acks = send_messages(addr, args.n, args.concurrency, prefix).await?;
        let ingest = started.elapsed();
        acks.sort_unstable();
        wait_replies(&mocks, args.n, Duration::from_secs(3600)).await?;
        let wall = started.elapsed();
        let peak_kib = rss_kib(pid, "VmHWM:");
        let _ = child.kill();
        let _ = child.wait();
        Ok(ChildRun {
            db,
            mocks,
            started,
            ingest,
            wall,
            acks,
            baseline_kib,
            peak_kib,
        })
    }

    async fn finish(self) {
        self.mocks.stop.cancel();
        self.db.drop_db().await;
    }
}

pub(crate) async fn in_flight(args: &Args) -> anyhow::Result<()> {
    let run = ChildRun::run(args, args.n.max(1), &[], "inflight").await?;
    let (mocks, in_flight) = (&run.mocks, run.mocks.max_in_flight.load(Ordering::Relaxed));
    println!(
        "scenario=in-flight db={} n={} model_latency={}ms wall={:.2}s ingest={:.2}s ack_p50={:.2}ms ack_p99={:.2}ms last_call={:.2}s first_reply={:.2}s max_in_flight={} baseline_rss={:.1}MiB peak_rss={:.1}MiB rss_per_task={:.1}KiB",
        db_name(args.db),
        args.n,
        args.model_latency_ms,
        run.wall.as_secs_f64(),
        run.ingest.as_secs_f64(),
        percentile(&run.acks, 0.50),
        percentile(&run.acks, 0.99),
        mocks.mark_after(&mocks.last_call_ms, run.started),
        mocks.mark_after(&mocks.first_reply_ms, run.started),
        in_flight,
        run.baseline_kib as f64 / 1024.0,
        run.peak_kib as f64 / 1024.0,
        // Per task actually in flight at the peak, not per message sent.
        run.peak_kib.saturating_sub(run.baseline_kib) as f64 / in_flight.max(1) as f64
    );
    run.finish().await;
    Ok(())
}

/// `n` tasks queued at once behind a provider that takes 64 calls at once (`[llm]
/// max_concurrency = 64`), in a child `assistd` with 256 worker slots: the drain time against
/// the ideal `n × latency / 64`, the most calls the model had at once, and the child's
/// resident memory while the tasks wait queued in the database.
pub(crate) async fn provider_limit(args: &Args) -> anyhow::Result<()> {
    const LIMIT: usize = 64;
    let limit = [("ASSISTD_LLM__MAX_CONCURRENCY", LIMIT.to_string())];
    let run = ChildRun::run(args, 256, &limit, "limited").await?;
    let ideal = args.model_latency_ms as f64 / 1000.0 * args.n as f64 / LIMIT as f64;
    println!(
        "scenario=provider-limit db={} n={} limit={LIMIT} model_latency={}ms wall={:.2}s ideal={:.2}s wall_over_ideal={:.2} ingest={:.2}s max_in_flight={} baseline_rss={:.1}MiB peak_rss={:.1}MiB",
        db_name(args.db),
        args.n,
        args.model_latency_ms,
        run.wall.as_secs_f64(),
        ideal,
        run.wall.as_secs_f64() / ideal,
        run.ingest.as_secs_f64(),
        run.mocks.max_in_flight.load(Ordering::Relaxed),
        run.baseline_kib as f64 / 1024.0,
        run.peak_kib as f64 / 1024.0,
    );
    run.finish().await;
    Ok(())
}

pub(crate) async fn recovery(args: &Args) -> anyhow::Result<()> {
    for (signal, grace) in [("KILL", 0u64), ("TERM", 0u64)] {
        let db = BenchDb::new(args.db).await?;
        // The model answers slowly enough that every task is in flight when the process dies.
        let mocks = start_mocks(Duration::from_millis(args.model_latency_ms.max(5_000))).await?;
        let port = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await?
            .local_addr()?
            .port();
        let mut child = spawn_child(&db.url, &mocks, port, grace, 4096, None, "bench-child", &[])?;
        wait_ready(port).await?;
        send_messages(
            format!("127.0.0.1:{port}").parse()?,
            args.n,
            args.concurrency,
            "rec",
        )
        .await?;
        wait_calls(&mocks, args.n, Duration::from_secs(300)).await?;
        let _ = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status();
        let _ = child.wait();
        let calls_before = mocks.model_calls.load(Ordering::Relaxed);
        let logs = tempfile::tempdir()?;
        let log = logs.path().join("restarted.log");
        let restarted = Instant::now();
        let mut child = spawn_child(
            &db.url,
            &mocks,
            port,
            grace,
            4096,
            Some(&log),
            "bench-child",
            &[],
        )?;
        wait_ready(port).await?;
        let ready = restarted.elapsed();
        // When 90 % of the tasks were running again: a late tail points at the claim loop's
        // fallback poll, a late start at the restart itself.
        let most = calls_before + args.n * 9 / 10;
        wait_calls(&mocks, most, Duration::from_secs(300)).await?;
        let most_resumed = restarted.elapsed();
        wait_calls(&mocks, calls_before + args.n, Duration::from_secs(300)).await?;
        let resumed = restarted.elapsed();
        wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
        let done = restarted.elapsed();
        println!(
            "scenario=recovery db={} signal=SIG{signal} n={} ready={:.3}s all_resumed={:.3}s all_done={:.3}s",
            db_name(args.db),
            args.n,
            ready.as_secs_f64(),
            resumed.as_secs_f64(),
            done.as_secs_f64()
        );
        if resumed > Duration::from_secs(1) {
            let warnings = std::fs::read_to_string(&log).unwrap_or_default();
            eprintln!(
                "recovery: resuming took over 1 s; 90 % were running again after {:.3}s; the \
                 restarted child logged {} warning or error line(s):",
                most_resumed.as_secs_f64(),
                warnings.lines().count()
            );
            for line in warnings.lines().take(20) {
                eprintln!("  {line}");
            }
        }
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let _ = child.wait();
        mocks.stop.cancel();
        db.drop_db().await;
    }
    Ok(())
}

pub(crate) async fn steps(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let (server, _dir) = tool_chain_server(&db, &mocks, WORKFLOW_STEPS).await?;
    let started = Instant::now();
    send_messages(server.addr, args.n, args.concurrency, "steps").await?;
    wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed();
    let journalled = args.n * WORKFLOW_STEPS;
    // The same steps over the journal's own window: first step begun to last step finished
    // (without the ingest before and the replies after).
    let (finished, span_ms) = server.worker.store.finished_steps_span().await?;
    println!(
        "scenario=steps db={} n={} steps_per_task={WORKFLOW_STEPS} rate={:.0} steps/s tasks={:.0}/s wall={:.2}s journal_window={:.2}s journal_rate={:.0} steps/s",
        db_name(args.db),
        args.n,
        journalled as f64 / elapsed.as_secs_f64(),
        args.n as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        span_ms as f64 / 1000.0,
        finished as f64 * 1000.0 / span_ms.max(1) as f64,
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}

/// Steps journalled by the task whose resume the context scenario measures.
pub(crate) const CONTEXT_STEPS: usize = 150;

/// Runs one task of 150 tool steps to the end, then rebuilds its resume state from the
/// database `n` times (capped at 1,000): load task, message, agent snapshot and journal,
/// parse the workflow and replay every journalled step, as a resume does before executing.
pub(crate) async fn context(args: &Args) -> anyhow::Result<()> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let (server, _dir) = tool_chain_server(&db, &mocks, CONTEXT_STEPS).await?;
    send_messages(server.addr, 1, 1, "context").await?;
    wait_replies(&mocks, 1, Duration::from_secs(120)).await?;
    let svc = server.worker.clone();
    let tasks = svc.store.list_tasks(None, None, 1).await?;
    let task_id = tasks
        .first()
        .map(|t| t.id)
        .context("the task was not found")?;
    let rounds = args.n.clamp(1, 1000);
    let mut times = Vec::with_capacity(rounds);
    let mut replayed = 0;
    for _ in 0..rounds {
        let started = Instant::now();
        replayed = assistd::engine::workflow::runner::replay(&svc, task_id).await?;
        times.push(started.elapsed());
    }
    anyhow::ensure!(
        replayed == CONTEXT_STEPS as i64,
        "replayed {replayed} of {CONTEXT_STEPS} steps"
    );
    times.sort();
    println!(
        "scenario=context db={} steps={replayed} rounds={rounds} p50={:.2}ms p99={:.2}ms max={:.2}ms",
        db_name(args.db),
        percentile(&times, 0.50),
        percentile(&times, 0.99),
        times.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
    );
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok(())
}
