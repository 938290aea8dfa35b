//! A private PostgreSQL cluster for one test: for the tests that stop the server (an
//! outage) and for the PostgreSQL-only tests when no `ASSISTD_TEST_POSTGRES_URL` is given.
//! A test using it is compiled as ignored without a PostgreSQL server to start
//! (`assistd_has_postgres_server`, see build.rs).

use std::path::PathBuf;
use std::process::Command;

use crate::binary::free_port;

/// A PostgreSQL cluster of one test: `initdb` in a temporary folder, listening on a free
/// port of 127.0.0.1 with trust authentication. Run as the `postgres` user when the test
/// runs as root (the server refuses root). Stopped when dropped.
pub struct PrivateCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    /// More server options (`-c name=value …`), given at every start.
    options: String,
}

impl PrivateCluster {
    pub fn start() -> PrivateCluster {
        PrivateCluster::start_with("")
    }

    /// [`start`](Self::start) with more server options, e.g.
    /// `-c shared_preload_libraries=pg_stat_statements`.
    pub fn start_with(options: &str) -> PrivateCluster {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("a Debian PostgreSQL")
            .flatten()
            .map(|v| v.path().join("bin"))
            .filter(|b| b.join("initdb").exists())
            .max()
            .expect("initdb");
        let dir = tempfile::tempdir().unwrap();
        if is_root() {
            let owner = Command::new("id")
                .args(["-u", "postgres"])
                .output()
                .unwrap();
            let uid: u32 = String::from_utf8_lossy(&owner.stdout)
                .trim()
                .parse()
                .unwrap();
            std::os::unix::fs::chown(dir.path(), Some(uid), None).unwrap();
        }
        let cluster = PrivateCluster {
            dir,
            bin,
            port: free_port(),
            options: options.to_string(),
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        cluster.start_again();
        cluster
    }

    pub fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off {}",
            self.port,
            self.dir.path().display(),
            self.options
        );
        let log = self.dir.path().join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        );
    }

    pub fn stop(&self) {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
    }

    fn run(&self, program: &str, args: &[&str]) {
        let path = self.bin.join(program);
        let status = if is_root() {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&path)
                .args(args)
                .current_dir(self.dir.path())
                .status()
        } else {
            Command::new(&path)
                .args(args)
                .current_dir(self.dir.path())
                .status()
        }
        .unwrap_or_else(|e| panic!("{program}: {e}"));
        assert!(status.success(), "{program} {args:?} failed: {status}");
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let data = self.data();
        let path = self.bin.join("pg_ctl");
        let args = ["-D", data.as_str(), "-m", "immediate", "stop"];
        let _ = if is_root() {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&path)
                .args(args)
                .output()
        } else {
            Command::new(&path).args(args).output()
        };
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}
