//! The row kernels: a row of packed codes made signature entries, portable or AVX2 (eight
//! codes at a time), and the AVX2 pieces of the fused wire route ([`fused_row`]).

use super::log::LogRow;
use super::unpack::{compact_run_scalar, unpack, unpack_run};
use crate::signature::SparseSignature;

/// For each 8-bit mask, the lanes whose bit is set, in order (the left-pack permutation of
/// the AVX2 row kernel).
#[cfg(target_arch = "x86_64")]
static LEFT_PACK: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let (mut k, mut lane) = (0, 0);
        while lane < 8 {
            if m & (1 << lane) != 0 {
                t[m][k] = lane as u32;
                k += 1;
            }
            lane += 1;
        }
        m += 1;
    }
    t
};

/// What a packed dense-layout row's codes are: the counts themselves, or log codes.
#[derive(Clone, Copy)]
pub(super) enum RowValues<'a> {
    Counts,
    Log(&'a LogRow),
}

/// Reused buffers of the portable row path.
#[derive(Default)]
pub(super) struct RowScratch {
    codes: Vec<u32>,
    vals: Vec<f32>,
}

/// How a row of packed codes becomes signature entries. Both kernels write the same values in
/// the same order (`x = value(code) * scale[e]` in f32, zeros dropped), so a signature does not
/// depend on the machine (the `kernels_agree` property test checks it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum RowKernel {
    /// Three tight loops (unpack, value, weight + compact) that the compiler keeps in registers.
    Portable,
    /// AVX2, eight codes at a time: one gather reads their bit windows, a variable shift and a
    /// mask extract them, a second gather looks up log values in the row's table (counts are
    /// converted instead), one multiply weights them, and a left-pack keeps the nonzeros.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl RowKernel {
    pub(super) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return RowKernel::Avx2;
        }
        RowKernel::Portable
    }

    /// Append the nonzero entries of the row of `scales.len()` codes starting at value `first`
    /// at `out[len..]`, output indices from `base`; returns the new length.
    ///
    /// # Safety
    /// Every code's 8-byte window lies in `data` (the decoder pads it with PAD zero bytes), and
    /// `out` has capacity for `len + scales.len() + 8` entries.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) unsafe fn fill_row(self, data: &[u8], first: usize, bits: u32, values: RowValues<'_>, scales: &[f32], base: u32, out: &mut SparseSignature, len: usize, scratch: &mut RowScratch) -> usize {
        #[cfg(target_arch = "x86_64")]
        if self == RowKernel::Avx2 && bits <= AVX2_MAX_BITS {
            // counts below 2^24 convert to f32 exactly, as `c as f32` does; a 4-byte window holds
            // any code of at most 25 bits at any bit offset
            match values {
                RowValues::Counts => return fill_row_avx2::<false>(data, first, bits, &[], scales, base, out, len),
                RowValues::Log(lut) if lut.table().len() == 1 << bits => return fill_row_avx2::<true>(data, first, bits, lut.table(), scales, base, out, len),
                RowValues::Log(_) => {}
            }
        }
        fill_row_portable(data, first, bits, values, scales, base, out, len, scratch)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) const AVX2_MAX_BITS: u32 = 24;

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fill_row_portable(data: &[u8], first: usize, bits: u32, values: RowValues<'_>, scales: &[f32], base: u32, out: &mut SparseSignature, len: usize, scratch: &mut RowScratch) -> usize {
    let e_n = scales.len();
    scratch.codes.resize(e_n, 0);
    scratch.vals.resize(e_n, 0.0);
    let (codes, vals) = (&mut scratch.codes[..], &mut scratch.vals[..]);
    unpack_run(data, first * bits as usize, bits, codes);
    match values {
        RowValues::Log(lut) => lut.values(codes, vals),
        RowValues::Counts => {
            for (v, &c) in vals.iter_mut().zip(codes.iter()) {
                *v = c as f32;
            }
        }
    }
    for (v, &w) in vals.iter_mut().zip(scales) {
        *v *= w;
    }
    compact_run_scalar(out, len, base, vals)
}

