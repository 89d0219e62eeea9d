//! Prometheus metrics through prometheus-client: one registry per
//! application instance (no global recorder, so tests in one process do not
//! share counts). Label values come from small fixed sets (methods, routes,
//! states, reasons): never allocation IDs.

use std::time::Duration;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::lifecycle::{CoordState, StopKind};

/// The store's background operations that can fail, as label values.
const STORE_OPERATIONS: [&str; 2] = ["checkpoint", "rollover"];

/// Names of the restart modes, the `mode` label's values.
pub const RESTART_MODES: [&str; 3] = ["task", "running", "all_tasks"];

/// Upper bounds (seconds) of the latency buckets.
const LATENCY_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
    300.0,
];
/// Upper bounds of the commit batch-size buckets.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0, 4096.0];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    method: &'static str,
    /// The matched route's template, or `unmatched`.
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    from: &'static str,
    to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabel {
    operation: &'static str,
}

/// What `/metrics` reads from the rest of the service when it is scraped.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scrape {
    pub waiters: u64,
    pub allocations: u64,
    pub last_index: u64,
    pub store_degraded: bool,
    pub store_refusing_writes: bool,
    /// Bytes of rendered changes the event stream keeps.
    pub stream_rendered_bytes: u64,
    /// Entries in the timer heap (TTLs and deadlines; stale ones included).
    pub timer_entries: u64,
}

/// Every metric of one application, and the registry that encodes them.
pub struct Metrics {
    registry: Registry,
    http: Family<HttpLabels, Histogram, fn() -> Histogram>,
    transitions: Family<TransitionLabels, Counter>,
    reports: Counter,
    restarts: Family<ModeLabel, Counter>,
    stop_orders: Family<ReasonLabel, Counter>,
    commit_latency: Histogram,
    commit_batch: Histogram,
    checkpoint_latency: Histogram,
    checkpoint_records: Counter,
    store_failures: Family<OperationLabel, Counter>,
    unfolded_log_bytes: Gauge,
    connections: Gauge,
    waiters: Gauge,
    allocations: Gauge,
    last_index: Gauge,
    store_degraded: Gauge,
    store_refusing_writes: Gauge,
    stream_rendered_bytes: Gauge,
    timer_entries: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics { .. }")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// An open connection, counted in `taskgate_connections` while it lives.
pub struct OpenConnection(Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// `x` as the `&'static str` of its fixed set; a value outside the set is
/// not counted (never as another value), and said once in the log.
fn in_set(all: &[&'static str], x: &str) -> Option<&'static str> {
    let found = all.iter().copied().find(|v| *v == x);
    if found.is_none() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                value = x,
                "a metric label value outside its set was not counted"
            )
        });
    }
    found
}

/// HTTP methods as a label: the standard ones, every other as `other` (a
/// client can send any token as a method, and every label value is a
/// series `/metrics` keeps for good).
fn method_label(method: &str) -> &'static str {
    const METHODS: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
    ];
    METHODS
        .into_iter()
        .find(|m| *m == method)
        .unwrap_or("other")
}

