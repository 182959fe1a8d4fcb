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

/// K-wide dot-product accumulator with block-wise f32 -> f64 flushing.
struct Dots<'m, const K: usize> {
    m: &'m [f32],
    acc: [f32; K],
    sum: [f64; K],
    n: usize,
}

impl<'m, const K: usize> Dots<'m, K> {
    #[inline(always)]
    fn new(m: &'m [f32]) -> Self {
        Dots { m, acc: [0.0; K], sum: [0.0; K], n: 0 }
    }
    #[inline(always)]
    fn add(&mut self, j: u32, x: f32) {
        let row: &[f32; K] = self.m[j as usize * K..(j as usize + 1) * K].try_into().unwrap();
        for i in 0..K {
            self.acc[i] += x * row[i];
        }
        self.n += 1;
        if self.n % BLOCK == 0 {
            self.flush();
        }
    }
    #[inline(always)]
    fn flush(&mut self) {
        for i in 0..K {
            self.sum[i] += self.acc[i] as f64;
            self.acc[i] = 0.0;
        }
    }
    #[inline(always)]
    fn distances(mut self, norm2: f64) -> Vec<f64> {
        self.flush();
        let inv = 1.0 / norm2.sqrt();
        self.sum.iter().map(|d| 1.0 - d * inv).collect()
    }
}

/// The same for any K (no const-generic specialization).
struct DotsDyn<'m> {
    m: &'m [f32],
    k: usize,
    acc: Vec<f32>,
    sum: Vec<f64>,
    n: usize,
}

impl<'m> DotsDyn<'m> {
    fn new(m: &'m [f32], k: usize) -> Self {
        DotsDyn { m, k, acc: vec![0.0; k], sum: vec![0.0; k], n: 0 }
    }
    #[inline(always)]
    fn add(&mut self, j: u32, x: f32) {
        let row = &self.m[j as usize * self.k..(j as usize + 1) * self.k];
        for (a, &c) in self.acc.iter_mut().zip(row) {
            *a += x * c;
        }
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
    fn distances(mut self, norm2: f64) -> Vec<f64> {
        self.flush();
        let inv = 1.0 / norm2.sqrt();
        self.sum.iter().map(|d| 1.0 - d * inv).collect()
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
                let n2 = spec.fold_dense(c, |j, x| dots.add(j, x))?;
                Ok(dots.distances(n2))
            }
            Counts::Sparse(idx, c) => {
                let (n2, ascending) = spec.fold_sparse(idx, c, |j, x| dots.add(j, x))?;
                if ascending {
                    Ok(dots.distances(n2))
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
        Ok(dots.distances(sig.norm * sig.norm))
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
