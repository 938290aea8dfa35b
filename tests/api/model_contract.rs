//! The model path against the chat-completions contract: the strict double's own refusals,
//! tools and tool_choice reaching the model, several calls in one answer, the last turn of a
//! loop, context windows, and providers per agent.

use std::time::Duration;

use serde_json::{Value, json};
use wiremock::matchers::{header, method, query_param};
use wiremock::{Mock, MockServer, Request};

use crate::helpers::*;
use crate::workflows::{AGENT_LOOP, calls_to, spawn_flow_scripted};

async fn post_to(model: &MockServer, body: Value) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", model.uri()))
        .json(&body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn lookup_tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_strict_double_refuses_what_providers_refuse() {
    let model = MockServer::start().await;
    model_mock(|body: &Value| {
        if body["messages"][0]["content"] == "call ghost" {
            ModelReply::calls(&[("ghost", json!({}))])
        } else {
            ModelReply::text("fine")
        }
    })
    .mount(&model)
    .await;
    let call = json!({"id": "c1", "type": "function", "function": {"name": "lookup_a", "arguments": "{}"}});
    let refused = [
        (
            "a tool message answering no call",
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c9", "content": "{}"}]}),
        ),
        (
            "an assistant tool_calls turn without its tool messages",
            json!({"model": "m", "tools": [lookup_tool("lookup_a")], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": "and?"}]}),
        ),
        (
            "an unknown role",
            json!({"model": "m", "messages": [{"role": "robot", "content": "q"}]}),
        ),
        (
            "null assistant content (llama.cpp)",
            json!({"model": "m", "tools": [lookup_tool("lookup_a")], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "{}"}]}),
        ),
        (
            "tool_choice without tools",
            json!({"model": "m", "tool_choice": "auto", "messages": [{"role": "user", "content": "q"}]}),
        ),
        (
            "tool_choice naming an undeclared function",
            json!({"model": "m", "tools": [lookup_tool("lookup_a")], "tool_choice": {"type": "function", "function": {"name": "lookup_b"}}, "messages": [{"role": "user", "content": "q"}]}),
        ),
        (
            "an unknown request field",
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}], "functions_please": true}),
        ),
    ];
    for (what, body) in refused {
        let (status, text) = post_to(&model, body).await;
        assert_eq!(status, 400, "{what}: {text}");
        assert!(text.contains("invalid_request_error"), "{what}: {text}");
    }
    // The same conversation with its tool message in place is accepted.
    let (status, text) = post_to(
        &model,
        json!({"model": "m", "tools": [lookup_tool("lookup_a")], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "{}"}]}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["content"], "fine");
    // A script calling a tool the request did not declare is a bug in the test, not an answer.
    let (status, text) = post_to(
        &model,
        json!({"model": "m", "tools": [lookup_tool("lookup_a")], "messages": [{"role": "user", "content": "call ghost"}]}),
    )
    .await;
    assert_eq!(status, 500);
    assert!(
        text.contains("strict model double") && text.contains("ghost"),
        "{text}"
    );
}

/// Calls every tool in one answer, then answers with what they said.
pub struct ParallelCalls;

