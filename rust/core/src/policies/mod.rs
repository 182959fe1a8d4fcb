//! Routing policies: one small trait, one file per policy, and a factory.
//!
//! A policy is a pure choice over a [`RouteContext`] (loads, health, and for ELDR the
//! signature-to-centroid distances, which the router computes). That keeps policies
//! testable on constructed cases and shared verbatim by the router service and simulator.
//! [`config`] holds the one list of policies, their capabilities and the defaults, and the
//! factory ([`PolicyConfig`], [`make_policy`]); the router's config and CLI, the data plane
//! and the simulator read them from here. [`spec`] is a router's typed spec ([`RouterSpec`]:
//! the policy with its costs, tau, load factor, binding), built and checked once.

mod config;
mod eldr;
mod label;
mod locality;
mod occupancy;
mod paged;
mod power_of_two;
mod random;
mod round_robin;
mod shortest_queue;
mod spec;

pub use config::{
    counts_policies, is_counts_policy, is_prefill_policy, make_policy, policy_info, prefill_policies, PolicyConfig, PolicyInfo, UnknownPolicy,
    DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_PREFILL_POLICY, DEFAULT_REQUEST_COST, DEFAULT_TAU, POLICIES, POLICY_NAMES,
};
pub use eldr::{band_size, Eldr};
pub use label::{parse_arms, parse_label, py_repr, ArmLabel, PolicyLabel, MAX_ARMS, PAGED};
pub use locality::{ExpertGuard, ExpertLoad, ExpertProfile, Locality, ProfileError};
pub use occupancy::{OccupancyError, OwnAtPoll};
pub use paged::{PagedLocality, ResidentEstimate};
pub use power_of_two::PowerOfTwo;
pub use random::Random;
pub use round_robin::RoundRobin;
pub use shortest_queue::ShortestQueue;
pub use spec::{check_float, fmt_g, Bind, RouterSpec, RouterSpecError, MAX_LOAD_FACTOR, MAX_REQUEST_COST, MAX_TAU, PAGED_EXPERTS_FLAG};

use std::sync::Arc;

use crate::signature::NoSignature;

/// The fallback vocabulary: why a counts policy routed without a usable signature. The names
/// of [`NoSignature`] and `no_centroids` ([`Reason::NoCentroids`]); a fallback decision's
/// label is `no_signature:<name>` or `no_centroids`.
pub fn fallback_reasons() -> Vec<&'static str> {
    NoSignature::ALL.iter().map(|w| w.as_str()).chain(std::iter::once(NO_CENTROIDS)).collect()
}

const NO_CENTROIDS: &str = "no_centroids";

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// ELDR: shortest queue inside the locality band.
    Band,
    /// ELDR fallback: no usable signature.
    NoSignature(NoSignature),
    /// ELDR fallback: no centroid file loaded.
    NoCentroids,
    /// A baseline policy's own rule.
    Policy,
    /// The locality balancer: least marginal expected expert cost under the cap.
    Profile,
}

impl Reason {
    pub fn label(&self) -> String {
        match self {
            Reason::Band => "band".into(),
            Reason::NoSignature(w) => format!("no_signature:{w}"),
            Reason::NoCentroids => NO_CENTROIDS.into(),
            Reason::Policy => "policy".into(),
            Reason::Profile => "profile".into(),
        }
    }
}

/// Everything a policy may look at. `distances` is `Some` only when ELDR has a usable
/// signature and centroids; otherwise `fallback` says why.
pub struct RouteContext<'a> {
    pub loads: &'a [i64],
    pub healthy: &'a [bool],
    pub distances: Option<&'a [f64]>,
    pub fallback: Reason,
    pub tau: f64,
    /// ELDR with bounded loads: only workers below `ceil((1 + f) * (total load + 1) / healthy)`
    /// are candidates. None = the paper's band rule exactly.
    pub load_factor: Option<f64>,
    /// The request's expert profile from its prompt counts (the locality balancer's input).
    pub profile: Option<&'a ExpertProfile>,
    /// Fill in the band (costs an allocation); off on the hot path.
    pub explain: bool,
}

/// A routing decision; `worker` is None only when no worker is healthy.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub worker: Option<usize>,
    pub reason: Reason,
    pub d_star: Option<f64>,
    pub band: Option<Vec<usize>>,
}

impl Decision {
    pub fn by_policy(worker: Option<usize>) -> Self {
        Decision { worker, reason: Reason::Policy, d_star: None, band: None }
    }
}

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether the router should compute signature distances for this policy.
    fn uses_signature(&self) -> bool {
        false
    }
    /// Whether the policy reads `RouteContext::profile` and tracks profiles on acquire.
    fn uses_profile(&self) -> bool {
        false
    }
    /// Count `profile` on `worker` while the request is in flight (the guard releases it).
    /// None: the policy keeps no per-request state.
    fn track(&self, _num_workers: usize, _worker: usize, _profile: Arc<ExpertProfile>) -> Option<Result<ExpertGuard, ProfileError>> {
        None
    }
    /// The locality balancer's `D_w` per worker (expected distinct experts per layer per step
    /// of its in-flight requests); None for policies that keep no expert state.
    fn expert_distinct(&self) -> Option<Vec<f64>> {
        None
    }
    /// The locality balancer's expert state (what a worker's occupancy report is blended
    /// into); None for other policies, and before the balancer's first profile.
    fn expert_load(&self) -> Option<Arc<ExpertLoad>> {
        None
    }
    /// Router replicas in front of the same workers, this one among them (1: alone); the
    /// locality balancer counts each request's experts as R alike requests (locality.rs).
    fn set_replicas(&self, _replicas: u32) {}
    /// The resident experts per MoE layer (SGLang's `--paged-experts-num-resident C`) that the
    /// cache-aware locality cost assumes on every decode worker; None for every other policy.
    fn paged_experts(&self) -> Option<usize> {
        None
    }
    /// The locality cost's per-request term `r` (distinct experts per layer per request in the
    /// batch; locality.rs); None for the policies without that cost.
    fn request_cost(&self) -> Option<f64> {
        None
    }
    fn choose(&self, ctx: &RouteContext) -> Decision;
}

/// Bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): a worker is a candidate only
/// below `ceil((1 + f) * (total + 1) / healthy workers)` in-flight requests.
pub(crate) fn load_cap(ctx: &RouteContext, f: f64) -> i64 {
    let (n, total) = (0..ctx.loads.len()).filter(|&k| ctx.healthy[k]).fold((0i64, 0i64), |(n, t), k| (n + 1, t + ctx.loads[k]));
    ((1.0 + f) * (total + 1) as f64 / n.max(1) as f64).ceil() as i64
}

/// Healthy worker with the fewest in-flight requests; ties to the lower index.
pub(crate) fn shortest_healthy(loads: &[i64], healthy: &[bool]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for w in 0..loads.len() {
        if healthy[w] && best.is_none_or(|b| loads[w] < loads[b]) {
            best = Some(w);
        }
    }
    best
}

#[cfg(test)]
mod occupancy_tests;
#[cfg(test)]
mod tests;
