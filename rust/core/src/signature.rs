//! The signature normalizer: `s = normalize_L2(idf ⊙ concat_l(w_l · c[l]))` over the selected
//! MoE layers (weight > 0). Dense and unselected layers carry weight 0 and vanish from the
//! signature, whose dimension is `selected_layers * E`.
//!
//! Work is done in f64 and a signature is kept sparse ([`SparseSignature`]): a 2k-token
//! DeepSeek-V3 prompt touches most of the 58x256 experts, but shorter prompts touch far fewer,
//! and the router never needs the dense vector (it dots straight into the centroids).

use thiserror::Error;

/// Why a request has no usable signature. The router then falls back to shortest queue.
/// The message is the reason's name ([`NoSignature::as_str`]): together with `no_centroids`
/// these names are the one fallback vocabulary, of decisions (`no_signature:<name>`), of the
/// `eldr_router_fallbacks_total{reason}` label and of both data planes.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoSignature {
    /// No signature arrived, for no reason known to the router.
    #[error("missing")]
    Missing,
    /// The prefill's signature did not arrive within the signature timeout.
    #[error("timeout")]
    Timeout,
    /// The payload (or the stream line carrying it) was refused: see `PayloadError`.
    #[error("malformed")]
    Malformed,
    /// The prefill said it sent no counts (its reason goes to the log, not the label).
    #[error("prefill_none")]
    PrefillNone,
    /// The prefill worker does not send signatures (unpatched, or started without the flag).
    #[error("prefill_no_signature")]
    PrefillNoSignature,
    /// Nothing left after masking and weighting (all zero, or only masked layers).
    #[error("empty")]
    Empty,
    /// A NaN or infinite count.
    #[error("non_finite")]
    NonFinite,
    /// A negative count.
    #[error("negative")]
    Negative,
    /// A sparse index or expert id outside `L * E`.
    #[error("out_of_range")]
    OutOfRange,
    /// The input's shape does not match the spec's `[L, E]`.
    #[error("shape")]
    Shape,
}

/// Why layer weights and IDF do not make a [`SignatureSpec`].
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SpecError {
    #[error("layer_weights is empty")]
    NoLayers,
    #[error("idf has {len} values, not a multiple of L={layers}")]
    IdfShape { len: usize, layers: usize },
    #[error("layer weight {layer} is {value}; weights must be finite and >= 0")]
    BadWeight { layer: usize, value: f32 },
    #[error("idf[{layer}][{expert}] is {value}; IDF must be finite and >= 0")]
    BadIdf { layer: usize, expert: usize, value: f32 },
    #[error("no layer is selected: every layer weight is 0")]
    NoneSelected,
}

impl NoSignature {
    pub fn as_str(&self) -> &'static str {
        match self {
            NoSignature::Missing => "missing",
            NoSignature::Timeout => "timeout",
            NoSignature::Malformed => "malformed",
            NoSignature::PrefillNone => "prefill_none",
            NoSignature::PrefillNoSignature => "prefill_no_signature",
            NoSignature::Empty => "empty",
            NoSignature::NonFinite => "non_finite",
            NoSignature::Negative => "negative",
            NoSignature::OutOfRange => "out_of_range",
            NoSignature::Shape => "shape",
        }
    }
}

impl NoSignature {
    pub const ALL: [NoSignature; 10] = [
        NoSignature::Missing,
        NoSignature::Timeout,
        NoSignature::Malformed,
        NoSignature::PrefillNone,
        NoSignature::PrefillNoSignature,
        NoSignature::Empty,
        NoSignature::NonFinite,
        NoSignature::Negative,
        NoSignature::OutOfRange,
        NoSignature::Shape,
    ];

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.as_str() == s)
    }
}

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
    /// The index as u64; a negative index wraps to a huge value, so one `< n` check covers
    /// both ends of the range.
    fn as_u64(self) -> u64;
}

