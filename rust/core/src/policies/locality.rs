//! Locality-aware balancer: send a request to the eligible worker with the least marginal
//! expected expert cost `D_w + (B_w + 1) * Delta_w`.
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
//!   summed over the requests it affects. The fixed, batch-independent part of a step is the
//!   same on every worker and drops out.
//! * Only workers under the bounded-load cap of `eldr/F` are eligible (`load_factor`; no cap
//!   without it). Ties go to the shorter queue, then the lower index. Without a profile the
//!   rule is shortest queue.
//!
//! State is lock-free: `S` lives in fixed-point `AtomicI64`s updated by `fetch_add`, and `D_w`
//! is kept incrementally from each cell's (old, new) transition through one deterministic
//! function, so the sum telescopes and acquire followed by release restores it exactly,
//! whatever the interleaving. A route reads `K x nnz(profile)` atomics (no locks, no allocation
//! beyond the decision).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};

use super::{load_cap, shortest_healthy, Decision, Policy, Reason, RouteContext};
use crate::signature::NoSignature;

/// Fixed-point scale of `log(1 - p)` in a cell.
const LOG_SCALE: f64 = (1u64 << 24) as f64;
/// Fixed-point scale of the "no request selects this expert" mass `exp(S)`.
const MASS_SCALE: f64 = (1u64 << 30) as f64;

/// `exp(s / LOG_SCALE)` for s <= 0 from three 1024-entry tables (one per 10-bit chunk of -s),
/// a pure function of s (so the telescoping sums below stay exact) and much cheaper than exp:
/// the route reads K x nnz cells.
struct ExpTables([[f64; 1024]; 3]);

fn exp_tables() -> &'static ExpTables {
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
fn mass(t: &ExpTables, s: i64) -> i64 {
    (keep_prob(t, s) * MASS_SCALE).round() as i64
}

/// A request's expected expert use per decode token (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertProfile {
    layers: usize,
    experts: usize,
    cells: Vec<u32>,
    p: Vec<f64>,
    log_keep: Vec<i64>,
}

impl ExpertProfile {
    /// From the prompt's counts in sparse form: `index[i] = l * experts + e` with `counts[i]`
    /// prompt tokens whose top-k at layer l included e; `tokens` prompt tokens in all.
    /// Zero counts are skipped; duplicate indices add up.
    pub fn from_sparse(layers: usize, experts: usize, index: &[u64], counts: &[f64], tokens: u64) -> Result<Self, String> {
        let n = layers.checked_mul(experts).filter(|&n| n > 0 && n <= u32::MAX as usize).ok_or("layers x experts must be in 1..2^32")?;
        if index.len() != counts.len() {
            return Err(format!("index has {} entries but counts has {}", index.len(), counts.len()));
        }
        if tokens == 0 {
            return Err("a profile needs at least one prompt token".into());
        }
        let mut dense: Vec<(u32, f64)> = Vec::with_capacity(index.len());
        for (&i, &c) in index.iter().zip(counts) {
            if i as usize >= n {
                return Err(format!("index {i} out of range 0..{n}"));
            }
            if !(c.is_finite() && c >= 0.0) {
                return Err(format!("counts must be finite and >= 0, got {c}"));
            }
            if c > 0.0 {
                dense.push((i as u32, c));
            }
        }
        dense.sort_unstable_by_key(|&(i, _)| i);
        dense.dedup_by(|b, a| {
            if a.0 == b.0 {
                a.1 += b.1;
                true
            } else {
                false
            }
        });
        let denom = tokens as f64 + 1.0;
        let mut prof = ExpertProfile { layers, experts, cells: Vec::with_capacity(dense.len()), p: Vec::with_capacity(dense.len()), log_keep: Vec::with_capacity(dense.len()) };
        for (i, c) in dense {
            let p = (c / denom).min(tokens as f64 / denom);
            prof.cells.push(i);
            prof.p.push(p);
            prof.log_keep.push(((-p).ln_1p() * LOG_SCALE).round() as i64);
        }
        Ok(prof)
    }

    pub fn layers(&self) -> usize {
        self.layers
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
    /// Expected distinct experts per layer of one of this request's tokens (about top-k).
    pub fn experts_per_layer(&self) -> f64 {
        self.p.iter().sum::<f64>() / self.layers as f64
    }
}

/// Per-worker in-flight expert state (see the module docs). Cells are laid out
/// `[cell][worker]`, so a route reads each of the request's cells for all K workers at once.
pub struct ExpertLoad {
    layers: usize,
    workers: usize,
    cells_per_worker: usize,
    log_sum: Box<[AtomicI64]>,
    distinct: Box<[PaddedI64]>,
}

#[repr(align(64))]
#[derive(Default)]
struct PaddedI64(AtomicI64);

impl ExpertLoad {
    pub fn new(workers: usize, layers: usize, experts: usize) -> Self {
        let n = layers * experts;
        ExpertLoad {
            layers,
            workers,
            cells_per_worker: n,
            log_sum: (0..workers * n).map(|_| AtomicI64::new(0)).collect(),
            distinct: (0..workers).map(|_| PaddedI64::default()).collect(),
        }
    }