impl ModelScript for ParallelCalls {
    fn reply(&self, _request: &Request, body: &Value) -> ModelReply {
        let results: Vec<String> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| m["content"].as_str().unwrap().to_string())
            .collect();
        if results.is_empty() {
            return ModelReply::calls(&[
                ("lookup_a", json!({"q": "one"})),
                ("lookup_b", json!({"q": "two"})),
                ("lookup_c", json!({"q": "three"})),
            ]);
        }
        ModelReply::text(format!("got {}", results.len()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_tool_calls_in_one_answer_are_each_journalled_and_run_once() {
    let flow = spawn_flow_scripted(AGENT_LOOP, ParallelCalls, |_| {}).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("mc-par", 1, "all at once")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], "got 3");
    let steps: Vec<(String, String)> = task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["idempotency_key"].as_str().unwrap().to_string(),
                s["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let keys: Vec<String> = ["1:llm", "2:lookup_a", "3:lookup_b", "4:lookup_c", "5:llm"]
        .iter()
        .map(|k| format!("{id}:{k}"))
        .collect();
    assert_eq!(steps.iter().map(|s| s.0.clone()).collect::<Vec<_>>(), keys);
    assert!(steps.iter().all(|s| s.1 == "SUCCEEDED"), "{steps:?}");
    for p in ["/tools/a", "/tools/b", "/tools/c"] {
        assert_eq!(calls_to(&flow.tools, "GET", p).await, 1, "{p}");
    }
    // One assistant turn with three calls, then one tool message per call, in order.
    let last = model_bodies(&app.model).await.pop().unwrap();
    let messages = last["messages"].as_array().unwrap();
    let calls = messages[2]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 3);
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(messages[3 + i]["role"], "tool");
        assert_eq!(messages[3 + i]["tool_call_id"], call["id"]);
    }
    flow.app.stop().await;
}

