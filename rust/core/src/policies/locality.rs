//! Locality-aware balancer: send a request to the eligible worker with the least marginal
//! expected step cost `D_w + (B_w + 1) * Delta_w + r * (2 * B_w + 1)`.
//!
//! * A request's profile `p[l][e]` is the chance that one of its decode tokens selects expert
//!   `e` at MoE layer `l`, estimated from its prompt: `c[l][e] / (T + 1)` for `T` prompt tokens
//!   (the +1 keeps p below 1, so every log below is finite).
//! * Worker w keeps, per (l, e), `S_w[l][e] = sum over its in-flight requests of log(1 - p)`, so
//!   `exp(S)` is the chance that no request of its batch selects e at l in a step. Then
//!   `D_w = mean_l sum_e (1 - exp(S))` is its expected distinct experts per layer per step,
//!   and the request adds `Delta_w = mean_l sum_e p * exp(S)` new ones (exact, not a bound).
//! * Joining w, the request runs at w's step cost `D_w + Delta_w` and slows the `B_w` requests
//!   already there by `Delta_w` each: `D_w + (B_w + 1) * Delta_w` in expert reads per step,
//!   summed over the requests it affects.
//! * `r` (`request_cost`, the router's `--eldr-request-cost R`, default 0) is the per-request
//!   part of a step in the same unit. For a step time `fixed + b * batch + c * sum_l distinct_l`
//!   over L layers, joining w costs `fixed + b * (2 * B_w + 1) + c * L * (D_w + (B_w + 1) *
//!   Delta_w)` summed over the requests it affects; divided by `c * L`, that is the cost above
//!   with `r = b / (c * L)` (distinct experts per layer) plus `fixed / (c * L)`, which is the
//!   same on every worker and drops out. `r = 0` is the rule without the per-request term.
//! * Only workers under the bounded-load cap of `eldr/F` are eligible (`load_factor`; no cap
//!   without it). Ties go to the shorter queue, then the lower index. Without a profile the
//!   rule is shortest queue.
//!
//! * A profile spans the MoE layers it was built over: all of them in the simulator, the
//!   centroid file's selected layers in the router service ([`ExpertProfile::from_counts`]),
//!   which cuts the state and the work per request by L / |selected|. It is sparse: only cells
//!   with nonzero expected use are kept.
//!
//! State: per worker, `S` in fixed point behind a short per-worker lock (held for one
//! acquire's or release's `O(nnz(profile))` plain adds: an atomic read-modify-write per cell
//! cost 5x more); the keep mass `exp(S)` per cell and `D_w` are published in atomics that a
//! route reads without any lock. `D_w` is kept incrementally from each cell's (old, new)
//! transition of `S` through one deterministic function, and the writes to a worker are
//! serialized, so acquire followed by release restores everything exactly, whatever the
//! interleaving. A route reads `K x nnz(profile)` keep masses and multiplies (no exp, no
//! locks, no allocation beyond the decision); it may see a concurrent acquire half applied,
//! which only shifts that one decision as a slightly earlier or later one would.
//!
//! A profile carries the layer ids of its rows and the centroid generation it was built
//! from. When the centroid file's layer selection changes, the first profile of the newer
//! generation replaces the expert state (requests in flight then release into the old one,
//! which they hold); a profile of an older generation and another layout falls back.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwapOption;

use super::{load_cap, shortest_healthy, Decision, Policy, Reason, RouteContext};
use crate::distance::Counts;
use crate::signature::{CountValue, NoSignature, SignatureSpec, SparseIndex};

use thiserror::Error;


/// Why a profile cannot be built from the given cells, or counted on a worker.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ProfileError {
    #[error("layers x experts must be in 1..2^32, got {layers} x {experts}")]
    Dims { layers: usize, experts: usize },
    #[error("index has {index} entries but counts has {counts}")]
    Lengths { index: usize, counts: usize },
    #[error("a profile needs at least one prompt token")]
    NoTokens,
    #[error("index {index} out of range 0..{cells}")]
    IndexOutOfRange { index: u64, cells: usize },
    #[error("counts must be finite and >= 0, got {0}")]
    BadCount(f64),
    #[error("worker {worker} out of range 0..{workers}")]
    WorkerOutOfRange { worker: usize, workers: usize },
    #[error("profile spans {layers} layers x {experts} experts but the balancer tracks {tracked_layers} layers x {tracked_experts} experts (another layer selection)")]
    OtherSelection { layers: usize, experts: usize, tracked_layers: usize, tracked_experts: usize },
    #[error("profile shape differs from the balancer's (an older layer selection)")]
    Stale,
}

