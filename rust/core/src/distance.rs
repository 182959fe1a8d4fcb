//! Signature-to-centroid distances `d_k = 1 - cos(s, mu_k)`, the hot loop of a route.
//!
//! Three ways in, one [`crate::order`] of summation (eight f32 lane sums by position, flushed into
//! f64 every 64 positions), so every path gives the same bits:
//!
//! * dense `[L, E]` counts, and sparse ones that fill a quarter of it, go eight positions at
//!   a time against the block-major centroids ([`blocks`]: no signature is built);
//! * other sparse counts fill a reused, per-thread signature buffer
//!   ([`crate::signature::SignatureSpec::fill_sparse`]), whose nonzeros are dotted into their K-wide rows of
//!   the feature-major matrix;
//! * the wire payload ([`crate::payload::DecodedCounts::distances`]) dots its rows as they are
//!   unpacked, with the same block kernel.
//!
//! With AVX2 (detected once at run time) and K in {8, 16, 32, 64} the sums run on explicit
//! SIMD lanes; otherwise on portable code, through a signature.

use std::cell::RefCell;

use crate::centroid_file::CentroidSet;
use crate::order::{lane_tree, GROUP};
use crate::signature::{CountValue, NoSignature, SignatureSpec, SparseIndex, SparseSignature};

/// Raw per-request counts, as the prefill worker sends them.
#[derive(Clone, Copy)]
pub enum Counts<'a, I, T> {
    Dense(&'a [T]),
    Sparse(&'a [I], &'a [T]),
}

thread_local! {
    static SCRATCH: RefCell<SparseSignature> = RefCell::new(SparseSignature::default());
}

thread_local! {
    /// A sparse request's counts laid out dense for [`blocks`] (zeros but while a route runs).
    static DENSE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Distances from raw counts, without allocating a signature. Dense counts, and sparse ones
/// that fill at least a quarter of `[L, E]`, go through [`blocks`] (no signature at all);
/// the rest through a signature. Both give the same bits ([`crate::order`]).
pub fn from_counts<I: SparseIndex, T: CountValue>(set: &CentroidSet, counts: Counts<'_, I, T>) -> Result<Vec<f64>, NoSignature> {
    let spec = set.spec();
    let size = spec.num_layers() * spec.num_experts();
    if blocks::applies(set) {
        match counts {
            Counts::Dense(c) if c.len() == size => {
                SignatureSpec::check_all(c)?;
                return Ok(blocks::distances(set, c)?);
            }
            Counts::Sparse(i, c) if i.len() == c.len() && 4 * i.len() >= size && ascending_below(i, size) => {
                SignatureSpec::check_all(c)?;
                return DENSE.with(|cell| {
                    let mut dense = cell.borrow_mut();
                    dense.resize(size, 0.0);
                    for (&j, &v) in i.iter().zip(c) {
                        // SAFETY: every index is below size (ascending_below)
                        unsafe { *dense.get_unchecked_mut(j.as_u64() as usize) = v.to_f32() };
                    }
                    let out = blocks::distances(set, &dense);
                    dense.fill(0.0); // a quarter or more of it was written: one memset is cheaper
                    out
                });
            }
            _ => {}
        }
    }
    from_fill(set, None, |spec, sig| match counts {
        Counts::Dense(c) => spec.fill_dense(c, sig),
        Counts::Sparse(i, c) => spec.fill_sparse(i, c, sig),
    })
}

/// Whether the indices are strictly ascending and below `n` (so no two merge).
fn ascending_below<I: SparseIndex>(index: &[I], n: usize) -> bool {
    let ascending = index.windows(2).fold(true, |ok, w| ok & (w[1].as_u64() > w[0].as_u64()));
    ascending && index.last().is_none_or(|l| l.as_u64() < n as u64)
}

/// Distances straight from dense `[L, E]` values, eight positions at a time against the
/// block-major centroids (as the wire route reads its rows): each selected layer's
/// `x = scale * c` into a small buffer, then [`avx2::Blocks::add_run`], which also sums the
/// norm. No signature is built, so there is no compaction and no second pass for the norm.
/// The values, zeros included, go through the [`crate::order`] as the signature's nonzeros do (a
/// zero adds exactly nothing), so the distances are the signature path's bits
/// (`blocks_match_signature_path` checks).
mod blocks {
    use super::*;

    /// AVX2, K in {8, 16, 32, 64}, and E a multiple of 8 (a layer's row is whole blocks).
    pub(super) fn applies(set: &CentroidSet) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(set.num_workers(), 8 | 16 | 32 | 64) && set.spec().num_experts() % 8 == 0 && std::arch::is_x86_feature_detected!("avx2")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = set;
            false
        }
    }

    /// `counts` has L*E values, each finite and non-negative ([`SignatureSpec::check_all`]);
    /// [`applies`] holds.
    pub(super) fn distances<T: CountValue>(set: &CentroidSet, counts: &[T]) -> Result<Vec<f64>, NoSignature> {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `applies` checked AVX2, K and E.
        unsafe {
            match set.num_workers() {
                8 => return distances_avx2::<8, T>(set, counts),
                16 => return distances_avx2::<16, T>(set, counts),
                32 => return distances_avx2::<32, T>(set, counts),
                64 => return distances_avx2::<64, T>(set, counts),
                _ => {}
            }
        }
        unreachable!("blocks::applies was not checked")
    }

    /// # Safety
    /// AVX2 is available, K is the set's number of workers, E is a multiple of 8, and
    /// `counts` has L*E values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn distances_avx2<const K: usize, T: CountValue>(set: &CentroidSet, counts: &[T]) -> Result<Vec<f64>, NoSignature> {
        let spec = set.spec();
        let e = spec.num_experts();
        let (scales, table) = (spec.scales(), spec.table());
        assert_eq!(counts.len(), scales.len());
        let m = set.centroid_blocks().as_ptr();
        let mut st = avx2::Blocks::<K>::new();
        let (mut dots, mut n2) = (vec![0f64; K], 0f64);
        let mut buf = vec![crate::centroid_file::Block8::default(); e / 8];
        for &l in spec.selected_layers() {
            let (row, sc) = (&counts[l * e..(l + 1) * e], &scales[l * e..(l + 1) * e]);
            for (x, (c, s)) in buf.iter_mut().zip(row.chunks_exact(8).zip(sc.chunks_exact(8))) {
                for i in 0..8 {
                    x.0[i] = s[i] * c[i].to_f32(); // the signature's `w * c`
                }
            }
            // the layer's first output position (a multiple of 8: E is)
            st.add_run(&buf, table[l * e].0 as usize, m, &mut dots, &mut n2);
        }
        st.flush::<true>(&mut dots, &mut n2);
        let inv = 1.0 / crate::signature::norm_from_squares(n2)?;
        Ok(dots.into_iter().map(|v| 1.0 - v * inv).collect())
    }
}

