//! A real headless Chromium, driven over WebDriver (chromedriver, through the `fantoccini`
//! client), using the admin pages and the console as a person would. CI installs Debian's
//! `chromium` and `chromium-driver`; elsewhere the test is skipped with a message when they
//! are missing (never under CI=true). Screenshots go to `target/screenshots/`, which
//! `.ci/run` keeps in `ci-artefacts/screenshots/`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

use crate::helpers::*;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A headless Chromium session over WebDriver, through `fantoccini` (chromedriver is
/// started and stopped with it).
struct Browser {
    client: Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session. The tests using it are compiled
    /// only where build.rs found both (else ignored, `assistd_has_chromium`).
    async fn start() -> Browser {
        Self::start_in("UTC").await
    }

    /// As `start`, the browser in time zone `tz` (its `TZ`).
    async fn start_in(tz: &str) -> Browser {
        assert!(
            std::path::Path::new(CHROMIUM).exists() && std::path::Path::new(CHROMEDRIVER).exists(),
            "{CHROMIUM} or {CHROMEDRIVER} is gone since build.rs found them: install them again, \
             or probe again (ASSISTD_TEST_PROBE=$(date +%s) cargo test)"
        );
        let port = crate::binary::free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .env("TZ", tz)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": CHROMIUM,
                "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--disable-quic", "--no-first-run", "--disable-background-networking",
                         "--disable-component-update", "--disable-sync", "--window-size=1280,1000",
                         format!("--user-data-dir={}", profile.path().display())]
            }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&base)
            .await
            .expect("a Chromium session");
        Browser {
            client,
            driver,
            _profile: profile,
        }
    }

    async fn goto(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    /// Waits for the element matching `css`, up to 10 s.
    async fn find(&self, css: &str) -> fantoccini::elements::Element {
        match self
            .client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
        {
            Ok(element) => element,
            Err(e) => {
                let url = self.client.current_url().await.map(|u| u.to_string());
                let source = self.client.source().await.unwrap_or_default();
                panic!(
                    "no element {css} on {url:?}: {e} {}",
                    &source[..source.len().min(600)]
                );
            }
        }
    }

    /// The element's text; found again when the page replaced it between finding and
    /// reading (a stale element: the console re-renders the answer as it streams in).
    async fn text(&self, css: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.find(css).await.text().await {
                Ok(text) => return text,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("reading {css} again: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("cannot read {css}: {e}"),
            }
        }
    }

    async fn attribute(&self, css: &str, name: &str) -> String {
        self.find(css)
            .await
            .attr(name)
            .await
            .unwrap()
            .unwrap_or_default()
    }

    async fn type_into(&self, css: &str, text: &str) {
        self.find(css).await.send_keys(text).await.unwrap();
    }

    /// Clicks the element; found again when the page replaced it between finding and
    /// clicking.
    async fn click(&self, css: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.find(css).await.click().await {
                Ok(()) => return,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("clicking {css} again: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("cannot click {css}: {e}"),
            }
        }
    }

    /// Waits until the page's URL satisfies `pred` (a navigation has happened), up to 10 s.
    async fn wait_url(&self, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let url = self.client.current_url().await.unwrap().to_string();
            if pred(&url) {
                return url;
            }
            assert!(Instant::now() < deadline, "stayed on {url}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the text of `css` satisfies `pred`, up to 20 s, reloading when asked.
    async fn wait_text(
        &self,
        css: &str,
        reload: Option<&str>,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let t = self.text(css).await;
            if pred(&t) {
                return t;
            }
            assert!(Instant::now() < deadline, "{css} stayed `{t}`");
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Some(url) = reload {
                self.goto(url).await;
            }
        }
    }

    /// A PNG of the page in `target/screenshots/` (CI keeps them as artefacts).
    async fn screenshot(&self, name: &str) {
        if let Ok(png) = self.client.screenshot().await {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(dir.join(format!("{name}.png")), png);
        }
    }

    async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

#[cfg_attr(
    not(assistd_has_chromium),
    ignore = "needs Chromium (apt-get install chromium chromium-driver); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_resumes_a_failed_task_and_a_newcomer_chats_in_a_real_browser() {
    let browser = Browser::start().await;
    let model = model_failing_first(2, "bad key").await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let mut failed = Vec::new();
    for n in 0..2 {
        let id = task_id_of(
            app.post_message(&message(&format!("br{n}"), 1, "will fail"))
                .await,
        )
        .await;
        app.wait_replied(id, WAIT).await;
        failed.push(id);
    }
    let ok = task_id_of(app.post_message(&message("br-ok", 1, "fine")).await).await;
    app.wait_replied(ok, WAIT).await;

    // Sign in and read the counts of the seeded data.
    browser.goto(&format!("{}/admin", app.addr)).await;
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#login").await;
    assert_eq!(browser.text("#total-tasks").await, "3");
    assert_eq!(browser.text("#failures-AUTH_FAILED").await, "2");
    browser.screenshot("admin-dashboard").await;

    // Drill down to a failed task and resume it.
    browser.click("#failures-AUTH_FAILED").await;
    browser
        .click(&format!("a[href='/admin/tasks/{}']", failed[0]))
        .await;
    assert_eq!(browser.text("#status").await, "FAILED");
    browser.click("#resume").await;
    let url = format!("{}/admin/tasks/{}", app.addr, failed[0]);
    browser
        .wait_text("#status", Some(&url), |s| s == "SUCCEEDED")
        .await;
    browser.screenshot("admin-task-resumed").await;

    // The console: type a message and see the answer.
    browser.goto(&format!("{}/", app.addr)).await;
    browser.type_into("#text", "hello from the browser").await;
    browser.click("#submit").await;
    // The answer streams in (shown with a trailing " …" while the task runs), then stands.
    let answer = browser
        .wait_text(".answer", None, |t| {
            t.starts_with("answer to:") && !t.ends_with(" …")
        })
        .await;
    assert_eq!(answer, "answer to: hello from the browser");
    browser.screenshot("console").await;
    browser.close().await;
    app.stop().await;
}

/// Issue 23 in a real browser: with the reply receiver down the dashboard shows the answer
/// pending and the backlog, not a success; the admin presses "Retry now" once the receiver
/// is back and the answer counts as delivered. Times are shown in the browser's own zone
/// (here Asia/Tokyo, UTC+9), UTC kept as their tooltip.
#[cfg_attr(
    not(assistd_has_chromium),
    ignore = "needs Chromium (apt-get install chromium chromium-driver); .ci/run installs it"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_sees_an_undelivered_answer_and_retries_it_in_a_real_browser() {
    let browser = Browser::start_in("Asia/Tokyo").await;
    let (app, id, reply) = crate::dashboard::an_answer_the_receiver_refused().await;

    browser.goto(&format!("{}/admin", app.addr)).await;
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#login").await;
    assert_eq!(browser.text("#answers-pending").await, "1");
    assert_eq!(browser.text("#answers-delivered").await, "0");
    assert_eq!(browser.text("#backlog").await, "1");
    assert_eq!(browser.text("#success-rate").await, "0.0 %");
    assert!(browser.text("#stuck-replies").await.contains("503"));
    browser.screenshot("admin-delivery-pending").await;

    receiver_accepts_again(&app.receiver).await;
    browser.click(&format!("#retry-{reply}")).await;
    assert!(
        browser
            .text("#delivery-message")
            .await
            .contains("being sent again"),
    );
    app.wait_replied(id, WAIT).await;
    let dashboard = format!("{}/admin", app.addr);
    browser
        .wait_text("#answers-delivered", Some(&dashboard), |t| t == "1")
        .await;
    assert_eq!(browser.text("#success-rate").await, "100.0 %");
    // The trend chart: bars, a scale from 0 to its highest bar, the window's ends, a legend.
    let bars = browser
        .client
        .find_all(fantoccini::Locator::Css("#trend rect"))
        .await
        .unwrap();
    assert!(!bars.is_empty());
    assert_eq!(browser.text("#chart-max").await, "1");
    assert!(!browser.text("#chart-from").await.is_empty());
    assert!(!browser.text("#chart-to").await.is_empty());
    assert!(browser.text("#chart-legend").await.contains("not answered"));
    // Tokens per agent and model (no price set for the test model: no cost).
    let tokens = browser.text("#tokens-by-agent-model").await;
    assert!(
        tokens.contains("test-model") && tokens.contains("no price set"),
        "{tokens}"
    );
    browser.screenshot("admin-delivery-retried").await;

    // A count link keeps the dashboard's filters (chosen in its selects).
    browser
        .click("#channel-filter option[value='generic']")
        .await;
    browser.click("form.card button[type='submit']").await;
    browser.click("a.count").await;
    let url = browser.client.current_url().await.unwrap().to_string();
    assert!(
        url.contains("channel=generic") && url.contains("since="),
        "{url}"
    );
    browser.find(&format!("a[href='/admin/tasks/{id}']")).await;

    // The task list: times in the viewer's zone (UTC as the tooltip), and a search.
    browser.goto(&format!("{}/admin/tasks", app.addr)).await;
    let shown = browser.text("#tasks time").await;
    let utc = browser.attribute("#tasks time", "title").await;
    assert!(shown.contains("GMT+9"), "{shown}");
    assert!(utc.ends_with(" UTC"), "{utc}");
    browser.type_into("#q", "HELLO").await;
    browser.click("#search").await;
    browser.wait_url(|u| u.contains("q=HELLO")).await;
    browser.find(&format!("a[href='/admin/tasks/{id}']")).await;

    // Paging: one task a page; "Older tasks" keeps the filters and the page size.
    let newer = task_id_of(
        app.post_message(&message("paging", 1, "write to ops@example.com"))
            .await,
    )
    .await;
    let paged = format!("{}/admin/tasks?channel=generic&limit=1", app.addr);
    browser.goto(&paged).await;
    browser
        .find(&format!("a[href='/admin/tasks/{newer}']"))
        .await;
    let rows = || async {
        let links = browser
            .client
            .find_all(fantoccini::Locator::Css("#tasks a.task-link"))
            .await
            .unwrap();
        links.len()
    };
    assert_eq!(rows().await, 1);
    browser.click("#older").await;
    let url = browser.wait_url(|u| u.contains("before=")).await;
    assert!(
        url.contains("channel=generic") && url.contains("limit=1"),
        "{url}"
    );
    browser.find(&format!("a[href='/admin/tasks/{id}']")).await;
    assert_eq!(rows().await, 1);
    // The last page offers no page after it.
    let more = browser
        .client
        .find_all(fantoccini::Locator::Css("#older"))
        .await
        .unwrap();
    assert!(more.is_empty(), "an older page after the oldest task");
    browser.screenshot("admin-tasks-older-page").await;

    // The task page redacts; "Show raw" shows the text as sent (and is audited).
    browser
        .goto(&format!("{}/admin/tasks/{newer}", app.addr))
        .await;
    let shown = browser.text("main").await;
    assert!(
        shown.contains("[email]") && !shown.contains("ops@example.com"),
        "{shown}"
    );
    browser.click("#show-raw").await;
    browser.find("#raw-banner").await;
    assert!(browser.text("main").await.contains("ops@example.com"));
    browser.screenshot("admin-task-raw").await;
    browser.close().await;
    app.stop().await;
}