/// See [`RowKernel::Avx2`]. `lut` (when `LOG`) holds `2^bits` values, so every code indexes it.
///
/// # Safety
/// As [`RowKernel::fill_row`], with AVX2 available and `bits <= AVX2_MAX_BITS`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn fill_row_avx2<const LOG: bool>(data: &[u8], first: usize, bits: u32, lut: &[f32], scales: &[f32], base: u32, out: &mut SparseSignature, mut len: usize) -> usize {
    let n = scales.len();
    let full = n / 8 * 8;
    let up = Unpack::new(bits, (first * bits as usize) & 7);
    // a gathered table: this path also serves rows the fused route does not (ragged E)
    let mut rd = RowReader::<LOG, 0>::new(&up, data, first, lut.as_ptr(), scales);
    let mut pk = LeftPack::new(out, base);
    let mut e = 0;
    while e < full {
        len = pk.push(rd.next_block(&up, e), len);
        e += 8;
    }
    let ip = out.index.as_mut_ptr();
    let vp = out.value.as_mut_ptr();
    for (e, &w) in scales.iter().enumerate().skip(full) {
        let code = unpack(data, 0, first + e, bits);
        let c = if LOG { *lut.get_unchecked(code as usize) } else { code as f32 };
        let x = c * w;
        ip.add(len).write(base + e as u32);
        vp.add(len).write(x);
        len += (x.to_bits() << 1 != 0) as usize;
    }
    len
}

/// How blocks of 8 `bits`-bit codes starting `s0` bits into a byte are unpacked. A block
/// spans `bits` whole bytes: when it fits one 16-byte window, a byte shuffle lays each code's
/// 4-byte window into its lane (bytes past the window's end are zeros the mask would drop
/// anyway); otherwise one gather reads the windows. A 4-byte window holds any code of at most
/// 25 bits at any bit offset.
#[cfg(target_arch = "x86_64")]
pub(super) struct Unpack {
    bits: u32,
    shuffled: bool,
    ctrl: std::arch::x86_64::__m256i,
    shifts: std::arch::x86_64::__m256i,
    mask: std::arch::x86_64::__m256i,
}

#[cfg(target_arch = "x86_64")]
impl Unpack {
    /// # Safety
    /// AVX2 is available; `bits <= AVX2_MAX_BITS`, `s0 < 8`.
    #[inline(always)]
    pub(super) unsafe fn new(bits: u32, s0: usize) -> Self {
        use std::arch::x86_64::*;
        let b = bits as usize;
        let mut ctrl = [0x80u8; 32];
        let mut shifts = [0i32; 8];
        for (i, sh) in shifts.iter_mut().enumerate() {
            let at = s0 + i * b;
            *sh = (at & 7) as i32;
            for t in 0..4 {
                if (at >> 3) + t < 16 {
                    ctrl[(i / 4) * 16 + (i % 4) * 4 + t] = ((at >> 3) + t) as u8;
                }
            }
        }
        Unpack {
            bits,
            shuffled: s0 + 8 * b <= 128,
            ctrl: _mm256_loadu_si256(ctrl.as_ptr() as *const __m256i),
            shifts: _mm256_loadu_si256(shifts.as_ptr() as *const __m256i),
            mask: _mm256_set1_epi32(((1u64 << bits) - 1) as u32 as i32),
        }
    }
}

/// The shared front of the AVX2 row kernels: a row of packed codes read eight at a time
/// ([`Unpack`]), each block valued and weighted by its scales, `x = value(code) * scale[e]`
/// in f32. Counts convert exactly (below 2^24), as `c as f32` does. A log table is gathered
/// (`REGS` = 0) or, when it has at most 64 entries (codes of at most 6 bits, the default),
/// held as `REGS` 8-lane registers and read by permutes and a blend tree on the code's high
/// bits, which is cheaper than a gather on the machines measured (AMD Zen 3).
#[cfg(target_arch = "x86_64")]
struct RowReader<const LOG: bool, const REGS: usize> {
    window: *const u8,
    src: *const i32,
    pos: std::arch::x86_64::__m256i,
    scales: *const f32,
    /// The log table: `2^bits` values (gathered), or REGS aligned blocks of 8.
    table: *const f32,
}

