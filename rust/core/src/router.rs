//! The router: signature -> distances to the current centroids -> policy -> decision, with
//! loads from the queue tracker. Shared by the PD router service and the simulator.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use thiserror::Error;

use crate::centroid_file::{CentroidFileError, CentroidSet};
use crate::limits::{self, SizeError};
use crate::policies::{Decision, ExpertProfile, Policy, Reason, RouteContext, RouterSpec, RouterSpecError, MAX_LOAD_FACTOR, MAX_TAU};
pub use crate::policies::DEFAULT_TAU;
use crate::queue::QueueTracker;
use crate::distance::Counts;
use crate::payload::DecodedCounts;
use crate::signature::{CountValue, NoSignature, SparseIndex, SparseSignature};
use crate::store::CentroidStore;

/// Why a router could not be built.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum BuildError {
    #[error(transparent)]
    Centroids(#[from] CentroidFileError),
    #[error(transparent)]
    Size(#[from] SizeError),
    #[error(transparent)]
    Spec(#[from] RouterSpecError),
    #[error(transparent)]
    Param(#[from] ParamError),
    #[error("give num_workers or a centroid file")]
    NoWorkerCount,
}

/// A routing parameter set at run time (a centroid file's tau, the admin's) out of the
/// range [`RouterSpec::new`] checks at start.
#[derive(Debug, Error, Clone, Copy, PartialEq)]
pub enum ParamError {
    #[error("tau must be finite and in [0, 2], got {0}")]
    Tau(f64),
    #[error("load_factor must be finite and in [0, 1e6], got {0}")]
    LoadFactor(f64),
}

#[derive(Debug, Error, Clone, PartialEq)]
pub enum RouteError {
    #[error("no healthy decode worker")]
    NoHealthyWorker,
}

/// A decision plus what it was made from.
#[derive(Debug, Clone)]
pub struct Routed {
    pub decision: Decision,
    pub distances: Option<Vec<f64>>,
    pub loads: Vec<i64>,
    pub tau: f64,
    /// Generation of the centroid snapshot used (0 without centroids).
    pub generation: u64,
    /// The signature the distances came from, when the caller asked to keep it
    /// ([`Router::route_counts`]); its `value / norm` is the unit signature.
    pub signature: Option<SparseSignature>,
    /// The chosen worker's distance (its centroid's; None: no distances, or it has none).
    pub chosen_distance: Option<f64>,
}

/// Which decode worker (slot) each centroid of the serving file belongs to. `distances` are
/// per centroid; the policies read them per worker slot. The first file maps centroid k to
/// worker k. A worker that leaves drops its centroid; one that joins has none (infinitely far:
/// the band rule reaches it only through its fallback) until a file of the next generation,
/// whose K must equal the members then, maps its centroids to the members in slot order (what
/// a refit writes). Shared by a router's siblings.
#[derive(Debug, Clone)]
struct CentroidMap {
    generation: u64,
    slot_of: Vec<Option<usize>>,
    /// Every centroid k on slot k, and as many slots as centroids: distances are used as they are.
    identity: bool,
}

impl CentroidMap {
    fn new(generation: u64, slot_of: Vec<Option<usize>>, slots: usize) -> Self {
        let identity = slot_of.len() == slots && slot_of.iter().enumerate().all(|(k, s)| *s == Some(k));
        CentroidMap { generation, slot_of, identity }
    }

    /// Per-slot distances from per-centroid ones (a slot without a centroid: +inf).
    fn per_slot(&self, d: &[f64], slots: usize) -> Vec<f64> {
        let mut out = vec![f64::INFINITY; slots];
        for (k, s) in self.slot_of.iter().enumerate() {
            if let (Some(s), Some(&v)) = (s, d.get(k)) {
                if *s < slots {
                    out[*s] = v;
                }
            }
        }
        out
    }
}

pub struct Router {
    /// What `policy` was built from, checked once (policies/spec.rs); its tau and load factor
    /// are the values at start (the live ones: `tau()`, `load_factor()`).
    spec: RouterSpec,
    policy: Box<dyn Policy>,
    tracker: Arc<QueueTracker>,
    /// Shared with [`Router::sibling`]s: a reload serves them all.
    store: Option<Arc<CentroidStore>>,
    tau_bits: Arc<AtomicU64>,
    /// f64 bits of the bounded-load factor; NaN = off (the paper's rule).
    load_factor_bits: AtomicU64,
    auto_reload: bool,
    centroid_map: Arc<ArcSwap<CentroidMap>>,
}

impl Router {
    /// `num_workers` may be omitted when a centroid file gives K; if both are given they must
    /// agree. `tau` is the spec's, else the file's, else 0.1.
    pub fn new(spec: RouterSpec, num_workers: Option<usize>, centroids: Option<&Path>, reload_interval_ms: u64, load_report_ttl_ms: u64) -> Result<Self, BuildError> {
        if let Some(k) = num_workers {
            limits::check_dim("num_workers", k)?;
        }
        let store = match centroids {
            Some(p) => Some(Arc::new(CentroidStore::open(p, num_workers, reload_interval_ms)?)),
            None => None,
        };
        let k = match (num_workers, &store) {
            (Some(k), _) => k,
            (None, Some(s)) => s.set().num_workers(),
            (None, None) => return Err(BuildError::NoWorkerCount),
        };
        let tau = spec.tau.or_else(|| store.as_ref().map(|s| s.set().tau() as f64)).unwrap_or(DEFAULT_TAU);
        check_tau(tau)?;
        let generation = store.as_ref().map_or(0, |s| s.generation());
        let r = Router {
            centroid_map: Arc::new(ArcSwap::from_pointee(CentroidMap::new(generation, (0..k).map(Some).collect(), k))),
            spec,
            policy: spec.policy.build(),
            tracker: Arc::new(QueueTracker::new(k, load_report_ttl_ms)),
            store,
            tau_bits: Arc::new(AtomicU64::new(tau.to_bits())),
            load_factor_bits: AtomicU64::new(f64::NAN.to_bits()),
            auto_reload: reload_interval_ms > 0,
        };
        r.set_load_factor(spec.load_factor)?;
        Ok(r)
    }

    /// What this router was built from (its policy, costs and binding).
    pub fn spec(&self) -> &RouterSpec {
        &self.spec
    }
    /// Whether a request waits for the prefill's signature before its decode is chosen (the
    /// data plane's binding of this router's requests).
    pub fn binds_late(&self) -> bool {
        self.spec.binds_late()
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }
    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }
    pub fn num_workers(&self) -> usize {
        self.tracker.num_workers()
    }
    pub fn tracker(&self) -> &Arc<QueueTracker> {
        &self.tracker
    }
    pub fn store(&self) -> Option<&CentroidStore> {
        self.store.as_deref()
    }

    /// A router on another policy over the same cluster: it shares this one's queue tracker
    /// (loads, health, in-flight counts), centroid store (a reload serves both) and tau; the
    /// policy and its own state (the locality balancer's expert loads), the load factor and
    /// the binding are `spec`'s (its tau is not read: tau is shared). A switchback
    /// experiment's arms (the data plane's `experiment`).
    pub fn sibling(&self, spec: RouterSpec) -> Result<Router, ParamError> {
        let r = Router {
            spec,
            policy: spec.policy.build(),
            tracker: Arc::clone(&self.tracker),
            store: self.store.clone(),
            tau_bits: Arc::clone(&self.tau_bits),
            load_factor_bits: AtomicU64::new(f64::NAN.to_bits()),
            auto_reload: self.auto_reload,
            centroid_map: Arc::clone(&self.centroid_map),
        };
        r.set_load_factor(spec.load_factor)?;
        // the replicas beside this router are the sibling's too (its balancer mirrors its
        // requests as this one's does)
        r.policy.set_replicas(self.tracker.replicas());
        Ok(r)
    }
    pub fn tau(&self) -> f64 {
        f64::from_bits(self.tau_bits.load(Ordering::Relaxed))
    }
    pub fn set_tau(&self, tau: f64) -> Result<(), ParamError> {
        check_tau(tau)?;
        self.tau_bits.store(tau.to_bits(), Ordering::Relaxed);
        Ok(())
    }

    /// Bounded loads for ELDR (see `policies::eldr`); None restores the paper's rule.
    pub fn load_factor(&self) -> Option<f64> {
        Some(f64::from_bits(self.load_factor_bits.load(Ordering::Relaxed))).filter(|f| !f.is_nan())
    }
    pub fn set_load_factor(&self, factor: Option<f64>) -> Result<(), ParamError> {
        if let Some(f) = factor {
            if !(f.is_finite() && (0.0..=MAX_LOAD_FACTOR).contains(&f)) {
                return Err(ParamError::LoadFactor(f));
            }
        }
        self.load_factor_bits.store(factor.unwrap_or(f64::NAN).to_bits(), Ordering::Relaxed);
        Ok(())
    }

    /// The locality cost's per-request term (None: not a locality policy).
    pub fn request_cost(&self) -> Option<f64> {
        self.policy.request_cost()
    }

    /// The resident experts per layer the policy assumes (None: not a paged-experts cost).
    pub fn paged_experts(&self) -> Option<usize> {
        self.policy.paged_experts()
    }

    /// Follow a membership change of the tracker (a worker added or removed; the data plane
    /// calls it after each): a centroid whose worker left is dropped, and a reloaded file must
    /// have one centroid per member from now on.
    pub fn sync_membership(&self) {
        let members = self.tracker.members();
        if let Some(store) = &self.store {
            store.set_expected_workers(members.len());
        }
        let cur = self.centroid_map.load_full();
        let slot_of = cur.slot_of.iter().map(|s| s.filter(|&s| self.tracker.is_member(s))).collect();
        self.centroid_map.store(Arc::new(CentroidMap::new(cur.generation, slot_of, self.tracker.num_workers())));
    }

    /// The centroid index of each worker slot (None: it has none), under the serving file.
    pub fn centroid_of_slots(&self) -> Vec<Option<usize>> {
        let n = self.num_workers();
        let map = match &self.store {
            Some(s) => self.map_for(s.generation(), s.set().num_workers()),
            None => return vec![None; n],
        };
        let mut out = vec![None; n];
        for (k, s) in map.slot_of.iter().enumerate() {
            if let Some(s) = s.filter(|&s| s < n) {
                out[s] = Some(k);
            }
        }
        out
    }

    /// The map for centroid `generation` with `k` centroids: a newer file maps its centroids to
    /// the members in slot order when it has one per member, else (a file the store took
    /// before a change: it checks K) centroid k stays on slot k while that is a member.
    fn map_for(&self, generation: u64, k: usize) -> Arc<CentroidMap> {
        let cur = self.centroid_map.load_full();
        if cur.generation == generation {
            return cur;
        }
        let members = self.tracker.members();
        let slot_of = if members.len() == k { members.into_iter().map(Some).collect() } else { (0..k).map(|s| Some(s).filter(|&s| self.tracker.is_member(s))).collect() };
        let map = Arc::new(CentroidMap::new(generation, slot_of, self.tracker.num_workers()));
        self.centroid_map.rcu(|c| if c.generation >= generation { Arc::clone(c) } else { Arc::clone(&map) });
        self.centroid_map.load_full()
    }

    pub fn reload(&self) -> Result<bool, CentroidFileError> {
        match &self.store {
            Some(s) => s.reload().map(|_| true),
            None => Ok(false),
        }
    }

    /// Choose a decode worker. Does not acquire: the caller acquires the chosen worker.
    ///
    /// `distances_of` computes `d_k` against the centroid snapshot this route uses from start to
    /// finish (see [`crate::distance`]); it is called only by signature-using policies with
    /// centroids loaded. An `Err` is the fallback reason.
    pub fn route<F>(&self, distances_of: F, explain: bool) -> Result<Routed, RouteError>
    where
        F: FnOnce(&CentroidSet) -> Result<Vec<f64>, NoSignature>,
    {
        self.route_profiled(distances_of, None, explain)
    }

    /// The request's expert profile for the locality balancer from its raw prefill counts,
    /// over the current centroid file's selected layers (tagged with its generation, so the
    /// balancer follows a change of layer selection). None without a centroid file.
    pub fn profile<I: SparseIndex, T: CountValue>(&self, counts: Counts<'_, I, T>, tokens: u64) -> Option<Result<ExpertProfile, NoSignature>> {
        let snap = self.store.as_ref()?.snapshot();
        Some(ExpertProfile::from_counts(snap.set.spec(), snap.generation, counts, tokens))
    }

    /// [`Router::route`] with the request's expert profile (read by the locality balancer).
    pub fn route_profiled<F>(&self, distances_of: F, profile: Option<&ExpertProfile>, explain: bool) -> Result<Routed, RouteError>
    where
        F: FnOnce(&CentroidSet) -> Result<Vec<f64>, NoSignature>,
    {
        let mut loads = Vec::with_capacity(self.num_workers());
        let mut healthy = Vec::with_capacity(self.num_workers());
        self.tracker.state_into(&mut loads, &mut healthy);
        let tau = self.tau();
        let mut distances = None;
        let mut per_slot = None; // the distances by worker slot, where they differ
        let mut fallback = Reason::NoCentroids;
        let mut generation = 0;
        let mut distances_of = Some(distances_of);
        if self.policy.uses_signature() {
            if let (Some(store), Some(distances_of)) = (&self.store, distances_of.take()) {
                if self.auto_reload {
                    let _ = store.maybe_reload(); // errors are kept in store.last_error()
                }
                let snap = store.snapshot();
                generation = snap.generation;
                match distances_of(&snap.set) {
                    Ok(d) => {
                        // the common case (no membership change since the file) costs one guard load
                        let cur = self.centroid_map.load();
                        let as_is = cur.generation == snap.generation && cur.identity && d.len() == loads.len();
                        if !as_is {
                            let map = self.map_for(snap.generation, snap.set.num_workers());
                            if !(map.identity && d.len() == loads.len()) {
                                per_slot = Some(map.per_slot(&d, loads.len()));
                            }
                        }
                        distances = Some(d);
                    }
                    Err(why) => fallback = Reason::NoSignature(why),
                }
            }
        }
        if self.policy.uses_profile() && profile.is_none() {
            // no profile: the caller's reason (a route_fallback) names the fallback
            if let (Some(store), Some(distances_of)) = (&self.store, distances_of.take()) {
                if let Err(why) = distances_of(&store.snapshot().set) {
                    fallback = Reason::NoSignature(why);
                }
            }
        }
        if let (true, Some(p)) = (self.policy.uses_profile(), profile) {
            generation = p.generation(); // the centroids its layer selection came from
        }
        let load_factor = self.load_factor();
        let by_slot = per_slot.as_deref().or(distances.as_deref());
        let ctx = RouteContext { loads: &loads, healthy: &healthy, distances: by_slot, fallback, tau, load_factor, profile, explain };
        let decision = self.policy.choose(&ctx);
        let Some(w) = decision.worker else {
            return Err(RouteError::NoHealthyWorker);
        };
        let chosen_distance = by_slot.and_then(|d| d.get(w).copied()).filter(|d| d.is_finite());
        Ok(Routed { decision, distances, loads, tau, generation, signature: None, chosen_distance })
    }

    /// Route from a decoded wire payload: the distances are read straight from the packed
    /// counts ([`DecodedCounts::distances`]). With `keep_signature`, the decision carries
    /// that signature (only when distances were computed from it).
    pub fn route_counts(&self, counts: &DecodedCounts, keep_signature: bool, explain: bool) -> Result<Routed, RouteError> {
        let mut kept = SparseSignature::default();
        let keep = keep_signature.then_some(&mut kept);
        let mut r = self.route(|set| counts.distances(set, keep), explain)?;
        if keep_signature && r.distances.is_some() {
            r.signature = Some(kept);
        }
        Ok(r)
    }
}

fn check_tau(tau: f64) -> Result<(), ParamError> {
    if tau.is_finite() && (0.0..=MAX_TAU).contains(&tau) {
        Ok(())
    } else {
        Err(ParamError::Tau(tau))
    }
}

