//! The log encoding's values: each row's code-to-count table, as the Python encoder
//! defines them (scalar, and the same bits compiled for AVX2).

/// One row's log-decoded values `c(code) = expm1(code * ln(1 + q) / (2^bits - 1))`, as the
/// Python encoder defines them (f64, then rounded to f32). With no more codes than
/// max(E, 64) they are tabled once per row, for every code, by the recurrence
/// `u(a+b) = u(a) + u(b) + u(a) * u(b)` (`expm1` of a sum) from `u(1) = expm1(scale)`: one
/// transcendental call per row instead of one per count. Every term is positive, so nothing
/// cancels: the f64 error grows by a few ulps a step, far below f32 rounding, and a tabled
/// value is the formula's f32 or one f32 ulp from it (`lut_matches_formula` checks this).
/// Code 0 is always 0.
#[derive(Default)]
pub(super) struct LogRow {
    scale: f64,
    /// Values in the table (0: none): every code `0..2^bits`.
    len: usize,
    /// A table of at most 64 values, in aligned blocks of 8 (zeros past its end, room for the
    /// chains' last block), the layout [`Self::prepare_small`] gives every row of the fused
    /// route at once; a larger one is in `big`.
    pub(super) small: [crate::centroid_file::Block8; Self::SMALL_BLOCKS],
    big: Vec<f32>,
}

impl LogRow {
    pub(super) fn prepare(&mut self, qmax: u64, bits: u32, experts: usize) {
        let levels = (1u64 << bits) - 1;
        self.scale = (qmax as f64).ln_1p() / levels as f64;
        self.len = 0;
        if !Self::tabled(bits, experts) {
            return;
        }
        // u(1..=8) in one chain, then eight independent chains u(j + 8i) (each step adds
        // u(8)), so the table is not one long chain of dependent multiply-adds
        let step = |u: f64, v: f64| u + v + u * v;
        let u1 = self.scale.exp_m1();
        let mut cur = [0f64; 8];
        let mut u = 0.0;
        for c in cur.iter_mut() {
            u = step(u, u1);
            *c = u;
        }
        let n = levels as usize + 1;
        // whole blocks of 8 from code 1: n + 7 values are written, the last ones past n
        let table: &mut [f32] = if n <= 64 {
            // SAFETY: Block8 is 8 f32s with no padding, so the 9 blocks are 72 f32s.
            unsafe { std::slice::from_raw_parts_mut(self.small.as_mut_ptr() as *mut f32, 72) }
        } else {
            self.big.clear();
            self.big.resize(n + 8, 0.0);
            &mut self.big
        };
        table[0] = 0.0;
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected. The same operations in the same order, on wider lanes.
            unsafe { table_chains_avx2(&mut table[1..n + 7], cur) };
        } else {
            table_chains(&mut table[1..n + 7], cur);
        }
        #[cfg(not(target_arch = "x86_64"))]
        table_chains(&mut table[1..n + 7], cur);
        if n <= 64 {
            table[n..].iter_mut().for_each(|v| *v = 0.0); // the permutes read whole blocks
        }
        self.len = n;
    }

    /// Aligned blocks of 8 per small table (see `small`).
    pub(super) const SMALL_BLOCKS: usize = 9;

    /// The tables of many rows of at most 64 codes, `SMALL_BLOCKS` blocks each in `out`, with
    /// the bits `prepare` gives each row alone: the same f64 operations in the same order, with
    /// four rows in the lanes of one vector. A row alone is two chains of dependent
    /// multiply-adds; four rows at once keep the vector units busy instead of waiting on them.
    pub(super) fn prepare_small(qs: impl ExactSizeIterator<Item = u64>, bits: u32, out: &mut Vec<crate::centroid_file::Block8>) {
        debug_assert!(bits <= 6);
        let rows = qs.len();
        out.clear();
        out.resize(rows.div_ceil(4) * 4 * Self::SMALL_BLOCKS, Default::default());
        let levels = (1u64 << bits) - 1;
        let n = levels as usize + 1;
        let mut q4 = [0u64; 4];
        let mut qs = qs;
        for group in 0..rows.div_ceil(4) {
            for q in q4.iter_mut() {
                *q = qs.next().unwrap_or(0);
            }
            // SAFETY: Block8 is 8 f32s with no padding: 4 rows of SMALL_BLOCKS blocks
            let t = unsafe {
                std::slice::from_raw_parts_mut(out[group * 4 * Self::SMALL_BLOCKS..].as_mut_ptr() as *mut f32, 4 * 8 * Self::SMALL_BLOCKS)
            };
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 was detected. The same operations in the same order, on wider lanes.
                unsafe { small_tables_avx2(t, q4, levels, n) };
                continue;
            }
            small_tables(t, q4, levels, n);
        }
        out.truncate(rows * Self::SMALL_BLOCKS);
    }

    /// The value of every code (empty: none tabled).
    pub(super) fn table(&self) -> &[f32] {
        if self.len <= 64 {
            // SAFETY: as in `prepare`; len <= 64 < 72.
            unsafe { std::slice::from_raw_parts(self.small.as_ptr() as *const f32, self.len) }
        } else {
            &self.big[..self.len]
        }
    }

    /// Whether rows of `bits`-bit codes get a table (`prepare`).
    pub(super) fn tabled(bits: u32, experts: usize) -> bool {
        ((1u64 << bits) - 1) as usize <= experts.max(64)
    }

    pub(super) fn values(&self, codes: &[u32], out: &mut [f32]) {
        let t = self.table();
        // codes have `bits` bits, so c <= levels < t.len() whenever there is a table; the check
        // is one vectorized pass, and lets the lookups below run unchecked
        if !t.is_empty() && codes.iter().all(|&c| (c as usize) < t.len()) {
            for (v, &c) in out.iter_mut().zip(codes) {
                // SAFETY: checked just above
                *v = unsafe { *t.get_unchecked(c as usize) };
            }
        } else {
            for (v, &c) in out.iter_mut().zip(codes) {
                *v = self.value(c);
            }
        }
    }

    #[inline(always)]
    pub(super) fn value(&self, code: u32) -> f32 {
        match self.table().get(code as usize) {
            Some(&v) => v,
            None if code == 0 => 0.0,
            None => (code as f64 * self.scale).exp_m1() as f32,
        }
    }
}

