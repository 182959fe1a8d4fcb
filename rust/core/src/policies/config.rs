//! The one definition of the policies: their list, what each can do, the defaults, and the
//! factory. The router's config and CLI (`_core.POLICIES`, `_core.PREFILL_POLICIES`, the
//! `_core.DEFAULT_*` names), the data plane's config check and the simulator read them; a
//! new policy is a file in this folder, a [`PolicyConfig`] variant and a row of [`POLICIES`].

use thiserror::Error;

use super::spec::{check_float, RouterSpecError, MAX_REQUEST_COST, PAGED_EXPERTS_FLAG, REQUEST_COST_FLAG};
use super::{Eldr, Locality, PagedLocality, Policy, PowerOfTwo, Random, RoundRobin, ShortestQueue};

/// A routing policy by name, and what it can do. `uses_counts`: it routes on the prefill's
/// expert counts, so it binds late, needs a centroid file (eldr its centroids, locality its
/// layer selection) and counts fallbacks. `prefill`: it can also place requests on prefill
/// workers (it reads loads and health only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyInfo {
    pub name: &'static str,
    pub uses_counts: bool,
    pub prefill: bool,
}

impl PolicyInfo {
    /// Whether a request waits for the prefill's signature before its decode is chosen.
    pub fn binds_late(&self) -> bool {
        self.uses_counts
    }
}

/// Every policy [`make_policy`] builds, in the order the CLI lists them.
pub const POLICIES: [PolicyInfo; 6] = [
    PolicyInfo { name: "eldr", uses_counts: true, prefill: false },
    PolicyInfo { name: "locality", uses_counts: true, prefill: false },
    PolicyInfo { name: "random", uses_counts: false, prefill: true },
    PolicyInfo { name: "round_robin", uses_counts: false, prefill: true },
    PolicyInfo { name: "shortest_queue", uses_counts: false, prefill: true },
    PolicyInfo { name: "power_of_two", uses_counts: false, prefill: false },
];

/// The names of [`POLICIES`], in order.
pub const POLICY_NAMES: [&str; POLICIES.len()] = {
    let mut out = [""; POLICIES.len()];
    let mut i = 0;
    while i < POLICIES.len() {
        out[i] = POLICIES[i].name;
        i += 1;
    }
    out
};

/// The decode policy a router uses when none is given: the locality-aware balancer
/// (benchmarks/results/tpot_study_protocol.md chose it; the README's TPOT section).
pub const DEFAULT_POLICY: &str = "locality";
/// The prefill placement a router uses when none is given.
pub const DEFAULT_PREFILL_POLICY: &str = "round_robin";
/// ELDR's band width when neither the caller nor the centroid file gives one.
pub const DEFAULT_TAU: f64 = 0.1;
/// The bounded-load cap of eldr/F, shared by locality/F (the default policy's label is
/// `locality/0.05`).
pub const DEFAULT_LOAD_FACTOR: f64 = 0.05;
/// The locality cost's per-request term r (`--eldr-request-cost`, `locality:rc=R`) when none is
/// given: one R for every deployment, between GPT-OSS-20B/H100's 0.021 and DeepSeek-V3/H200's
/// 0.049. The full strict study picked the term over none by the rule fixed in advance
/// (benchmarks/results/per_request_cost_study.md: 25 of 108 runs losing against 28, with
/// R = 0.03 and with each profile's own R). 0 is the paper-like rule without the term.
pub const DEFAULT_REQUEST_COST: f64 = 0.03;

/// The policy of this name, if there is one.
pub fn policy_info(name: &str) -> Option<&'static PolicyInfo> {
    POLICIES.iter().find(|p| p.name == name)
}

/// The names of the policies that route on counts, in [`POLICIES`] order.
pub fn counts_policies() -> Vec<&'static str> {
    POLICIES.iter().filter(|p| p.uses_counts).map(|p| p.name).collect()
}

/// The names of the policies that can place prefill requests, in [`POLICIES`] order.
pub fn prefill_policies() -> Vec<&'static str> {
    POLICIES.iter().filter(|p| p.prefill).map(|p| p.name).collect()
}

pub fn is_counts_policy(name: &str) -> bool {
    policy_info(name).is_some_and(|p| p.uses_counts)
}

pub fn is_prefill_policy(name: &str) -> bool {
    policy_info(name).is_some_and(|p| p.prefill)
}

/// A policy name that is not in [`POLICY_NAMES`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("unknown policy {name:?}; choose one of {}", POLICY_NAMES.join(", "))]
pub struct UnknownPolicy {
    pub name: String,
}