/// Fixed-point scale of `log(1 - p)` in a cell.
pub(super) const LOG_SCALE: f64 = (1u64 << 24) as f64;
/// Fixed-point scale of the "no request selects this expert" mass `exp(S)`.
const MASS_SCALE: f64 = (1u64 << 30) as f64;

/// `exp(s / LOG_SCALE)` for s <= 0 from three 1024-entry tables (one per 10-bit chunk of -s),
/// a pure function of s (so the telescoping sums below stay exact) and much cheaper than exp:
/// the route reads K x nnz cells.
pub(super) struct ExpTables([[f64; 1024]; 3]);

pub(super) fn exp_tables() -> &'static ExpTables {
    static T: OnceLock<ExpTables> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = [[0.0f64; 1024]; 3];
        for (j, tab) in t.iter_mut().enumerate() {
            for (i, v) in tab.iter_mut().enumerate() {
                *v = (-((i as f64) * (1u64 << (10 * j)) as f64) / LOG_SCALE).exp();
            }
        }
        ExpTables(t)
    })
}

#[inline]
fn keep_prob(t: &ExpTables, s: i64) -> f64 {
    let x = s.clamp(i64::MIN + 1, 0).unsigned_abs();
    if x >= 1 << 30 {
        return 0.0; // exp(-64): no mass left
    }
    t.0[2][(x >> 20) as usize] * t.0[1][((x >> 10) & 1023) as usize] * t.0[0][(x & 1023) as usize]
}

#[inline]
pub(super) fn mass(t: &ExpTables, s: i64) -> i64 {
    // + 0.5 and truncate: round half up for this non-negative value, without the libm call
    // that f64::round is on a baseline x86-64 target.
    let x = keep_prob(t, s) * MASS_SCALE + 0.5;
    // SAFETY: keep_prob is in [0, 1], so x is finite and in [0.5, 2^30 + 0.5]: it fits an i64.
    unsafe { x.to_int_unchecked::<i64>() }
}

/// `round(log(1 - c / denom) * LOG_SCALE)`, memoized for small integer counts: a prompt's counts
/// take few distinct values, and `ln_1p` per cell was most of a profile's build time.
struct LogKeep {
    denom: f64,
    cap: f64,
    memo: [i64; 256],
}

impl LogKeep {
    fn new(tokens: u64) -> Self {
        LogKeep { denom: tokens as f64 + 1.0, cap: tokens as f64, memo: [1; 256] }
    }
    /// (p, fixed-point log(1 - p)) for a finite count c > 0.
    #[inline]
    fn of(&mut self, c: f64) -> (f64, i64) {
        let c = if c < self.cap { c } else { self.cap };
        let p = c / self.denom;
        if c < 256.0 {
            // SAFETY: 0 < c < 256, so the truncation fits a u32 (no saturating checks needed).
            let i = unsafe { c.to_int_unchecked::<u32>() } as usize;
            if i as f64 == c {
                if self.memo[i] == 1 {
                    self.memo[i] = ((-p).ln_1p() * LOG_SCALE).round() as i64;
                }
                return (p, self.memo[i]);
            }
        }
        (p, ((-p).ln_1p() * LOG_SCALE).round() as i64)
    }
}

/// Appends at most `capacity` cells, in ascending order, to a profile under construction.
/// Writes go through raw pointers into the reserved capacity with the length in a register
/// (three `Vec::push` per cell were a third of a profile's build).
struct Builder {
    prof: ExpertProfile,
    lk: LogKeep,
    len: usize,
    capacity: usize,
}

