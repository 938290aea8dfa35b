//! The benchmark harness keeps working: every scenario at a small N, on the test database's
//! dialect. Figures are printed, never asserted.

use std::process::Command;

#[test]
fn every_benchmark_scenario_runs_at_small_n() {
    let db = if std::env::var("ASSISTD_TEST_POSTGRES_URL").is_ok_and(|u| !u.is_empty()) {
        "postgres"
    } else {
        "sqlite"
    };
    let out = Command::new(env!("CARGO_BIN_EXE_assistd-bench"))
        .args([
            "all",
            "--db",
            db,
            "--n",
            "40",
            "--concurrency",
            "4",
            "--model-latency-ms",
            "100",
            "--stream-ms",
            "1500",
        ])
        .output()
        .expect("run assistd-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    for scenario in [
        "ingest",
        "end-to-end",
        "in-flight",
        "steps",
        "context",
        "recovery",
        "feedback",
        "mcp-steps",
    ] {
        assert!(
            stdout.contains(&format!("scenario={scenario} db={db}")),
            "{stdout}"
        );
    }
}