#[cfg(target_arch = "x86_64")]
impl<const LOG: bool, const REGS: usize> RowReader<LOG, REGS> {
    /// # Safety
    /// AVX2 is available; every code's window lies in `data` (the decoder pads it with PAD
    /// zero bytes); `unpack` is for this row's bits and bit offset; with `LOG`, `table` holds
    /// every code's value (as REGS 32-byte aligned blocks of 8 when REGS > 0).
    #[inline(always)]
    pub(super) unsafe fn new(unpack: &Unpack, data: &[u8], first: usize, table: *const f32, scales: &[f32]) -> Self {
        use std::arch::x86_64::*;
        let b = unpack.bits as usize;
        let lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(b as i32));
        RowReader {
            window: data.as_ptr().add((first * b) >> 3),
            src: data.as_ptr() as *const i32,
            // bit offsets stay below 2^31: at most MAX_ENTRIES values of at most 24 bits
            pos: _mm256_add_epi32(_mm256_set1_epi32((first * b) as i32), lanes),
            scales: scales.as_ptr(),
            table,
        }
    }

    /// The weighted values of the row's block at `e` (blocks are read in order, `e` = 0, 8, ..).
    #[inline(always)]
    unsafe fn next_block(&mut self, u: &Unpack, e: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let codes = if u.shuffled {
            // SAFETY: the window starts in the data and the data ends with PAD = 16 zero bytes
            let w = _mm256_broadcastsi128_si256(_mm_loadu_si128(self.window as *const __m128i));
            self.window = self.window.add(u.bits as usize);
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(w, u.ctrl), u.shifts), u.mask)
        } else {
            let words = _mm256_i32gather_epi32::<1>(self.src, _mm256_srli_epi32::<3>(self.pos));
            let codes = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_and_si256(self.pos, _mm256_set1_epi32(7))), u.mask);
            self.pos = _mm256_add_epi32(self.pos, _mm256_set1_epi32(8 * u.bits as i32));
            codes
        };
        let c = if !LOG {
            _mm256_cvtepi32_ps(codes)
        } else if REGS > 0 {
            self.permuted(codes)
        } else {
            _mm256_i32gather_ps::<4>(self.table, codes)
        };
        _mm256_mul_ps(c, _mm256_loadu_ps(self.scales.add(e)))
    }

    /// `table[codes]` from REGS registers: each permuted by the code's low 3 bits, then one
    /// blend per further bit (blendv reads the sign bit, where the bit is shifted).
    #[inline(always)]
    unsafe fn permuted(&self, codes: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // macros, not closures: a closure would not inherit the caller's AVX2
        let t = self.table;
        macro_rules! p {
            ($r:expr) => {
                _mm256_permutevar8x32_ps(_mm256_load_ps(t.add(8 * $r)), codes)
            };
        }
        if REGS == 1 {
            return p!(0);
        }
        let b3 = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(codes));
        macro_rules! pair {
            ($r:expr) => {
                _mm256_blendv_ps(p!($r), p!($r + 1), b3)
            };
        }
        if REGS == 2 {
            return pair!(0);
        }
        let b4 = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(codes));
        macro_rules! quad {
            ($r:expr) => {
                _mm256_blendv_ps(pair!($r), pair!($r + 2), b4)
            };
        }
        if REGS == 4 {
            return quad!(0);
        }
        let b5 = _mm256_castsi256_ps(_mm256_slli_epi32::<26>(codes));
        _mm256_blendv_ps(quad!(0), quad!(4), b5)
    }
}

/// The nonzeros of eight values at a time appended to a signature, with their output
/// positions (a left-pack by movemask; +-0 drop out and a NaN stays, as the scalar test).
#[cfg(target_arch = "x86_64")]
struct LeftPack {
    ip: *mut u32,
    vp: *mut f32,
    idx: std::arch::x86_64::__m256i,
}

