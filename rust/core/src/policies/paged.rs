//! The locality balancer's cache-aware cost, for decode workers that page experts (SGLang's
//! `--enable-paged-experts --paged-experts-num-resident C`): send a request to the eligible
//! worker where it is expected to cause the fewest expert page-ins.
//!
//! * What a worker holds is estimated with SGLang's own rule (sglang/srt/layers/moe/
//!   paged_experts/residency.py `LRUPolicy`): per MoE layer of the profile, C slots under
//!   LRU, starting with experts 0..C-1 resident. The estimate is driven by the profiles routed
//!   to the worker: routing request r there touches, per layer, r's C most likely experts
//!   (its decode tokens' selections concentrate there), in ascending order of likelihood so the
//!   most likely end most recent. Requests that finish leave their experts resident, as they
//!   do on the GPU until evicted.
//! * A request's expected page-ins per decode token on worker w is the probability mass of its
//!   profile outside w's estimated resident set, `m_w = mean_l sum_{e not resident} p[l][e]`.
//!   A page-in stalls the whole step (SGLang copies on the compute stream), so it costs every
//!   request of the batch: the cost is `(B_w + 1) * m_w`.
//! * Ties (every worker holding the request's experts, e.g. C = E) go to the locality
//!   balancer's cost `D_w + (B_w + 1) * Delta_w + r * (2 * B_w + 1)` (locality.rs, whose
//!   in-flight state and per-request term `r` this policy keeps too), then the shorter queue,
//!   then the lower index. Only workers under the
//!   bounded-load cap are eligible. Without a profile the rule is shortest queue.
//!
//! The estimate is of the router's making: it sees prompt profiles, not the decode steps'
//! routing, so it can drift from the GPU's slots; it is never read back from the workers.

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;

use super::locality::{state_for, LayoutState};
use super::{load_cap, shortest_healthy, Decision, ExpertGuard, ExpertLoad, ExpertProfile, Locality, Policy, ProfileError, Reason, RouteContext};
use crate::signature::NoSignature;

/// One worker's estimated slots: per profile row, the recency stamp of each expert (0 = never
/// resident) and whether it is resident now.
struct Slots {
    stamp: Vec<u64>,
    resident: Vec<bool>,
    clock: u64,
}

/// The resident-set estimate of every worker, for one profile layout.
pub struct ResidentEstimate {
    layer_ids: Arc<[u32]>,
    experts: usize,
    generation: u64,
    capacity: usize,
    workers: Box<[Mutex<Slots>]>,
}

impl ResidentEstimate {
    pub fn new(workers: usize, layer_ids: Arc<[u32]>, experts: usize, generation: u64, capacity: usize) -> Self {
        let rows = layer_ids.len();
        let c = capacity.min(experts);
        let slots = || {
            let mut stamp = vec![0u64; rows * experts];
            let mut resident = vec![false; rows * experts];
            for r in 0..rows {
                for e in 0..c {
                    // LRUPolicy: slots start holding experts 0..C-1, expert 0 least recent
                    stamp[r * experts + e] = e as u64 + 1;
                    resident[r * experts + e] = true;
                }
            }
            Mutex::new(Slots { stamp, resident, clock: c as u64 })
        };
        ResidentEstimate { layer_ids, experts, generation, capacity: c, workers: (0..workers).map(|_| slots()).collect() }
    }

    fn fits(&self, p: &ExpertProfile) -> bool {
        p.experts() == self.experts && p.layer_ids() == &self.layer_ids[..]
    }

    pub fn num_workers(&self) -> usize {
        self.workers.len()
    }