/// Distances from a signature that `fill` writes into the reused per-thread buffer (one of the
/// `fill_*` normalizers, or [`crate::payload::DecodedCounts::fill_signature`]). With `keep`,
/// the signature is also copied out (the drift reservoir's sample), so it is never computed twice.
pub fn from_fill<F>(set: &CentroidSet, keep: Option<&mut SparseSignature>, fill: F) -> Result<Vec<f64>, NoSignature>
where
    F: FnOnce(&crate::signature::SignatureSpec, &mut SparseSignature) -> Result<(), NoSignature>,
{
    SCRATCH.with(|cell| {
        let mut sig = cell.borrow_mut();
        fill(set.spec(), &mut sig)?;
        if let Some(k) = keep {
            k.clone_from(&sig);
        }
        // fill_* only emit indices below D: no range check needed.
        Ok(distances_unchecked(set, &sig))
    })
}

/// Distances from a signature (its values need not be unit: the norm divides).
pub fn from_signature(set: &CentroidSet, sig: &SparseSignature) -> Result<Vec<f64>, NoSignature> {
    let (k, m) = (set.num_workers(), set.centroids_t());
    if !(sig.norm > 0.0 && sig.norm.is_finite()) {
        return Err(NoSignature::Empty);
    }
    let d = m.len() / k;
    if sig.index.len() != sig.value.len() || sig.index.iter().any(|&j| j as usize >= d) {
        return Err(NoSignature::OutOfRange);
    }
    Ok(distances_unchecked(set, sig))
}

