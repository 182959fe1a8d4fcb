//! Signature-to-centroid distances `d_k = 1 - cos(s, mu_k)`, the hot loop of a route.
//!
//! From raw counts the signature is never materialized: [`SignatureSpec::fold_dense`] /
//! `fold_sparse` stream each weighted value into K-wide dot products against the
//! feature-major centroid matrix (one contiguous row per feature), and the norm divides at
//! the end. Products are summed in f32 lanes, which vectorize, and flushed into f64 every
//! `BLOCK` features, which keeps the error near f64's (the parity tests hold distances to
//! 1e-6). AVX2 is used when the CPU has it (detected once at run time), so a portable build
//! stays fast.

use crate::centroid_file::CentroidSet;
use crate::signature::{CountValue, NoSignature, SignatureSpec, SparseIndex, SparseSignature};

const BLOCK: usize = 64;

/// Raw per-request counts, as the prefill worker sends them.
#[derive(Clone, Copy)]
pub enum Counts<'a, I, T> {
    Dense(&'a [T]),
    Sparse(&'a [I], &'a [T]),
}

/// K-wide dot-product accumulator. Values are buffered per block of `BLOCK` features, then
/// summed with four independent f32 accumulators (so the adds pipeline instead of waiting on
/// each other) and flushed into f64 totals, together with the squared norm.
struct Dots<'m, const K: usize> {
    m: &'m [f32],
    buf_j: [u32; BLOCK],
    buf_x: [f32; BLOCK],
    len: usize,
    sum: [f64; K],
    n2: f64,
}

impl<'m, const K: usize> Dots<'m, K> {
    #[inline(always)]
    fn new(m: &'m [f32]) -> Self {
        Dots { m, buf_j: [0; BLOCK], buf_x: [0.0; BLOCK], len: 0, sum: [0.0; K], n2: 0.0 }
    }
    #[inline(always)]
    fn add(&mut self, j: u32, x: f32) {
        self.buf_j[self.len] = j;
        self.buf_x[self.len] = x;
        self.len += 1;
        if self.len == BLOCK {
            self.flush();
        }
    }
    #[inline(always)]
    fn row(&self, t: usize) -> &[f32; K] {
        let j = self.buf_j[t] as usize;
        self.m[j * K..(j + 1) * K].try_into().unwrap()
    }
    #[inline(always)]
    fn flush(&mut self) {
        let mut a = [[0f32; K]; 4];
        let mut q = [0f32; 4];
        let full = self.len / 4 * 4;
        let mut t = 0;
        while t < full {
            for u in 0..4 {
                let x = self.buf_x[t + u];
                let row = self.row(t + u);
                for i in 0..K {
                    a[u][i] += x * row[i];
                }
                q[u] += x * x;
            }
            t += 4;
        }
        while t < self.len {
            let x = self.buf_x[t];
            let row = self.row(t);
            for i in 0..K {
                a[0][i] += x * row[i];
            }
            q[0] += x * x;
            t += 1;
        }
        for i in 0..K {
            self.sum[i] += ((a[0][i] + a[1][i]) + (a[2][i] + a[3][i])) as f64;
        }
        self.n2 += ((q[0] + q[1]) + (q[2] + q[3])) as f64;
        self.len = 0;
    }
    #[inline(always)]
    fn distances(mut self) -> Result<Vec<f64>, NoSignature> {
        self.flush();
        let inv = 1.0 / unit_norm(self.n2)?;
        Ok(self.sum.iter().map(|d| 1.0 - d * inv).collect())
    }
}

/// The norm of a signature from its squared norm, or why there is no signature.
#[inline]
fn unit_norm(n2: f64) -> Result<f64, NoSignature> {
    if !n2.is_finite() {
        Err(NoSignature::NonFinite)
    } else if n2 > 0.0 {
        Ok(n2.sqrt())
    } else {
        Err(NoSignature::Empty)
    }
}

/// The same for any K (no const-generic specialization).
struct DotsDyn<'m> {
    m: &'m [f32],
    k: usize,
    acc: Vec<f32>,
    sum: Vec<f64>,
    n: usize,
    n2: f64,
}