    /// Route `p` to `worker`: per row, its `capacity` most likely experts are used, least
    /// likely first, and the least recently used experts outside them are evicted.
    pub fn touch(&self, worker: usize, p: &ExpertProfile) {
        let e = self.experts;
        let (cells, probs) = p.parts();
        let mut s = self.workers[worker].lock().unwrap_or_else(|x| x.into_inner());
        let mut i = 0;
        let mut row: Vec<(f64, u32)> = Vec::new();
        while i < cells.len() {
            let r = cells[i] as usize / e;
            row.clear();
            while i < cells.len() && cells[i] as usize / e == r {
                row.push((probs[i], cells[i] % e as u32));
                i += 1;
            }
            // the C most likely, then least likely first (ties: higher id first, so the order
            // is total and lower ids end most recent)
            row.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            row.truncate(self.capacity);
            row.reverse();
            let base = r * e;
            for &(_, x) in row.iter() {
                s.clock += 1;
                let c = s.clock;
                s.stamp[base + x as usize] = c;
                s.resident[base + x as usize] = true;
            }
            // evict down to C: the least recent residents go (they are outside this request's set,
            // whose stamps are the newest)
            let mut res: Vec<(u64, usize)> = (0..e).filter(|&x| s.resident[base + x]).map(|x| (s.stamp[base + x], x)).collect();
            if res.len() > self.capacity {
                res.sort_unstable();
                for &(_, x) in &res[..res.len() - self.capacity] {
                    s.resident[base + x] = false;
                }
            }
        }
    }

    /// Expected page-ins per decode token of `p` on `worker`: its mass outside the estimate,
    /// averaged over the profile's rows.
    pub fn miss_mass(&self, worker: usize, p: &ExpertProfile) -> f64 {
        let (cells, probs) = p.parts();
        let s = self.workers[worker].lock().unwrap_or_else(|x| x.into_inner());
        let m: f64 = cells.iter().zip(probs).filter(|(&c, _)| !s.resident[c as usize]).map(|(_, &pr)| pr).sum();
        m / self.layer_ids.len().max(1) as f64
    }

    /// Whether expert `e` of profile row `row` is in `worker`'s estimate.
    pub fn is_resident(&self, worker: usize, row: usize, e: usize) -> bool {
        self.workers[worker].lock().unwrap_or_else(|x| x.into_inner()).resident[row * self.experts + e]
    }
}

/// The policy: the locality balancer with the cache-aware cost (module docs).
pub struct PagedLocality {
    capacity: usize,
    inner: Locality,
    estimate: ArcSwapOption<ResidentEstimate>,
}

impl PagedLocality {
    /// `capacity`: SGLang's `--paged-experts-num-resident`, C >= 1.
    pub fn new(capacity: usize) -> Self {
        Self::with_request_cost(capacity, 0.0)
    }

    /// With the locality tie-break's per-request term `r` (see [`Locality::with_request_cost`]).
    pub fn with_request_cost(capacity: usize, request_cost: f64) -> Self {
        PagedLocality { capacity: capacity.max(1), inner: Locality::with_request_cost(request_cost), estimate: ArcSwapOption::empty() }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The estimate for `workers` workers that `p` fits; replaced by a profile of a newer
    /// centroid generation with another layout (as the locality state is).
    pub fn estimate_for(&self, workers: usize, p: &ExpertProfile) -> Option<Arc<ResidentEstimate>> {
        state_for(&self.estimate, workers, p, || ResidentEstimate::new(workers, p.layer_ids_arc(), p.experts(), p.generation(), self.capacity))
    }
}

impl LayoutState for ResidentEstimate {
    fn fits(&self, p: &ExpertProfile) -> bool {
        ResidentEstimate::fits(self, p)
    }
    fn generation(&self) -> u64 {
        self.generation
    }
    fn num_workers(&self) -> usize {
        ResidentEstimate::num_workers(self)
    }
}

impl Policy for PagedLocality {
    fn name(&self) -> &'static str {
        "locality"
    }

    fn uses_profile(&self) -> bool {
        true
    }

    fn paged_experts(&self) -> Option<usize> {
        Some(self.capacity)
    }