    pub fn num_workers(&self) -> usize {
        self.distinct.len()
    }

    fn fits(&self, p: &ExpertProfile) -> bool {
        p.layers == self.layers && p.layers * p.experts == self.cells_per_worker
    }

    fn apply(&self, worker: usize, p: &ExpertProfile, sign: i64) {
        let t = exp_tables();
        let k = self.workers;
        let mut d = 0i64;
        for (&c, &lk) in p.cells.iter().zip(&p.log_keep) {
            let old = self.log_sum[c as usize * k + worker].fetch_add(sign * lk, Ordering::AcqRel);
            d += mass(t, old) - mass(t, old + sign * lk);
        }
        self.distinct[worker].0.fetch_add(d, Ordering::AcqRel);
    }

    /// `D_w`: expected distinct experts per layer per step of worker w's in-flight requests.
    pub fn distinct(&self, worker: usize) -> f64 {
        self.distinct[worker].0.load(Ordering::Acquire) as f64 / MASS_SCALE / self.layers as f64
    }

    /// `Delta_w`: expected new experts per layer that `p` adds to worker w's steps.
    pub fn added(&self, worker: usize, p: &ExpertProfile) -> f64 {
        let (t, k) = (exp_tables(), self.workers);
        let s: f64 = p.cells.iter().zip(&p.p).map(|(&c, &pr)| pr * keep_prob(t, self.log_sum[c as usize * k + worker].load(Ordering::Relaxed))).sum();
        s / self.layers as f64
    }

    /// `Delta_w` for every worker in one pass over the profile's cells.
    pub fn added_all(&self, p: &ExpertProfile, out: &mut Vec<f64>) {
        let (t, k) = (exp_tables(), self.workers);
        out.clear();
        out.resize(k, 0.0);
        for (&c, &pr) in p.cells.iter().zip(&p.p) {
            let row = &self.log_sum[c as usize * k..(c as usize + 1) * k];
            for (acc, cell) in out.iter_mut().zip(row) {
                *acc += pr * keep_prob(t, cell.load(Ordering::Relaxed));
            }
        }
        let l = self.layers as f64;
        out.iter_mut().for_each(|v| *v /= l);
    }

    /// Count `p` on `worker` until the guard is released (or dropped).
    pub fn acquire(self: &Arc<Self>, worker: usize, p: Arc<ExpertProfile>) -> Result<ExpertGuard, String> {
        if worker >= self.num_workers() {
            return Err(format!("worker {worker} out of range 0..{}", self.num_workers()));
        }
        if !self.fits(&p) {
            return Err(format!("profile is {} x {} but the balancer tracks {} cells per worker", p.layers, p.experts, self.cells_per_worker));
        }
        self.apply(worker, &p, 1);
        Ok(ExpertGuard { load: Arc::clone(self), worker, profile: p, released: AtomicBool::new(false) })
    }
}

/// One request's expert profile counted on one worker; released exactly once.
pub struct ExpertGuard {
    load: Arc<ExpertLoad>,
    worker: usize,
    profile: Arc<ExpertProfile>,
    released: AtomicBool,
}

impl ExpertGuard {
    /// True the first time; false (and no effect) after.
    pub fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.load.apply(self.worker, &self.profile, -1);
        true
    }
}

impl Drop for ExpertGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// The balancer. Its expert state is sized by the first profile it sees.
#[derive(Default)]
pub struct Locality {
    load: OnceLock<Arc<ExpertLoad>>,
}

impl Locality {
    /// The expert state for `workers` workers and `p`'s shape, created on first use; None when
    /// `p` does not match the shape it was created with.
    pub fn load_for(&self, workers: usize, p: &ExpertProfile) -> Option<&Arc<ExpertLoad>> {
        let l = self.load.get_or_init(|| Arc::new(ExpertLoad::new(workers, p.layers, p.experts)));
        (l.fits(p) && l.num_workers() == workers).then_some(l)
    }
}

impl Policy for Locality {
    fn name(&self) -> &'static str {
        "locality"
    }

    fn uses_profile(&self) -> bool {
        true
    }

    fn track(&self, num_workers: usize, worker: usize, profile: Arc<ExpertProfile>) -> Option<Result<ExpertGuard, String>> {
        Some(match self.load_for(num_workers, &profile) {
            Some(l) => l.acquire(worker, profile),
            None => Err("profile shape differs from the balancer's".into()),
        })
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let k = ctx.loads.len();
        let prof = ctx.profile.filter(|p| !p.is_empty());
        let Some(load) = prof.and_then(|p| self.load_for(k, p)) else {
            let why = match ctx.profile {
                None => NoSignature::Missing,
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
            let cost = load.distinct(w) + (b + 1) as f64 * delta[w];
            let key = (cost, b, w);
            if best.is_none_or(|bk| key.0 < bk.0 || (key.0 == bk.0 && (key.1, key.2) < (bk.1, bk.2))) {
                best = Some(key);
            }
        }
        Decision { worker: best.map(|b| b.2), reason: Reason::Policy, d_star: None, band: None }
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