impl Builder {
    fn new(layer_ids: Arc<[u32]>, experts: usize, generation: u64, tokens: u64, capacity: usize) -> Self {
        let prof = ExpertProfile { layer_ids, experts, generation, cells: Vec::with_capacity(capacity), p: Vec::with_capacity(capacity), log_keep: Vec::with_capacity(capacity), wire: WireCache::default() };
        Builder { prof, lk: LogKeep::new(tokens), len: 0, capacity }
    }
    #[inline]
    fn push(&mut self, cell: u32, count: f64) {
        assert!(self.len < self.capacity, "more cells than reserved");
        let (p, l) = self.lk.of(count);
        // SAFETY: len < capacity, which each of the three vectors reserved.
        unsafe {
            self.prof.cells.as_mut_ptr().add(self.len).write(cell);
            self.prof.p.as_mut_ptr().add(self.len).write(p);
            self.prof.log_keep.as_mut_ptr().add(self.len).write(l);
        }
        self.len += 1;
    }
    fn finish(mut self) -> ExpertProfile {
        // SAFETY: the first `len` entries of each vector were written by push.
        unsafe {
            self.prof.cells.set_len(self.len);
            self.prof.p.set_len(self.len);
            self.prof.log_keep.set_len(self.len);
        }
        self.prof
    }
}

/// An f32 that is NaN, infinite or below zero (-0.0 is zero).
#[inline(always)]
fn bad_bits(b: u32) -> bool {
    ((b & 0x7fff_ffff) >= 0x7f80_0000) | (b > 0x8000_0000)
}

/// A profile's wire form once built (a cache: not part of the profile's value, so profiles
/// compare equal whether or not theirs was built).
#[derive(Default, Clone)]
pub(super) struct WireCache(pub(super) OnceLock<Box<str>>);

impl PartialEq for WireCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for WireCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WireCache")
    }
}

/// A request's expected expert use per decode token (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertProfile {
    /// The MoE layer (row of the prefill's counts) of each profile row.
    pub(super) layer_ids: Arc<[u32]>,
    pub(super) experts: usize,
    /// Centroid generation the layer selection came from (0: not from a centroid file).
    generation: u64,
    /// Flat `row * experts + e`, ascending.
    pub(super) cells: Vec<u32>,
    p: Vec<f64>,
    pub(super) log_keep: Vec<i64>,
    /// Its `eldr_profile` JSON, built once: every decode attempt of the request sends it.
    pub(super) wire: WireCache,
}

impl ExpertProfile {
    /// From the prompt's counts in sparse form: `index[i] = l * experts + e` with `counts[i]`
    /// prompt tokens whose top-k at layer l included e; `tokens` prompt tokens in all.
    /// Zero counts are skipped; duplicate indices add up. Spans all `layers`.
    pub fn from_sparse(layers: usize, experts: usize, index: &[u64], counts: &[f64], tokens: u64) -> Result<Self, ProfileError> {
        let n = layers.checked_mul(experts).filter(|&n| n > 0 && n <= u32::MAX as usize).ok_or(ProfileError::Dims { layers, experts })?;
        if index.len() != counts.len() {
            return Err(ProfileError::Lengths { index: index.len(), counts: counts.len() });
        }
        if tokens == 0 {
            return Err(ProfileError::NoTokens);
        }
        let mut cells: Vec<(u32, f64)> = Vec::with_capacity(index.len());
        for (&i, &c) in index.iter().zip(counts) {
            if i >= n as u64 {
                return Err(ProfileError::IndexOutOfRange { index: i, cells: n });
            }
            if !(c.is_finite() && c >= 0.0) {
                return Err(ProfileError::BadCount(c));
            }
            if c > 0.0 {
                cells.push((i as u32, c));
            }
        }
        let ids: Arc<[u32]> = (0..layers as u32).collect();
        Ok(Self::from_cells(ids, experts, 0, cells, tokens))
    }

