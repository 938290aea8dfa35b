//! Instances sharing one database: end-to-end with one `assistd` child and with two, the
//! webhooks split between them, alternating, three pairs, a fresh database each round.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::*;

/// One round: `count` children on one fresh database, `n` messages split between them.
struct Round {
    rate: f64,
    /// CPU milliseconds per message: the assistd children, this process (load generator,
    /// mock model and receiver) and PostgreSQL's processes.
    cpu: [f64; 3],
    /// Distinct replies (one per message answered) and deliveries that repeated a key.
    answered: usize,
    repeated: usize,
}

pub(crate) async fn instances(args: &Args) -> anyhow::Result<()> {
    let mut one = Vec::new();
    let mut two = Vec::new();
    // ASSISTD_BENCH_INSTANCE_COUNTS=2 (say) runs only those rounds, for profiling one.
    let counts: Vec<usize> = std::env::var("ASSISTD_BENCH_INSTANCE_COUNTS")
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2]);
    for pair in 0..3 {
        for &count in &counts {
            let round = round(args, count).await?;
            println!(
                "scenario=instances db={} n={} pair={} instances={count} rate={:.0}/s answered={} repeated_deliveries={} cpu_ms_per_msg assistd={:.3} harness={:.3} postgres={:.3}",
                db_name(args.db),
                args.n,
                pair + 1,
                round.rate,
                round.answered,
                round.repeated,
                round.cpu[0],
                round.cpu[1],
                round.cpu[2],
            );
            if count == 1 { &mut one } else { &mut two }.push(round);
            if counts.len() == 1 {
                return Ok(());
            }
        }
    }
    let median = |rounds: &[Round]| {
        let mut rates: Vec<f64> = rounds.iter().map(|r| r.rate).collect();
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    };
    let (one_rate, two_rate) = (median(&one), median(&two));
    let unanswered: usize = one.iter().chain(&two).map(|r| args.n - r.answered).sum();
    let repeated: usize = one.iter().chain(&two).map(|r| r.repeated).sum();
    println!(
        "scenario=instances db={} n={} median_one={one_rate:.0}/s median_two={two_rate:.0}/s two_over_one={:.2} unanswered={unanswered} repeated_deliveries={repeated}",
        db_name(args.db),
        args.n,
        two_rate / one_rate
    );
    Ok(())
}

async fn round(args: &Args, count: usize) -> anyhow::Result<Round> {
    // ASSISTD_BENCH_SECOND_ROLE=api: every child after the first runs that role
    // (`server.role`), e.g. webhooks only, so one instance claims and finishes every task
    // (instances taking turns at the workers' statements; issue 35 part 3). Checked here: a
    // child refusing its configuration would only show as "did not become ready" 30 s later,
    // and before the database and mocks exist, so a refusal leaves none behind.
    let later_role = std::env::var("ASSISTD_BENCH_SECOND_ROLE").ok();
    if let Some(role) = &later_role {
        anyhow::ensure!(
            ["all", "api", "worker"].contains(&role.as_str()),
            "ASSISTD_BENCH_SECOND_ROLE must be all, api or worker, not {role:?}"
        );
    }
    let db = BenchDb::new(args.db).await?;
    let mocks = match start_mocks(Duration::ZERO).await {
        Ok(mocks) => mocks,
        Err(e) => {
            db.drop_db().await;
            return Err(e);
        }
    };
    let mut children = Vec::new();
    // A child that fails to start (or to be pinned, or to become ready) ends the round, and
    // what it had started (children, mocks, the database) goes with it.
    let started = start_children(count, &db, &mocks, later_role.as_deref(), &mut children).await;
    let addrs = match started {
        Ok(addrs) => addrs,
        Err(e) => {
            stop_round(children, &mocks, &db).await;
            return Err(e);
        }
    };
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let cpu_before = cpu_now(&pids);
    let started = Instant::now();
    let sent = send_messages_to(&addrs, args.n, args.concurrency, "inst").await;
    let waited = match sent {
        Ok(_) => wait_replies(&mocks, args.n, Duration::from_secs(600)).await,
        Err(e) => Err(e),
    };
    let elapsed = started.elapsed();
    let cpu_after = cpu_now(&pids);
    // A second reply for a message would come after its first: give it time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_round(children, &mocks, &db).await;
    waited?;
    let answered = mocks.reply_keys.lock().unwrap().len();
    let per_message = |i: usize| (cpu_after[i] - cpu_before[i]) / args.n as f64;
    Ok(Round {
        rate: args.n as f64 / elapsed.as_secs_f64(),
        cpu: [per_message(0), per_message(1), per_message(2)],
        answered,
        repeated: mocks.repeated_replies.load(Ordering::Relaxed),
    })
}

/// Ends a round, measured or failed: its children killed and reaped, its mocks stopped,
/// its database dropped.
async fn stop_round(children: Vec<std::process::Child>, mocks: &Mocks, db: &BenchDb) {
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    mocks.stop.cancel();
    db.drop_db().await;
}

/// Starts `count` instances on `db` against `mocks` (pushed to `children` as they start, so
/// the caller stops them whatever happens) and waits for each to be ready; their addresses.
async fn start_children(
    count: usize,
    db: &BenchDb,
    mocks: &Mocks,
    later_role: Option<&str>,
    children: &mut Vec<std::process::Child>,
) -> anyhow::Result<Vec<SocketAddr>> {
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for i in 0..count {
        let port = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await?
            .local_addr()?
            .port();
        let instance = format!("bench-{}", i + 1);
        let extra: Vec<(&str, String)> = match later_role {
            Some(role) if i > 0 => vec![("ASSISTD_SERVER__ROLE", role.to_string())],
            _ => Vec::new(),
        };
        children.push(spawn_child(
            &db.url, mocks, port, 0, 256, None, &instance, &extra,
        )?);
        // ASSISTD_BENCH_PIN=1: each child on its own core (child i on core i mod the
        // cores), for checking the capacity model's separate machines as far as one allows.
        if std::env::var_os("ASSISTD_BENCH_PIN").is_some() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let pid = children.last().map_or(0, |c| c.id());
            let pinned = std::process::Command::new("taskset")
                .args(["-pc", &(i % cores).to_string(), &pid.to_string()])
                .stdout(std::process::Stdio::null())
                .status()?;
            anyhow::ensure!(pinned.success(), "taskset could not pin the child");
        }
        wait_ready(port).await?;
        addrs.push(format!("127.0.0.1:{port}").parse()?);
    }
    Ok(addrs)
}

/// CPU milliseconds used so far by `children`, by this process, and by the processes named
/// `postgres` (the cluster's backends and its background processes; a backend that exited
/// meanwhile is not counted, and the children keep their connections to the end).
fn cpu_now(children: &[u32]) -> [f64; 3] {
    let assistd = children.iter().map(|&pid| cpu_ms(pid)).sum();
    let postgres = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "postgres")
        })
        .map(cpu_ms)
        .sum();
    [assistd, cpu_ms(std::process::id()), postgres]
}

/// User and system CPU time of `pid` in milliseconds (`/proc/<pid>/stat`, at Linux's usual
/// 100 ticks a second); 0 when it cannot be read.
fn cpu_ms(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime: fields 14 and 15 of the line, counted from the pid as 1.
    (ticks(11) + ticks(12)) * 10.0
}
