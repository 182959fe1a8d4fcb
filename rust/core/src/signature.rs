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
            NoSignature::Empty => "empty",
            NoSignature::NonFinite => "non_finite",
            NoSignature::Negative => "negative",
            NoSignature::OutOfRange => "out_of_range",
            NoSignature::Shape => "shape",
        }
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
    fn to_f64(self) -> f64;
}

macro_rules! impl_count {
    ($($t:ty),*) => {$(impl CountValue for $t { #[inline] fn to_f64(self) -> f64 { self as f64 } })*};
}
impl_count!(u8, u16, u32, u64, i16, i32, i64, f32, f64);

/// A unit signature in sparse form: indices into the `D`-dim signature space, ascending.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseSignature {
    pub index: Vec<u32>,
    pub value: Vec<f64>,
}

impl SparseSignature {
    pub fn to_dense(&self, dim: usize) -> Vec<f32> {
        let mut out = vec![0f32; dim];
        for (&i, &v) in self.index.iter().zip(&self.value) {
            out[i as usize] = v as f32;
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
    /// `w_l * idf[l][e]` for every flat index `l*E + e` (0 on masked layers).
    scale: Vec<f64>,
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
        let mut scale = vec![0f64; layers * experts];
        let mut out_index = vec![u32::MAX; layers * experts];
        for (slot, &l) in selected.iter().enumerate() {
            for e in 0..experts {
                scale[l * experts + e] = layer_weights[l] as f64 * idf[l * experts + e] as f64;
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

    /// Dense `[L, E]` counts -> unit signature.
    pub fn from_dense<T: CountValue>(&self, counts: &[T]) -> Result<SparseSignature, NoSignature> {
        if counts.len() != self.scale.len() {
            return Err(NoSignature::Shape);
        }
        let mut sig = SparseSignature::default();
        for (j, &c) in counts.iter().enumerate() {
            self.push(&mut sig, j, c.to_f64())?;
        }
        Self::finish(sig)
    }

    /// Sparse `(flat index l*E+e, count)` pairs -> unit signature. Repeated indices add up.
    pub fn from_sparse<I: CountValue, T: CountValue>(&self, index: &[I], counts: &[T]) -> Result<SparseSignature, NoSignature> {
        if index.len() != counts.len() {
            return Err(NoSignature::Shape);
        }
        let mut sig = SparseSignature::default();
        let n = self.scale.len() as f64;
        let mut sorted = true;
        let mut last = -1f64;
        for (&i, &c) in index.iter().zip(counts) {
            let j = i.to_f64();
            if !(j >= 0.0 && j < n) || j.fract() != 0.0 {
                return Err(NoSignature::OutOfRange);
            }
            sorted &= j > last;
            last = j;
            self.push(&mut sig, j as usize, c.to_f64())?;
        }
        if !sorted {
            sig = Self::sort_merge(sig);
        }
        Self::finish(sig)
    }

    /// Top-k ids `[T, L, k]` (flat, row-major) -> unit signature.
    pub fn from_topk<T: crate::experts::ExpertId>(&self, ids: &[T], k: usize) -> Result<SparseSignature, NoSignature> {
        if k == 0 || ids.len() % (self.layers * k) != 0 {
            return Err(NoSignature::Shape);
        }
        let mut counts = vec![0u32; self.layers * self.experts];
        crate::experts::count_topk(ids, self.layers, k, self.experts, &mut counts).map_err(|_| NoSignature::OutOfRange)?;
        self.from_dense(&counts)
    }

    #[inline]
    fn push(&self, sig: &mut SparseSignature, j: usize, c: f64) -> Result<(), NoSignature> {
        if !c.is_finite() {
            return Err(NoSignature::NonFinite);
        }
        if c < 0.0 {
            return Err(NoSignature::Negative);
        }
        let x = self.scale[j] * c;
        if x != 0.0 {
            sig.index.push(self.out_index[j]);
            sig.value.push(x);
        }
        Ok(())
    }

    fn sort_merge(sig: SparseSignature) -> SparseSignature {
        let mut pairs: Vec<(u32, f64)> = sig.index.into_iter().zip(sig.value).collect();
        pairs.sort_unstable_by_key(|p| p.0);
        let mut out = SparseSignature::default();
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

    fn finish(mut sig: SparseSignature) -> Result<SparseSignature, NoSignature> {
        let norm2: f64 = sig.value.iter().map(|v| v * v).sum();
        if !(norm2 > 0.0) {
            return Err(NoSignature::Empty);
        }
        if !norm2.is_finite() {
            return Err(NoSignature::NonFinite);
        }
        let inv = 1.0 / norm2.sqrt();
        sig.value.iter_mut().for_each(|v| *v *= inv);
        Ok(sig)
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
        for (a, b) in s.value.iter().zip([2.0 / n, 2.0 / n, 4.0 / n]) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn sparse_equals_dense_and_merges_repeats() {
        let sp = spec();
        let d = sp.from_dense(&[0f32, 0.0, 2.0, 4.0, 1.0, 0.0]).unwrap();
        let s = sp.from_sparse(&[4i64, 2, 3, 2], &[1u32, 1, 4, 1]).unwrap();
        assert_eq!(d.index, s.index);
        for (a, b) in d.value.iter().zip(&s.value) {
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
