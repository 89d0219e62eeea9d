//! OpenTelemetry traces (docs/operations.md, "Traces"): off unless an
//! OTLP endpoint is configured, and configured only by the standard
//! `OTEL_*` variables, which the SDK reads where it can; this module reads
//! those it cannot (the protocol, the sampler and the client's) and
//! refuses the values it does not support, naming the variable.
//!
//! Two kinds of spans go out through one batch processor (a thread of its
//! own with a bounded queue: a span that finds it full is dropped, and the
//! SDK logs the first drop and the total at shutdown): a span per request
//! (`http/edge.rs`, through `tracing-opentelemetry`), and each
//! allocation's trace (`registry/traces.rs`), made from the records. The
//! exporter sends OTLP over HTTP (protobuf or JSON) with reqwest's
//! blocking client, on the processor's thread: a collector that is slow
//! or down never holds a request up.

use std::{sync::Arc, time::Duration};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    trace::{
        BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, Span, SpanData, SpanExporter,
        SpanProcessor,
    },
};

use crate::registry::Traces;

/// The service name when neither `OTEL_SERVICE_NAME` nor `service.name`
/// in `OTEL_RESOURCE_ATTRIBUTES` gives one.
pub const SERVICE_NAME: &str = "taskgate";

/// How long a graceful stop waits for the last spans to be exported.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Traces, when they are on.
pub struct Telemetry {
    provider: SdkTracerProvider,
    /// Where each allocation's trace goes (`RegistryConfig::traces`).
    pub traces: Arc<Traces>,
    /// Where the spans go, for the log line that says traces are on.
    pub endpoint: String,
}

/// A variable's value, if set and not blank.
fn var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// The traces' value of a setting: its `OTEL_EXPORTER_OTLP_TRACES_*`
/// variable, else its `OTEL_EXPORTER_OTLP_*` one; the name it came from.
fn signal_var(setting: &str) -> Option<(String, String)> {
    [
        format!("OTEL_EXPORTER_OTLP_TRACES_{setting}"),
        format!("OTEL_EXPORTER_OTLP_{setting}"),
    ]
    .into_iter()
    .find_map(|name| var(&name).map(|v| (name, v)))
}

impl Telemetry {
    /// Traces as the environment configures them: `None` (off, and
    /// nothing of them runs) unless `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
    /// or `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and neither
    /// `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none` turns them
    /// off). A setting this build cannot honour is an error naming it.
    pub fn from_env() -> Result<Option<Self>, String> {
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match var("OTEL_TRACES_EXPORTER").as_deref() {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => {
                return Err(format!(
                    "OTEL_TRACES_EXPORTER={other:?} is not supported: taskgate exports traces \
                     over OTLP only (`otlp`, the default), or not at all (`none`)"
                ));
            }
        }
        let Some((_, endpoint)) = signal_var("ENDPOINT") else {
            return Ok(None);
        };
        let protocol = protocol()?;
        let sampler = sampler()?;
        let client = client(&endpoint)?;
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(protocol)
            .with_http_client(client)
            .build()
            .map_err(|e| {
                format!("cannot export traces: {e} (check the OTEL_EXPORTER_OTLP_* variables)")
            })?;
        let resource = resource();
        // The provider hands its resource to the processors it owns; this
        // one is shared with the allocations' traces, so its exporter gets
        // the resource here.
        exporter.set_resource(&resource);
        let batch = Arc::new(BatchSpanProcessor::builder(exporter).build());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Shared(batch.clone()))
            .with_sampler(sampler.clone())
            .with_resource(resource)
            .build();
        Ok(Some(Self {
            provider,
            traces: Arc::new(Traces::new(batch, sampler)),
            endpoint,
        }))
    }

    /// The tracer the request spans are made with.
    pub fn tracer(&self) -> SdkTracer {
        self.provider.tracer("taskgate")
    }

    /// Exports what is queued and stops the exporter (at a graceful stop):
    /// waits at most `FLUSH_TIMEOUT`.
    pub fn shutdown(&self) -> OTelSdkResult {
        self.provider.shutdown_with_timeout(FLUSH_TIMEOUT)
    }
}

/// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or `OTEL_EXPORTER_OTLP_PROTOCOL`:
/// `http/protobuf` (the default) or `http/json`.
fn protocol() -> Result<Protocol, String> {
    match signal_var("PROTOCOL") {
        None => Ok(Protocol::HttpBinary),
        Some((_, v)) if v == "http/protobuf" => Ok(Protocol::HttpBinary),
        Some((_, v)) if v == "http/json" => Ok(Protocol::HttpJson),
        Some((name, v)) if v == "grpc" => Err(format!(
            "{name}=grpc is not supported: this build exports traces over OTLP/HTTP only; set \
             {name}=http/protobuf (or http/json) and point the endpoint at the collector's HTTP \
             port (4318 by default)"
        )),
        Some((name, v)) => Err(format!(
            "{name}={v:?} is not a protocol taskgate exports with: use http/protobuf (the \
             default) or http/json"
        )),
    }
}

/// `OTEL_TRACES_SAMPLER` (default `parentbased_always_on`) with
/// `OTEL_TRACES_SAMPLER_ARG` for the ratio ones (default 1.0).
fn sampler() -> Result<Sampler, String> {
    let ratio = || match var("OTEL_TRACES_SAMPLER_ARG") {
        None => Ok(1.0),
        Some(v) => v
            .parse::<f64>()
            .ok()
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| {
                format!("OTEL_TRACES_SAMPLER_ARG={v:?} must be a ratio from 0.0 to 1.0")
            }),
    };
    let name = var("OTEL_TRACES_SAMPLER").unwrap_or_else(|| "parentbased_always_on".into());
    Ok(match name.as_str() {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::TraceIdRatioBased(ratio()?),
        "parentbased_always_on" => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        "parentbased_always_off" => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        "parentbased_traceidratio" => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio()?)))
        }
        other => {
            return Err(format!(
                "OTEL_TRACES_SAMPLER={other:?} is not supported: use always_on, always_off, \
                 traceidratio, parentbased_always_on (the default), parentbased_always_off or \
                 parentbased_traceidratio"
            ));
        }
    })
}

/// The SDK's resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`),
/// named `taskgate` unless they name it.
fn resource() -> Resource {
    let named = var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attrs| {
            attrs
                .split(',')
                .any(|kv| kv.split('=').next().map(str::trim) == Some("service.name"))
        });
    let resource = Resource::builder();
    if named {
        resource.build()
    } else {
        resource.with_service_name(SERVICE_NAME).build()
    }
}

/// The exporter's HTTP client: reqwest's blocking client (it runs on the
/// batch processor's thread), with rustls on ring as the rest of the
/// service, the timeout of `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` or
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds, default 10 s), and for
/// `https` the CA of `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE` or
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` if given, else the system's roots.
fn client(endpoint: &str) -> Result<reqwest::blocking::Client, String> {
    let timeout = match signal_var("TIMEOUT") {
        None => Duration::from_secs(10),
        Some((name, v)) => v
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| format!("{name}={v:?} must be a number of milliseconds"))?,
    };
    let certs = match signal_var("CERTIFICATE") {
        None => None,
        Some((name, path)) => {
            let pem = std::fs::read(&path).map_err(|e| format!("{name}: {path}: {e}"))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("{name}: {path}: {e}"))?;
            if certs.is_empty() {
                return Err(format!("{name}: {path}: no PEM certificate in it"));
            }
            Some(certs)
        }
    };
    let plain = endpoint.starts_with("http://");
    let _ = rustls::crypto::ring::default_provider().install_default();
    // reqwest's blocking client runs a runtime of its own: it is built
    // (and later dropped) outside any other.
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut builder = reqwest::blocking::Client::builder()
                .timeout(timeout)
                .redirect(reqwest::redirect::Policy::none());
            if let Some(certs) = certs {
                builder = builder.tls_certs_only(certs);
            } else if plain {
                // Plain HTTP needs no roots (and a minimal image has none).
                builder = builder.tls_certs_only([]);
            }
            builder.build()
        })
        .join()
    })
    .map_err(|_| "building the traces' HTTP client panicked".to_owned())?
    .map_err(|e| format!("cannot make an HTTP client for the traces' endpoint {endpoint}: {e}"))
}

/// The batch processor, shared by the provider (request spans) and the
/// allocations' traces.
#[derive(Debug)]
struct Shared(Arc<BatchSpanProcessor>);

impl SpanProcessor for Shared {
    fn on_start(&self, span: &mut Span, cx: &opentelemetry::Context) {
        self.0.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.0.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
}
