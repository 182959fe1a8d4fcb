//! Criterion benches of the hot path at DeepSeek-V3 shape (58 MoE layers x 256 experts, top-8,
//! the middle 60% of layers selected as in benchmarks/bench_router.py, K = 8), for the counts
//! of a 2k-token prompt:
//!
//! * one ELDR route from sparse counts, and from dense f32 counts;
//! * the wire path and its parts: the prefill's stream event (its payload in the lossy 6-bit
//!   `log` encoding, as the prefill encodes 2k tokens within 16 KiB, or exact 12-bit `dense`)
//!   -> `decode_event` -> `fill_signature` -> distances (`fill_and_distances`; fused in one
//!   pass: `distances_fused`) -> `route_counts` (with the signature kept: `route_counts_keep`);
//! * a queue acquire+release.
//!
//! Timed in the thread's CPU time, not wall time: the machine is shared, and a wall clock
//! counts the time other processes hold the core (the benches here are single-threaded and
//! do not sleep, so for them the two agree on an idle machine).

use std::hint::black_box;
use std::sync::Arc;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{criterion_group, criterion_main, Criterion};
use eldr_core::distance::{from_counts, from_fill, Counts};
use eldr_core::payload::{decode_event, pack_bits, DecodeLimits, Payload};
use eldr_core::{CentroidWriter, PolicyConfig, QueueTracker, Router, RouterSpec, SparseSignature};

/// CPU time of the calling thread (`CLOCK_THREAD_CPUTIME_ID`), in ns.
struct ThreadTime;

fn thread_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Measurement for ThreadTime {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        thread_ns()
    }
    fn end(&self, t0: u64) -> u64 {
        thread_ns() - t0
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        static WALL: WallTime = WallTime;
        WALL.formatter() // values are ns, as wall time's
    }
}

fn lcg(state: &mut u64) -> u64 {
    *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *state >> 33
}