#[cfg(target_arch = "x86_64")]
impl LeftPack {
    /// # Safety
    /// AVX2 is available; `out` has room for 8 entries past the last one pushed.
    #[inline(always)]
    pub(super) unsafe fn new(out: &mut SparseSignature, base: u32) -> Self {
        use std::arch::x86_64::*;
        let idx = _mm256_add_epi32(_mm256_set1_epi32(base as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        LeftPack { ip: out.index.as_mut_ptr(), vp: out.value.as_mut_ptr(), idx }
    }

    /// Append the nonzeros of `x` (the next 8 positions) at `len`; returns the new length.
    #[inline(always)]
    pub(super) unsafe fn push(&mut self, x: std::arch::x86_64::__m256, len: usize) -> usize {
        use std::arch::x86_64::*;
        let keep = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NEQ_UQ>(x, _mm256_setzero_ps())) as usize;
        let perm = _mm256_loadu_si256(LEFT_PACK[keep].as_ptr() as *const __m256i);
        _mm256_storeu_ps(self.vp.add(len), _mm256_permutevar8x32_ps(x, perm));
        _mm256_storeu_si256(self.ip.add(len) as *mut __m256i, _mm256_permutevar8x32_epi32(self.idx, perm));
        self.idx = _mm256_add_epi32(self.idx, _mm256_set1_epi32(8));
        len + keep.count_ones() as usize
    }
}

/// What [`fused_row`] reads and updates: the packed data, the row's first value, the unpack
/// constants, the row's scales, its first output position, the block-major centroids, the
/// lane sums, the f64 dot and norm totals, the row's value buffer, and the kept signature
/// with its length.
#[cfg(target_arch = "x86_64")]
type FusedArgs<'a, const K: usize> =
    (&'a [u8], usize, &'a Unpack, &'a [f32], u32, *const crate::centroid_file::Block8, &'a mut crate::distance::avx2::Blocks<K>, &'a mut [f64], &'a mut f64, &'a mut [crate::centroid_file::Block8], &'a mut SparseSignature, usize);

/// One row of the fused wire route, in two passes: the [`RowReader`] unpacks and values the
/// row eight codes at a time into a small buffer (with `KEEP`, the nonzeros are also
/// left-packed into the kept signature), then [`crate::distance::avx2::Blocks::add_run`] dots
/// each block into the K centroids' same eight positions and squares it into the norm, in
/// [`crate::order`]. Two passes, because one would hold the lane sums, the table and
/// the unpack constants at once, more than the 16 vector registers (the spills cost more than
/// the buffer, which stays in L1). Returns the kept signature's length.
///
/// # Safety
/// As [`fill_row_avx2`] (the kept signature has room for D + 8 entries when `KEEP`), with
/// `table` as [`RowReader::new`] takes it; the row's positions lie below D, its first position
/// is a multiple of 8, the buffer holds a block per 8 of the row's values, and `blocks` is the
/// set's [`crate::centroid_file::CentroidSet::centroid_blocks`] for K centroids.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn fused_row<const K: usize, const LOG: bool, const REGS: usize, const KEEP: bool>(table: *const f32, args: FusedArgs<'_, K>) -> usize {
    use std::arch::x86_64::_mm256_store_ps;
    let (data, first, unpack, scales, base, blocks, st, dots, n2, buf, out, mut len) = args;
    let mut rd = RowReader::<LOG, REGS>::new(unpack, data, first, table, scales);
    let mut pk = LeftPack::new(out, base);
    let xs = &mut buf[..scales.len() / 8];
    for (i, x) in xs.iter_mut().enumerate() {
        let v = rd.next_block(unpack, 8 * i);
        if KEEP {
            len = pk.push(v, len);
        }
        _mm256_store_ps(x.0.as_mut_ptr(), v);
    }
    st.add_run(xs, base as usize, blocks, dots, n2);
    len
}