macro_rules! impl_index {
    ($($t:ty),*) => {$(impl SparseIndex for $t {
        #[inline(always)]
        fn as_u64(self) -> u64 { self as i64 as u64 }
    })*};
}
impl_index!(u16, u32, i32, i64);
impl SparseIndex for u64 {
    #[inline(always)]
    fn as_u64(self) -> u64 {
        self
    }
}

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
    /// The unit signature's nonzero values.
    pub fn unit_values(&self) -> Vec<f64> {
        self.value.iter().map(|&v| v as f64 / self.norm).collect()
    }

    pub fn to_dense(&self, dim: usize) -> Vec<f32> {
        let mut out = vec![0f32; dim];
        self.write_unit(&mut out);
        out
    }

    /// Write the unit signature into a dense row (its nonzeros only; the caller zeroes the
    /// row). The one place a sparse signature becomes dense f32 values, so every dense
    /// output (one request or a batch) holds the same bits.
    pub fn write_unit(&self, row: &mut [f32]) {
        for (&i, &v) in self.index.iter().zip(&self.value) {
            row[i as usize] = (v as f64 / self.norm) as f32;
        }
    }
}

/// Why a CSR batch of count rows ([`SignatureSpec::fill_sparse_batch`]) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// `indptr` is empty, does not start at 0, decreases, or does not end at `index.len()`.
    #[error("indptr must hold n+1 non-decreasing offsets from 0 to len(index) = {entries}; {what}")]
    Indptr { entries: usize, what: String },
    /// `index` and `counts` differ in length.
    #[error("index has {index} entries and counts {counts}")]
    Lengths { index: usize, counts: usize },
    /// The output does not hold `rows * dim` values and `rows` valid flags.
    #[error("the output holds {values} values and {flags} flags, expected {rows} x {dim} and {rows}")]
    Output { values: usize, flags: usize, rows: usize, dim: usize },
    /// A row is bad input (out-of-range index, negative or non-finite count), not just empty.
    #[error("row {row}: {why}")]
    Row { row: usize, why: NoSignature },
}

/// Layer weights and IDF: how raw counts become a signature.
#[derive(Debug, Clone, PartialEq)]
pub struct SignatureSpec {
    layers: usize,
    experts: usize,
    layer_weights: Vec<f32>,
    idf: Vec<f32>,
    /// `(output index, w_l * idf[l][e])` for every flat input index `l*E + e`: the output index
    /// is `slot*E + e` where `slot` is the layer's position among the selected layers, and the
    /// scale is computed in f64, then rounded to f32. The two are interleaved so a sparse
    /// input's random access touches one cache line per entry. Masked layers have scale 0 and
    /// output index u32::MAX; a zero product is never emitted, so that index is never seen.
    table: Vec<(u32, f32)>,
    /// The scales of `table` alone, contiguous, so a row of them loads as SIMD lanes (the
    /// wire payload's row kernel, `payload/kernels.rs`).
    scales: Vec<f32>,
    selected: Vec<usize>,
}