    fn track(&self, num_workers: usize, worker: usize, profile: Arc<ExpertProfile>) -> Option<Result<ExpertGuard, ProfileError>> {
        if worker < num_workers {
            if let Some(est) = self.estimate_for(num_workers, &profile) {
                est.touch(worker, &profile);
            }
        }
        self.inner.track(num_workers, worker, profile)
    }

    fn request_cost(&self) -> Option<f64> {
        self.inner.request_cost()
    }

    fn expert_distinct(&self) -> Option<Vec<f64>> {
        self.inner.expert_distinct()
    }

    fn expert_load(&self) -> Option<Arc<ExpertLoad>> {
        self.inner.expert_load()
    }

    fn set_replicas(&self, replicas: u32) {
        self.inner.set_replicas(replicas)
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let k = ctx.loads.len();
        let prof = ctx.profile.filter(|p| !p.is_empty());
        let found = prof.and_then(|p| Some((p, self.estimate_for(k, p)?, self.inner.load_for(k, p)?)));
        let Some((p, est, load)) = found else {
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
        let cap = ctx.load_factor.map(|f| load_cap(ctx, f));
        let mut delta = Vec::with_capacity(k);
        load.added_all(p, &mut delta);
        let mut best: Option<(f64, f64, i64, usize)> = None;
        for w in 0..k {
            if !ctx.healthy[w] || cap.is_some_and(|c| ctx.loads[w] >= c) {
                continue;
            }
            let b = ctx.loads[w].max(0);
            let key = ((b + 1) as f64 * est.miss_mass(w, p), self.inner.marginal_cost(&load, w, b, delta[w]), b, w);
            let better = |bk: &(f64, f64, i64, usize)| {
                key.0.total_cmp(&bk.0).then(key.1.total_cmp(&bk.1)).then((key.2, key.3).cmp(&(bk.2, bk.3))).is_lt()
            };
            if best.as_ref().is_none_or(better) {
                best = Some(key);
            }
        }
        Decision { worker: best.map(|b| b.3), reason: Reason::Profile, d_star: None, band: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever is routed, every row holds exactly C experts, the last request's C likeliest
        /// experts among them; the choice is healthy and under the load cap.
        #[test]
        fn holds_c_per_row_and_routes_under_the_cap(
            reqs in prop::collection::vec(prop::collection::vec((0u64..24, 1.0f64..9.0), 1..12), 1..20),
            loads in prop::collection::vec(0i64..6, 3),
            c in 1usize..7,
        ) {
            let (layers, experts) = (2usize, 12usize);
            let pol = PagedLocality::new(c);
            let healthy = [true, false, true];
            for (i, cells) in reqs.iter().enumerate() {
                let (idx, cnt): (Vec<u64>, Vec<f64>) = cells.iter().copied().unzip();
                let p = Arc::new(ExpertProfile::from_sparse(layers, experts, &idx, &cnt, 10).unwrap());
                let w = pol.choose(&ctx(&loads, &healthy, Some(&*p), Some(0.05))).worker.unwrap();
                let total: i64 = loads[0] + loads[2];
                let cap = (1.05 * (total + 1) as f64 / 2.0).ceil() as i64;
                prop_assert!(healthy[w] && loads[w] < cap);
                let target = [0usize, 2][i % 2];
                drop(pol.track(3, target, Arc::clone(&p)));
                let est = pol.estimate_for(3, &p).unwrap();
                for r in 0..layers {
                    let held: Vec<usize> = (0..experts).filter(|&e| est.is_resident(target, r, e)).collect();
                    prop_assert_eq!(held.len(), c);
                    // the request's C likeliest in this row are resident
                    let (cs, ps) = p.parts();
                    let mut row: Vec<(f64, usize)> = cs.iter().zip(ps).filter(|(&x, _)| x as usize / experts == r).map(|(&x, &q)| (q, x as usize % experts)).collect();
                    row.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                    for &(_, e) in row.iter().take(c) {
                        prop_assert!(est.is_resident(target, r, e), "expert {} of row {}", e, r);
                    }
                }
            }
        }
    }

    /// A one-layer profile over `experts` experts with these (expert, count) cells and `tokens`
    /// prompt tokens (p = count / (tokens + 1)).
    fn prof(experts: usize, cells: &[(u64, f64)], tokens: u64) -> ExpertProfile {
        let (idx, c): (Vec<u64>, Vec<f64>) = cells.iter().copied().unzip();
        ExpertProfile::from_sparse(1, experts, &idx, &c, tokens).unwrap()
    }

    fn resident(est: &ResidentEstimate, w: usize, e: usize) -> Vec<usize> {
        (0..e).filter(|&x| est.is_resident(w, 0, x)).collect()
    }

    #[test]
    fn starts_like_sglang_and_evicts_the_least_recently_used() {
        let p = prof(6, &[(4, 3.0)], 9);
        let est = ResidentEstimate::new(2, p.layer_ids_arc(), 6, 0, 2);
        assert_eq!(resident(&est, 0, 6), vec![0, 1], "slots start holding experts 0..C-1");
        est.touch(0, &p); // expert 4 in, the least recent of {0, 1} (0) out
        assert_eq!(resident(&est, 0, 6), vec![1, 4]);
        assert_eq!(resident(&est, 1, 6), vec![0, 1], "another worker is untouched");
        // a request whose likeliest experts are 5 then 2 (3 is third and beyond C = 2)
        est.touch(0, &prof(6, &[(5, 6.0), (2, 4.0), (3, 1.0)], 9));
        assert_eq!(resident(&est, 0, 6), vec![2, 5]);
        // 2 was touched before 5 (less likely first), so 2 is the least recent of the two
        est.touch(0, &prof(6, &[(1, 2.0)], 9));
        assert_eq!(resident(&est, 0, 6), vec![1, 5]);
    }

    #[test]
    fn miss_mass_is_the_profile_outside_the_estimate() {
        let p = prof(6, &[(0, 3.0), (4, 6.0)], 9); // p = 0.3 and 0.6
        let est = ResidentEstimate::new(1, p.layer_ids_arc(), 6, 0, 2);
        assert!((est.miss_mass(0, &p) - 0.6).abs() < 1e-12, "0 is resident, 4 is not");
        est.touch(0, &p);
        assert_eq!(est.miss_mass(0, &p), 0.0);
    }

    fn ctx<'a>(loads: &'a [i64], healthy: &'a [bool], p: Option<&'a ExpertProfile>, lf: Option<f64>) -> RouteContext<'a> {
        RouteContext { loads, healthy, distances: None, fallback: Reason::NoCentroids, tau: 0.1, load_factor: lf, profile: p, explain: false }
    }