    /// The router's profile: raw `[L, E]` counts (dense, or sparse `(l*E+e, count)`) as the
    /// prefill sends them, restricted to `spec`'s selected layers (the layers the centroid
    /// file routes on). Validated like a signature: the same [`NoSignature`] reasons.
    pub fn from_counts<I: SparseIndex, T: CountValue>(spec: &SignatureSpec, generation: u64, counts: Counts<'_, I, T>, tokens: u64) -> Result<Self, NoSignature> {
        let (l, e) = (spec.num_layers(), spec.num_experts());
        let sel = spec.selected_layers();
        let ids: Arc<[u32]> = sel.iter().map(|&x| x as u32).collect();
        let check = |c: T| -> Result<f64, NoSignature> {
            let v = c.to_f32() as f64;
            if v.is_nan() || v.is_infinite() {
                Err(NoSignature::NonFinite)
            } else if v < 0.0 {
                Err(NoSignature::Negative)
            } else {
                Ok(v)
            }
        };
        match counts {
            Counts::Dense(c) => {
                if c.len() != l * e {
                    return Err(NoSignature::Shape);
                }
                // every count is validated, selected layer or not (as a signature is): one
                // branch-free pass over the f32 bits (NaN/inf exponent, or a negative nonzero),
                // and only if it finds something, a pass that names the first bad value
                if T::MAY_BE_INVALID && c.iter().fold(false, |bad, &v| bad | bad_bits(v.to_f32().to_bits())) {
                    for v in c.iter().copied() {
                        check(v)?;
                    }
                }
                if tokens == 0 {
                    return Err(NoSignature::Empty);
                }
                // already in ascending cell order: straight into the profile, no sort, no copy
                let mut b = Builder::new(ids, e, generation, tokens, sel.len() * e);
                for (s, &layer) in sel.iter().enumerate() {
                    for (j, v) in c[layer * e..(layer + 1) * e].iter().enumerate() {
                        let v = v.to_f32() as f64; // checked above
                        if v > 0.0 {
                            b.push((s * e + j) as u32, v);
                        }
                    }
                }
                Ok(b.finish())
            }
            Counts::Sparse(idx, c) => {
                if idx.len() != c.len() {
                    return Err(NoSignature::Shape);
                }
                // row slot of each layer, u32::MAX for an unselected one
                let mut slot = vec![u32::MAX; l];
                for (s, &layer) in sel.iter().enumerate() {
                    slot[layer] = s as u32;
                }
                let (n, e64) = ((l * e) as u64, e as u64);
                let mut cells: Vec<(u32, f64)> = Vec::with_capacity(idx.len());
                for (&i, &v) in idx.iter().zip(c) {
                    let i = i.as_u64();
                    if i >= n {
                        return Err(NoSignature::OutOfRange);
                    }
                    let v = check(v)?;
                    let s = slot[(i / e64) as usize];
                    if v > 0.0 && s != u32::MAX {
                        cells.push((s * e as u32 + (i % e64) as u32, v));
                    }
                }
                if tokens == 0 {
                    return Err(NoSignature::Empty);
                }
                Ok(Self::from_cells(ids, e, generation, cells, tokens))
            }
        }
    }

    /// `cells`: (flat row*E+e, count > 0), any order, repeats allowed.
    fn from_cells(layer_ids: Arc<[u32]>, experts: usize, generation: u64, mut cells: Vec<(u32, f64)>, tokens: u64) -> Self {
        if !cells.is_sorted_by(|a, b| a.0 < b.0) {
            cells.sort_unstable_by_key(|&(i, _)| i);
            cells.dedup_by(|b, a| {
                if a.0 == b.0 {
                    a.1 += b.1;
                    true
                } else {
                    false
                }
            });
        }
        let mut b = Builder::new(layer_ids, experts, generation, tokens, cells.len());
        for (i, c) in cells {
            b.push(i, c);
        }
        b.finish()
    }

    /// Rows (MoE layers) the profile spans.
    pub fn layers(&self) -> usize {
        self.layer_ids.len()
    }
    /// The MoE layer of each row.
    pub fn layer_ids(&self) -> &[u32] {
        &self.layer_ids
    }
    /// The same, shared (for state sized by a profile's layout).
    pub fn layer_ids_arc(&self) -> Arc<[u32]> {
        Arc::clone(&self.layer_ids)
    }
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// Nonzero cells.
    pub fn nnz(&self) -> usize {
        self.cells.len()
    }
    pub fn experts(&self) -> usize {
        self.experts
    }
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }
    /// (flat cell indices, probabilities) of the nonzero entries.
    pub fn parts(&self) -> (&[u32], &[f64]) {
        (&self.cells, &self.p)
    }
    /// The request's `log(1 - p)` per cell in the state's fixed point (what a worker sums to
    /// report its batch's occupancy from the requests' profiles: [`Self::to_wire_json`]).
    pub fn log_keep(&self) -> &[i64] {
        &self.log_keep
    }
    /// Expected distinct experts per layer of one of this request's tokens (about top-k).
    pub fn experts_per_layer(&self) -> f64 {
        self.p.iter().sum::<f64>() / self.layers() as f64
    }
}

