//! `GET /metrics` as a Prometheus server reads it: every scrape here is parsed by the
//! Prometheus project's own OpenMetrics parser (`check_metrics.py`, prometheus-client from
//! PyPI), which refuses what a scraper would refuse, before any value is looked at.

use serde_json::Value;

use crate::helpers::*;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/api/check_metrics.py");
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A parsed exposition: `{family: {type, unit, samples: [[name, labels, value]]}}`.
pub struct Exposition(Value);

/// Runs the reference parser over `text`: the families, or what the parser said.
fn parse(text: &str) -> Result<Value, String> {
    crate::helpers::python_json(SCRIPT, text)
}

/// Fetches `/metrics` from `addr` and parses it; panics if a scraper would refuse it.
pub async fn scrape(addr: &str) -> Exposition {
    let resp = reqwest::get(format!("{addr}/metrics")).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], OPENMETRICS);
    let text = resp.text().await.unwrap();
    match parse(&text) {
        Ok(families) => Exposition(families),
        Err(e) => panic!("the OpenMetrics parser refused /metrics: {e}\n{text}"),
    }
}

impl Exposition {
    /// Every sample called `name`, with its labels.
    pub fn samples(&self, name: &str) -> Vec<(Value, f64)> {
        self.0
            .as_object()
            .unwrap()
            .values()
            .flat_map(|f| f["samples"].as_array().unwrap())
            .filter(|s| s[0] == name)
            .map(|s| (s[1].clone(), s[2].as_f64().unwrap()))
            .collect()
    }

    /// The value of the sample `name` whose labels are exactly `labels`.
    pub fn sample(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect();
        self.samples(name)
            .into_iter()
            .find(|(l, _)| l.as_object() == Some(&want))
            .map(|(_, v)| v)
    }

    /// A family's type and unit.
    pub fn family(&self, name: &str) -> (&str, &str) {
        let f = &self.0[name];
        (
            f["type"].as_str().unwrap_or("missing"),
            f["unit"].as_str().unwrap_or(""),
        )
    }
}

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

/// The reference parser is as strict as a scraper: the exposition the hand-written renderer
/// used to write (a counter family typed under its `_total` sample name, no `# EOF`) is
/// refused, so the checks below would catch a regression to it.
#[cfg_attr(
    not(assistd_has_prometheus),
    ignore = "needs Python's prometheus-client (pip install 'prometheus-client>=0.20,<1'); .ci/run installs it"
)]
#[test]
fn the_parser_refuses_what_a_scraper_refuses() {
    let good = "# TYPE a counter\na_total 1\n# EOF\n";
    assert!(parse(good).is_ok());
    for bad in [
        "# TYPE a counter\na_total 1\n",
        "# TYPE a_total counter\na_total 1\n# EOF\n",
        "# TYPE a gauge\na{x=\"un\"closed\"} 1\n# EOF\n",
    ] {
        assert!(parse(bad).is_err(), "accepted:\n{bad}");
    }
}

#[cfg_attr(
    not(assistd_has_prometheus),
    ignore = "needs Python's prometheus-client (pip install 'prometheus-client>=0.20,<1'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_exposed_in_openmetrics_format() {
    let (app, _) = crate::dashboard::seeded().await;
    let m = scrape(&app.addr).await;
    let task = |status| m.sample("assistd_tasks", &[("status", status)]);
    assert_eq!(task("SUCCEEDED"), Some(3.0), "{m:?}");
    assert_eq!(task("FAILED"), Some(3.0));
    assert_eq!(
        m.sample("assistd_task_failures", &[("failure_type", "AUTH_FAILED")]),
        Some(2.0)
    );
    assert_eq!(
        m.sample("assistd_replies", &[("status", "SENT")]),
        Some(6.0)
    );
    assert_eq!(m.family("assistd_tasks"), ("gauge", ""));
    assert_eq!(m.family("assistd_webhook_requests"), ("counter", ""));
    for histogram in [
        "assistd_model_call_seconds",
        "assistd_step_seconds",
        "assistd_recovery_seconds",
    ] {
        assert_eq!(m.family(histogram), ("histogram", "seconds"), "{m:?}");
    }
    assert!(
        m.sample("assistd_step_seconds_bucket", &[("le", "+Inf")])
            .unwrap()
            >= 6.0
    );
    // Webhook counters are per process, and tests share one: at least this test's six.
    let webhooks = m
        .sample(
            "assistd_webhook_requests_total",
            &[("channel", "generic"), ("status", "200")],
        )
        .unwrap_or(0.0);
    assert!(webhooks >= 6.0, "{m:?}");
    app.stop().await;
}

/// The standard process families, read from this process (`metrics-process`).
#[cfg_attr(
    not(assistd_has_prometheus),
    ignore = "needs Python's prometheus-client (pip install 'prometheus-client>=0.20,<1'); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_metrics_describe_this_process() {
    let app = TestApp::spawn().await;
    let m = scrape(&app.addr).await;
    let value = |name| {
        m.sample(name, &[])
            .unwrap_or_else(|| panic!("{name}: {m:?}"))
    };
    assert_eq!(m.family("process_cpu_seconds"), ("counter", "seconds"));
    assert!(value("process_cpu_seconds_total") > 0.0);
    let rss = value("process_resident_memory_bytes");
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    // The same process, read moments apart: within a factor of two of /proc's own figure.
    assert!(
        rss > kib * 1024.0 / 2.0 && rss < kib * 1024.0 * 2.0,
        "{rss} vs {kib} KiB"
    );
    let started = value("process_start_time_seconds");
    let now = assistd::domain::now_ms() as f64 / 1000.0;
    assert!(started <= now && started > now - 86_400.0, "{started}");
    assert!(value("process_threads") >= 2.0);
    assert!(value("process_open_fds") >= 1.0);
    assert!(value("process_max_fds") >= value("process_open_fds"));
    app.stop().await;
}
