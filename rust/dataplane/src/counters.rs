//! The data plane's metrics: labelled counters and fixed-bucket histograms, read by the
//! Python control plane's Prometheus collector at scrape time (never per request).
//!
//! Names and buckets are those of `eldr_sglang/router/metrics.py`, so /metrics keeps its
//! series whichever plane serves the requests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const DIST: &[f64] = &[0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0];
const WAIT: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const FAST: &[f64] = &[0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01];
const BAND: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0];
const BYTES: &[f64] = &[256.0, 1024.0, 2048.0, 4096.0, 8192.0, 12288.0, 16384.0, 65536.0];
/// Latency buckets (seconds): first token and the prefill leg; per token; whole requests.
const TTFT: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
const TPOT: &[f64] = &[0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0];
const E2E: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0];

/// Latency histograms of one (policy, decode worker, endpoint): looked up once per request,
/// then observed with atomics only.
pub struct Latency {
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Latency {
    fn new() -> Self {
        Latency { ttft: Histogram::new(TTFT), tpot: Histogram::new(TPOT), itl: Histogram::new(TPOT), e2e: Histogram::new(E2E) }
    }
}

/// The request path's latency metrics, labelled. Cardinality is bounded by construction:
/// policies are the core's names, workers the configured decode workers, endpoints three.
#[derive(Default)]
pub struct LatencyMetrics {
    decode: Mutex<HashMap<(&'static str, usize, &'static str), Arc<Latency>>>,
    prefill: Mutex<HashMap<(&'static str, &'static str), Arc<Histogram>>>,
}

/// (metric, label names, bucket bounds, [(label values, per-bucket counts, sum)]).
pub type LabelledSnapshot = Vec<(&'static str, &'static [&'static str], &'static [f64], Vec<(Vec<String>, Vec<u64>, f64)>)>;

impl LatencyMetrics {
    pub fn decode(&self, policy: &'static str, worker: usize, endpoint: &'static str) -> Arc<Latency> {
        let mut m = self.decode.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(m.entry((policy, worker, endpoint)).or_insert_with(|| Arc::new(Latency::new())))
    }

    pub fn prefill(&self, policy: &'static str, endpoint: &'static str) -> Arc<Histogram> {
        let mut m = self.prefill.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(m.entry((policy, endpoint)).or_insert_with(|| Arc::new(Histogram::new(TTFT))))
    }

    /// Every series, for the collector.
    pub fn snapshot(&self) -> LabelledSnapshot {
        const DEC: &[&str] = &["policy", "worker", "endpoint"];
        const PRE: &[&str] = &["policy", "endpoint"];
        let dec: Vec<_> = self.decode.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (*k, Arc::clone(v))).collect();
        let mut out = Vec::new();
        for (name, bounds, pick) in [
            (names::TTFT, TTFT, (|l: &Latency| &l.ttft) as fn(&Latency) -> &Histogram),
            (names::TPOT, TPOT, |l: &Latency| &l.tpot),
            (names::ITL, TPOT, |l: &Latency| &l.itl),
            (names::E2E, E2E, |l: &Latency| &l.e2e),
        ] {
            let series = dec.iter().map(|((p, w, e), l)| {
                let (c, s) = pick(l).snapshot();
                (vec![p.to_string(), w.to_string(), e.to_string()], c, s)
            }).collect();
            out.push((name, DEC, bounds, series));
        }
        let pre = self.prefill.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|((p, e), h)| {
            let (c, s) = h.snapshot();
            (vec![p.to_string(), e.to_string()], c, s)
        }).collect();
        out.push((names::PREFILL_LEG, PRE, TTFT, pre));
        out
    }
}