/// A policy and what building it takes: the factory's typed input. The band width and the
/// load factor are the router's (they change at run time: `Router::set_tau`), passed to every
/// choice in the [`super::RouteContext`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicyConfig {
    Eldr,
    /// The locality balancer; `request_cost` is its per-request term `r` (locality.rs; the
    /// router's `--eldr-request-cost R`, 0 = the rule without it).
    Locality { request_cost: f64 },
    /// The locality balancer with the cache-aware cost (paged.rs) for decode workers running
    /// SGLang's paged experts with `resident` experts per MoE layer: the router's
    /// `--eldr-paged-experts C`. Its name and row of [`POLICIES`] are locality's.
    PagedLocality { resident: u32, request_cost: f64 },
    Random { seed: u64 },
    RoundRobin,
    ShortestQueue,
    PowerOfTwo { seed: u64 },
}

impl PolicyConfig {
    /// The policy of this name; `seed` drives the random ones.
    pub fn parse(name: &str, seed: u64) -> Result<PolicyConfig, UnknownPolicy> {
        Ok(match name {
            "eldr" => PolicyConfig::Eldr,
            "locality" => PolicyConfig::Locality { request_cost: DEFAULT_REQUEST_COST },
            "random" => PolicyConfig::Random { seed },
            "round_robin" => PolicyConfig::RoundRobin,
            "shortest_queue" => PolicyConfig::ShortestQueue,
            "power_of_two" => PolicyConfig::PowerOfTwo { seed },
            other => return Err(UnknownPolicy { name: other.to_owned() }),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::Eldr => "eldr",
            PolicyConfig::Locality { .. } | PolicyConfig::PagedLocality { .. } => "locality",
            PolicyConfig::Random { .. } => "random",
            PolicyConfig::RoundRobin => "round_robin",
            PolicyConfig::ShortestQueue => "shortest_queue",
            PolicyConfig::PowerOfTwo { .. } => "power_of_two",
        }
    }

    /// The locality balancer with the cache-aware cost for `resident` paged experts per layer;
    /// only the locality policy takes it, and C must be at least 1 ([`super::RouterSpec::new`]
    /// checks the range with the command line's words).
    pub fn with_paged_experts(self, resident: Option<u32>) -> Result<PolicyConfig, RouterSpecError> {
        match (self, resident) {
            (c, None) => Ok(c),
            (_, Some(0)) => Err(RouterSpecError::Range { flag: PAGED_EXPERTS_FLAG, lo: 1.0, hi: crate::limits::MAX_EXPERTS as f64, got: "0".into() }),
            (PolicyConfig::Locality { request_cost } | PolicyConfig::PagedLocality { request_cost, .. }, Some(resident)) => {
                Ok(PolicyConfig::PagedLocality { resident, request_cost })
            }
            (c, Some(_)) => Err(RouterSpecError::NotLocality { flag: PAGED_EXPERTS_FLAG, policy: c.name() }),
        }
    }

    /// The locality cost with the per-request term `r` (locality.rs): finite and in
    /// [0, 1e6], and only the locality policy takes it (None, and r = 0 on any policy, change
    /// nothing).
    pub fn with_request_cost(self, request_cost: Option<f64>) -> Result<PolicyConfig, RouterSpecError> {
        let Some(r) = request_cost else { return Ok(self) };
        check_float(REQUEST_COST_FLAG, r, 0.0, MAX_REQUEST_COST)?;
        match self {
            PolicyConfig::Locality { .. } => Ok(PolicyConfig::Locality { request_cost: r }),
            PolicyConfig::PagedLocality { resident, .. } => Ok(PolicyConfig::PagedLocality { resident, request_cost: r }),
            c if r == 0.0 => Ok(c),
            c => Err(RouterSpecError::NotLocality { flag: REQUEST_COST_FLAG, policy: c.name() }),
        }
    }

    /// Its row of [`POLICIES`].
    pub fn info(&self) -> &'static PolicyInfo {
        policy_info(self.name()).expect("every PolicyConfig is listed in POLICIES")
    }

    pub fn build(&self) -> Box<dyn Policy> {
        match *self {
            PolicyConfig::Eldr => Box::new(Eldr),
            PolicyConfig::Locality { request_cost } => Box::new(Locality::with_request_cost(request_cost)),
            PolicyConfig::PagedLocality { resident, request_cost } => Box::new(PagedLocality::with_request_cost(resident as usize, request_cost)),
            PolicyConfig::Random { seed } => Box::new(Random::new(seed)),
            PolicyConfig::RoundRobin => Box::new(RoundRobin::default()),
            PolicyConfig::ShortestQueue => Box::new(ShortestQueue),
            PolicyConfig::PowerOfTwo { seed } => Box::new(PowerOfTwo::new(seed)),
        }
    }
}

/// Build a policy by name. `seed` drives the random ones.
pub fn make_policy(name: &str, seed: u64) -> Result<Box<dyn Policy>, UnknownPolicy> {
    PolicyConfig::parse(name, seed).map(|c| c.build())
}