/// Calls a tool whenever it may (like a model that never tires of tools).
fn always_calls(body: &Value) -> ModelReply {
    if body.get("tools").is_none() {
        return ModelReply::text("summary: looked things up");
    }
    match body["tool_choice"].clone() {
        Value::String(s) if s == "none" => ModelReply::text("what I found so far"),
        Value::Object(o) => {
            let name = o["function"]["name"].as_str().unwrap().to_string();
            ModelReply::calls(&[(name, json!({"q": "forced"}))])
        }
        _ => ModelReply::calls(&[("lookup_b", json!({"q": "again"}))]),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_forces_the_first_turn_and_max_steps_ends_with_an_answer() {
    let workflow = r#"{"start": "loop", "nodes": [
      {"id": "loop", "type": "agent", "prompt": "{{ message.text }}", "tools": ["lookup_a", "lookup_b"], "tool_choice": "lookup_a", "max_steps": 2, "next": "done"},
      {"id": "done", "type": "reply", "text": "{{ steps.loop.text }}"}]}"#;
    let flow = spawn_flow_scripted(workflow, always_calls, |_| {}).await;
    let app = &flow.app;
    let id = task_id_of(app.post_message(&message("mc-choice", 1, "go")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], "what I found so far");
    let sent = model_bodies(&app.model).await;
    // max_steps turns, a rolling summary (no tools), then one turn that may not call.
    let turns: Vec<&Value> = sent.iter().filter(|b| b.get("tools").is_some()).collect();
    assert_eq!(turns.len(), 3, "{sent:#?}");
    assert_eq!(
        turns[0]["tool_choice"],
        json!({"type": "function", "function": {"name": "lookup_a"}})
    );
    assert!(
        turns[1].get("tool_choice").is_none(),
        "later turns are auto: {}",
        turns[1]
    );
    assert_eq!(turns[2]["tool_choice"], "none");
    assert_eq!(calls_to(&flow.tools, "GET", "/tools/a").await, 1);
    assert_eq!(calls_to(&flow.tools, "GET", "/tools/b").await, 1);
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_answer_is_a_failure_notice_or_the_fallback_never_an_empty_message() {
    let model = MockServer::start().await;
    model_mock(|_: &Value| ModelReply::text(""))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |_| {}).await;
    let id = task_id_of(app.post_message(&message("mc-empty", 1, "hello?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "FAILED");
    assert_eq!(task["failure_type"], "INVALID_RESPONSE");
    let replies = app.replies().await;
    assert_eq!(replies.len(), 1);
    assert!(
        replies[0].1["text"]
            .as_str()
            .unwrap()
            .contains("INVALID_RESPONSE")
    );
    let (db, model, receiver) = app.stop_keeping_db().await;
    db.drop_db().await;
    // With a fallback text the chat gets that instead.
    let app = TestApp::spawn_with(model, receiver, |c| {
        c.agents.get_mut("default").unwrap().fallback_text = "Sorry, I have no answer.".into();
    })
    .await;
    let id = task_id_of(app.post_message(&message("mc-empty2", 1, "hello?")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED");
    let replies = app.replies().await;
    assert_eq!(
        replies.last().unwrap().1["text"],
        "Sorry, I have no answer."
    );
    app.stop().await;
}

/// A model that answers at length (300 bytes), as a small model does until max_tokens.
fn long_echo(body: &Value) -> ModelReply {
    let n = body["messages"].as_array().unwrap().len();
    ModelReply::text(format!("answer {n}: {}", "blah ".repeat(60)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_fits_the_model_context_window() {
    // The model's server has 512 tokens; so does the configured window.
    let model = MockServer::start().await;
    strict_mock(StrictModel::new(long_echo).with_context_window(512))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.llm.context_window = 512;
        let agent = c.agents.get_mut("default").unwrap();
        agent.max_tokens = 128;
    })
    .await;
    let mut ids = Vec::new();
    for n in 1..=4 {
        let id = task_id_of(
            app.post_message(&message(
                "mc-window",
                n,
                &format!("question {n} {}", "word ".repeat(20)),
            ))
            .await,
        )
        .await;
        let task = app.wait_replied(id, WAIT).await;
        assert_eq!(task["status"], "SUCCEEDED", "message {n}: {task:#}");
        ids.push(id);
    }
    // History was sent, cut to the window: the last request holds earlier turns, but not all.
    let last = model_bodies(&app.model).await.pop().unwrap();
    let turns = last["messages"].as_array().unwrap().len();
    assert!(turns > 2 && turns < 8, "{turns} messages: {last:#}");
    app.stop().await;
}

/// Answers of 10,000 characters, as a chatty model gives them; a history summary is short.
fn ten_thousand_characters(body: &Value) -> ModelReply {
    let asked = body["messages"][1]["content"].as_str().unwrap_or("");
    if asked.starts_with("Conversation so far:") || asked.starts_with("Summary so far:") {
        return ModelReply::text(format!("summary of {} bytes", asked.len()));
    }
    ModelReply::text(format!(
        "answer: {}",
        "the report shows growth ".repeat(417)
    ))
}

/// A team chat whose answers run to 10,000 characters, on an 8,192-token server: the older
/// turns folded into a summary are the newest that fit the summary call's window, so the
/// call is not refused (it was sent every older turn, 40 KB by the fifth question) and the
/// answer is given the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_summary_is_asked_within_the_model_context_window() {
    let model = MockServer::start().await;
    strict_mock(StrictModel::new(ten_thousand_characters).with_context_window(8192))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.llm.context_window = 8192;
        c.agents.get_mut("default").unwrap().max_tokens = 3000;
    })
    .await;
    let mut last = 0;
    for n in 1..=5 {
        let question = format!("question {n}: how did the quarter go?");
        last = task_id_of(app.post_message(&message("mc-long", n, &question)).await).await;
        let task = app.wait_replied(last, WAIT).await;
        assert_eq!(task["status"], "SUCCEEDED", "message {n}");
    }
    let steps = app.store().task_steps(last).await.unwrap();
    let kinds: Vec<(&str, &str)> = steps
        .iter()
        .map(|s| (s.tool_name.as_str(), s.status.as_str()))
        .collect();
    assert_eq!(kinds, [("summary", "SUCCEEDED"), ("chat", "SUCCEEDED")]);
    let asked = steps[0].input.as_deref().unwrap();
    assert!(
        asked.len() < 8192 * 3,
        "summary request of {} bytes",
        asked.len()
    );
    // Each answer outgrows the budget alone, so each message folds the last exchange into
    // the summary the previous message made (carried over, not asked again from scratch).
    let asked: Value = serde_json::from_str(asked).unwrap();
    let transcript = asked["messages"][1]["content"].as_str().unwrap();
    assert!(
        transcript.starts_with("Summary so far:\nsummary of")
            && transcript.contains("\nConversation since:\nuser: question 4"),
        "{}",
        transcript.chars().take(100).collect::<String>()
    );
    let chat = model_bodies(&app.model).await.pop().unwrap();
    let given = chat["messages"][1]["content"].as_str().unwrap();
    assert!(
        given.starts_with("Summary of the earlier conversation:\nsummary of"),
        "{}",
        given.chars().take(100).collect::<String>()
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_too_long_answer_is_retried_once_with_the_question_alone() {
    // The configured window (8192) overstates the server's (200): the model refuses.
    let model = MockServer::start().await;
    strict_mock(StrictModel::new(long_echo).with_context_window(200))
        .mount(&model)
        .await;
    let app = TestApp::spawn_with(model, accepting_receiver().await, |c| {
        c.agents.get_mut("default").unwrap().max_tokens = 64;
    })
    .await;
    let first = task_id_of(
        app.post_message(&message("mc-ctl", 1, "first question"))
            .await,
    )
    .await;
    assert_eq!(app.wait_replied(first, WAIT).await["status"], "SUCCEEDED");
    let second = task_id_of(
        app.post_message(&message("mc-ctl", 2, "second question"))
            .await,
    )
    .await;
    let task = app.wait_replied(second, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    let steps = task["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2, "{steps:#?}");
    assert_eq!(steps[0]["idempotency_key"], format!("{second}:1:chat"));
    assert_eq!(steps[0]["status"], "FAILED");
    assert!(
        steps[0]["error"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
    assert_eq!(
        steps[1]["idempotency_key"],
        format!("{second}:2:chat_shrunk")
    );
    assert_eq!(steps[1]["status"], "SUCCEEDED");
    let last = model_bodies(&app.model).await.pop().unwrap();
    assert_eq!(
        last["messages"].as_array().unwrap().len(),
        2,
        "system and the question"
    );
    let replies = app.replies().await;
    let answer = replies
        .iter()
        .find(|(k, _)| *k == format!("agent-task-{second}"))
        .unwrap();
    assert!(answer.1["text"].as_str().unwrap().starts_with("answer 2:"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_on_a_named_provider_calls_that_provider() {
    let default_model = echo_model().await;
    let azure = MockServer::start().await;
    Mock::given(method("POST"))
        .and(wiremock::matchers::path(
            "/openai/deployments/gpt/chat/completions",
        ))
        .and(header("api-key", "azure-key"))
        .and(query_param("api-version", "2024-10-21"))
        .and(header("x-team", "support"))
        .respond_with(StrictModel::new(|b: &Value| {
            ModelReply::text(format!("azure says hi to {}", b["model"].as_str().unwrap()))
        }))
        .mount(&azure)
        .await;
    let azure_uri = azure.uri();
    let app = TestApp::spawn_with(default_model, accepting_receiver().await, move |c| {
        c.llm.providers.insert(
            "azure".into(),
            assistd::config::LlmProviderConfig {
                base_url: format!("{azure_uri}/openai/deployments/gpt"),
                api_key: "azure-key".into(),
                api_key_header: "api-key".into(),
                model: "gpt-4o".into(),
                timeout_secs: 5,
                context_window: 128_000,
                headers: [("x-team".to_string(), "support".to_string())].into(),
                query: [("api-version".to_string(), "2024-10-21".to_string())].into(),
                max_concurrency: 0,
            },
        );
        c.agents.get_mut("default").unwrap().provider = "azure".into();
    })
    .await;
    let id = task_id_of(app.post_message(&message("mc-prov", 1, "hi")).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], "azure says hi to gpt-4o");
    assert!(
        app.model.received_requests().await.unwrap().is_empty(),
        "the default provider was not called"
    );
    let sent = azure.received_requests().await.unwrap();
    assert!(
        sent[0].headers.get("authorization").is_none(),
        "the key goes in api-key only"
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    app.stop().await;
}

/// The keys and statuses of a task's steps, `step_no:name STATUS`, without the task id.
fn step_list(task: &Value) -> Vec<String> {
    task["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let key = s["idempotency_key"].as_str().unwrap();
            let key = key.split_once(':').unwrap().1;
            format!("{key} {}", s["status"].as_str().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_node_refused_as_too_long_is_asked_again_with_its_prompt_cut() {
    let workflow = r#"{"start": "ask", "nodes": [
      {"id": "ask", "type": "llm", "prompt": "Summarise: {{ message.text }}", "next": "done"},
      {"id": "done", "type": "reply", "text": "{{ steps.ask.text }}"}]}"#;
    let model = MockServer::start().await;
    strict_mock(StrictModel::new(|_: &Value| ModelReply::text("short")).with_context_window(200))
        .mount(&model)
        .await;
    let flow = crate::workflows::spawn_flow_on(workflow, model, |c| {
        c.llm.context_window = 200;
        c.agents.get_mut("flow").unwrap().max_tokens = 64;
    })
    .await;
    let app = &flow.app;
    let long = format!("start {} end", "lorem ipsum ".repeat(100));
    let id = task_id_of(app.post_message(&message("mc-cut", 1, &long)).await).await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(step_list(&task), ["1:llm FAILED", "2:llm SUCCEEDED"]);
    assert!(
        task["steps"][0]["error"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
    let sent = model_bodies(&app.model).await;
    let cut = sent[1]["messages"][1]["content"].as_str().unwrap();
    assert!(
        cut.starts_with("Summarise: start") && cut.ends_with(" end"),
        "{cut}"
    );
    assert!(
        cut.contains("bytes cut to fit the model's context window"),
        "{cut}"
    );
    assert_eq!(app.replies().await[0].1["text"], "short");
    flow.app.stop().await;
}

/// The three-lookup agent loop on a model server of 250 tokens (the strict double), with
/// `max_tokens` 64, no periodic summaries, and `context_window` configured when given;
/// returns the flow and its finished, replied task.
async fn agent_loop_on_a_250_token_server(window: Option<u32>) -> (crate::workflows::Flow, Value) {
    let model = MockServer::start().await;
    strict_mock(
        StrictModel::new(crate::workflows::ToolScriptModel::default()).with_context_window(250),
    )
    .mount(&model)
    .await;
    let flow = crate::workflows::spawn_flow_on(AGENT_LOOP, model, |c| {
        if let Some(tokens) = window {
            c.llm.context_window = tokens;
        }
        c.context.summary_every_steps = 100;
        c.agents.get_mut("flow").unwrap().max_tokens = 64;
    })
    .await;
    let app = &flow.app;
    let id = task_id_of(
        app.post_message(&message("mc-window", 1, "find things"))
            .await,
    )
    .await;
    let task = app.wait_replied(id, WAIT).await;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    (flow, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_loop_refused_as_too_long_folds_its_rounds_into_a_summary_and_goes_on() {
    // The configured window (8192) overstates the server's: only the refusal tells.
    let (flow, task) = agent_loop_on_a_250_token_server(None).await;
    assert_eq!(
        task["result"], "found alpha, beta, gamma",
        "nothing lost in the fold"
    );
    let steps = step_list(&task);
    let refused = steps
        .iter()
        .position(|s| s.ends_with(":llm FAILED"))
        .expect("a refused turn");
    assert!(
        steps[refused + 1].ends_with(":summary SUCCEEDED"),
        "{steps:?}"
    );
    assert!(steps[refused + 2].ends_with(":llm SUCCEEDED"), "{steps:?}");
    for p in ["/tools/a", "/tools/b", "/tools/c"] {
        assert_eq!(calls_to(&flow.tools, "GET", p).await, 1, "{p}");
    }
    flow.app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_loop_summarises_before_it_outgrows_the_configured_window() {
    // Less than the server has: the loop's own budget decides when to summarise.
    let (flow, task) = agent_loop_on_a_250_token_server(Some(120)).await;
    assert_eq!(task["result"], "found alpha, beta, gamma");
    let steps = step_list(&task);
    assert!(
        steps.iter().all(|s| s.ends_with("SUCCEEDED")),
        "never refused: {steps:?}"
    );
    assert!(
        steps.iter().any(|s| s.contains(":summary ")),
        "summarised for the window: {steps:?}"
    );
    flow.app.stop().await;
}
