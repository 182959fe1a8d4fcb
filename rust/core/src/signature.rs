//! The signature normalizer: `s = normalize_L2(idf ⊙ concat_l(w_l · c[l]))` over the selected
//! MoE layers (weight > 0). Dense and unselected layers carry weight 0 and vanish from the
//! signature, whose dimension is `selected_layers * E`.
//!
//! Work is done in f64 and a signature is kept sparse ([`SparseSignature`]): a 2k-token
//! DeepSeek-V3 prompt touches most of the 58x256 experts, but shorter prompts touch far fewer,
//! and the router never needs the dense vector (it dots straight into the centroids).

use std::fmt;

/// Why a request has no usable signature. The router then falls back to shortest queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoSignature {
    /// No signature arrived (prefill did not send one, or it timed out).
    Missing,
    /// Nothing left after masking and weighting (all zero, or only masked layers).
    Empty,
    /// A NaN or infinite count.
    NonFinite,
    /// A negative count.
    Negative,
    /// A sparse index or expert id outside `L * E`.
    OutOfRange,
    /// The input's shape does not match the spec's `[L, E]`.
    Shape,
}

impl NoSignature {
    pub fn as_str(&self) -> &'static str {
        match self {
            NoSignature::Missing => "missing",
            NoSignature::Empty => "empty",
            NoSignature::NonFinite => "non_finite",
            NoSignature::Negative => "negative",
            NoSignature::OutOfRange => "out_of_range",
            NoSignature::Shape => "shape",
        }
    }
}

impl NoSignature {
    pub const ALL: [NoSignature; 6] =
        [NoSignature::Missing, NoSignature::Empty, NoSignature::NonFinite, NoSignature::Negative, NoSignature::OutOfRange, NoSignature::Shape];

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.as_str() == s)
    }
}

impl fmt::Display for NoSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::error::Error for NoSignature {}

/// A count value read from numpy (integer counts or float weights).
pub trait CountValue: Copy + Send + Sync {
    /// Whether a value of this type can be negative or NaN (and so must be checked).
    const MAY_BE_INVALID: bool;
    fn to_f32(self) -> f32;
}

macro_rules! impl_count {
    ($check:expr => $($t:ty),*) => {$(impl CountValue for $t {
        const MAY_BE_INVALID: bool = $check;
        #[inline(always)]
        fn to_f32(self) -> f32 { self as f32 }
    })*};
}
impl_count!(false => u8, u16, u32, u64);
impl_count!(true => i16, i32, i64, f32, f64);

/// An integer index into the flat `L * E` count space, read from numpy.
pub trait SparseIndex: Copy + Send + Sync {
    /// The index, or None when negative.
    fn to_index(self) -> Option<usize>;
}

macro_rules! impl_index {
    ($($t:ty),*) => {$(impl SparseIndex for $t {
        #[inline]
        #[allow(unused_comparisons)]
        fn to_index(self) -> Option<usize> { if self < 0 { None } else { Some(self as usize) } }
    })*};
}
impl_index!(u16, u32, u64, i32, i64);

/// A signature in sparse form: indices into the `D`-dim signature space (ascending) and the
/// weighted values before normalization, with their L2 norm. The unit signature is
/// `value / norm`; the router folds that division into its distances instead of a pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseSignature {
    pub index: Vec<u32>,
    pub value: Vec<f32>,
    pub norm: f64,
}

impl SparseSignature {
    fn with_capacity(n: usize) -> Self {
        SparseSignature { index: Vec::with_capacity(n), value: Vec::with_capacity(n), norm: 0.0 }
    }

    /// The unit signature's nonzero values.
    pub fn unit_values(&self) -> Vec<f64> {
        self.value.iter().map(|&v| v as f64 / self.norm).collect()
    }

    pub fn to_dense(&self, dim: usize) -> Vec<f32> {
        let mut out = vec![0f32; dim];
        for (&i, &v) in self.index.iter().zip(&self.value) {
            out[i as usize] = (v as f64 / self.norm) as f32;
        }
        out
    }
}

/// Layer weights and IDF: how raw counts become a signature.
#[derive(Debug, Clone, PartialEq)]
pub struct SignatureSpec {
    layers: usize,
    experts: usize,
    layer_weights: Vec<f32>,
    idf: Vec<f32>,
    /// `w_l * idf[l][e]` for every flat index `l*E + e` (0 on masked layers), computed in f64.
    scale: Vec<f32>,
    /// Output index of flat index `l*E + e`, or `u32::MAX` on masked layers.
    out_index: Vec<u32>,
    selected: Vec<usize>,
}