/// Per-worker in-flight expert state (see the module docs). Cells are laid out
/// `[cell][worker]`, so a route reads each of the request's cells for all K workers at once.
pub struct ExpertLoad {
    pub(super) layer_ids: Arc<[u32]>,
    pub(super) experts: usize,
    generation: u64,
    pub(super) workers: usize,
    /// Per worker, `S` (sum of fixed-point `log(1 - p)` over its in-flight requests) per cell,
    /// and the worker's own occupancy report; the lock serializes that worker's writes.
    pub(super) log_sum: Box<[Mutex<Sums>]>,
    /// `exp(S)` in fixed point per `[cell][worker]`, written under the worker's lock, read by routes.
    pub(super) keep: Box<[AtomicU32]>,
    pub(super) distinct: Box<[PaddedI64]>,
}

#[repr(align(64))]
#[derive(Default)]
pub(super) struct PaddedI64(pub(super) AtomicI64);

/// One worker's sums: `own`, this router's in-flight requests' `S`; `report`, empty without an
/// occupancy report, else per cell the report's `log(idle)` minus `own` at the poll (at most 0). A cell's
/// published mass is `exp(min(own + report, 0))`: the worker's whole batch as it reported it,
/// plus this router's own requests since (issue 32: the other replicas' requests count).
/// `mirror`: with R router replicas, R - 1 images of each of this router's requests sent since
/// the worker's last occupancy report (empty when none); a report replaces them with the
/// others' real requests (`epoch` counts reports, so a request sent before one leaves its
/// images alone when it ends).
pub(super) struct Sums {
    pub(super) own: Vec<i64>,
    pub(super) mirror: Vec<i64>,
    pub(super) report: Vec<i64>,
    pub(super) epoch: u64,
}

impl Sums {
    #[inline]
    pub(super) fn effective(&self, c: usize) -> i64 {
        self.own[c] + self.mirror.get(c).copied().unwrap_or(0) + self.report.get(c).copied().unwrap_or(0)
    }
}

impl ExpertLoad {
    pub fn new(workers: usize, layers: usize, experts: usize) -> Self {
        Self::with_layout(workers, (0..layers as u32).collect(), experts, 0)
    }

    /// State for profiles over `layer_ids` (see [`ExpertProfile::layer_ids`]).
    pub fn with_layout(workers: usize, layer_ids: Arc<[u32]>, experts: usize, generation: u64) -> Self {
        let cells = layer_ids.len() * experts;
        let one = mass(exp_tables(), 0) as u32;
        ExpertLoad {
            layer_ids,
            experts,
            generation,
            workers,
            log_sum: (0..workers).map(|_| Mutex::new(Sums { own: vec![0i64; cells], mirror: Vec::new(), report: Vec::new(), epoch: 0 })).collect(),
            keep: (0..cells * workers).map(|_| AtomicU32::new(one)).collect(),
            distinct: (0..workers).map(|_| PaddedI64::default()).collect(),
        }
    }

    pub fn num_workers(&self) -> usize {
        self.distinct.len()
    }

    fn layers(&self) -> usize {
        self.layer_ids.len()
    }

    fn fits(&self, p: &ExpertProfile) -> bool {
        p.experts == self.experts && (Arc::ptr_eq(&p.layer_ids, &self.layer_ids) || p.layer_ids[..] == self.layer_ids[..])
    }

