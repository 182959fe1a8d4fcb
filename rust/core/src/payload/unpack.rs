//! Little-endian bit unpacking (and the encoder's packing, for tests and benches), and the
//! dense views of the counts that tools read; the route never makes them.

use super::format::{DecodedCounts, Encoding, PayloadError};
use super::log::LogRow;
use crate::signature::SparseSignature;

pub(super) fn index_width(size: usize) -> usize {
    if size <= 1 << 16 {
        2
    } else {
        4
    }
}

#[inline(always)]
pub(super) fn read_index(data: &[u8], size: usize, t: usize) -> u32 {
    if index_width(size) == 2 {
        u16::from_le_bytes([data[2 * t], data[2 * t + 1]]) as u32
    } else {
        u32::from_le_bytes([data[4 * t], data[4 * t + 1], data[4 * t + 2], data[4 * t + 3]])
    }
}

/// Little-endian bit packing, the encoder's side of what this module unpacks (as
/// `eldr_sglang.sglang_ext.payload._pack`): the tests and benches build payloads with it.
pub fn pack_bits(values: &[u32], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; (values.len() * bits as usize).div_ceil(8)];
    for (i, &v) in values.iter().enumerate() {
        for b in 0..bits as usize {
            if (v >> b) & 1 == 1 {
                let bit = i * bits as usize + b;
                out[bit / 8] |= 1 << (bit % 8);
            }
        }
    }
    out
}

/// Value `i` of a little-endian bit-packed run starting at byte `base`.
///
/// # Safety
/// `base + (i * bits) / 8 + 8 <= data.len()` (the decoder pads the data with PAD zero bytes).
#[inline(always)]
pub(super) unsafe fn unpack(data: &[u8], base: usize, i: usize, bits: u32) -> u32 {
    let bp = i * bits as usize;
    let p = data.as_ptr().add(base + (bp >> 3)) as *const [u8; 8];
    let w = u64::from_le_bytes(p.read_unaligned());
    ((w >> (bp & 7)) & ((1u64 << bits) - 1)) as u32
}

/// `out.len()` consecutive values of a bit-packed run, starting at bit `start`.
///
/// # Safety
/// Every value's 8-byte window lies in `data` (the decoder pads the data with PAD zero bytes).
#[inline(always)]
pub(super) unsafe fn unpack_run(data: &[u8], start: usize, bits: u32, out: &mut [u32]) {
    let mask = (1u64 << bits) - 1;
    let p = data.as_ptr();
    let mut bp = start;
    for o in out.iter_mut() {
        let w = u64::from_le_bytes((p.add(bp >> 3) as *const [u8; 8]).read_unaligned());
        *o = ((w >> (bp & 7)) & mask) as u32;
        bp += bits as usize;
    }
}

/// Append `(base + e, x[e])` for every nonzero `x[e]` at `out[len..]` (branch-free, as
/// `SignatureSpec::compact`); returns the new length.
///
/// # Safety
/// `out` must have capacity for `len + x.len()` entries.
#[inline(always)]
pub(super) unsafe fn compact_run_scalar(out: &mut SparseSignature, mut len: usize, base: u32, x: &[f32]) -> usize {
    let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
    for (e, &v) in x.iter().enumerate() {
        ip.add(len).write(base + e as u32);
        vp.add(len).write(v);
        len += (v.to_bits() << 1 != 0) as usize;
    }
    len
}

/// How the payload's rows map onto a `[num_layers, E]` layout: identity (the file holds only
/// the listed layers, in order) or by hidden-layer id.
#[derive(Clone, Copy)]
pub(super) enum RowMap {
    Identity,
    ById,
}

impl DecodedCounts {

    pub(super) fn row_map(&self, num_layers: usize, num_experts: usize) -> Result<RowMap, PayloadError> {
        if self.experts != num_experts {
            return Err(PayloadError::Experts { got: self.experts, want: num_experts });
        }
        if self.layers.len() == num_layers {
            return Ok(RowMap::Identity);
        }
        let max_id = *self.layers.iter().max().expect("non-empty");
        if (max_id as usize) < num_layers {
            Ok(RowMap::ById)
        } else {
            Err(PayloadError::Layers { layers: self.layers.len(), max_id, want: num_layers })
        }
    }

    #[inline(always)]
    pub(super) fn layer_of(&self, map: RowMap, row: usize) -> usize {
        match map {
            RowMap::Identity => row,
            RowMap::ById => self.layers[row] as usize,
        }
    }

    /// Call `f(row, e, count)` for every nonzero count, in payload order.
    pub fn for_each_nonzero(&self, mut f: impl FnMut(usize, usize, f32)) {
        let (e_n, bits) = (self.experts, self.bits);
        let size = self.layers.len() * e_n;
        match &self.encoding {
            Encoding::Dense => {
                for i in 0..size {
                    // SAFETY: the length was checked at decode and the data is padded.
                    let v = unsafe { unpack(&self.data, 0, i, bits) };
                    if v != 0 {
                        f(i / e_n, i % e_n, v as f32);
                    }
                }
            }
            Encoding::Sparse { nnz } => {
                let base = nnz * index_width(size);
                for t in 0..*nnz {
                    let i = read_index(&self.data, size, t) as usize;
                    // SAFETY: as above.
                    let v = unsafe { unpack(&self.data, base, t, bits) };
                    if v != 0 {
                        f(i / e_n, i % e_n, v as f32);
                    }
                }
            }
            Encoding::Log { q } => {
                let mut lut = LogRow::default();
                for (row, &qmax) in q.iter().enumerate() {
                    lut.prepare(qmax, bits, e_n);
                    for e in 0..e_n {
                        // SAFETY: as above.
                        let code = unsafe { unpack(&self.data, 0, row * e_n + e, bits) };
                        if code != 0 {
                            f(row, e, lut.value(code));
                        }
                    }
                }
            }
        }
    }

    /// Dense counts `[rows, E]` in payload row order (tests, tools; the route never makes this).
    pub fn to_dense(&self) -> Vec<f32> {
        let e_n = self.experts;
        let mut out = vec![0f32; self.layers.len() * e_n];
        self.for_each_nonzero(|row, e, c| out[row * e_n + e] = c);
        out
    }

    /// Dense counts in a centroid file's `[num_layers, E]` layout: rows in order when the file
    /// holds only the listed layers, else placed at their hidden-layer ids (others stay zero).
    pub fn to_layout(&self, num_layers: usize, num_experts: usize) -> Result<Vec<f32>, PayloadError> {
        let map = self.row_map(num_layers, num_experts)?;
        let mut out = vec![0f32; num_layers * num_experts];
        self.for_each_nonzero(|row, e, c| out[self.layer_of(map, row) * num_experts + e] = c);
        Ok(out)
    }
}