impl SignatureSpec {
    /// `layer_weights` has `L` entries (0 masks a layer); `idf` is `[L, E]` row-major.
    pub fn new(layer_weights: &[f32], idf: &[f32]) -> Result<Self, String> {
        let layers = layer_weights.len();
        if layers == 0 {
            return Err("layer_weights is empty".into());
        }
        if idf.is_empty() || idf.len() % layers != 0 {
            return Err(format!("idf has {} values, not a multiple of L={layers}", idf.len()));
        }
        let experts = idf.len() / layers;
        if let Some((l, w)) = layer_weights.iter().enumerate().find(|(_, w)| !w.is_finite() || **w < 0.0) {
            return Err(format!("layer weight {l} is {w}; weights must be finite and >= 0"));
        }
        if let Some((i, v)) = idf.iter().enumerate().find(|(_, v)| !v.is_finite() || **v < 0.0) {
            return Err(format!("idf[{}][{}] is {v}; IDF must be finite and >= 0", i / experts, i % experts));
        }
        let selected: Vec<usize> = (0..layers).filter(|&l| layer_weights[l] > 0.0).collect();
        if selected.is_empty() {
            return Err("no layer is selected: every layer weight is 0".into());
        }
        let mut scale = vec![0f32; layers * experts];
        let mut out_index = vec![u32::MAX; layers * experts];
        for (slot, &l) in selected.iter().enumerate() {
            for e in 0..experts {
                scale[l * experts + e] = (layer_weights[l] as f64 * idf[l * experts + e] as f64) as f32;
                out_index[l * experts + e] = (slot * experts + e) as u32;
            }
        }
        Ok(SignatureSpec { layers, experts, layer_weights: layer_weights.to_vec(), idf: idf.to_vec(), scale, out_index, selected })
    }

    pub fn num_layers(&self) -> usize {
        self.layers
    }
    pub fn num_experts(&self) -> usize {
        self.experts
    }
    pub fn dim(&self) -> usize {
        self.selected.len() * self.experts
    }
    pub fn selected_layers(&self) -> &[usize] {
        &self.selected
    }
    pub fn layer_weights(&self) -> &[f32] {
        &self.layer_weights
    }
    pub fn idf(&self) -> &[f32] {
        &self.idf
    }

    /// Validate and weight dense `[L, E]` counts, passing each nonzero weighted value
    /// `(output index, w_l * idf * c)` to `sink` in ascending order. The consumer computes
    /// the norm (the router fuses it into its distance kernel).
    /// This is the one implementation of the formula: the materialized signatures below and
    /// the router's fused distance kernel both run through it.
    #[inline(always)]
    pub fn fold_dense<T: CountValue>(&self, counts: &[T], mut sink: impl FnMut(u32, f32)) -> Result<(), NoSignature> {
        if counts.len() != self.scale.len() {
            return Err(NoSignature::Shape);
        }
        for (j, &c) in counts.iter().enumerate() {
            self.weigh(j, c, &mut sink)?;
        }
        Ok(())
    }

    /// Like [`Self::fold_dense`] for `(flat index l*E+e, count)` pairs. Returns whether the
    /// indices were strictly ascending; if not, repeated indices have not been merged and
    /// the values are not yet the signature's (use [`Self::from_sparse`]).
    #[inline(always)]
    pub fn fold_sparse<I: SparseIndex, T: CountValue>(&self, index: &[I], counts: &[T], mut sink: impl FnMut(u32, f32)) -> Result<bool, NoSignature> {
        if index.len() != counts.len() {
            return Err(NoSignature::Shape);
        }
        let n = self.scale.len();
        let mut ascending = true;
        let mut next = 0usize; // smallest index that keeps the order strictly ascending
        for (&i, &c) in index.iter().zip(counts) {
            let j = match i.to_index() {
                Some(j) if j < n => j,
                _ => return Err(NoSignature::OutOfRange),
            };
            ascending &= j >= next;
            next = j + 1;
            self.weigh(j, c, &mut sink)?;
        }
        Ok(ascending)
    }

    #[inline(always)]
    fn weigh<T: CountValue>(&self, j: usize, c: T, sink: &mut impl FnMut(u32, f32)) -> Result<(), NoSignature> {
        let c = c.to_f32();
        if T::MAY_BE_INVALID {
            if !(c >= 0.0) {
                return Err(if c.is_nan() { NoSignature::NonFinite } else { NoSignature::Negative });
            }
            if c == f32::INFINITY {
                return Err(NoSignature::NonFinite);
            }
        }
        let x = self.scale[j] * c;
        if x != 0.0 {
            sink(self.out_index[j], x);
        }
        Ok(())
    }

    fn norm_of(values: &[f32]) -> Result<f64, NoSignature> {
        let n2: f64 = values.iter().map(|&v| v as f64 * v as f64).sum();
        if !n2.is_finite() {
            Err(NoSignature::NonFinite)
        } else if n2 > 0.0 {
            Ok(n2.sqrt())
        } else {
            Err(NoSignature::Empty)
        }
    }