    /// Count (`sign` 1) or uncount (-1) `p` on `worker`, with `mirrors` images of it while
    /// the worker's report epoch is still `epoch` (an acquire passes None: the current one).
    /// Returns the epoch the images were counted in.
    fn apply(&self, worker: usize, p: &ExpertProfile, sign: i64, mirrors: i64, epoch: Option<u64>) -> u64 {
        let t = exp_tables();
        let k = self.workers;
        // A poisoned lock only means another thread panicked mid-update of plain integers;
        // the sums it left are still the ones every later update telescopes from.
        let mut sums = self.log_sum[worker].lock().unwrap_or_else(|e| e.into_inner());
        let mirrors = if epoch.is_none_or(|e| e == sums.epoch) { mirrors } else { 0 };
        if mirrors > 0 && sums.mirror.is_empty() {
            sums.mirror = vec![0; sums.own.len()];
        }
        let mut d = 0i64;
        for (&c, &lk) in p.cells.iter().zip(&p.log_keep) {
            sums.own[c as usize] += sign * lk;
            if mirrors > 0 {
                sums.mirror[c as usize] += sign * mirrors * lk;
            }
            let cell = &self.keep[c as usize * k + worker];
            // the published mass is mass(old S): only this worker's lock holder writes it
            let (old, new) = (cell.load(Ordering::Relaxed) as i64, mass(t, sums.effective(c as usize)));
            cell.store(new as u32, Ordering::Relaxed);
            d += old - new;
        }
        self.distinct[worker].0.fetch_add(d, Ordering::Release);
        sums.epoch
    }

    /// The MoE layer ids and the experts per layer of the cells this state tracks.
    pub fn layout(&self) -> (&[u32], usize) {
        (&self.layer_ids, self.experts)
    }

    /// `D_w`: expected distinct experts per layer per step of worker w's in-flight requests.
    pub fn distinct(&self, worker: usize) -> f64 {
        self.distinct[worker].0.load(Ordering::Acquire) as f64 / MASS_SCALE / self.layers() as f64
    }

    /// `exp(S)` of one cell on one worker, as the route reads it.
    pub fn keep_mass(&self, worker: usize, cell: usize) -> f64 {
        self.keep[cell * self.workers + worker].load(Ordering::Relaxed) as f64 / MASS_SCALE
    }

    /// `Delta_w`: expected new experts per layer that `p` adds to worker w's steps.
    pub fn added(&self, worker: usize, p: &ExpertProfile) -> f64 {
        let k = self.workers;
        let s: f64 = p.cells.iter().zip(&p.p).map(|(&c, &pr)| pr * self.keep[c as usize * k + worker].load(Ordering::Relaxed) as f64).sum();
        s / MASS_SCALE / self.layers() as f64
    }

    /// `Delta_w` for every worker in one pass over the profile's cells.
    pub fn added_all(&self, p: &ExpertProfile, out: &mut Vec<f64>) {
        let k = self.workers;
        out.clear();
        out.resize(k, 0.0);
        for (&c, &pr) in p.cells.iter().zip(&p.p) {
            let row = &self.keep[c as usize * k..(c as usize + 1) * k];
            for (acc, cell) in out.iter_mut().zip(row) {
                *acc += pr * cell.load(Ordering::Relaxed) as f64;
            }
        }
        let scale = MASS_SCALE * self.layers() as f64;
        out.iter_mut().for_each(|v| *v /= scale);
    }

    /// Count `p` on `worker` until the guard is released (or dropped).
    pub fn acquire(self: &Arc<Self>, worker: usize, p: Arc<ExpertProfile>) -> Result<ExpertGuard, ProfileError> {
        self.acquire_mirrored(worker, p, 0)
    }

    /// Count `p` on `worker` until the guard is released, and with R router replicas
    /// `mirrors` = R - 1 images of it standing for the others' alike requests there (they
    /// route on the same centroids) until the worker's next occupancy report.
    pub fn acquire_mirrored(self: &Arc<Self>, worker: usize, p: Arc<ExpertProfile>, mirrors: i64) -> Result<ExpertGuard, ProfileError> {
        if worker >= self.num_workers() {
            return Err(ProfileError::WorkerOutOfRange { worker, workers: self.num_workers() });
        }
        if !self.fits(&p) {
            return Err(ProfileError::OtherSelection { layers: p.layers(), experts: p.experts, tracked_layers: self.layers(), tracked_experts: self.experts });
        }
        let mirrors = mirrors.max(0);
        let epoch = self.apply(worker, &p, 1, mirrors, None);
        Ok(ExpertGuard { load: Arc::clone(self), worker, profile: p, mirrors, epoch, released: AtomicBool::new(false) })
    }
}