/// `sig` must have a positive finite norm and every index below D.
fn distances_unchecked(set: &CentroidSet, sig: &SparseSignature) -> Vec<f64> {
    let (k, m) = (set.num_workers(), set.centroids_t());
    let mut dots = vec![0f64; k];
    dot_rows(&sig.index, &sig.value, m, &mut dots);
    let inv = 1.0 / sig.norm;
    dots.into_iter().map(|v| 1.0 - v * inv).collect()
}

/// Distances from a signature already in the centroids' D-dim space (any positive scale).
pub fn from_dense_signature(set: &CentroidSet, s: &[f32]) -> Result<Vec<f64>, NoSignature> {
    if s.len() != set.dim() {
        return Err(NoSignature::Shape);
    }
    let mut sig = SparseSignature::default();
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
        sig.index.push(j as u32);
        sig.value.push(v);
    }
    sig.norm = crate::signature::norm_of(&sig.index, &sig.value)?;
    from_signature(set, &sig)
}

/// `dots[k] += sum_t value[t] * m[index[t] * K + k]`, in the [`crate::order`] every route path
/// uses. Every index must be below `m.len() / K`, ascending.
fn dot_rows(index: &[u32], value: &[f32], m: &[f32], dots: &mut [f64]) {
    let k = dots.len();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected; indices were checked against the matrix by the caller.
        match k {
            8 => return unsafe { dot_rows_avx2::<1>(index, value, m, dots) },
            16 => return unsafe { dot_rows_avx2::<2>(index, value, m, dots) },
            32 => return unsafe { dot_rows_avx2::<4>(index, value, m, dots) },
            64 => return unsafe { dot_rows_avx2::<8>(index, value, m, dots) },
            _ => {}
        }
    }
    dot_rows_portable(index, value, m, dots);
}

fn dot_rows_portable(index: &[u32], value: &[f32], m: &[f32], dots: &mut [f64]) {
    let k = dots.len();
    let mut lanes = vec![0f32; 8 * k]; // [lane][k]
    let mut group = usize::MAX;
    let flush = |lanes: &mut [f32], dots: &mut [f64]| {
        for (c, d) in dots.iter_mut().enumerate() {
            *d += lane_tree(std::array::from_fn(|i| lanes[i * k + c])) as f64;
        }
        lanes.iter_mut().for_each(|a| *a = 0.0);
    };
    for (&j, &x) in index.iter().zip(value) {
        let j = j as usize;
        if j / GROUP != group {
            flush(&mut lanes, dots);
            group = j / GROUP;
        }
        let row = &m[j * k..(j + 1) * k];
        for (a, &c) in lanes[(j % 8) * k..(j % 8 + 1) * k].iter_mut().zip(row) {
            *a += x * c;
        }
    }
    flush(&mut lanes, dots);
}

