//! The request's signature and its distances to the centroids, read straight from the
//! packed counts: only the selected layers' rows are unpacked, by the row kernels, and under
//! AVX2 the distances are dotted as the rows are read (the fused route).

use super::format::{DecodedCounts, Encoding};
#[cfg(target_arch = "x86_64")]
use super::kernels::{fused_row, Unpack, AVX2_MAX_BITS};
use super::kernels::{RowKernel, RowScratch, RowValues};
use super::log::LogRow;
use super::unpack::{index_width, read_index, unpack, RowMap};
use crate::centroid_file::CentroidSet;
use crate::signature::{norm_of, NoSignature, SignatureSpec, SparseSignature};

impl DecodedCounts {
    /// The request's signature into `out` (cleared first), for `spec`'s layout: only the rows of
    /// selected layers are unpacked, each count weighted as it is read. Same values, order and
    /// norm as [`SignatureSpec::fill_dense`] of [`Self::to_layout`].
    pub fn fill_signature(&self, spec: &SignatureSpec, out: &mut SparseSignature) -> Result<(), NoSignature> {
        self.fill_signature_with(spec, out, RowKernel::detect())
    }

    /// Distances from the request's signature to `set`'s centroids, read straight from the
    /// packed counts: each value is dotted into its centroid row as it is unpacked, with no
    /// signature in between unless `keep` asks for it (then it is written there, as
    /// [`Self::fill_signature`] writes it). The same bits as [`crate::distance::from_fill`] of
    /// `fill_signature` (both sum in [`crate::order`]; `fused_matches_fill` checks).
    pub fn distances(&self, set: &CentroidSet, keep: Option<&mut SparseSignature>) -> Result<Vec<f64>, NoSignature> {
        self.distances_with(set, keep, RowKernel::detect())
    }

    pub(super) fn distances_with(&self, set: &CentroidSet, keep: Option<&mut SparseSignature>, kernel: RowKernel) -> Result<Vec<f64>, NoSignature> {
        #[cfg(target_arch = "x86_64")]
        if kernel == RowKernel::Avx2 && self.fusable() {
            // SAFETY: AVX2 was detected (RowKernel::Avx2 is only made so), and the checks of fusable.
            unsafe {
                match set.num_workers() {
                    8 => return self.distances_avx2::<8>(set, keep),
                    16 => return self.distances_avx2::<16>(set, keep),
                    32 => return self.distances_avx2::<32>(set, keep),
                    64 => return self.distances_avx2::<64>(set, keep),
                    _ => {}
                }
            }
        }
        crate::distance::from_fill(set, keep, |spec, sig| self.fill_signature_with(spec, sig, kernel))
    }

    /// Whether the fused AVX2 route reads this payload: packed dense or log rows of at most
    /// `AVX2_MAX_BITS` bits, every log row tabled, and rows of whole 8-lane blocks (E a
    /// multiple of 8, so a block's lanes are its positions mod 8).
    #[cfg(target_arch = "x86_64")]
    fn fusable(&self) -> bool {
        let tabled = match self.encoding {
            Encoding::Dense => true,
            Encoding::Log { .. } => LogRow::tabled(self.bits, self.experts),
            Encoding::Sparse { .. } => false,
        };
        tabled && self.bits <= AVX2_MAX_BITS && self.experts % 8 == 0
    }