/// One request's expert profile counted on one worker; released exactly once.
pub struct ExpertGuard {
    load: Arc<ExpertLoad>,
    worker: usize,
    profile: Arc<ExpertProfile>,
    mirrors: i64,
    epoch: u64,
    released: AtomicBool,
}

impl ExpertGuard {
    /// True the first time; false (and no effect) after.
    pub fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.load.apply(self.worker, &self.profile, -1, self.mirrors, Some(self.epoch));
        true
    }
}

impl Drop for ExpertGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// The balancer. Its expert state is sized by the first profile it sees, and replaced by the
/// first profile of a newer centroid generation with another layout (see the module docs).
/// `Default` is the rule with no per-request term (`r = 0`).
#[derive(Default)]
pub struct Locality {
    load: ArcSwapOption<ExpertLoad>,
    /// `r`: the per-request part of a step in distinct experts per layer (finite, >= 0).
    request_cost: f64,
    /// Router replicas beside this one, R - 1: each request's profile also counts R - 1
    /// mirror images of it (the others, routing on the same centroids, send alike requests
    /// alike) until the worker's next occupancy report, which counts the others' real ones.
    mirrors: AtomicU32,
}

impl Locality {
    /// The balancer with the per-request term `r * (2 * B_w + 1)`; `r` finite and >= 0 (the
    /// policy config checks it: [`super::PolicyConfig::with_request_cost`]).
    pub fn with_request_cost(request_cost: f64) -> Self {
        Locality { load: ArcSwapOption::empty(), request_cost, mirrors: AtomicU32::new(0) }
    }

    /// Worker w's marginal cost for a request adding `delta` new experts per layer there, with
    /// `b` requests in flight on it: `D_w + (b + 1) * delta + r * (2 * b + 1)`. With r = 0 the
    /// last term adds exactly 0.0, so the value is the rule without it, bit for bit.
    #[inline]
    pub(crate) fn marginal_cost(&self, load: &ExpertLoad, w: usize, b: i64, delta: f64) -> f64 {
        load.distinct(w) + (b + 1) as f64 * delta + self.request_cost * (2 * b + 1) as f64
    }

    /// The expert state for `workers` workers that `p` counts in; None when `p` does not fit
    /// it (another layout of an older or the same generation, or another worker count).
    pub fn load_for(&self, workers: usize, p: &ExpertProfile) -> Option<Arc<ExpertLoad>> {
        state_for(&self.load, workers, p, || ExpertLoad::with_layout(workers, Arc::clone(&p.layer_ids), p.experts, p.generation))
    }
}

/// Per-worker state sized by a profile layout and tagged with the centroid generation it came
/// from: the locality balancer's [`ExpertLoad`] and the paged cost's resident estimate.
pub(crate) trait LayoutState {
    fn fits(&self, p: &ExpertProfile) -> bool;
    fn generation(&self) -> u64;
    fn num_workers(&self) -> usize;
}

impl LayoutState for ExpertLoad {
    fn fits(&self, p: &ExpertProfile) -> bool {
        ExpertLoad::fits(self, p)
    }
    fn generation(&self) -> u64 {
        self.generation
    }
    fn num_workers(&self) -> usize {
        ExpertLoad::num_workers(self)
    }
}