impl<'m> DotsDyn<'m> {
    fn new(m: &'m [f32], k: usize) -> Self {
        DotsDyn { m, k, acc: vec![0.0; k], sum: vec![0.0; k], n: 0, n2: 0.0 }
    }
    #[inline(always)]
    fn add(&mut self, j: u32, x: f32) {
        let row = &self.m[j as usize * self.k..(j as usize + 1) * self.k];
        for (a, &c) in self.acc.iter_mut().zip(row) {
            *a += x * c;
        }
        self.n2 += x as f64 * x as f64;
        self.n += 1;
        if self.n % BLOCK == 0 {
            self.flush();
        }
    }
    fn flush(&mut self) {
        for (s, a) in self.sum.iter_mut().zip(self.acc.iter_mut()) {
            *s += *a as f64;
            *a = 0.0;
        }
    }
    fn distances(mut self) -> Result<Vec<f64>, NoSignature> {
        self.flush();
        let inv = 1.0 / unit_norm(self.n2)?;
        Ok(self.sum.iter().map(|d| 1.0 - d * inv).collect())
    }
}

/// One kernel body, instantiated per K and per CPU feature level.
macro_rules! with_dots {
    ($k:expr, $m:expr, |$dots:ident| $body:expr) => {
        match $k {
            4 => { let mut $dots = Dots::<4>::new($m); $body }
            8 => { let mut $dots = Dots::<8>::new($m); $body }
            16 => { let mut $dots = Dots::<16>::new($m); $body }
            32 => { let mut $dots = Dots::<32>::new($m); $body }
            k => { let mut $dots = DotsDyn::new($m, k); $body }
        }
    };
}

#[inline(always)]
fn counts_impl<I: SparseIndex, T: CountValue>(set: &CentroidSet, spec: &SignatureSpec, counts: Counts<'_, I, T>) -> Result<Vec<f64>, NoSignature> {
    with_dots!(set.num_workers(), set.centroids_t(), |dots| {
        match counts {
            Counts::Dense(c) => {
                spec.fold_dense(c, |j, x| dots.add(j, x))?;
                dots.distances()
            }
            Counts::Sparse(idx, c) => {
                let ascending = spec.fold_sparse(idx, c, |j, x| dots.add(j, x))?;
                if ascending {
                    dots.distances()
                } else {
                    // Unsorted or repeated indices: merge first (rare; prefill sends them sorted).
                    signature_impl(set, &spec.from_sparse(idx, c)?)
                }
            }
        }
    })
}

