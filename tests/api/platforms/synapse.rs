//! Against a real Matrix homeserver: Synapse (`matrix-synapse` from PyPI), started here on
//! 127.0.0.1 with its own SQLite database, assistd registered as its application service.
//! A user made through Synapse's client API opens a direct chat with the bot; Synapse pushes
//! the invite and the messages to assistd and takes every send, edit and typing notice from
//! it under its own rules (event size, relations, transaction ids). What the user's client
//! reads back is what the test checks: Markdown shown as `org.matrix.custom.html`
//! `formatted_body` beside a plain `body`, and an 80 KB streamed answer as numbered parts,
//! every event accepted under the homeserver's 65,536-byte limit.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wiremock::MockServer;

use super::long_answers::{check_parts_of, huge_answer};
use super::*;
use crate::strict_model::{ModelReply, model_mock};

const BOT: &str = "@assistd:localhost";
const MARKDOWN: &str = "**Travel** policy: book through [the portal](https://example.com/travel).\n\n- flights\n- hotels";

/// A Synapse homeserver in a temporary directory, killed when dropped.
struct Synapse {
    url: String,
    dir: PathBuf,
    child: tokio::process::Child,
    http: reqwest::Client,
}

impl Synapse {
    /// Starts Synapse on `port`, pushing to the application service at `appservice_url`.
    async fn start(port: u16, appservice_url: &str) -> Synapse {
        let python = std::env::var("ASSISTD_TEST_SYNAPSE").unwrap_or_else(|_| "python3".into());
        let dir = std::env::temp_dir().join(format!("assistd-synapse-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.display();
        std::fs::write(
            dir.join("appservice.yaml"),
            format!(
                "id: assistd\nurl: \"{appservice_url}\"\nas_token: \"as-token\"\n\
                 hs_token: \"{HS_TOKEN}\"\nsender_localpart: \"assistd\"\nrate_limited: false\n\
                 namespaces:\n  users: [{{exclusive: true, regex: \"@assistd:localhost\"}}]\n\
                 \x20 rooms: []\n  aliases: []\n"
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("log.yaml"),
            format!(
                "version: 1\nformatters: {{plain: {{format: '%(asctime)s %(levelname)s %(name)s %(message)s'}}}}\n\
                 handlers: {{file: {{class: logging.FileHandler, filename: {d}/homeserver.log, formatter: plain}}}}\n\
                 root: {{level: INFO, handlers: [file]}}\ndisable_existing_loggers: false\n"
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("homeserver.yaml"),
            format!(
                "server_name: localhost\npid_file: {d}/homeserver.pid\n\
                 listeners:\n  - port: {port}\n    bind_addresses: ['127.0.0.1']\n    type: http\n\
                 \x20   tls: false\n    x_forwarded: false\n    resources:\n      - names: [client]\n\
                 \x20       compress: false\n\
                 database:\n  name: sqlite3\n  args:\n    database: {d}/homeserver.db\n\
                 log_config: {d}/log.yaml\nmedia_store_path: {d}/media\n\
                 enable_registration: true\nenable_registration_without_verification: true\n\
                 report_stats: false\nmacaroon_secret_key: macaroon-test\nform_secret: form-test\n\
                 signing_key_path: {d}/localhost.signing.key\ntrusted_key_servers: []\n\
                 suppress_key_server_warning: true\nurl_preview_enabled: false\n\
                 app_service_config_files: [{d}/appservice.yaml]\n\
                 rc_message: {{per_second: 1000, burst_count: 1000}}\n\
                 rc_registration: {{per_second: 1000, burst_count: 1000}}\n"
            ),
        )
        .unwrap();
        let config = dir.join("homeserver.yaml");
        let keys = std::process::Command::new(&python)
            .args(["-m", "synapse.app.homeserver", "--generate-keys", "-c"])
            .arg(&config)
            .output()
            .expect("running Synapse");
        assert!(keys.status.success(), "{keys:?}");
        let child = tokio::process::Command::new(&python)
            .args(["-m", "synapse.app.homeserver", "-c"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("starting Synapse");
        let synapse = Synapse {
            url: format!("http://127.0.0.1:{port}"),
            dir,
            child,
            http: reqwest::Client::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let up = synapse
                .http
                .get(format!("{}/_matrix/client/versions", synapse.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if up {
                return synapse;
            }
            assert!(
                Instant::now() < deadline,
                "Synapse did not start: {}",
                synapse.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("homeserver.log")).unwrap_or_default();
        log.lines().rev().take(40).collect::<Vec<_>>().join("\n")
    }

    /// A client API call as the user holding `token`.
    async fn call(&self, token: &str, method: reqwest::Method, path: &str, body: Value) -> Value {
        let mut request = self
            .http
            .request(method.clone(), format!("{}{path}", self.url))
            .bearer_auth(token);
        if method != reqwest::Method::GET {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        assert!(status.is_success(), "{method} {path}: {status} {answer}");
        answer
    }

    /// Registers `user` and returns its access token.
    async fn register(&self, user: &str) -> String {
        let answer: Value = self
            .http
            .post(format!("{}/_matrix/client/v3/register", self.url))
            .json(
                &json!({"username": user, "password": "a-long-test-password",
                          "auth": {"type": "m.login.dummy"}}),
            )
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        answer["access_token"]
            .as_str()
            .unwrap_or_else(|| panic!("{answer}"))
            .to_string()
    }

    /// The room's latest `limit` events as `token`'s client reads them, oldest first.
    async fn events(&self, token: &str, room: &str, limit: usize) -> Vec<Value> {
        let path = format!(
            "/_matrix/client/v3/rooms/{}/messages?dir=b&limit={limit}",
            urlencoding(room)
        );
        let answer = self
            .call(token, reqwest::Method::GET, &path, Value::Null)
            .await;
        let mut events = answer["chunk"].as_array().cloned().unwrap_or_default();
        events.reverse();
        events
    }
}

impl Drop for Synapse {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn urlencoding(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// What each of the bot's messages finally shows, in the order they were sent: the content of
/// its last `m.replace` edit (`m.new_content`), else its own.
fn bot_messages(events: &[Value]) -> Vec<(String, Value)> {
    let from_bot = |e: &&Value| e["sender"] == BOT && e["type"] == "m.room.message";
    let mut shown: Vec<(String, Value)> = events
        .iter()
        .filter(from_bot)
        .filter(|e| e["content"]["m.relates_to"]["rel_type"] != "m.replace")
        .map(|e| {
            (
                e["event_id"].as_str().unwrap().to_string(),
                e["content"].clone(),
            )
        })
        .collect();
    for edit in events.iter().filter(from_bot) {
        let relation = &edit["content"]["m.relates_to"];
        if relation["rel_type"] != "m.replace" {
            continue;
        }
        if let Some((_, content)) = shown.iter_mut().find(|(id, _)| relation["event_id"] == *id) {
            *content = edit["content"]["m.new_content"].clone();
        }
    }
    shown
}

/// Waits for the task answering the `n`-th question (from 1) of `room` to be replied.
async fn answered(app: &TestApp, synapse: &Synapse, room: &str, n: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids = crate::platforms::groups::conversation_tasks(app, room).await;
        if let Some(id) = ids.get(n - 1) {
            return app.wait_replied(*id, Duration::from_secs(60)).await;
        }
        assert!(
            Instant::now() < deadline,
            "no task for question {n} in {room}: {}",
            synapse.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(assistd_has_synapse),
    ignore = "needs Synapse (pip install 'matrix-synapse==1.163.2', into the Python ASSISTD_TEST_SYNAPSE names); .ci/run installs it"
)]
async fn a_real_synapse_takes_formatted_answers_and_a_streamed_long_answer_in_parts() {
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        let question = crate::helpers::last_content(body);
        ModelReply::text(if question.contains("all of it") {
            huge_answer()
        } else {
            MARKDOWN.to_string()
        })
    })
    .mount(&model)
    .await;
    let port = crate::binary::free_port();
    let homeserver = format!("http://127.0.0.1:{port}");
    let app = TestApp::spawn_with(model, accepting_receiver().await, move |c| {
        enable_matrix(c, &homeserver);
        c.channels.matrix.bot_user_id = BOT.into();
        c.replies.stream_edit_ms = 60;
        c.replies.placeholder_after_ms = 0;
    })
    .await;
    let synapse = Synapse::start(port, &format!("{}/webhooks/matrix", app.addr)).await;
    let ada = synapse.register("ada").await;
    let created = synapse
        .call(
            &ada,
            reqwest::Method::POST,
            "/_matrix/client/v3/createRoom",
            json!({"preset": "trusted_private_chat", "is_direct": true, "invite": [BOT]}),
        )
        .await;
    let room = created["room_id"].as_str().unwrap().to_string();
    // The invite reaches assistd, which joins (and marks the room direct).
    let members = format!(
        "/_matrix/client/v3/rooms/{}/joined_members",
        urlencoding(&room)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while synapse
        .call(&ada, reqwest::Method::GET, &members, Value::Null)
        .await["joined"]
        .get(BOT)
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "the bot never joined: {}",
            synapse.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ask = async |n: usize, text: &str| {
        let path = format!(
            "/_matrix/client/v3/rooms/{}/send/m.room.message/ada-{n}",
            urlencoding(&room)
        );
        let body = json!({"msgtype": "m.text", "body": text});
        synapse.call(&ada, reqwest::Method::PUT, &path, body).await
    };

    // Markdown: shown as HTML, with the plain text beside it.
    ask(1, "what is the travel policy?").await;
    answered(&app, &synapse, &room, 1).await;
    let shown = bot_messages(&synapse.events(&ada, &room, 100).await);
    let (_, answer) = shown.last().expect("an answer from the bot");
    assert_eq!(answer["format"], "org.matrix.custom.html", "{answer}");
    let html = answer["formatted_body"].as_str().unwrap();
    assert!(html.contains("<strong>Travel</strong>"), "{html}");
    assert!(
        html.contains(r#"<a href="https://example.com/travel">the portal</a>"#),
        "{html}"
    );
    assert!(html.contains("<li>flights</li>"), "{html}");
    // Beside it, the Markdown as written (as Element sends it), for clients without HTML.
    assert_eq!(answer["body"], MARKDOWN);

    // An 80 KB answer, streamed: every part and edit taken by the homeserver, the parts
    // numbered and together the whole answer.
    let before = shown.len();
    ask(2, "the travel policy, all of it?").await;
    answered(&app, &synapse, &room, 2).await;
    let events = synapse.events(&ada, &room, 1000).await;
    // The limit is on the event as the homeserver keeps it (the federation format): what
    // a client is served beside it in `unsigned` (the bundled latest edit, in full since
    // MSC3925) is not part of it, and makes an edited event look twice its size.
    for event in &events {
        let mut kept = event.clone();
        kept.as_object_mut().unwrap().remove("unsigned");
        let size = kept.to_string().len();
        assert!(size <= 65_536, "{size} bytes: {kept}");
    }
    let texts: Vec<String> = bot_messages(&events)[before..]
        .iter()
        .map(|(_, content)| content["body"].as_str().unwrap().to_string())
        .collect();
    check_parts_of("synapse (streamed)", &huge_answer(), &texts, |t| {
        serde_json::to_string(t).unwrap().len() <= 30_000
    });
    drop(synapse);
    app.stop().await;
}