/// The table's eight chains from `u(1..=8)` (see [`LogRow`]): block i holds `u(j + 8i)`.
#[inline(always)]
fn table_chains(table: &mut [f32], mut cur: [f64; 8]) {
    let step = |u: f64, v: f64| u + v + u * v;
    let u8 = cur[7];
    for block in table.chunks_exact_mut(8) {
        for (t, c) in block.iter_mut().zip(cur.iter_mut()) {
            *t = *c as f32;
            *c = step(*c, u8);
        }
    }
}

/// Four rows' small tables (see [`LogRow::prepare_small`]) into `t`, 72 values a row: the
/// steps of [`LogRow::prepare`] and [`table_chains`], row `i` in lane `i`.
#[inline(always)]
fn small_tables(t: &mut [f32], q: [u64; 4], levels: u64, n: usize) {
    pub(super) const W: usize = 8 * LogRow::SMALL_BLOCKS;
    assert!(t.len() >= 4 * W && (2..=64).contains(&n));
    // four lanes at once, each `u + v + u * v` as the scalar step (no fused multiply-add)
    #[inline(always)]
    fn step(u: [f64; 4], v: [f64; 4]) -> [f64; 4] {
        [u[0] + v[0] + u[0] * v[0], u[1] + v[1] + u[1] * v[1], u[2] + v[2] + u[2] * v[2], u[3] + v[3] + u[3] * v[3]]
    }
    let u1 = q.map(|q| ((q as f64).ln_1p() / levels as f64).exp_m1());
    // u(1..=8) of each row, then the eight chains u(j + 8i) (each step adds u(8))
    let mut cur = [[0f64; 4]; 8];
    let mut u = [0f64; 4];
    for c in cur.iter_mut() {
        u = step(u, u1);
        *c = u;
    }
    let u8 = cur[7];
    let p = t.as_mut_ptr();
    // table[1..n + 7] in whole blocks of 8, as `prepare` writes it
    for b in 0..(n + 6) / 8 {
        for (j, c) in cur.iter_mut().enumerate() {
            let x = c.map(|v| v as f32);
            for (i, &x) in x.iter().enumerate() {
                // SAFETY: 1 + 8b + j <= n + 6 <= 70 < W, and t holds 4 rows of W
                unsafe { *p.add(i * W + 1 + 8 * b + j) = x };
            }
            *c = step(*c, u8);
        }
    }
    for i in 0..4 {
        t[i * W] = 0.0;
        t[i * W + n..(i + 1) * W].iter_mut().for_each(|v| *v = 0.0); // the permutes read whole blocks
    }
}

/// [`small_tables`] compiled for AVX2 (four f64 lanes: one row each); the same bits.
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn small_tables_avx2(t: &mut [f32], q: [u64; 4], levels: u64, n: usize) {
    small_tables(t, q, levels, n)
}

/// [`table_chains`] compiled for AVX2, whose 4-wide f64 lanes the compiler then uses (the
/// baseline target has 2-wide ones); the values are the same bits.
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn table_chains_avx2(table: &mut [f32], cur: [f64; 8]) {
    table_chains(table, cur)
}
