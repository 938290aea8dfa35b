//! Logging and, when `[telemetry] otlp_endpoint` is set, OpenTelemetry traces exported over
//! OTLP/HTTP (protobuf) by `opentelemetry-otlp`'s batch exporter.
//!
//! A message's trace: `webhook` (continuing a `traceparent` the caller sent) → `intake` →
//! `claim` (one per claim of the task, on whichever instance) → `step` → the model or tool
//! call → `reply` (each delivery try). The trace crosses the database: intake stores the
//! W3C `traceparent` of its span with the message (`im_message.trace_context`), and the
//! claim and the delivery continue from it. Model and tool calls carry a `traceparent`
//! header naming their span.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

use crate::config::{Config, LogFormat, TelemetryConfig};

/// Whether spans are exported (set once, at start-up).
static ENABLED: OnceLock<bool> = OnceLock::new();

/// Whether this process exports traces: only then is a message's trace context looked up.
pub fn enabled() -> bool {
    ENABLED.get().copied().unwrap_or(false)
}

/// The exporter, kept to flush what is buffered at shutdown.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports the spans still buffered (within the export timeout) and stops the exporter.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown()
        {
            // The exporter's error may name the endpoint, credentials and all.
            eprintln!(
                "assistd: flushing traces at shutdown failed: {}",
                crate::redaction::outbound_error(&e)
            );
        }
    }
}

/// The traces URL: `otlp_endpoint` is the collector's OTLP/HTTP base (as
/// `OTEL_EXPORTER_OTLP_ENDPOINT`), to which `/v1/traces` is added unless it is there.
pub fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{base}/v1/traces")
    }
}

fn provider(config: &TelemetryConfig, instance: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(traces_url(&config.otlp_endpoint))
        .with_timeout(Duration::from_secs(config.export_timeout_secs))
        .with_headers(config.headers.clone().into_iter().collect())
        .build()
        .map_err(|e| format!("telemetry.otlp_endpoint: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name(config.service_name.clone())
        .with_attributes([
            opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            opentelemetry::KeyValue::new("service.instance.id", instance.to_string()),
        ])
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Installs the global subscriber: the log output at `log.level` (or `RUST_LOG`), and the
/// span exporter when `telemetry.otlp_endpoint` is set. Spans of assistd's own code at INFO
/// and above are exported, whatever the log level.
pub fn init(config: &Config, instance: &str) -> Result<Telemetry, String> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&config.log.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(ScrubForeign(std::io::stdout));
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match config.log.format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Pretty => fmt.boxed(),
    };
    let telemetry = &config.telemetry;
    let provider = if telemetry.otlp_endpoint.is_empty() {
        None
    } else {
        Some(provider(telemetry, instance)?)
    };
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("assistd"))
            .with_filter(Targets::new().with_target("assistd", tracing::Level::INFO))
    });
    let _ = ENABLED.set(provider.is_some());
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init()
        .map_err(|e| format!("installing the log subscriber: {e}"))?;
    Ok(Telemetry { provider })
}

/// The W3C `traceparent` of the current span, when it is exported.
pub fn traceparent() -> Option<String> {
    if !enabled() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&tracing::Span::current().context(), &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` continue the trace of `traceparent` (a stored or received W3C header); a
/// missing or malformed one leaves the span a root. Call before the span is first entered.
pub fn continue_trace(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(traceparent) = traceparent.filter(|_| enabled()) else {
        return;
    };
    let carrier = HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    let parent = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(parent);
}

/// The log's writer around `M` (standard output in the binary): assistd's own events are
/// built without secrets where they are built; another crate's (rmcp, the OTLP exporter,
/// hyper) may name the URL it called, credentials and all, so its lines pass through
/// `redaction::foreign_log_line` on their way to `M`.
#[derive(Clone, Copy)]
pub struct ScrubForeign<M>(pub M);

impl<'a, M: tracing_subscriber::fmt::MakeWriter<'a>> tracing_subscriber::fmt::MakeWriter<'a>
    for ScrubForeign<M>
{
    type Writer = ForeignLine<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        ForeignLine {
            inner: self.0.make_writer(),
            foreign: false,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        ForeignLine {
            inner: self.0.make_writer_for(meta),
            foreign: !meta.target().starts_with("assistd"),
        }
    }
}

/// One event's line (the fmt layer writes each formatted event whole).
pub struct ForeignLine<W> {
    inner: W,
    foreign: bool,
}

impl<W: std::io::Write> std::io::Write for ForeignLine<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.foreign {
            let clean = crate::redaction::foreign_log_line(&String::from_utf8_lossy(buf));
            self.inner.write_all(clean.as_bytes())?;
        } else {
            self.inner.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