/// The [`crate::order`]'s lane sums on AVX2 for K = 8 * LANES: `acc[lane][l]` holds centroids
/// `8l..8l+8` of lane `j % 8`.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    pub(crate) struct Lanes<const LANES: usize> {
        pub acc: [[__m256; LANES]; 8],
        pub nrm: __m256,
        pub group: usize,
    }

    impl<const LANES: usize> Lanes<LANES> {
        #[inline(always)]
        pub unsafe fn new() -> Self {
            Lanes { acc: [[_mm256_setzero_ps(); LANES]; 8], nrm: _mm256_setzero_ps(), group: usize::MAX }
        }

        /// End the group: its lane trees into `dots` (and the norm's into `n2` with `NORM`).
        #[inline(always)]
        pub unsafe fn flush<const NORM: bool>(&mut self, dots: &mut [f64], n2: &mut f64) {
            let a = &self.acc;
            for l in 0..LANES {
                let t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0][l], a[1][l]), _mm256_add_ps(a[2][l], a[3][l])), _mm256_add_ps(_mm256_add_ps(a[4][l], a[5][l]), _mm256_add_ps(a[6][l], a[7][l])));
                let d = dots.as_mut_ptr().add(8 * l);
                _mm256_storeu_pd(d, _mm256_add_pd(_mm256_loadu_pd(d), _mm256_cvtps_pd(_mm256_castps256_ps128(t))));
                _mm256_storeu_pd(d.add(4), _mm256_add_pd(_mm256_loadu_pd(d.add(4)), _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(t))));
            }
            if NORM {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), self.nrm);
                *n2 += super::lane_tree(l) as f64;
                self.nrm = _mm256_setzero_ps();
            }
            self.acc = [[_mm256_setzero_ps(); LANES]; 8];
        }
    }

    /// The [`crate::order`]'s lane sums position-major, for the block kernels that read eight
    /// consecutive positions of a signature at once against the block-major centroids
    /// ([`crate::centroid_file::CentroidSet::centroid_blocks`]): lane i of `acc[c]` is
    /// centroid c's lane sum of positions `j % 8 == i` (the same sums as [`Lanes`], transposed,
    /// so a block costs one multiply and add per centroid and no broadcasts).
    #[derive(Clone, Copy)]
    pub(crate) struct Blocks<const K: usize> {
        pub acc: [__m256; K],
        pub nrm: __m256,
        pub group: usize,
    }

    impl<const K: usize> Blocks<K> {
        #[inline(always)]
        pub unsafe fn new() -> Self {
            Blocks { acc: [_mm256_setzero_ps(); K], nrm: _mm256_setzero_ps(), group: usize::MAX }
        }

        /// Add the block of values `x` (eight consecutive positions, the first a multiple of
        /// 8) against `mu`, the K centroids' eight values at those positions.
        #[inline(always)]
        pub unsafe fn add(&mut self, x: __m256, mu: *const f32) {
            self.nrm = _mm256_add_ps(self.nrm, _mm256_mul_ps(x, x));
            for (c, a) in self.acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(x, _mm256_load_ps(mu.add(8 * c))));
            }
        }

        /// Add a run of blocks: `xs[i]` holds the values of positions `j0 + 8i ..` (`j0` a
        /// multiple of 8), against the block-major centroids `blocks`; groups are flushed as
        /// the run crosses them. The sums stay in registers for the run.
        ///
        /// # Safety
        /// AVX2 is available; `blocks` holds K blocks per 8 positions up to `j0 + 8 xs.len()`.
        #[inline(always)]
        pub unsafe fn add_run(&mut self, xs: &[crate::centroid_file::Block8], j0: usize, blocks: *const crate::centroid_file::Block8, dots: &mut [f64], n2: &mut f64) {
            let mut sums = *self;
            for (i, x) in xs.iter().enumerate() {
                let j = j0 + 8 * i;
                if j / super::GROUP != sums.group {
                    sums.flush::<true>(dots, n2);
                    sums.group = j / super::GROUP;
                }
                sums.add(_mm256_load_ps(x.0.as_ptr()), blocks.add((j / 8) * K) as *const f32);
            }
            *self = sums;
        }

        /// End the group: each centroid's lane tree into `dots` (and the norm's into `n2`
        /// with `NORM`). Two rounds of horizontal adds and one add of the halves give
        /// `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))` for four centroids at once, as [`super::lane_tree`].
        #[inline(always)]
        pub unsafe fn flush<const NORM: bool>(&mut self, dots: &mut [f64], n2: &mut f64) {
            for (q, a) in self.acc.chunks_exact(4).enumerate() {
                let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                let s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
                let d = dots.as_mut_ptr().add(4 * q);
                _mm256_storeu_pd(d, _mm256_add_pd(_mm256_loadu_pd(d), _mm256_cvtps_pd(s)));
            }
            if NORM {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), self.nrm);
                *n2 += super::lane_tree(l) as f64;
                self.nrm = _mm256_setzero_ps();
            }
            self.acc = [_mm256_setzero_ps(); K];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_rows_avx2<const LANES: usize>(index: &[u32], value: &[f32], m: &[f32], dots: &mut [f64]) {
    use std::arch::x86_64::*;
    let k = 8 * LANES;
    let base = m.as_ptr();
    let mut st = avx2::Lanes::<LANES>::new();
    let mut unused = 0f64;
    for (&j, &x) in index.iter().zip(value) {
        let j = j as usize;
        if j / GROUP != st.group {
            st.flush::<false>(dots, &mut unused);
            st.group = j / GROUP;
        }
        let xv = _mm256_set1_ps(x);
        let row = base.add(j * k);
        let a = st.acc.get_unchecked_mut(j % 8);
        for (l, a) in a.iter_mut().enumerate() {
            *a = _mm256_add_ps(*a, _mm256_mul_ps(xv, _mm256_loadu_ps(row.add(8 * l))));
        }
    }
    st.flush::<false>(dots, &mut unused);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::centroid_file::CentroidWriter;
    use proptest::prelude::*;

    fn set(k: usize, seed: u64, dir: &std::path::Path) -> CentroidSet {
        block_set(k, 5, 12, seed, dir)
    }

    /// Straightforward f64 distances from a materialized unit signature.
    fn reference(set: &CentroidSet, sig: &SparseSignature) -> Vec<f64> {
        let (k, m) = (set.num_workers(), set.centroids_t());
        let unit = sig.unit_values();
        (0..k).map(|c| 1.0 - sig.index.iter().zip(&unit).map(|(&j, &v)| v * m[j as usize * k + c] as f64).sum::<f64>()).collect()
    }

    proptest! {
        #[test]
        fn fused_matches_reference(k in prop::sample::select(vec![1usize, 3, 4, 8, 16, 32, 64]), counts in prop::collection::vec(0u32..40, 60), seed in 0u64..1000, shuffle in any::<bool>()) {
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

    /// A set of K centroids over L layers of E experts (layer 0 masked).
    fn block_set(k: usize, l: usize, e: usize, seed: u64, dir: &std::path::Path) -> CentroidSet {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        let weights: Vec<f32> = (0..l).map(|i| if i == 0 { 0.0 } else { 0.5 + next() }).collect();
        let idf: Vec<f32> = (0..l * e).map(|_| next() * 3.0).collect();
        let cents: Vec<f32> = (0..k * (l - 1) * e).map(|_| next().powi(3) + 1e-3).collect();
        let p = dir.join(format!("b{k}-{l}-{e}-{seed}.eldr"));
        CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| i.to_string()).collect(), provenance: "" }
            .write(&p)
            .unwrap();
        CentroidSet::open(&p).unwrap()
    }

    fn bits(d: &Result<Vec<f64>, NoSignature>) -> Result<Vec<u64>, NoSignature> {
        d.clone().map(|d| d.iter().map(|v| v.to_bits()).collect())
    }

    proptest! {
        /// The block path (dense counts, and sparse ones dense enough) gives the signature
        /// path's bits, and its errors, for zeros, masked layers, -0.0 and overflowing counts.
        #[test]
        fn blocks_match_signature_path(k in prop::sample::select(vec![8usize, 16, 32, 64]), l in 2usize..5, e8 in 1usize..4,
                                       raw in prop::collection::vec((0u32..6, 0u32..40), 96), seed in 0u64..1000, special in 0u8..6) {
            let e = 8 * e8;
            let dir = tempfile::tempdir().unwrap();
            let set = block_set(k, l, e, seed, dir.path());
            prop_assume!(blocks::applies(&set)); // AVX2 (else nothing here is new)
            // mostly zeros or small counts
            let mut counts: Vec<f32> = (0..l * e).map(|i| { let (z, c) = raw[i % raw.len()]; if z < 2 { 0.0 } else { c as f32 } }).collect();
            match special {
                1 => counts[l * e - 1] = -0.0,
                2 => counts[e] = f32::MAX, // x = w * c overflows: no finite norm
                3 => counts.iter_mut().skip(e).for_each(|c| *c = 0.0), // only the masked layer
                4 => counts[e + 1] = f32::NAN,
                _ => {}
            }
            let want = from_fill(&set, None, |spec, sig| spec.fill_dense(&counts, sig));
            let dense = from_counts::<u32, f32>(&set, Counts::Dense(&counts));
            prop_assert_eq!(bits(&dense), bits(&want));
            let (idx, val): (Vec<i64>, Vec<f32>) = counts.iter().enumerate().filter(|(_, &c)| c != 0.0 || c.is_nan()).map(|(i, &c)| (i as i64, c)).unzip();
            let want_sparse = from_fill(&set, None, |spec, sig| spec.fill_sparse(&idx, &val, sig));
            prop_assert_eq!(bits(&from_counts(&set, Counts::Sparse(&idx, &val))), bits(&want_sparse));
            // the sparse path's scratch is all zeros again: a second, sparser request agrees too
            let half: Vec<i64> = idx.iter().copied().step_by(2).collect();
            let hv: Vec<f32> = val.iter().copied().step_by(2).collect();
            let want_half = from_fill(&set, None, |spec, sig| spec.fill_sparse(&half, &hv, sig));
            prop_assert_eq!(bits(&from_counts(&set, Counts::Sparse(&half, &hv))), bits(&want_half));
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
