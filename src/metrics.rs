//! Prometheus metrics, kept by hand: a few atomics and fixed-bucket
//! histograms, one set per application instance (no global recorder, so
//! tests in one process do not share counts). Label values come from small
//! fixed sets (routes, states, reasons): never allocation IDs.

use std::{
    collections::HashMap,
    fmt::Write,
    sync::{
        Arc, PoisonError, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::lifecycle::{CoordState, StopKind};

/// The store's background operations that can fail, as label values.
const STORE_OPERATIONS: [&str; 2] = ["checkpoint", "rollover"];

/// Upper bounds (seconds) of the latency buckets.
const LATENCY_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
    300.0,
];
/// Upper bounds of the commit batch-size buckets.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0, 4096.0];

/// A histogram with fixed buckets.
struct Histogram {
    bounds: &'static [f64],
    /// Cumulative counts are computed when rendering; these are per bucket,
    /// plus one for +Inf.
    counts: Vec<AtomicU64>,
    /// Sum in micro-units (µs for seconds, units for sizes).
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((value * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, bound) in self.bounds.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
            );
        }
        cumulative += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
        );
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(
            out,
            "{name}_count{braces} {}",
            self.count.load(Ordering::Relaxed)
        );
    }
}

/// One (method, status) series of a route's request latency.
type RouteSeries = (String, u16, Histogram);

/// Every metric of one application.
pub struct Metrics {
    /// route → (method, status, request latency). Read-locked per request
    /// and looked up without allocating (the histograms are atomics);
    /// write-locked only for a new label set.
    http: RwLock<HashMap<String, Vec<RouteSeries>>>,
    /// Coordinator transitions, `[from][to]` in `CoordState::ALL` order.
    transitions: [[AtomicU64; 6]; 6],
    /// Task-state reports applied (a batch counts each task).
    reports: AtomicU64,
    /// Restart requests that restarted something or reset the coordinator,
    /// by mode: task, running, all_tasks.
    restarts: [AtomicU64; 3],
    /// New stop orders, by reason in `StopKind::ALL` order.
    stop_orders: [AtomicU64; 3],
    /// Store commit latency and batch size.
    commit_latency: Histogram,
    commit_batch: Histogram,
    /// Checkpoints of the store's log into its snapshot, and the records
    /// they wrote.
    checkpoint_latency: Histogram,
    checkpoint_records: AtomicU64,
    /// Failed background operations of the store, by `STORE_OPERATIONS`.
    store_failures: [AtomicU64; 2],
    unfolded_log_bytes: AtomicU64,
    /// Client connections open now.
    connections: AtomicU64,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics { .. }")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            http: RwLock::new(HashMap::new()),
            transitions: Default::default(),
            reports: AtomicU64::new(0),
            restarts: Default::default(),
            stop_orders: Default::default(),
            commit_latency: Histogram::new(&LATENCY_BUCKETS),
            commit_batch: Histogram::new(&BATCH_BUCKETS),
            checkpoint_latency: Histogram::new(&LATENCY_BUCKETS),
            checkpoint_records: AtomicU64::new(0),
            store_failures: Default::default(),
            unfolded_log_bytes: AtomicU64::new(0),
            connections: AtomicU64::new(0),
        }
    }
}

/// An open connection, counted in `taskgate_connections` while it lives.
pub struct OpenConnection(Arc<Metrics>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Names of the restart modes, in `Metrics::restarts` order.
pub const RESTART_MODES: [&str; 3] = ["task", "running", "all_tasks"];

/// Where `x` is in `all`; a value outside the fixed set is not counted
/// (never as another value), and said once in the log.
fn position<T: PartialEq + std::fmt::Debug>(all: &[T], x: &T) -> Option<usize> {
    let found = all.iter().position(|v| v == x);
    if found.is_none() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(
            || tracing::warn!(value = ?x, "a metric label value outside its set was not counted"),
        );
    }
    found
}