impl SignatureSpec {
    /// `layer_weights` has `L` entries (0 masks a layer); `idf` is `[L, E]` row-major.
    pub fn new(layer_weights: &[f32], idf: &[f32]) -> Result<Self, SpecError> {
        let layers = layer_weights.len();
        if layers == 0 {
            return Err(SpecError::NoLayers);
        }
        if idf.is_empty() || idf.len() % layers != 0 {
            return Err(SpecError::IdfShape { len: idf.len(), layers });
        }
        let experts = idf.len() / layers;
        if let Some((layer, &value)) = layer_weights.iter().enumerate().find(|(_, w)| !w.is_finite() || **w < 0.0) {
            return Err(SpecError::BadWeight { layer, value });
        }
        if let Some((i, &value)) = idf.iter().enumerate().find(|(_, v)| !v.is_finite() || **v < 0.0) {
            return Err(SpecError::BadIdf { layer: i / experts, expert: i % experts, value });
        }
        let selected: Vec<usize> = (0..layers).filter(|&l| layer_weights[l] > 0.0).collect();
        if selected.is_empty() {
            return Err(SpecError::NoneSelected);
        }
        let mut scale = vec![0f32; layers * experts];
        let mut out_index = vec![u32::MAX; layers * experts];
        for (slot, &l) in selected.iter().enumerate() {
            for e in 0..experts {
                scale[l * experts + e] = (layer_weights[l] as f64 * idf[l * experts + e] as f64) as f32;
                out_index[l * experts + e] = (slot * experts + e) as u32;
            }
        }
        let table = out_index.into_iter().zip(scale.iter().copied()).collect();
        Ok(SignatureSpec { layers, experts, layer_weights: layer_weights.to_vec(), idf: idf.to_vec(), table, scales: scale, selected })
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
    /// `(output index, scale)` of every flat input index `l*E + e` (see the field's doc).
    pub(crate) fn table(&self) -> &[(u32, f32)] {
        &self.table
    }
    /// `w_l * idf[l][e]` of every flat input index (0 for masked layers), as in [`Self::table`].
    pub(crate) fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Validate and weight dense `[L, E]` counts into `out` (cleared first): each nonzero
    /// `w_l * idf[l][e] * c` with its output index, ascending. This and [`Self::fill_sparse`]
    /// are the one implementation of the formula; `out` can be reused across calls, so the
    /// router's hot path does not allocate.
    pub fn fill_dense<T: CountValue>(&self, counts: &[T], out: &mut SparseSignature) -> Result<(), NoSignature> {
        out.index.clear();
        out.value.clear();
        if counts.len() != self.table.len() {
            return Err(NoSignature::Shape);
        }
        Self::check_all(counts)?;
        // SAFETY: j < counts.len() == table.len().
        let len = unsafe { self.compact(out, counts.len(), |j| (j, counts.get_unchecked(j).to_f32())) };
        out.norm = norm_of(&out.index[..len], &out.value[..len])?;
        Ok(())
    }

    /// Like [`Self::fill_dense`] for `(flat index l*E+e, count)` pairs. Repeated or unsorted
    /// indices are merged (sorted) before the norm is taken.
    pub fn fill_sparse<I: SparseIndex, T: CountValue>(&self, index: &[I], counts: &[T], out: &mut SparseSignature) -> Result<(), NoSignature> {
        out.index.clear();
        out.value.clear();
        if index.len() != counts.len() {
            return Err(NoSignature::Shape);
        }
        // Order first, in one tight pass (it vectorizes): when the indices are strictly
        // ascending the last one is the largest, so the range check is a single comparison.
        // Then the weighting loop below runs without checks.
        let n = self.table.len() as u64;
        let ascending = index.windows(2).fold(true, |ok, w| ok & (w[1].as_u64() > w[0].as_u64()));
        let out_of_range = match (ascending, index.last()) {
            (_, None) => false,
            (true, Some(last)) => last.as_u64() >= n,
            (false, _) => index.iter().fold(false, |bad, i| bad | (i.as_u64() >= n)),
        };
        if out_of_range {
            return Err(NoSignature::OutOfRange);
        }
        Self::check_all(counts)?;
        // SAFETY: t < index.len() == counts.len(), and every index is below n (checked above).
        unsafe { self.compact(out, index.len(), |t| (index.get_unchecked(t).as_u64() as usize, counts.get_unchecked(t).to_f32())) };
        if !ascending {
            Self::sort_merge(out);
        }
        out.norm = norm_of(&out.index, &out.value)?;
        Ok(())
    }

    /// Append `(out index of j, scale of j * c)` for `(j, c) = item(t)`, t in 0..candidates,
    /// keeping only nonzero values (branch-free: a zero's slot is overwritten by the next).
    /// Writes through raw pointers into capacity reserved up front, with the length in a
    /// register; returns the new length.
    ///
    /// # Safety
    /// `item(t)` must return `j < self.table.len()` for every t in 0..candidates.
    #[inline(always)]
    unsafe fn compact(&self, out: &mut SparseSignature, candidates: usize, item: impl Fn(usize) -> (usize, f32)) -> usize {
        out.index.reserve(candidates);
        out.value.reserve(candidates);
        let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
        let table = self.table.as_ptr();
        let mut len = 0usize;
        for t in 0..candidates {
            let (j, c) = item(t);
            let (o, w) = *table.add(j);
            let x = w * c;
            ip.add(len).write(o);
            vp.add(len).write(x);
            // x != 0.0 as an integer test (x is finite or +inf here, never NaN)
            len += (x.to_bits() << 1 != 0) as usize;
        }
        out.index.set_len(len);
        out.value.set_len(len);
        len
    }

    /// Reject NaN, infinite and negative counts, in one branch-free pass (it vectorizes);
    /// only a bad input pays for finding out which kind it is. Unsigned types skip it.
    #[inline(always)]
    pub(crate) fn check_all<T: CountValue>(counts: &[T]) -> Result<(), NoSignature> {
        if !T::MAY_BE_INVALID {
            return Ok(());
        }
        let ok = |c: f32| c >= 0.0 && c < f32::INFINITY;
        if counts.iter().fold(true, |all, &c| all & ok(c.to_f32())) {
            return Ok(());
        }
        let c = counts.iter().map(|&c| c.to_f32()).find(|&c| !ok(c)).unwrap_or(f32::NAN);
        Err(if c < 0.0 { NoSignature::Negative } else { NoSignature::NonFinite })
    }

    /// Unit signatures of a CSR batch of count rows, into dense rows of `out` (`[n, dim]`,
    /// row-major; every value is overwritten) with `valid[r]` telling which rows have one.
    /// Row r is the pairs `index[indptr[r]..indptr[r+1]]`, `counts[..]`, as for
    /// [`Self::fill_sparse`], which each row goes through (the per-request path), so a batch
    /// row holds exactly the bits of the single-request signature. A row with no usable
    /// signature ([`NoSignature::Empty`]: no counts, or only masked layers) is zero with
    /// `valid` false; any other reason is bad input and fails the batch, naming the row.
    pub fn fill_sparse_batch<I: SparseIndex, T: CountValue>(
        &self,
        indptr: &[i64],
        index: &[I],
        counts: &[T],
        out: &mut [f32],
        valid: &mut [bool],
    ) -> Result<(), BatchError> {
        let entries = index.len();
        if counts.len() != entries {
            return Err(BatchError::Lengths { index: entries, counts: counts.len() });
        }
        let bad = |what: String| Err(BatchError::Indptr { entries, what });
        let (Some(&first), Some(&last)) = (indptr.first(), indptr.last()) else {
            return bad("it is empty".into());
        };
        if first != 0 || last != entries as i64 {
            return bad(format!("it runs from {first} to {last}"));
        }
        if let Some(r) = indptr.windows(2).position(|w| w[1] < w[0]) {
            return bad(format!("it decreases at row {r}"));
        }
        let (rows, dim) = (indptr.len() - 1, self.dim());
        if out.len() != rows * dim || valid.len() != rows {
            return Err(BatchError::Output { values: out.len(), flags: valid.len(), rows, dim });
        }
        let mut sig = SparseSignature::default();
        for (r, (row, ok)) in out.chunks_exact_mut(dim).zip(valid.iter_mut()).enumerate() {
            row.fill(0.0);
            let (a, b) = (indptr[r] as usize, indptr[r + 1] as usize);
            *ok = match self.fill_sparse(&index[a..b], &counts[a..b], &mut sig) {
                Ok(()) => {
                    sig.write_unit(row);
                    true
                }
                Err(NoSignature::Empty) => false,
                Err(why) => return Err(BatchError::Row { row: r, why }),
            };
        }
        Ok(())
    }

    /// Dense `[L, E]` counts -> signature.
    pub fn from_dense<T: CountValue>(&self, counts: &[T]) -> Result<SparseSignature, NoSignature> {
        let mut sig = SparseSignature::default();
        self.fill_dense(counts, &mut sig)?;
        Ok(sig)
    }

    /// Sparse `(flat index l*E+e, count)` pairs -> signature. Repeated indices add up.
    pub fn from_sparse<I: SparseIndex, T: CountValue>(&self, index: &[I], counts: &[T]) -> Result<SparseSignature, NoSignature> {
        let mut sig = SparseSignature::default();
        self.fill_sparse(index, counts, &mut sig)?;
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

    pub(crate) fn sort_merge(sig: &mut SparseSignature) {
        let mut pairs: Vec<(u32, f32)> = sig.index.iter().copied().zip(sig.value.iter().copied()).collect();
        pairs.sort_unstable_by_key(|p| p.0);
        sig.index.clear();
        sig.value.clear();
        for (i, v) in pairs {
            if sig.index.last() == Some(&i) {
                *sig.value.last_mut().unwrap() += v;
            } else {
                sig.index.push(i);
                sig.value.push(v);
            }
        }
    }
}

/// The L2 norm of a signature (ascending positions `index`), or why there is no signature.
/// Summed in the one order of the route's dot products ([`crate::order`]), so the
/// wire path, which sums it as it unpacks, gets the same bits.
pub fn norm_of(index: &[u32], values: &[f32]) -> Result<f64, NoSignature> {
    norm_from_squares(crate::order::norm2_sparse(index, values))
}

/// The norm from its square, or why there is no signature.
pub(crate) fn norm_from_squares(n2: f64) -> Result<f64, NoSignature> {
    if !n2.is_finite() {
        Err(NoSignature::NonFinite)
    } else if n2 > 0.0 {
        Ok(n2.sqrt())
    } else {
        Err(NoSignature::Empty)
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
    fn batch_rows_are_the_single_request_bits() {
        let sp = spec();
        // rows: a normal one, unsorted with repeats, empty, masked layer only, one entry
        let indptr = [0i64, 3, 7, 7, 9, 10];
        let index = [2u16, 3, 4, 4, 2, 3, 2, 0, 1, 5];
        let counts = [2u32, 4, 1, 1, 1, 4, 1, 9, 9, 3];
        let mut out = vec![f32::NAN; 5 * sp.dim()];
        let mut valid = vec![true; 5];
        sp.fill_sparse_batch(&indptr, &index, &counts, &mut out, &mut valid).unwrap();
        assert_eq!(valid, [true, true, false, false, true]);
        for r in 0..5 {
            let (a, b) = (indptr[r] as usize, indptr[r + 1] as usize);
            let want = sp.from_sparse(&index[a..b], &counts[a..b]).map_or(vec![0f32; sp.dim()], |s| s.to_dense(sp.dim()));
            let got = &out[r * sp.dim()..(r + 1) * sp.dim()];
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "row {r}");
        }
    }

    #[test]
    fn batch_refuses_bad_input_naming_it() {
        let sp = spec();
        let (mut out, mut valid) = (vec![0f32; 2 * sp.dim()], vec![false; 2]);
        let mut run = |indptr: &[i64], index: &[i64], counts: &[f32]| sp.fill_sparse_batch(indptr, index, counts, &mut out, &mut valid);
        assert_eq!(run(&[0, 1, 2], &[2, 6], &[1.0, 1.0]), Err(BatchError::Row { row: 1, why: NoSignature::OutOfRange }));
        assert_eq!(run(&[0, 1, 2], &[2, 3], &[-1.0, 1.0]), Err(BatchError::Row { row: 0, why: NoSignature::Negative }));
        assert_eq!(run(&[0, 1, 2], &[2, 3], &[1.0, f32::NAN]), Err(BatchError::Row { row: 1, why: NoSignature::NonFinite }));
        assert!(matches!(run(&[0, 2, 1], &[2, 3], &[1.0, 1.0]), Err(BatchError::Indptr { .. })));
        assert!(matches!(run(&[0, 1, 3], &[2, 3], &[1.0, 1.0]), Err(BatchError::Indptr { .. })));
        assert!(matches!(run(&[], &[], &[]), Err(BatchError::Indptr { .. })));
        assert!(matches!(run(&[0, 1, 2], &[2, 3], &[1.0]), Err(BatchError::Lengths { .. })));
        assert!(matches!(run(&[0, 2], &[2, 3], &[1.0, 1.0]), Err(BatchError::Output { rows: 1, .. })));
        assert_eq!(run(&[0, 1, 2], &[2, 6], &[1.0, 1.0]).unwrap_err().to_string(), "row 1: out_of_range");
        assert_eq!(run(&[0, 1, 2], &[2, 3], &[1.0, 1.0]), Ok(()));
    }

    #[test]
    fn spec_rejects_bad_weights() {
        assert!(SignatureSpec::new(&[0.0, 0.0], &[1.0; 4]).is_err());
        assert!(SignatureSpec::new(&[1.0, f32::NAN], &[1.0; 4]).is_err());
        assert!(SignatureSpec::new(&[1.0, 1.0], &[1.0; 5]).is_err());
        assert!(SignatureSpec::new(&[1.0, 1.0], &[1.0, 1.0, -1.0, 1.0]).is_err());
    }
}