#[inline(always)]
fn signature_impl(set: &CentroidSet, sig: &SparseSignature) -> Result<Vec<f64>, NoSignature> {
    with_dots!(set.num_workers(), set.centroids_t(), |dots| {
        for (&j, &x) in sig.index.iter().zip(&sig.value) {
            dots.add(j, x);
        }
        dots.distances()
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn counts_avx2<I: SparseIndex, T: CountValue>(set: &CentroidSet, spec: &SignatureSpec, counts: Counts<'_, I, T>) -> Result<Vec<f64>, NoSignature> {
    counts_impl(set, spec, counts)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn signature_avx2(set: &CentroidSet, sig: &SparseSignature) -> Result<Vec<f64>, NoSignature> {
    signature_impl(set, sig)
}

#[inline]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Distances from raw counts (fused: no signature is materialized).
pub fn from_counts<I: SparseIndex, T: CountValue>(set: &CentroidSet, counts: Counts<'_, I, T>) -> Result<Vec<f64>, NoSignature> {
    let spec = set.spec();
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected on this CPU.
        return unsafe { counts_avx2(set, spec, counts) };
    }
    counts_impl(set, spec, counts)
}

/// Distances from a materialized signature (e.g. from top-k ids).
pub fn from_signature(set: &CentroidSet, sig: &SparseSignature) -> Result<Vec<f64>, NoSignature> {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected on this CPU.
        return unsafe { signature_avx2(set, sig) };
    }
    signature_impl(set, sig)
}

/// Distances from a signature already in the centroids' D-dim space (any positive scale).
pub fn from_dense_signature(set: &CentroidSet, s: &[f32]) -> Result<Vec<f64>, NoSignature> {
    if s.len() != set.dim() {
        return Err(NoSignature::Shape);
    }
    let mut sig = SparseSignature::default();
    let mut n2 = 0f64;
    for (j, &v) in s.iter().enumerate() {
        if v == 0.0 {
            continue;
        }
        if v.is_nan() || v.is_infinite() {
            return Err(NoSignature::NonFinite);
        }
        if v < 0.0 {
            return Err(NoSignature::Negative);
        }
        n2 += v as f64 * v as f64;
        sig.index.push(j as u32);
        sig.value.push(v);
    }
    if !(n2 > 0.0) {
        return Err(NoSignature::Empty);
    }
    sig.norm = n2.sqrt();
    from_signature(set, &sig)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::centroid_file::CentroidWriter;
    use proptest::prelude::*;

    fn set(k: usize, seed: u64, dir: &std::path::Path) -> CentroidSet {
        let (l, e) = (5usize, 12usize);
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        let weights: Vec<f32> = (0..l).map(|i| if i == 0 { 0.0 } else { 0.5 + next() }).collect();
        let idf: Vec<f32> = (0..l * e).map(|_| next() * 3.0).collect();
        let cents: Vec<f32> = (0..k * 4 * e).map(|_| next().powi(3) + 1e-3).collect();
        let p = dir.join(format!("k{k}-{seed}.eldr"));
        CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| i.to_string()).collect(), provenance: "" }
            .write(&p)
            .unwrap();
        CentroidSet::open(&p).unwrap()
    }

    /// Straightforward f64 distances from a materialized unit signature.
    fn reference(set: &CentroidSet, sig: &SparseSignature) -> Vec<f64> {
        let (k, m) = (set.num_workers(), set.centroids_t());
        let unit = sig.unit_values();
        (0..k).map(|c| 1.0 - sig.index.iter().zip(&unit).map(|(&j, &v)| v * m[j as usize * k + c] as f64).sum::<f64>()).collect()
    }

    proptest! {
        #[test]
        fn fused_matches_reference(k in prop::sample::select(vec![1usize, 3, 4, 8, 16, 32]), counts in prop::collection::vec(0u32..40, 60), seed in 0u64..1000, shuffle in any::<bool>()) {
            let dir = tempfile::tempdir().unwrap();
            let set = set(k, seed, dir.path());
            let spec = set.spec();
            match spec.from_dense(&counts) {
                Err(why) => {
                    prop_assert_eq!(from_counts::<u32, u32>(&set, Counts::Dense(&counts)), Err(why));
                }
                Ok(sig) => {
                    let want = reference(&set, &sig);
                    let dense = from_counts::<u32, u32>(&set, Counts::Dense(&counts)).unwrap();
                    let (mut idx, mut val): (Vec<i64>, Vec<f32>) =
                        counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &c)| (i as i64, c as f32)).unzip();
                    if shuffle && idx.len() > 1 {
                        idx.reverse();
                        val.reverse();
                        // and a repeated index split in two halves
                        let (i0, v0) = (idx[0], val[0]);
                        val[0] = v0 / 2.0;
                        idx.push(i0);
                        val.push(v0 / 2.0);
                    }
                    let sparse = from_counts(&set, Counts::Sparse(&idx, &val)).unwrap();
                    let via_sig = from_signature(&set, &sig).unwrap();
                    for c in 0..k {
                        prop_assert!((dense[c] - want[c]).abs() < 1e-6, "dense {} vs {}", dense[c], want[c]);
                        prop_assert!((sparse[c] - want[c]).abs() < 1e-6, "sparse {} vs {}", sparse[c], want[c]);
                        prop_assert!((via_sig[c] - want[c]).abs() < 1e-6);
                    }
                }
            }
        }
    }

    #[test]
    fn bad_values_are_typed() {
        let dir = tempfile::tempdir().unwrap();
        let set = set(4, 1, dir.path());
        let mut c = vec![1f32; 60];
        c[30] = f32::NAN;
        assert_eq!(from_counts::<u32, f32>(&set, Counts::Dense(&c)), Err(NoSignature::NonFinite));
        c[30] = -2.0;
        assert_eq!(from_counts::<u32, f32>(&set, Counts::Dense(&c)), Err(NoSignature::Negative));
        assert_eq!(from_counts::<u32, f32>(&set, Counts::Dense(&c[..59])), Err(NoSignature::Shape));
        assert_eq!(from_counts(&set, Counts::Sparse(&[60i64], &[1u32])), Err(NoSignature::OutOfRange));
        assert_eq!(from_counts(&set, Counts::Sparse(&[3i64], &[1u32])), Err(NoSignature::Empty)); // masked layer 0
        assert_eq!(from_counts(&set, Counts::Sparse(&[20i64], &[f32::INFINITY])), Err(NoSignature::NonFinite));
        assert_eq!(from_dense_signature(&set, &vec![0f32; set.dim()]), Err(NoSignature::Empty));
    }
}
