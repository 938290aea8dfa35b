//! The `feedback` scenario (issue 20): `n` conversations at once, the model streaming 50
//! tokens over `--stream-ms`; per platform (Telegram, which shows typing, and Slack, which
//! shows a placeholder), the time from the webhook to the first thing the chat shows, and
//! the platform calls per answer (messages created, edits).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use assistd::config::Role;

use crate::harness::*;
use crate::*;

const TG_TOKEN: &str = "1:bench";
const TG_SECRET: &str = "bench-tg-secret";
const SLACK_SECRET: &str = "bench-slack-secret";
const TOKENS: usize = 50;

/// What one chat saw: its first platform call, messages created, edits, typing calls.
#[derive(Default, Clone)]
struct ChatCalls {
    first: Option<Instant>,
    creates: u32,
    edits: u32,
    answered: bool,
}

type Chats = Arc<Mutex<HashMap<String, ChatCalls>>>;

/// The streaming model and both platforms' APIs on one listener.
async fn start_api(
    stream: Duration,
    chats: Chats,
    stop: CancellationToken,
) -> anyhow::Result<std::net::SocketAddr> {
    let every = stream / TOKENS as u32;
    let record = move |chats: &Chats, chat: String, kind: &str, text: &str| {
        let mut chats = chats.lock().unwrap_or_else(|p| p.into_inner());
        let c = chats.entry(chat).or_default();
        c.first.get_or_insert_with(Instant::now);
        match kind {
            "create" => c.creates += 1,
            "edit" => c.edits += 1,
            _ => {}
        }
        if text.ends_with("end.") {
            c.answered = true;
        }
    };
    let (tg, slack) = (chats.clone(), chats);
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(move |body: axum::Json<Value>| async move {
                let events = (0..TOKENS)
                    .map(move |i| {
                        let piece = if i + 1 == TOKENS { "end.".to_string() } else { format!("w{i} ") };
                        json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": null}]})
                    })
                    .chain([json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": TOKENS, "total_tokens": 10 + TOKENS}})])
                    .map(|c| format!("data: {c}\n\n"))
                    .chain(["data: [DONE]\n\n".to_string()]);
                if body["stream"] != true {
                    tokio::time::sleep(stream).await;
                    return axum::response::Response::builder()
                        .header("content-type", "application/json")
                        .body(axum::body::Body::from(json!({"choices": [{"index": 0, "message": {"role": "assistant",
                            "content": "whole answer end."}, "finish_reason": "stop"}]}).to_string()))
                        .unwrap_or_default();
                }
                let events = futures_util::stream::iter(events).then(move |e| async move {
                    tokio::time::sleep(every).await;
                    Ok::<_, std::convert::Infallible>(e)
                });
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(axum::body::Body::from_stream(events))
                    .unwrap_or_default()
            }),
        )
        .route(
            "/{bot}/{method}",
            post(move |axum::extract::Path((_, method)): axum::extract::Path<(String, String)>, body: axum::Json<Value>| {
                let chats = tg.clone();
                async move {
                    let chat = body["chat_id"].as_str().unwrap_or("").to_string();
                    let text = body["text"].as_str().unwrap_or("");
                    let kind = match method.as_str() {
                        "sendMessage" => "create",
                        "editMessageText" => "edit",
                        _ => "typing",
                    };
                    record(&chats, chat, kind, text);
                    axum::Json(json!({"ok": true, "result": {"message_id": 7, "date": 1, "chat": {"id": 1}}}))
                }
            }),
        )
        .route(
            "/slack/{method}",
            post(move |axum::extract::Path(method): axum::extract::Path<String>, body: axum::Json<Value>| {
                let chats = slack.clone();
                async move {
                    let chat = body["channel"].as_str().unwrap_or("").to_string();
                    let text = body["text"].as_str().unwrap_or("");
                    let kind = if method == "chat.update" { "edit" } else { "create" };
                    record(&chats, chat, kind, text);
                    axum::Json(json!({"ok": true, "ts": "1.1"}))
                }
            }),
        );
    let listener = assistd::app::listen("127.0.0.1:0", 4096)?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
    });
    Ok(addr)
}

use futures_util::StreamExt;