/// The stream event carrying `counts` `[rows, e]`: exact dense, or the `log` encoding with
/// `log_bits` (the Python encoder's rule: `rint(log1p(c) / log1p(q_row) * levels)`, >= 1 where c > 0).
fn event(counts: &[u32], rows: usize, e: usize, log_bits: Option<u32>) -> Vec<u8> {
    let layers: Vec<usize> = (0..rows).collect();
    let head = format!(r#"{{"v":1,"layers":{layers:?},"E":{e},"n":2048"#);
    let b64 = base64_simd::STANDARD;
    let payload = match log_bits {
        None => {
            let bits = 32 - counts.iter().max().unwrap().leading_zeros();
            format!(r#"{head},"enc":"dense","bits":{bits},"d":"{}"}}"#, b64.encode_to_string(pack_bits(counts, bits)))
        }
        Some(bits) => {
            let levels = ((1u32 << bits) - 1) as f64;
            let q: Vec<u32> = counts.chunks(e).map(|r| *r.iter().max().unwrap()).collect();
            let codes: Vec<u32> = counts
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    let lm = (q[i / e] as f64).ln_1p();
                    let code = if lm > 0.0 { ((c as f64).ln_1p() / lm * levels).round_ties_even() as u32 } else { 0 };
                    if c > 0 { code.max(1) } else { code }
                })
                .collect();
            format!(r#"{head},"enc":"log","bits":{bits},"q":{q:?},"d":"{}"}}"#, b64.encode_to_string(pack_bits(&codes, bits)))
        }
    };
    format!(r#"{{"text":"","meta_info":{{"id":"r0","eldr_signature":[{payload}]}}}}"#).into_bytes()
}

/// DeepSeek-V3's shape: MoE layers, experts per layer, top-k per token; K decode workers and
/// the prompt's tokens.
const L: usize = 58;
const E: usize = 256;
const TOPK: usize = 8;
const K: usize = 8;
const TOKENS: usize = 2048;

/// A router on a centroid file written under `dir`: the middle 60% of layers selected, random
/// IDF and centroids drawn from `s`.
fn centroid_router(dir: &std::path::Path, s: &mut u64) -> Router {
    let (lo, hi) = ((0.2 * L as f64) as usize, (0.8 * L as f64) as usize);
    let weights: Vec<f32> = (0..L).map(|i| if (lo..hi).contains(&i) { 1.0 } else { 0.0 }).collect();
    let idf: Vec<f32> = (0..L * E).map(|_| 0.2 + (lcg(s) % 1000) as f32 / 500.0).collect();
    let d = (hi - lo) * E;
    let cents: Vec<f32> = (0..K * d).map(|_| (lcg(s) % 1000) as f32 / 1000.0).collect();
    let path = dir.join("bench.eldr");
    CentroidWriter { centroids: &cents, k: K, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..K).map(|i| format!("d{i}")).collect(), provenance: "{}" }
        .write(&path)
        .unwrap();
    Router::new(RouterSpec::of(PolicyConfig::Eldr), None, Some(&path), 250, 2000).unwrap()
}

/// Counts `[L, E]` of a 2k-token prompt: top-k distinct experts per token and layer, skewed
/// (domain-like) per layer, so most experts of a layer are used, a few heavily.
fn prompt_counts(s: &mut u64) -> Vec<u32> {
    let mut counts = vec![0u32; L * E];
    for layer in 0..L {
        for _ in 0..TOKENS {
            let mut picked = [usize::MAX; 8];
            let mut n = 0;
            while n < TOPK {
                let x = lcg(s) % 1000;
                let ex = ((x * x) / 4000 + layer as u64 * 37) as usize % E;
                if !picked[..n].contains(&ex) {
                    picked[n] = ex;
                    n += 1;
                    counts[layer * E + ex] += 1;
                }
            }
        }
    }
    counts
}

/// The wire path and its parts for `counts` sent in one encoding (`bits`: the `log` encoding's,
/// None: exact `dense`).
fn bench_wire(c: &mut Criterion<ThreadTime>, router: &Router, counts: &[u32], name: &str, bits: Option<u32>) {
    let limits = DecodeLimits { layout: Some((L, E)), ..Default::default() };
    let ev = event(counts, L, E, bits);
    let Ok(Some(Payload::Counts(wire))) = decode_event(&ev, &limits) else { panic!("the bench's payload does not decode") };
    let dense = wire.to_layout(L, E).unwrap();
    c.bench_function(&format!("wire_{name}_decode_event"), |b| b.iter(|| black_box(decode_event(black_box(&ev), &limits).unwrap())));
    let spec = router.store().unwrap().set().spec().clone();
    let mut sig = SparseSignature::default();
    c.bench_function(&format!("wire_{name}_fill_signature"), |b| {
        b.iter(|| {
            wire.fill_signature(&spec, &mut sig).unwrap();
            black_box(sig.norm)
        })
    });
    c.bench_function(&format!("wire_{name}_fill_dense_same_counts"), |b| {
        b.iter(|| {
            spec.fill_dense(&dense, &mut sig).unwrap();
            black_box(sig.norm)
        })
    });
    let set = router.store().unwrap().snapshot().set.clone();
    c.bench_function(&format!("wire_{name}_fill_and_distances"), |b| {
        b.iter(|| black_box(from_fill(&set, None, |spec, out| wire.fill_signature(spec, out)).unwrap()))
    });
    c.bench_function(&format!("wire_{name}_distances_fused"), |b| b.iter(|| black_box(wire.distances(&set, None).unwrap())));
    c.bench_function(&format!("wire_{name}_route_counts"), |b| b.iter(|| black_box(router.route_counts(&wire, false, false).unwrap().decision.worker)));
    c.bench_function(&format!("wire_{name}_route_counts_keep"), |b| b.iter(|| black_box(router.route_counts(&wire, true, false).unwrap().signature)));
    c.bench_function(&format!("wire_{name}_route_dense_same_counts"), |b| {
        b.iter(|| black_box(router.route(|set| from_counts::<u32, f32>(set, Counts::Dense(&dense)), false).unwrap().decision.worker))
    });
    c.bench_function(&format!("wire_{name}_event_to_decision"), |b| {
        b.iter(|| {
            let Ok(Some(Payload::Counts(w))) = decode_event(black_box(&ev), &limits) else { unreachable!() };
            black_box(router.route_counts(&w, false, false).unwrap().decision.worker)
        })
    });
}

fn bench(c: &mut Criterion<ThreadTime>) {
    let mut s = 42u64;
    let dir = std::env::temp_dir().join(format!("eldr-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let router = centroid_router(&dir, &mut s);
    let counts = prompt_counts(&mut s);
    let (idx, val): (Vec<u32>, Vec<u32>) = counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &c)| (i as u32, c)).unzip();
    c.bench_function("route_sparse_dsv3_k8_2k_tokens", |b| {
        b.iter(|| black_box(router.route(|set| from_counts(set, Counts::Sparse(&idx, &val)), false).unwrap().decision.worker))
    });
    for (name, bits) in [("log6", Some(6)), ("dense_exact", None)] {
        bench_wire(c, &router, &counts, name, bits);
    }
    let tracker = Arc::new(QueueTracker::new(8, 2000));
    c.bench_function("queue_acquire_release", |b| {
        b.iter(|| {
            let g = tracker.acquire(black_box(3), black_box(100));
            g.release();
        })
    });
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadTime);
    targets = bench
}
criterion_main!(benches);
