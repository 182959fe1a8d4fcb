//! The data plane's metrics: labelled counters and fixed-bucket histograms, read by the
//! Python control plane's Prometheus collector at scrape time (never per request).
//!
//! Names and buckets are those of `eldr_sglang/router/metrics.py`, so /metrics keeps its
//! series whichever plane serves the requests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const DIST: &[f64] = &[0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0];
const WAIT: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const FAST: &[f64] = &[0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01];
const BAND: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0];
const BYTES: &[f64] = &[256.0, 1024.0, 2048.0, 4096.0, 8192.0, 12288.0, 16384.0, 65536.0];

/// A histogram with Prometheus' `le` buckets (each count is of its own bucket; the
/// collector makes them cumulative).
pub struct Histogram {
    pub bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    sum_bits: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum_bits: AtomicU64::new(0f64.to_bits()) }
    }

    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self.sum_bits.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some((f64::from_bits(b) + v).to_bits()));
    }

    /// (per-bucket counts, the last being +Inf; sum).
    pub fn snapshot(&self) -> (Vec<u64>, f64) {
        (self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect(), f64::from_bits(self.sum_bits.load(Ordering::Relaxed)))
    }
}

/// Labelled counters keyed by (metric, label values). One short critical section per
/// increment: a handful per request, uncontended on a few threads.
pub struct Counters {
    values: Mutex<HashMap<(&'static str, Vec<String>), u64>>,
    pub band_size: Histogram,
    pub d_star: Histogram,
    pub d_chosen: Histogram,
    pub sig_wait: Histogram,
    pub sig_bytes: Histogram,
    pub route_seconds: Histogram,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            values: Mutex::new(HashMap::new()),
            band_size: Histogram::new(BAND),
            d_star: Histogram::new(DIST),
            d_chosen: Histogram::new(DIST),
            sig_wait: Histogram::new(WAIT),
            sig_bytes: Histogram::new(BYTES),
            route_seconds: Histogram::new(FAST),
        }
    }
}

impl Counters {
    pub fn inc(&self, metric: &'static str, labels: &[&str]) {
        self.add(metric, labels, 1);
    }

    pub fn add(&self, metric: &'static str, labels: &[&str], n: u64) {
        let key = (metric, labels.iter().map(|s| s.to_string()).collect());
        *self.values.lock().unwrap_or_else(|e| e.into_inner()).entry(key).or_insert(0) += n;
    }

    pub fn get(&self, metric: &'static str, labels: &[&str]) -> u64 {
        let key = (metric, labels.iter().map(|s| s.to_string()).collect());
        self.values.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied().unwrap_or(0)
    }

    /// Every counter: metric name -> [(label values, value)].
    pub fn snapshot(&self) -> HashMap<&'static str, Vec<(Vec<String>, u64)>> {
        let mut out: HashMap<&'static str, Vec<(Vec<String>, u64)>> = HashMap::new();
        for ((m, labels), v) in self.values.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            out.entry(m).or_default().push((labels.clone(), *v));
        }
        out
    }

    pub fn histograms(&self) -> [(&'static str, &Histogram); 6] {
        [
            ("eldr_router_band_size", &self.band_size),
            ("eldr_router_distance_best", &self.d_star),
            ("eldr_router_distance_chosen", &self.d_chosen),
            ("eldr_router_signature_wait_seconds", &self.sig_wait),
            ("eldr_router_signature_bytes", &self.sig_bytes),
            ("eldr_router_route_seconds", &self.route_seconds),
        ]
    }
}

/// Metric names (Prometheus adds `_total`).
pub mod names {
    pub const REQUESTS: &str = "eldr_router_requests";
    pub const ROUTES: &str = "eldr_router_decode_routes";
    pub const DECODE_FAILOVERS: &str = "eldr_router_decode_failovers";
    pub const RETRIES: &str = "eldr_router_retries";
    pub const RETRIES_REFUSED: &str = "eldr_router_retries_refused";
    pub const TIMEOUTS: &str = "eldr_router_upstream_timeouts";
    pub const EJECTIONS: &str = "eldr_router_ejections";
    pub const PROBATION_TRIALS: &str = "eldr_router_probation_trials";
    pub const PREFILL_ROUTES: &str = "eldr_router_prefill_routes";
    pub const FALLBACKS: &str = "eldr_router_fallbacks";
    pub const MALFORMED: &str = "eldr_router_malformed_signatures";
    pub const WORKER_ERRORS: &str = "eldr_router_worker_errors";
    pub const DISCONNECTS: &str = "eldr_router_client_disconnects";
    pub const ADMITTED: &str = "eldr_router_admission_admitted";
    pub const QUEUED: &str = "eldr_router_admission_queued";
    pub const REJECTED: &str = "eldr_router_admission_rejected";
    pub const PANIC_ROUTES: &str = "eldr_router_panic_routes";
    pub const OVERLOAD_TIMEOUTS: &str = "eldr_router_overload_timeouts";
    pub const CONNECTION_ERRORS: &str = "eldr_router_client_connection_errors";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_sum() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 3.0, f64::NAN] {
            h.observe(v);
        }
        let (c, s) = h.snapshot();
        assert_eq!(c, vec![2, 1, 1]);
        assert!((s - 6.0).abs() < 1e-12);
    }

    #[test]
    fn labelled_counters_add_up() {
        let c = Counters::default();
        c.inc(names::RETRIES, &["decode", "connect"]);
        c.add(names::RETRIES, &["decode", "connect"], 2);
        c.inc(names::RETRIES, &["prefill", "connect"]);
        assert_eq!(c.get(names::RETRIES, &["decode", "connect"]), 3);
        assert_eq!(c.snapshot()[names::RETRIES].len(), 2);
    }
}