    /// # Safety
    /// AVX2 is available, `self.fusable()`, and K is the set's number of workers.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn distances_avx2<const K: usize>(&self, set: &CentroidSet, keep: Option<&mut SparseSignature>) -> Result<Vec<f64>, NoSignature> {
        let spec = set.spec();
        let map = self.row_map(spec.num_layers(), spec.num_experts()).map_err(|_| NoSignature::Shape)?;
        let (e_n, bits) = (self.experts, self.bits);
        let mut none = SparseSignature::default();
        let (out, keeping) = keep_out(keep, &mut none, spec.dim());
        let m = set.centroid_blocks().as_ptr();
        let (scales, table) = (spec.scales(), spec.table());
        let mut st = crate::distance::avx2::Blocks::<K>::new();
        let (mut dots, mut n2) = (vec![0f64; K], 0f64);
        let mut lut = LogRow::default();
        // rows start at whole bytes: E is a multiple of 8 (fusable)
        let up = Unpack::new(bits, 0);
        let mut buf = vec![crate::centroid_file::Block8::default(); e_n / 8];
        let mut len = 0;
        let rows = self.selected_rows(spec, map);
        let mut tables = Vec::new();
        self.small_tables(&rows, &mut tables);
        for (at, &(l, row)) in rows.iter().enumerate() {
            let row_scales = &scales[l * e_n..(l + 1) * e_n];
            let base = table[l * e_n].0;
            let args = (&self.data[..], row * e_n, &up, row_scales, base, m, &mut st, &mut dots[..], &mut n2, &mut buf[..], &mut *out, len);
            macro_rules! row {
                ($log:expr, $regs:expr, $table:expr) => {
                    if keeping { fused_row::<K, $log, $regs, true>($table, args) } else { fused_row::<K, $log, $regs, false>($table, args) }
                };
            }
            len = match &self.encoding {
                Encoding::Log { .. } if !tables.is_empty() => {
                    let t = tables[at * LogRow::SMALL_BLOCKS..].as_ptr() as *const f32;
                    match (1usize << bits).div_ceil(8).next_power_of_two() {
                        1 => row!(true, 1, t),
                        2 => row!(true, 2, t),
                        4 => row!(true, 4, t),
                        _ => row!(true, 8, t),
                    }
                }
                Encoding::Log { q } => {
                    // more than 64 codes (tabled: fusable): the row's table is gathered
                    lut.prepare(q[row], bits, e_n);
                    row!(true, 0, lut.table().as_ptr())
                }
                _ => row!(false, 0, std::ptr::null()),
            };
        }
        st.flush::<true>(&mut dots, &mut n2);
        // SAFETY: the rows wrote `len` kept values when keeping.
        finish(dots, n2, keeping.then_some((out, len)))
    }

    /// The payload rows of `spec`'s selected layers as (layer, row), in signature order
    /// (ascending positions); a selected layer the payload does not hold is zeros: left out.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn selected_rows(&self, spec: &SignatureSpec, map: RowMap) -> Vec<(usize, usize)> {
        // the payload row of each layer
        let mut row_of = Vec::new();
        if let RowMap::ById = map {
            row_of = vec![usize::MAX; spec.num_layers()];
            for (row, &l) in self.layers.iter().enumerate() {
                row_of[l as usize] = row;
            }
        }
        spec.selected_layers()
            .iter()
            .map(|&l| (l, match map {
                RowMap::Identity => l,
                RowMap::ById => row_of[l],
            }))
            .filter(|&(_, row)| row != usize::MAX)
            .collect()
    }

    /// Small log tables (the default 6-bit codes) of every row at once, before the rows, into
    /// `tables`; left empty unless the payload is log-coded with at most 64 codes.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn small_tables(&self, rows: &[(usize, usize)], tables: &mut Vec<crate::centroid_file::Block8>) {
        if let Encoding::Log { q } = &self.encoding {
            if LogRow::tabled(self.bits, self.experts) && (1usize << self.bits) <= 64 {
                LogRow::prepare_small(rows.iter().map(|&(_, row)| q[row]), self.bits, tables);
            }
        }
    }

    pub(super) fn fill_signature_with(&self, spec: &SignatureSpec, out: &mut SparseSignature, kernel: RowKernel) -> Result<(), NoSignature> {
        out.index.clear();
        out.value.clear();
        let map = self.row_map(spec.num_layers(), spec.num_experts()).map_err(|_| NoSignature::Shape)?;
        let (e_n, bits) = (self.experts, self.bits);
        let table = spec.table();
        let weights = spec.layer_weights();
        let size = self.layers.len() * e_n;
        let cap = match self.encoding {
            Encoding::Sparse { nnz } => nnz,
            _ => spec.dim(),
        };
        out.index.reserve(cap + 8); // the SIMD stores write up to 8 past the last kept value
        out.value.reserve(cap + 8);
        let mut len = 0usize;
        match &self.encoding {
            Encoding::Dense | Encoding::Log { .. } => {
                let scales = spec.scales();
                let mut lut = LogRow::default();
                let mut scratch = RowScratch::default();
                for row in 0..self.layers.len() {
                    let l = self.layer_of(map, row);
                    if weights[l] <= 0.0 {
                        continue; // masked: never unpacked
                    }
                    let values = match &self.encoding {
                        Encoding::Log { q } => {
                            lut.prepare(q[row], bits, e_n);
                            RowValues::Log(&lut)
                        }
                        _ => RowValues::Counts,
                    };
                    // The row's output indices are consecutive (slot * E + e), so only the
                    // scales are read from the table.
                    let row_scales = &scales[l * e_n..(l + 1) * e_n];
                    let base = table[l * e_n].0;
                    // SAFETY: the data length was checked at decode and it is padded; at most E
                    // values per selected row, cap = selected rows * E, plus 8.
                    len = unsafe { kernel.fill_row(&self.data, row * e_n, bits, values, row_scales, base, out, len, &mut scratch) };
                }
            }
            Encoding::Sparse { nnz } => {
                let base = nnz * index_width(size);
                let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
                for t in 0..*nnz {
                    let i = read_index(&self.data, size, t) as usize;
                    let l = self.layer_of(map, i / e_n);
                    let (o, w) = table[l * e_n + i % e_n];
                    // SAFETY: as above; t < nnz = cap.
                    unsafe {
                        let x = w * unpack(&self.data, base, t, bits) as f32;
                        ip.add(len).write(o);
                        vp.add(len).write(x);
                        len += (x.to_bits() << 1 != 0) as usize;
                    }
                }
            }
        }
        // SAFETY: len <= cap values were written.
        unsafe {
            out.index.set_len(len);
            out.value.set_len(len);
        }
        if !self.layers_ascending && matches!(map, RowMap::ById) {
            SignatureSpec::sort_merge(out);
        }
        out.norm = norm_of(&out.index, &out.value)?;
        Ok(())
    }
}

/// Where the fused route writes the signature: `keep`, cleared and with room for the SIMD
/// stores, or else `none` (never written); and whether it is kept.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn keep_out<'a>(keep: Option<&'a mut SparseSignature>, none: &'a mut SparseSignature, dim: usize) -> (&'a mut SparseSignature, bool) {
    match keep {
        Some(out) => {
            out.index.clear();
            out.value.clear();
            out.index.reserve(dim + 8); // the SIMD stores write up to 8 past the last kept value
            out.value.reserve(dim + 8);
            (out, true)
        }
        None => (none, false),
    }
}

/// The distances `1 - dot / norm` from the dots and the squared norm; with `kept`, the kept
/// signature's length and norm are set.
///
/// # Safety
/// `kept`'s signature holds `len` written values in its reserved capacity.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn finish(dots: Vec<f64>, n2: f64, kept: Option<(&mut SparseSignature, usize)>) -> Result<Vec<f64>, NoSignature> {
    let norm = crate::signature::norm_from_squares(n2)?;
    if let Some((out, len)) = kept {
        out.index.set_len(len);
        out.value.set_len(len);
        out.norm = norm;
    }
    let inv = 1.0 / norm;
    Ok(dots.into_iter().map(|v| 1.0 - v * inv).collect())
}