/// What a streamed answer's chunk holds: its SSE data events (tokens, for SGLang's one event
/// per token; `[DONE]` not counted) and the last `"completion_tokens":N` in it (SGLang's
/// meta_info, or an OpenAI usage block). One pass over the bytes, no JSON parse.
pub fn scan_chunk(c: &[u8]) -> (u64, Option<u64>) {
    const DATA: &[u8] = b"data:";
    const DONE: &[u8] = b"[DONE]";
    const TOKENS: &[u8] = b"\"completion_tokens\":";
    let (mut events, mut tokens) = (0u64, None);
    let mut i = 0;
    while i < c.len() {
        let rest = &c[i..];
        if rest.starts_with(DATA) && (i == 0 || c[i - 1] == b'\n') {
            let body = rest[DATA.len()..].trim_ascii_start();
            if !body.starts_with(DONE) {
                events += 1;
            }
            i += DATA.len();
        } else if rest.starts_with(TOKENS) {
            let digits = rest[TOKENS.len()..].trim_ascii_start();
            let n = digits.iter().take_while(|b| b.is_ascii_digit()).fold(None, |a: Option<u64>, &d| Some(a.unwrap_or(0).saturating_mul(10).saturating_add((d - b'0') as u64)));
            if n.is_some() {
                tokens = n;
            }
            i += TOKENS.len();
        } else {
            i += 1;
        }
    }
    (events, tokens)
}

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
    pub latency: LatencyMetrics,
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
            latency: LatencyMetrics::default(),
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
    pub const OUTPUT_TOKENS: &str = "eldr_router_output_tokens";
    // latency histograms (seconds), labelled: the gateway's ttft/tpot/itl naming
    pub const TTFT: &str = "eldr_router_ttft_seconds";
    pub const TPOT: &str = "eldr_router_tpot_seconds";
    pub const ITL: &str = "eldr_router_itl_seconds";
    pub const E2E: &str = "eldr_router_e2e_seconds";
    pub const PREFILL_LEG: &str = "eldr_router_prefill_seconds";
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
    fn chunks_give_their_events_and_token_counts() {
        assert_eq!(scan_chunk(b"data: {\"text\":\" a\",\"meta_info\":{\"completion_tokens\":1}}\n\n"), (1, Some(1)));
        // two events in one chunk, the last count wins; [DONE] is no token
        let two = b"data: {\"meta_info\":{\"completion_tokens\": 7}}\n\ndata: {\"meta_info\":{\"completion_tokens\":8}}\n\ndata: [DONE]\n\n";
        assert_eq!(scan_chunk(two), (2, Some(8)));
        // OpenAI chunks without usage: events only; "data:" inside a string is not an event
        assert_eq!(scan_chunk(b"data: {\"choices\":[{\"text\":\"data: x\"}]}\n\n"), (1, None));
        assert_eq!(scan_chunk(b"data: [DONE]\n\n"), (0, None));
        assert_eq!(scan_chunk(b"{\"usage\":{\"completion_tokens\":12,\"total_tokens\":20}}"), (0, Some(12)));
    }

    #[test]
    fn latency_series_are_per_policy_worker_and_endpoint() {
        let c = Counters::default();
        c.latency.decode("eldr", 1, "generate").ttft.observe(0.2);
        c.latency.decode("eldr", 1, "generate").ttft.observe(0.3);
        c.latency.decode("round_robin", 0, "chat").tpot.observe(0.01);
        c.latency.prefill("eldr", "generate").observe(0.1);
        let snap = c.latency.snapshot();
        let ttft = snap.iter().find(|s| s.0 == names::TTFT).unwrap();
        assert_eq!(ttft.1, &["policy", "worker", "endpoint"]);
        let s = ttft.3.iter().find(|s| s.0 == vec!["eldr", "1", "generate"]).unwrap();
        assert_eq!(s.1.iter().sum::<u64>(), 2);
        assert!((s.2 - 0.5).abs() < 1e-12);
        let pre = snap.iter().find(|s| s.0 == names::PREFILL_LEG).unwrap();
        assert_eq!(pre.3.len(), 1);
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