    #[test]
    fn routes_to_the_worker_holding_the_request_experts() {
        let pol = PagedLocality::new(2);
        let a = Arc::new(prof(8, &[(6, 5.0), (7, 4.0)], 9));
        let b = Arc::new(prof(8, &[(2, 5.0), (3, 4.0)], 9));
        let healthy = [true, true];
        // worker 1 served a request using 6 and 7 (it has finished: its guard is dropped)
        drop(pol.track(2, 1, Arc::clone(&a)).unwrap().unwrap());
        assert_eq!(pol.choose(&ctx(&[0, 0], &healthy, Some(&*a), None)).worker, Some(1));
        // b's experts are resident nowhere: both workers miss all of it, and the locality tie
        // break (nothing in flight) and then the index decide
        assert_eq!(pol.choose(&ctx(&[0, 0], &healthy, Some(&*b), None)).worker, Some(0));
        // the load cap still binds: worker 1 full
        assert_eq!(pol.choose(&ctx(&[0, 5], &healthy, Some(&*a), Some(0.05))).worker, Some(0));
        // no profile: shortest queue
        assert_eq!(pol.choose(&ctx(&[3, 1], &healthy, None, None)).worker, Some(1));
        assert_eq!(pol.paged_experts(), Some(2));
        assert_eq!(pol.name(), "locality");
    }
}