/// A metric of one series, without labels (`kind`: `counter`, `gauge`).
fn unlabeled(out: &mut String, name: &str, kind: &str, help: &str, value: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// A counter with one label, one series per value of its fixed set.
fn labeled_counter<'a, V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    series: impl Iterator<Item = (V, &'a AtomicU64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (value, n) in series {
        let _ = writeln!(
            out,
            "{name}{{{label}=\"{value}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
}

/// HTTP methods as a label: the standard ones, every other as `other` (a
/// client can send any token as a method; 3,000 invented ones grew
/// `/metrics` by 6 MB).
fn method_label(method: &str) -> &'static str {
    const METHODS: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
    ];
    METHODS
        .into_iter()
        .find(|m| *m == method)
        .unwrap_or("other")
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts a request; `route` is the matched route's template, or
    /// `unmatched` (never the path a client sent).
    pub fn http_request(&self, method: &str, route: &str, status: u16, latency: Duration) {
        let method = method_label(method);
        let seconds = latency.as_secs_f64();
        let find =
            |set: &Vec<RouteSeries>| set.iter().position(|(m, s, _)| m == method && *s == status);
        {
            let http = self.http.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(set) = http.get(route)
                && let Some(i) = find(set)
            {
                set[i].2.observe(seconds);
                return;
            }
        }
        let mut http = self.http.write().unwrap_or_else(PoisonError::into_inner);
        let set = http.entry(route.to_owned()).or_default();
        let i = find(set).unwrap_or_else(|| {
            set.push((method.to_owned(), status, Histogram::new(&LATENCY_BUCKETS)));
            set.len() - 1
        });
        set[i].2.observe(seconds);
    }

    pub fn transition(&self, from: CoordState, to: CoordState) {
        if let (Some(f), Some(t)) = (
            position(CoordState::ALL, &from),
            position(CoordState::ALL, &to),
        ) {
            self.transitions[f][t].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn reports(&self, n: usize) {
        self.reports.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn restart(&self, mode: &str) {
        if let Some(i) = position(&RESTART_MODES, &mode) {
            self.restarts[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn stop_order(&self, reason: StopKind) {
        if let Some(i) = position(StopKind::ALL, &reason) {
            self.stop_orders[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn commit(&self, latency: Duration, changes: usize) {
        self.commit_latency.observe(latency.as_secs_f64());
        self.commit_batch.observe(changes as f64);
    }

    /// Counts a connection as open until the returned guard is dropped.
    pub fn open_connection(self: &Arc<Self>) -> OpenConnection {
        self.connections.fetch_add(1, Ordering::Relaxed);
        OpenConnection(self.clone())
    }

    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    pub fn checkpoint(&self, latency: Duration, records: usize) {
        self.checkpoint_latency.observe(latency.as_secs_f64());
        self.checkpoint_records
            .fetch_add(records as u64, Ordering::Relaxed);
    }

    /// Counts a failed background operation of the store (one of
    /// `STORE_OPERATIONS`).
    pub fn store_failure(&self, operation: &str) {
        if let Some(i) = position(&STORE_OPERATIONS, &operation) {
            self.store_failures[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The store log's bytes not folded into the snapshot yet.
    pub fn unfolded_log(&self, bytes: u64) {
        self.unfolded_log_bytes.store(bytes, Ordering::Relaxed);
    }

    /// The Prometheus text exposition, with `gauges` (name, help, value).
    pub fn render(&self, gauges: &[(&str, &str, u64)]) -> String {
        let mut out = String::with_capacity(8192);
        for (name, help, value) in gauges {
            unlabeled(&mut out, name, "gauge", help, *value);
        }

        out.push_str("# HELP taskgate_http_request_duration_seconds HTTP requests by method, matched route and status.\n");
        out.push_str("# TYPE taskgate_http_request_duration_seconds histogram\n");
        let http = self.http.read().unwrap_or_else(PoisonError::into_inner);
        let mut series: Vec<_> = http
            .iter()
            .flat_map(|(route, set)| set.iter().map(move |(m, s, h)| (m, route, s, h)))
            .collect();
        series.sort_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
        for (method, route, status, h) in series {
            let labels = format!("method=\"{method}\",route=\"{route}\",status=\"{status}\"");
            h.render(&mut out, "taskgate_http_request_duration_seconds", &labels);
        }
        drop(http);

        out.push_str("# HELP taskgate_coordinator_transitions_total Coordinator state changes, from the state before a change to the state after it (skipped empty stages are not counted).\n");
        out.push_str("# TYPE taskgate_coordinator_transitions_total counter\n");
        for (i, from) in CoordState::ALL.iter().enumerate() {
            for (j, to) in CoordState::ALL.iter().enumerate() {
                let n = self.transitions[i][j].load(Ordering::Relaxed);
                if n > 0 {
                    let _ = writeln!(
                        out,
                        "taskgate_coordinator_transitions_total{{from=\"{from}\",to=\"{to}\"}} {n}"
                    );
                }
            }
        }

        unlabeled(
            &mut out,
            "taskgate_state_reports_total",
            "counter",
            "Task-state reports applied.",
            self.reports.load(Ordering::Relaxed),
        );

        labeled_counter(
            &mut out,
            "taskgate_restarts_total",
            "Restart requests that changed something, by mode.",
            "mode",
            RESTART_MODES.iter().copied().zip(&self.restarts),
        );

        labeled_counter(
            &mut out,
            "taskgate_stop_orders_total",
            "Tasks newly told to stop, by reason.",
            "reason",
            StopKind::ALL.iter().zip(&self.stop_orders),
        );

        out.push_str(
            "# HELP taskgate_store_commit_duration_seconds Durable commits of the store.\n",
        );
        out.push_str("# TYPE taskgate_store_commit_duration_seconds histogram\n");
        self.commit_latency
            .render(&mut out, "taskgate_store_commit_duration_seconds", "");
        out.push_str("# HELP taskgate_store_commit_batch_size Changes per durable commit.\n");
        out.push_str("# TYPE taskgate_store_commit_batch_size histogram\n");
        self.commit_batch
            .render(&mut out, "taskgate_store_commit_batch_size", "");
        out.push_str(
            "# HELP taskgate_store_checkpoint_duration_seconds Checkpoints of the store log into the snapshot.\n",
        );
        out.push_str("# TYPE taskgate_store_checkpoint_duration_seconds histogram\n");
        self.checkpoint_latency
            .render(&mut out, "taskgate_store_checkpoint_duration_seconds", "");
        unlabeled(
            &mut out,
            "taskgate_store_checkpoint_records_total",
            "counter",
            "Changed records folded into the snapshot by checkpoints.",
            self.checkpoint_records.load(Ordering::Relaxed),
        );
        labeled_counter(
            &mut out,
            "taskgate_store_background_failures_total",
            "Failed checkpoints and failed tries to start a log segment.",
            "operation",
            STORE_OPERATIONS.iter().copied().zip(&self.store_failures),
        );
        unlabeled(
            &mut out,
            "taskgate_store_unfolded_log_bytes",
            "gauge",
            "Store log not yet folded into the snapshot.",
            self.unfolded_log_bytes.load(Ordering::Relaxed),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let m = Metrics::new();
        m.http_request("GET", "/v1/health", 200, Duration::from_micros(300));
        m.http_request("GET", "/v1/health", 200, Duration::from_millis(7));
        let text = m.render(&[]);
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
        let text = m.render(&[("taskgate_waiters", "Parked.", 4)]);
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
        let text = m.render(&[]);
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