    /// Dense `[L, E]` counts -> signature.
    pub fn from_dense<T: CountValue>(&self, counts: &[T]) -> Result<SparseSignature, NoSignature> {
        let mut sig = SparseSignature::with_capacity(counts.len().min(self.dim()));
        self.fold_dense(counts, |i, x| {
            sig.index.push(i);
            sig.value.push(x);
        })?;
        sig.norm = Self::norm_of(&sig.value)?;
        Ok(sig)
    }

    /// Sparse `(flat index l*E+e, count)` pairs -> signature. Repeated indices add up.
    pub fn from_sparse<I: SparseIndex, T: CountValue>(&self, index: &[I], counts: &[T]) -> Result<SparseSignature, NoSignature> {
        let mut sig = SparseSignature::with_capacity(index.len());
        let ascending = self.fold_sparse(index, counts, |i, x| {
            sig.index.push(i);
            sig.value.push(x);
        })?;
        if !ascending {
            sig = Self::sort_merge(sig);
        }
        sig.norm = Self::norm_of(&sig.value)?;
        Ok(sig)
    }

    /// Top-k ids `[T, L, k]` (flat, row-major) -> signature.
    pub fn from_topk<T: crate::experts::ExpertId>(&self, ids: &[T], k: usize) -> Result<SparseSignature, NoSignature> {
        if k == 0 || ids.len() % (self.layers * k) != 0 {
            return Err(NoSignature::Shape);
        }
        let mut counts = vec![0u32; self.layers * self.experts];
        crate::experts::count_topk(ids, self.layers, k, self.experts, &mut counts).map_err(|_| NoSignature::OutOfRange)?;
        self.from_dense(&counts)
    }

    fn sort_merge(sig: SparseSignature) -> SparseSignature {
        let mut pairs: Vec<(u32, f32)> = sig.index.into_iter().zip(sig.value).collect();
        pairs.sort_unstable_by_key(|p| p.0);
        let mut out = SparseSignature::with_capacity(pairs.len());
        for (i, v) in pairs {
            if out.index.last() == Some(&i) {
                *out.value.last_mut().unwrap() += v;
            } else {
                out.index.push(i);
                out.value.push(v);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SignatureSpec {
        // L=3, E=2; layer 0 is dense/masked.
        SignatureSpec::new(&[0.0, 1.0, 2.0], &[1.0, 1.0, 1.0, 0.5, 2.0, 1.0]).unwrap()
    }

    #[test]
    fn dense_matches_hand_computation() {
        let s = spec().from_dense(&[9u32, 9, 2, 4, 1, 0]).unwrap();
        // weighted: layer1 -> [2*1, 4*0.5] = [2, 2]; layer2 -> [2*2*1, 0] = [4, 0]
        let n = (4.0f64 + 4.0 + 16.0).sqrt();
        assert_eq!(s.index, vec![0, 1, 2]);
        for (a, b) in s.unit_values().iter().zip([2.0 / n, 2.0 / n, 4.0 / n]) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn sparse_equals_dense_and_merges_repeats() {
        let sp = spec();
        let d = sp.from_dense(&[0f32, 0.0, 2.0, 4.0, 1.0, 0.0]).unwrap();
        let s = sp.from_sparse(&[4i64, 2, 3, 2], &[1u32, 1, 4, 1]).unwrap();
        assert_eq!(d.index, s.index);
        for (a, b) in d.unit_values().iter().zip(&s.unit_values()) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn unusable_inputs_are_typed() {
        let sp = spec();
        assert_eq!(sp.from_dense(&[0u32; 6]), Err(NoSignature::Empty));
        assert_eq!(sp.from_dense(&[5u32, 5, 0, 0, 0, 0]), Err(NoSignature::Empty)); // masked layer only
        assert_eq!(sp.from_dense(&[0f32, 0.0, f32::NAN, 0.0, 0.0, 0.0]), Err(NoSignature::NonFinite));
        assert_eq!(sp.from_dense(&[0f32, 0.0, -1.0, 0.0, 0.0, 0.0]), Err(NoSignature::Negative));
        assert_eq!(sp.from_dense(&[1u32; 5]), Err(NoSignature::Shape));
        assert_eq!(sp.from_sparse(&[6i64], &[1u32]), Err(NoSignature::OutOfRange));
        assert_eq!(sp.from_sparse(&[-1i64], &[1u32]), Err(NoSignature::OutOfRange));
        assert_eq!(sp.from_topk(&[0i32, 1, 7], 1), Err(NoSignature::OutOfRange));
    }

    #[test]
    fn spec_rejects_bad_weights() {
        assert!(SignatureSpec::new(&[0.0, 0.0], &[1.0; 4]).is_err());
        assert!(SignatureSpec::new(&[1.0, f32::NAN], &[1.0; 4]).is_err());
        assert!(SignatureSpec::new(&[1.0, 1.0], &[1.0; 5]).is_err());
        assert!(SignatureSpec::new(&[1.0, 1.0], &[1.0, 1.0, -1.0, 1.0]).is_err());
    }
}
