//! `mcp-steps`: journalled MCP read-only tool steps per second against a local
//! streamable-HTTP MCP server (rmcp's own, in-process), next to the same number of HTTP tool
//! steps against the mock, in one run, alternating.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{MaybeSendFuture, RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::harness::*;
use crate::{Args, db_name};

/// One read-only tool, `ping`, answered at once.
#[derive(Clone)]
struct PingServer;

impl ServerHandler for PingServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListToolsResult, rmcp::ErrorData>> + MaybeSendFuture + '_ {
        let schema = json!({"type": "object"}).as_object().cloned().unwrap();
        let tool = Tool::new("ping", "Answers pong.", Arc::new(schema))
            .annotate(ToolAnnotations::default().read_only(true));
        std::future::ready(Ok(ListToolsResult::with_all_items(vec![tool])))
    }

    fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CallToolResponse, rmcp::ErrorData>> + MaybeSendFuture + '_
    {
        std::future::ready(Ok(
            CallToolResult::structured(json!({"value": "pong"})).into()
        ))
    }
}

/// Serves `PingServer` at `http://127.0.0.1:<port>/mcp` until `stop`.
async fn ping_server(stop: &CancellationToken) -> anyhow::Result<String> {
    let service: StreamableHttpService<PingServer, LocalSessionManager> =
        StreamableHttpService::new(
            || Ok(PingServer),
            Default::default(),
            StreamableHttpServerConfig::default().with_cancellation_token(stop.child_token()),
        );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = stop.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
    });
    Ok(format!("http://{addr}/mcp"))
}

/// One round: `n` tasks of `WORKFLOW_STEPS` steps each calling `tool`; steps per second.
async fn round(args: &Args, tool: &str, extra: &str) -> anyhow::Result<f64> {
    let db = BenchDb::new(args.db).await?;
    let mocks = start_mocks(Duration::ZERO).await?;
    let (server, _dir) = tool_chain_server_with(&db, &mocks, WORKFLOW_STEPS, tool, extra).await?;
    let started = Instant::now();
    send_messages(server.addr, args.n, args.concurrency, "mcp-steps").await?;
    wait_replies(&mocks, args.n, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed();
    server.stop().await;
    mocks.stop.cancel();
    db.drop_db().await;
    Ok((args.n * WORKFLOW_STEPS) as f64 / elapsed.as_secs_f64())
}

/// HTTP and MCP rounds alternating (three pairs), each on a fresh database; prints each
/// round and the medians.
pub(crate) async fn mcp_steps(args: &Args) -> anyhow::Result<()> {
    let stop = CancellationToken::new();
    let url = ping_server(&stop).await?;
    let extra = format!("\n[mcp_servers.bench]\nurl = \"{url}\"\ntimeout_secs = 30\n");
    let (mut http, mut mcp) = (Vec::new(), Vec::new());
    for pair in 1..=3 {
        let h = round(args, "ping", "").await?;
        let m = round(args, "bench.ping", &extra).await?;
        println!(
            "scenario=mcp-steps db={} pair={pair} n={} steps_per_task={WORKFLOW_STEPS} http={h:.0} steps/s mcp={m:.0} steps/s",
            db_name(args.db),
            args.n
        );
        http.push(h);
        mcp.push(m);
    }
    stop.cancel();
    http.sort_by(f64::total_cmp);
    mcp.sort_by(f64::total_cmp);
    println!(
        "scenario=mcp-steps db={} median http={:.0} steps/s mcp={:.0} steps/s mcp/http={:.2}",
        db_name(args.db),
        http[1],
        mcp[1],
        mcp[1] / http[1]
    );
    Ok(())
}
