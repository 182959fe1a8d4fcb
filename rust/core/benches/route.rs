//! Criterion benches of the hot path: one ELDR route from sparse counts of a 2k-token
//! DeepSeek-V3 prompt (58 MoE layers x 256 experts, top-8, K=8), and a queue acquire+release.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use eldr_core::distance::{from_counts, Counts};
use eldr_core::{CentroidWriter, QueueTracker, Router};

fn lcg(state: &mut u64) -> u64 {
    *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *state >> 33
}

fn bench(c: &mut Criterion) {
    let (l, e, k, topk, tokens) = (58usize, 256usize, 8usize, 8usize, 2048usize);
    let mut s = 42u64;
    let weights: Vec<f32> = (0..l).map(|i| if (10..48).contains(&i) { 1.0 } else { 0.0 }).collect();
    let idf: Vec<f32> = (0..l * e).map(|_| 0.2 + (lcg(&mut s) % 1000) as f32 / 500.0).collect();
    let d = 38 * e;
    let cents: Vec<f32> = (0..k * d).map(|_| (lcg(&mut s) % 1000) as f32 / 1000.0).collect();
    let dir = std::env::temp_dir().join(format!("eldr-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bench.eldr");
    CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| format!("d{i}")).collect(), provenance: "{}" }
        .write(&path)
        .unwrap();
    let router = Router::new("eldr", None, Some(&path), None, 0, 250, 2000).unwrap();
    // Sparse counts of a 2k-token prompt with skewed (domain-like) expert choice.
    let mut counts = vec![0u32; l * e];
    for _ in 0..tokens {
        for layer in 0..l {
            for _ in 0..topk {
                let x = lcg(&mut s) % 1000;
                let ex = ((x * x) / 4000) as usize % e;
                counts[layer * e + ex] += 1;
            }
        }
    }
    let (idx, val): (Vec<u32>, Vec<u32>) = counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &c)| (i as u32, c)).unzip();
    c.bench_function("route_sparse_dsv3_k8_2k_tokens", |b| {
        b.iter(|| {
            black_box(router.route(|set| from_counts(set, Counts::Sparse(&idx, &val)), false).unwrap().decision.worker)
        })
    });
    let tracker = Arc::new(QueueTracker::new(8, 2000));
    c.bench_function("queue_acquire_release", |b| {
        b.iter(|| {
            let g = tracker.acquire(black_box(3), black_box(100));
            g.release();
        })
    });
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, bench);
criterion_main!(benches);