/// The generation-slot install: the state in `slot` for `workers` workers that `p` fits. The
/// first profile, the first of a newer generation with another layout, or the first route
/// after workers joined (more slots: issue 31) installs `fresh()` (once, whatever threads
/// race: a state another thread installed first is used). Requests in flight keep their
/// guards on the state they were counted in, so a fresh state starts empty and fills as
/// requests start. None when `p` does not fit the state (another layout of an older or the
/// same generation, or fewer workers than the state's: a route that read the slot count
/// before a join).
pub(crate) fn state_for<T: LayoutState>(slot: &ArcSwapOption<T>, workers: usize, p: &ExpertProfile, fresh: impl FnOnce() -> T) -> Option<Arc<T>> {
    if let Some(cur) = slot.load_full() {
        if cur.fits(p) && cur.num_workers() >= workers {
            return (cur.num_workers() == workers).then_some(cur);
        }
        if !cur.fits(p) && p.generation <= cur.generation() {
            return None;
        }
    }
    let fresh = Arc::new(fresh());
    let keep = |c: &Arc<T>| (c.fits(p) && c.num_workers() >= workers) || (!c.fits(p) && p.generation <= c.generation());
    let prev = slot.rcu(|cur| match cur {
        Some(c) if keep(c) => Some(Arc::clone(c)),
        _ => Some(Arc::clone(&fresh)),
    });
    // rcu returns what it replaced: if another thread installed a fitting state first, use it
    let now = match prev {
        Some(c) if keep(&c) => c,
        _ => fresh,
    };
    (now.fits(p) && now.num_workers() == workers).then_some(now)
}

impl Policy for Locality {
    fn name(&self) -> &'static str {
        "locality"
    }

    fn uses_profile(&self) -> bool {
        true
    }

    fn track(&self, num_workers: usize, worker: usize, profile: Arc<ExpertProfile>) -> Option<Result<ExpertGuard, ProfileError>> {
        let mirrors = self.mirrors.load(Ordering::Relaxed) as i64;
        Some(match self.load_for(num_workers, &profile) {
            Some(l) => l.acquire_mirrored(worker, profile, mirrors),
            None => Err(ProfileError::Stale),
        })
    }

    fn request_cost(&self) -> Option<f64> {
        Some(self.request_cost)
    }

    fn expert_distinct(&self) -> Option<Vec<f64>> {
        Some(self.load.load_full().map_or_else(Vec::new, |l| (0..l.num_workers()).map(|w| l.distinct(w)).collect()))
    }

    fn expert_load(&self) -> Option<Arc<ExpertLoad>> {
        self.load.load_full()
    }

    fn set_replicas(&self, replicas: u32) {
        self.mirrors.store(replicas.max(1) - 1, Ordering::Relaxed);
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let k = ctx.loads.len();
        let prof = ctx.profile.filter(|p| !p.is_empty());
        let Some(load) = prof.and_then(|p| self.load_for(k, p)) else {
            let why = match ctx.profile {
                None => match ctx.fallback {
                    Reason::NoSignature(w) => w,
                    _ => NoSignature::Missing,
                },
                Some(p) if p.is_empty() => NoSignature::Empty,
                Some(_) => NoSignature::Shape,
            };
            return Decision { worker: shortest_healthy(ctx.loads, ctx.healthy), reason: Reason::NoSignature(why), d_star: None, band: None };
        };
        let p = prof.expect("checked above");
        let cap = ctx.load_factor.map(|f| load_cap(ctx, f));
        let mut delta = Vec::with_capacity(k);
        load.added_all(p, &mut delta);
        let mut best: Option<(f64, i64, usize)> = None;
        for w in 0..k {
            if !ctx.healthy[w] || cap.is_some_and(|c| ctx.loads[w] >= c) {
                continue;
            }
            let b = ctx.loads[w].max(0);
            let cost = self.marginal_cost(&load, w, b, delta[w]);
            let key = (cost, b, w);
            if best.is_none_or(|bk| key.0 < bk.0 || (key.0 == bk.0 && (key.1, key.2) < (bk.1, bk.2))) {
                best = Some(key);
            }
        }
        Decision { worker: best.map(|b| b.2), reason: Reason::Profile, d_star: None, band: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_exp_matches_exp() {
        let t = exp_tables();
        for s in [0i64, -1, -1023, -1024, -(1 << 20) - 7, -123_456_789, -(1 << 30) + 1] {
            let want = (s as f64 / LOG_SCALE).exp();
            assert!((keep_prob(t, s) - want).abs() <= 1e-12 * want.max(1e-300), "s={s}");
        }
        assert_eq!(keep_prob(t, -(1 << 30)), 0.0);
        assert_eq!(keep_prob(t, 5), 1.0, "positive sums (never reached) clamp to no mass taken");
    }
}