/// Gauges hold `i64`; counts beyond it (never in practice) show as its
/// maximum rather than wrapping negative.
fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let http = Family::<HttpLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        let transitions = Family::<TransitionLabels, Counter>::default();
        let reports = Counter::default();
        let restarts = Family::<ModeLabel, Counter>::default();
        let stop_orders = Family::<ReasonLabel, Counter>::default();
        let commit_latency = latency_histogram();
        let commit_batch = Histogram::new(BATCH_BUCKETS);
        let checkpoint_latency = latency_histogram();
        let checkpoint_records = Counter::default();
        let store_failures = Family::<OperationLabel, Counter>::default();
        // Every value of a fixed set shows, counted or not.
        for mode in RESTART_MODES {
            drop(restarts.get_or_create(&ModeLabel { mode }));
        }
        for kind in StopKind::ALL {
            drop(stop_orders.get_or_create(&ReasonLabel {
                reason: kind.as_str(),
            }));
        }
        for operation in STORE_OPERATIONS {
            drop(store_failures.get_or_create(&OperationLabel { operation }));
        }

        // Help texts without their final period: the registry adds it.
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            registry.register(name, help, g.clone());
            g
        };
        let waiters = gauge(
            &mut registry,
            "taskgate_waiters",
            "Requests parked in a long-poll or blocking query",
        );
        let stream_rendered_bytes = gauge(
            &mut registry,
            "taskgate_stream_rendered_bytes",
            "Bytes of rendered changes the event stream keeps for its readers (one copy for all)",
        );
        let timer_entries = gauge(
            &mut registry,
            "taskgate_timer_entries",
            "Entries in the timer heap of liveness TTLs and deadlines (one per timed allocation, plus stale ones)",
        );
        let allocations = gauge(
            &mut registry,
            "taskgate_allocations",
            "Registered allocations",
        );
        let last_index = gauge(
            &mut registry,
            "taskgate_last_index",
            "The last global index handed out",
        );
        let connections = gauge(
            &mut registry,
            "taskgate_connections",
            "Client connections open now",
        );
        let store_degraded = gauge(
            &mut registry,
            "taskgate_store_degraded",
            "1 while the store takes writes but its background work (checkpoints, log rollover) fails",
        );
        let store_refusing_writes = gauge(
            &mut registry,
            "taskgate_store_refusing_writes",
            "1 while the store refuses writes (a failed write, or its log at its ceiling)",
        );
        registry.register(
            "taskgate_http_request_duration_seconds",
            "HTTP requests by method, matched route and status",
            http.clone(),
        );
        registry.register(
            "taskgate_coordinator_transitions",
            "Coordinator state changes, from the state before a change to the state after it (skipped empty stages are not counted)",
            transitions.clone(),
        );
        registry.register(
            "taskgate_state_reports",
            "Task-state reports applied",
            reports.clone(),
        );
        registry.register(
            "taskgate_restarts",
            "Restart requests that changed something, by mode",
            restarts.clone(),
        );
        registry.register(
            "taskgate_stop_orders",
            "Tasks newly told to stop, by reason",
            stop_orders.clone(),
        );
        registry.register(
            "taskgate_store_commit_duration_seconds",
            "Durable commits of the store",
            commit_latency.clone(),
        );
        registry.register(
            "taskgate_store_commit_batch_size",
            "Changes per durable commit",
            commit_batch.clone(),
        );
        registry.register(
            "taskgate_store_checkpoint_duration_seconds",
            "Checkpoints of the store log into the snapshot",
            checkpoint_latency.clone(),
        );
        registry.register(
            "taskgate_store_checkpoint_records",
            "Changed records folded into the snapshot by checkpoints",
            checkpoint_records.clone(),
        );
        registry.register(
            "taskgate_store_background_failures",
            "Failed checkpoints and failed tries to start a log segment",
            store_failures.clone(),
        );
        let unfolded_log_bytes = gauge(
            &mut registry,
            "taskgate_store_unfolded_log_bytes",
            "Store log not yet folded into the snapshot",
        );
        Self {
            registry,
            http,
            transitions,
            reports,
            restarts,
            stop_orders,
            commit_latency,
            commit_batch,
            checkpoint_latency,
            checkpoint_records,
            store_failures,
            unfolded_log_bytes,
            connections,
            waiters,
            allocations,
            last_index,
            store_degraded,
            store_refusing_writes,
            stream_rendered_bytes,
            timer_entries,
        }
    }

    /// Counts a request; `route` is the matched route's template, or
    /// `unmatched` (never the path a client sent).
    pub fn http_request(&self, method: &str, route: &str, status: u16, latency: Duration) {
        let labels = HttpLabels {
            method: method_label(method),
            route: route.to_owned(),
            status,
        };
        self.http
            .get_or_create(&labels)
            .observe(latency.as_secs_f64());
    }

    pub fn transition(&self, from: CoordState, to: CoordState) {
        self.transitions
            .get_or_create(&TransitionLabels {
                from: from.as_str(),
                to: to.as_str(),
            })
            .inc();
    }

    pub fn reports(&self, n: usize) {
        self.reports.inc_by(n as u64);
    }

    pub fn restart(&self, mode: &str) {
        if let Some(mode) = in_set(&RESTART_MODES, mode) {
            self.restarts.get_or_create(&ModeLabel { mode }).inc();
        }
    }

    pub fn stop_order(&self, reason: StopKind) {
        self.stop_orders
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub fn commit(&self, latency: Duration, changes: usize) {
        self.commit_latency.observe(latency.as_secs_f64());
        self.commit_batch.observe(changes as f64);
    }

    /// Counts a connection as open until the returned guard is dropped.
    pub fn open_connection(&self) -> OpenConnection {
        self.connections.inc();
        OpenConnection(self.connections.clone())
    }

    pub fn connections(&self) -> u64 {
        u64::try_from(self.connections.get()).unwrap_or(0)
    }

    pub fn checkpoint(&self, latency: Duration, records: usize) {
        self.checkpoint_latency.observe(latency.as_secs_f64());
        self.checkpoint_records.inc_by(records as u64);
    }

    /// Counts a failed background operation of the store (one of
    /// `STORE_OPERATIONS`).
    pub fn store_failure(&self, operation: &str) {
        if let Some(operation) = in_set(&STORE_OPERATIONS, operation) {
            self.store_failures
                .get_or_create(&OperationLabel { operation })
                .inc();
        }
    }

    /// The store log's bytes not folded into the snapshot yet.
    pub fn unfolded_log(&self, bytes: u64) {
        self.unfolded_log_bytes.set(gauge_value(bytes));
    }

    /// The Prometheus text exposition (format 0.0.4), with what the rest
    /// of the service shows at this scrape.
    pub fn render(&self, now: Scrape) -> String {
        self.waiters.set(gauge_value(now.waiters));
        self.allocations.set(gauge_value(now.allocations));
        self.last_index.set(gauge_value(now.last_index));
        self.store_degraded.set(i64::from(now.store_degraded));
        self.store_refusing_writes
            .set(i64::from(now.store_refusing_writes));
        self.stream_rendered_bytes
            .set(gauge_value(now.stream_rendered_bytes));
        self.timer_entries.set(gauge_value(now.timer_entries));
        let mut out = String::with_capacity(8192);
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// The `Content-Type` of what `render` writes.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let m = Metrics::new();
        m.http_request("GET", "/v1/health", 200, Duration::from_micros(300));
        m.http_request("GET", "/v1/health", 200, Duration::from_millis(7));
        let text = m.render(Scrape::default());
        assert!(text.contains(
            "taskgate_http_request_duration_seconds_bucket{method=\"GET\",route=\"/v1/health\",status=\"200\",le=\"0.0005\"} 1\n"
        ), "{text}");
        assert!(text.contains("le=\"0.01\"} 2\n"), "{text}");
        assert!(text.contains(
            "taskgate_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/health\",status=\"200\"} 2\n"
        ));
    }

    #[test]
    fn counters_use_exact_state_and_reason_names() {
        let m = Metrics::new();
        m.transition(CoordState::Poststart, CoordState::Poststop);
        m.stop_order(StopKind::MainTasksDead);
        m.restart("all_tasks");
        m.commit(Duration::from_micros(200), 3);
        let text = m.render(Scrape {
            waiters: 4,
            ..Scrape::default()
        });
        assert!(text.contains("taskgate_waiters 4\n"));
        assert!(text.contains(
            "taskgate_coordinator_transitions_total{from=\"poststart\",to=\"poststop\"} 1\n"
        ));
        assert!(text.contains("taskgate_stop_orders_total{reason=\"Main Tasks Dead\"} 1\n"));
        assert!(text.contains("taskgate_restarts_total{mode=\"all_tasks\"} 1\n"));
        assert!(
            text.contains("taskgate_store_commit_batch_size_bucket{le=\"4\"} 1\n"),
            "{text}"
        );
    }

    /// Label values come from fixed sets whatever a client sends: invented
    /// methods are `other`, and a value outside a set is not counted as
    /// another one.
    #[test]
    fn label_values_stay_in_their_fixed_sets() {
        let m = Metrics::new();
        for i in 0..3000 {
            m.http_request(&format!("X{i}"), "unmatched", 405, Duration::from_micros(1));
        }
        m.http_request("DELETE", "unmatched", 404, Duration::from_micros(1));
        m.restart("no-such-mode");
        let text = m.render(Scrape::default());
        assert!(text.contains(
            "taskgate_http_request_duration_seconds_count{method=\"other\",route=\"unmatched\",status=\"405\"} 3000\n"
        ), "{text}");
        assert!(text.contains("method=\"DELETE\""), "{text}");
        assert!(!text.contains("X1"), "{text}");
        assert!(
            text.contains("taskgate_restarts_total{mode=\"task\"} 0\n"),
            "{text}"
        );
        assert!(text.len() < 20_000, "{} bytes", text.len());
    }
}
