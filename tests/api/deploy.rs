//! The shipped Dockerfile and docker-compose.yml (issue 23): checked with a parser (there is
//! no Docker engine here; `check_deploy.py`, PyYAML), and the start-up the compose file
//! describes run with the real binary: two instances on one PostgreSQL, with the
//! environment compose would give them.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::binary::RealServer;
use crate::helpers::*;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/api/check_deploy.py");

fn check(dockerfile: &str, compose: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let (d, c) = (
        dir.path().join("Dockerfile"),
        dir.path().join("compose.yml"),
    );
    std::fs::write(&d, dockerfile).unwrap();
    std::fs::write(&c, compose).unwrap();
    let out = Command::new(crate::real_model::python())
        .arg(SCRIPT)
        .arg("check")
        .arg(&d)
        .arg(&c)
        .output()
        .expect("python3 with PyYAML (installed by .ci/run)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("ModuleNotFoundError"), "{text}");
    (out.status.success(), text)
}

fn shipped(name: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name)).unwrap()
}

/// The shipped files pass; each property the checker holds them to is also shown to fail
/// when broken (a default secret, no restart policy, root, no health check, no dependency
/// layer).
#[cfg_attr(
    not(assistd_has_yaml),
    ignore = "needs PyYAML (pip install 'pyyaml>=6,<7'); .ci/run installs it"
)]
#[test]
fn the_dockerfile_and_compose_file_hold_what_production_needs() {
    let (dockerfile, compose) = (shipped("Dockerfile"), shipped("docker-compose.yml"));
    let (ok, text) = check(&dockerfile, &compose);
    assert!(ok, "{text}");
    let planted: [(String, String, &str); 6] = [
        (
            dockerfile.clone(),
            compose.replace(
                "${ASSISTD_CHANNELS__GENERIC__SECRET:?",
                "${ASSISTD_CHANNELS__GENERIC__SECRET:-change-me}${X:?",
            ),
            "change-me",
        ),
        (
            dockerfile.clone(),
            compose.replace("restart: unless-stopped", "labels: {}"),
            "no restart policy",
        ),
        (
            dockerfile.replace("USER assistd", "USER root"),
            compose.clone(),
            "non-root USER",
        ),
        (
            dockerfile.replace("/readyz", "/"),
            compose.clone(),
            "HEALTHCHECK on /readyz",
        ),
        (
            dockerfile.replace("COPY Cargo.toml Cargo.lock ./", "COPY . ."),
            compose.clone(),
            "before the code",
        ),
        (
            dockerfile.clone(),
            compose.replace("\"127.0.0.1:8788:8787\"", "\"8788:8787\""),
            "beyond the host's loopback",
        ),
    ];
    for (d, c, problem) in planted {
        let (ok, text) = check(&d, &c);
        assert!(!ok && text.contains(problem), "{problem}: {text}");
    }
}

/// The environment compose gives `service`, for the values `vars`.
fn compose_env(service: &str, vars: &[(&str, &str)]) -> Result<Value, String> {
    let out = Command::new(crate::real_model::python())
        .arg(SCRIPT)
        .arg("env")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docker-compose.yml"))
        .arg(service)
        .args(vars.iter().map(|(k, v)| format!("{k}={v}")))
        .output()
        .unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// What `docker compose up` starts, without Docker: both instances with the environment
/// compose gives them (the database URL pointed at this test's PostgreSQL, the listen
/// address at loopback), waiting on /readyz as the health checks do. Each answers a signed
/// message, once. A required secret left unset stops the start-up, naming it. PostgreSQL
/// (the compose file's database) in every run: `ASSISTD_TEST_POSTGRES_URL`'s server, or a
/// private cluster.
#[cfg_attr(
    any(not(assistd_has_yaml), not(assistd_has_postgres_server)),
    ignore = "needs PyYAML (pip install 'pyyaml>=6,<7') and PostgreSQL (ASSISTD_TEST_POSTGRES_URL, or apt-get install postgresql); .ci/run installs both"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_start_up_runs_two_instances_on_one_postgres() {
    let refused = compose_env("assistd-1", &[("POSTGRES_PASSWORD", "pw")]).unwrap_err();
    assert!(
        refused.contains("ASSISTD_CHANNELS__GENERIC__SECRET"),
        "{refused}"
    );
    let model = echo_model().await;
    let receiver = accepting_receiver().await;
    let token = "t".repeat(40);
    let model_url = format!("{}/v1", model.uri());
    let reply_url = format!("{}/reply", receiver.uri());
    let vars = [
        ("POSTGRES_PASSWORD", "pw-from-env"),
        ("ASSISTD_ADMIN__TOKEN", token.as_str()),
        ("ASSISTD_CHANNELS__GENERIC__SECRET", SECRET),
        ("ASSISTD_LLM__BASE_URL", model_url.as_str()),
        ("ASSISTD_CHANNELS__GENERIC__REPLY_URL", reply_url.as_str()),
    ];
    let envs: Vec<Value> = ["assistd-1", "assistd-2"]
        .iter()
        .map(|s| compose_env(s, &vars).unwrap())
        .collect();
    assert_eq!(
        envs[0]["ASSISTD_DATABASE__URL"],
        "postgres://assistd:pw-from-env@postgres:5432/assistd"
    );
    assert_eq!(envs[1]["ASSISTD_WORKER__INSTANCE_ID"], "assistd-2");
    let db = TestDb::postgres().await;
    let workdir = tempfile::tempdir().unwrap();
    let mut servers = Vec::new();
    for env in &envs {
        let mut pairs: Vec<(String, String)> = env
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect();
        for (k, v) in pairs.iter_mut() {
            if k == "ASSISTD_DATABASE__URL" {
                *v = db.url.clone();
            }
        }
        servers.push(RealServer::start(&pairs, workdir.path()).await);
    }
    let http = reqwest::Client::new();
    for (n, server) in servers.iter().enumerate() {
        let resp = server
            .post_message(&message(&format!("compose{n}"), 1, "hello"))
            .await;
        assert_eq!(resp.status(), 200);
        let ready = http
            .get(format!("{}/readyz", server.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(ready.status(), 200, "the health check's URL");
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let replies = received_replies(&receiver).await;
        if replies.len() >= 2 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let replies = received_replies(&receiver).await;
            assert_eq!(replies.len(), 2, "each message answered once: {replies:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no replies from the two instances"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for server in servers {
        assert_eq!(server.terminate(), Some(0));
    }
    db.drop_db().await;
}