pub(crate) async fn feedback(args: &Args) -> anyhow::Result<()> {
    for platform in ["telegram", "slack"] {
        let db = BenchDb::new(args.db).await?;
        let mocks = start_mocks(Duration::ZERO).await?;
        let chats: Chats = Arc::default();
        let stop = CancellationToken::new();
        let stream = Duration::from_millis(args.stream_ms);
        let api = start_api(stream, chats.clone(), stop.clone()).await?;
        let mut c = bench_config(&db.url, &mocks, Role::All, args.n.max(1))?;
        c.llm.base_url = format!("http://{api}/v1");
        c.channels.telegram.enabled = true;
        c.channels.telegram.bot_token = TG_TOKEN.into();
        c.channels.telegram.secret_token = TG_SECRET.into();
        c.channels.telegram.api_base_url = format!("http://{api}");
        c.channels.slack.enabled = true;
        c.channels.slack.signing_secret = SLACK_SECRET.into();
        c.channels.slack.bot_token = "xoxb-bench".into();
        c.channels.slack.bot_user_id = "UBOT".into();
        c.channels.slack.api_base_url = format!("http://{api}/slack");
        let server = start_server(c).await?;
        let sent = send(platform, server.addr, args.n, args.concurrency).await?;
        let deadline = Instant::now() + stream * 3 + Duration::from_secs(120);
        loop {
            let done = chats
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .filter(|c| c.answered)
                .count();
            if done >= args.n {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {done} of {} answered",
                args.n
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Let the last edits land before counting.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let chats = chats.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut firsts: Vec<Duration> = sent
            .iter()
            .filter_map(|(chat, at)| {
                chats
                    .get(chat)
                    .and_then(|c| c.first)
                    .map(|f| f.saturating_duration_since(*at))
            })
            .collect();
        firsts.sort_unstable();
        let creates: Vec<u32> = chats.values().map(|c| c.creates).collect();
        let edits: Vec<u32> = chats.values().map(|c| c.edits).collect();
        println!(
            "scenario=feedback db={} platform={platform} n={} stream={}ms first_feedback_p50={:.0}ms first_feedback_p99={:.0}ms creates_per_answer_max={} edits_per_answer_mean={:.1} edits_per_answer_max={}",
            db_name(args.db),
            args.n,
            args.stream_ms,
            percentile(&firsts, 0.50),
            percentile(&firsts, 0.99),
            creates.iter().max().unwrap_or(&0),
            edits.iter().sum::<u32>() as f64 / edits.len().max(1) as f64,
            edits.iter().max().unwrap_or(&0),
        );
        server.stop().await;
        stop.cancel();
        mocks.stop.cancel();
        db.drop_db().await;
    }
    Ok(())
}

/// Sends one question per conversation on `platform`; returns each chat with the time its
/// webhook was sent.
async fn send(
    platform: &str,
    addr: std::net::SocketAddr,
    n: usize,
    concurrency: usize,
) -> anyhow::Result<Vec<(String, Instant)>> {
    let http = reqwest::Client::new();
    let sent = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (http, sent, next, platform) = (
            http.clone(),
            sent.clone(),
            next.clone(),
            platform.to_string(),
        );
        clients.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, anyhow::Error>(());
                }
                let (chat, request) = if platform == "telegram" {
                    let chat = format!("-{}", 1000 + i);
                    let update = json!({"update_id": i, "message": {"message_id": 1, "date": 1,
                        "from": {"id": 5, "is_bot": false, "first_name": "B"},
                        "chat": {"id": -(1000 + i as i64), "type": "private"}, "text": format!("question {i}")}});
                    let request = http
                        .post(format!("http://{addr}/webhooks/telegram"))
                        .header("X-Telegram-Bot-Api-Secret-Token", TG_SECRET)
                        .json(&update);
                    (chat, request)
                } else {
                    let chat = format!("C{i}");
                    let event = json!({"token": "x", "team_id": "T", "api_app_id": "A", "type": "event_callback",
                        "event_id": format!("Ev{i}"), "event_time": 1, "event": {"type": "app_mention",
                        "user": "U1", "text": format!("<@UBOT> question {i}"), "ts": format!("{i}.1"), "channel": chat}});
                    let raw = serde_json::to_vec(&event)?;
                    let ts = (assistd::domain::now_ms() / 1000).to_string();
                    let sig = assistd::channels::slack::sign(SLACK_SECRET, &ts, &raw);
                    let request = http
                        .post(format!("http://{addr}/webhooks/slack"))
                        .header("content-type", "application/json")
                        .header("X-Slack-Request-Timestamp", ts)
                        .header("X-Slack-Signature", sig)
                        .body(raw);
                    (chat, request)
                };
                let at = Instant::now();
                let resp = request.send().await?;
                anyhow::ensure!(resp.status().is_success(), "webhook answered {}", resp.status());
                sent.lock().unwrap_or_else(|p| p.into_inner()).push((chat, at));
            }
        });
    }
    while let Some(done) = clients.join_next().await {
        done??;
    }
    let sent = std::mem::take(&mut *sent.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(sent)
}
