//! The router's spec: the one typed description of how a decode router routes (its policy
//! with the locality costs, tau, the load factor, the binding), built and checked here once.
//! `Router::new` and `Router::sibling` take it; the Python config (`_core.RouterSpec`), the
//! data plane and the simulator read its capabilities (`needs_centroids`, `binds_late`) from
//! it. Its errors are the command line's, word for word (the router's flags name each rule).

use thiserror::Error;

use super::{PolicyConfig, UnknownPolicy, DEFAULT_POLICY};
use crate::limits::MAX_EXPERTS;

/// tau's range: cosine distances lie in [0, 2], so a wider band is every worker.
pub const MAX_TAU: f64 = 2.0;
/// The bounded-load factor's range (past it the cap never binds: a typo).
pub const MAX_LOAD_FACTOR: f64 = 1e6;
/// The locality cost's per-request term's range.
pub const MAX_REQUEST_COST: f64 = 1e6;

/// When a request's decode worker is chosen: after the prefill's signature (late), with the
/// prefill (early), or by the policy (auto: late for the counts policies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bind {
    #[default]
    Auto,
    Late,
    Early,
}

impl Bind {
    pub const NAMES: [&'static str; 3] = ["auto", "late", "early"];

    pub fn parse(text: &str) -> Option<Bind> {
        match text {
            "auto" => Some(Bind::Auto),
            "late" => Some(Bind::Late),
            "early" => Some(Bind::Early),
            _ => None,
        }
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Bind::Auto => "auto",
            Bind::Late => "late",
            Bind::Early => "early",
        }
    }
}

/// A routing setting the router cannot take, in the command line's words.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum RouterSpecError {
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
    #[error("{flag} must be a finite number, got {}", fmt_g(*.got))]
    NotFinite { flag: &'static str, got: f64 },
    #[error("{flag} must be between {} and {}, got {got}", fmt_g(*.lo), fmt_g(*.hi))]
    Range { flag: &'static str, lo: f64, hi: f64, got: String },
    #[error("{flag} is a cost of the locality policy, not of --disagg-router {policy}")]
    NotLocality { flag: &'static str, policy: &'static str },
    #[error("unknown --eldr-bind {0:?}; choose one of auto, late, early")]
    Bind(String),
    #[error("--disagg-router eldr needs --eldr-centroids (a centroid file from `eldr fit`)")]
    EldrNeedsCentroids,
    #[error("--disagg-router locality needs --eldr-centroids (a centroid file from `eldr fit`: the balancer tracks experts on the layers it selected)")]
    LocalityNeedsCentroids,
    #[error("--experiment arm {0} needs --eldr-centroids (a centroid file from `eldr fit`: eldr routes on its centroids, locality tracks experts on the layers it selected)")]
    ArmNeedsCentroids(String),
}

pub const TAU_FLAG: &str = "--eldr-tau";
pub const LOAD_FACTOR_FLAG: &str = "--eldr-load-factor";
pub const PAGED_EXPERTS_FLAG: &str = "--eldr-paged-experts";
pub const REQUEST_COST_FLAG: &str = "--eldr-request-cost";

/// `v` finite and in `[lo, hi]` (the command line's float check).
pub fn check_float(flag: &'static str, v: f64, lo: f64, hi: f64) -> Result<f64, RouterSpecError> {
    if !v.is_finite() {
        return Err(RouterSpecError::NotFinite { flag, got: v });
    }
    if !(lo..=hi).contains(&v) {
        return Err(RouterSpecError::Range { flag, lo, hi, got: fmt_g(v) });
    }
    Ok(v)
}

/// What a decode router is built from. `policy` carries the locality costs (paged experts,
/// request cost) and the random policies' seed; `tau` None is the centroid file's, else
/// [`super::DEFAULT_TAU`]; `load_factor` None is the paper's rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSpec {
    pub policy: PolicyConfig,
    pub tau: Option<f64>,
    pub load_factor: Option<f64>,
    pub bind: Bind,
}

impl RouterSpec {
    /// The one check of the routing flags, in the command line's order: tau, the load factor,
    /// paged experts, the request cost; then which policy takes the locality costs. `None`
    /// for `policy` is the core's [`DEFAULT_POLICY`].
    pub fn new(
        policy: Option<&str>,
        seed: u64,
        tau: Option<f64>,
        load_factor: Option<f64>,
        paged_experts: Option<i64>,
        request_cost: Option<f64>,
        bind: Bind,
    ) -> Result<RouterSpec, RouterSpecError> {
        if let Some(t) = tau {
            check_float(TAU_FLAG, t, 0.0, MAX_TAU)?;
        }
        if let Some(f) = load_factor {
            check_float(LOAD_FACTOR_FLAG, f, 0.0, MAX_LOAD_FACTOR)?;
        }
        let resident = match paged_experts {
            Some(c) if !(1..=MAX_EXPERTS as i64).contains(&c) => {
                return Err(RouterSpecError::Range { flag: PAGED_EXPERTS_FLAG, lo: 1.0, hi: MAX_EXPERTS as f64, got: c.to_string() })
            }
            c => c.map(|c| c as u32),
        };
        if let Some(r) = request_cost {
            check_float(REQUEST_COST_FLAG, r, 0.0, MAX_REQUEST_COST)?;
        }
        let config = PolicyConfig::parse(policy.unwrap_or(DEFAULT_POLICY), seed)?.with_paged_experts(resident)?.with_request_cost(request_cost)?;
        Ok(RouterSpec { policy: config, tau, load_factor, bind })
    }

    /// A spec of `policy` alone: no tau, no load factor, auto binding.
    pub fn of(policy: PolicyConfig) -> RouterSpec {
        RouterSpec { policy, tau: None, load_factor: None, bind: Bind::Auto }
    }

    pub fn name(&self) -> &'static str {
        self.policy.name()
    }

    /// Whether the policy routes on the prefill's counts, so needs a centroid file (eldr its
    /// centroids, locality its layer selection).
    pub fn needs_centroids(&self) -> bool {
        self.policy.info().uses_counts
    }

    /// Whether a request waits for the prefill's signature before its decode is chosen.
    pub fn binds_late(&self) -> bool {
        match self.bind {
            Bind::Late => true,
            Bind::Early => false,
            Bind::Auto => self.policy.info().binds_late(),
        }
    }

    /// The command line's check that a policy which needs a centroid file has one; `arm`: the
    /// experiment arm's label it routes.
    pub fn check_centroids(&self, has_centroids: bool, arm: Option<&str>) -> Result<(), RouterSpecError> {
        if has_centroids || !self.needs_centroids() {
            return Ok(());
        }
        Err(match (arm, self.name()) {
            (Some(label), _) => RouterSpecError::ArmNeedsCentroids(label.to_owned()),
            (None, "eldr") => RouterSpecError::EldrNeedsCentroids,
            (None, _) => RouterSpecError::LocalityNeedsCentroids,
        })
    }
}

/// A number as Python's `format(v, "g")` writes it (the router's messages have always used
/// it): six significant digits, the exponent form below 1e-4 and from 1e6.
pub fn fmt_g(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0" } else { "0" }.into();
    }
    let trim = |s: &str| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s.to_string() };
    let sci = format!("{v:.5e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..6).contains(&exp) {
        trim(&format!("{:.*}", (5 - exp) as usize, v))
    } else {
        format!("{}e{}{:02}", trim(mantissa), if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(policy: &str, tau: Option<f64>, lf: Option<f64>, c: Option<i64>, r: Option<f64>) -> Result<RouterSpec, String> {
        RouterSpec::new(Some(policy), 0, tau, lf, c, r, Bind::Auto).map_err(|e| e.to_string())
    }

    #[test]
    fn every_routing_flag_is_checked_once_in_the_command_lines_words() {
        assert_eq!(spec("eldr", Some(-1.0), None, None, None).unwrap_err(), "--eldr-tau must be between 0 and 2, got -1");
        assert_eq!(spec("eldr", Some(2.5), None, None, None).unwrap_err(), "--eldr-tau must be between 0 and 2, got 2.5");
        assert_eq!(spec("eldr", Some(f64::NAN), None, None, None).unwrap_err(), "--eldr-tau must be a finite number, got nan");
        assert_eq!(spec("eldr", None, Some(-0.5), None, None).unwrap_err(), "--eldr-load-factor must be between 0 and 1e+06, got -0.5");
        assert_eq!(spec("eldr", None, Some(f64::INFINITY), None, None).unwrap_err(), "--eldr-load-factor must be a finite number, got inf");
        assert_eq!(spec("locality", None, None, Some(0), None).unwrap_err(), "--eldr-paged-experts must be between 1 and 1.04858e+06, got 0");
        assert_eq!(spec("locality", None, None, Some(1 << 20 | 1), None).unwrap_err(), "--eldr-paged-experts must be between 1 and 1.04858e+06, got 1048577");
        assert_eq!(spec("locality", None, None, None, Some(-0.1)).unwrap_err(), "--eldr-request-cost must be between 0 and 1e+06, got -0.1");
        assert_eq!(spec("shortest_queue", None, None, Some(32), None).unwrap_err(), "--eldr-paged-experts is a cost of the locality policy, not of --disagg-router shortest_queue");
        assert_eq!(spec("eldr", None, None, None, Some(0.4)).unwrap_err(), "--eldr-request-cost is a cost of the locality policy, not of --disagg-router eldr");
        assert_eq!(spec("nope", None, None, None, None).unwrap_err(), "unknown policy \"nope\"; choose one of eldr, locality, random, round_robin, shortest_queue, power_of_two");
        let ok = spec("locality", Some(2.0), Some(0.05), Some(4), Some(0.4)).unwrap();
        assert_eq!(ok.policy, PolicyConfig::PagedLocality { resident: 4, request_cost: 0.4 });
        assert_eq!((ok.tau, ok.load_factor), (Some(2.0), Some(0.05)));
        assert_eq!(spec("eldr", None, None, None, Some(0.0)).unwrap().policy, PolicyConfig::Eldr, "r = 0 is every policy's rule");
    }

    #[test]
    fn capabilities_follow_the_policy_and_the_binding() {
        for (name, counts) in [("eldr", true), ("locality", true), ("random", false), ("round_robin", false), ("shortest_queue", false), ("power_of_two", false)] {
            let s = spec(name, None, None, None, None).unwrap();
            assert_eq!((s.needs_centroids(), s.binds_late()), (counts, counts), "{name}");
            for (bind, late) in [(Bind::Late, true), (Bind::Early, false)] {
                assert_eq!(RouterSpec { bind, ..s }.binds_late(), late);
            }
            assert_eq!(s.check_centroids(true, None), Ok(()));
            assert_eq!(s.check_centroids(false, None).is_err(), counts);
        }
        let loc = spec("locality", None, None, None, None).unwrap();
        assert!(loc.check_centroids(false, None).unwrap_err().to_string().starts_with("--disagg-router locality needs --eldr-centroids"));
        assert!(loc.check_centroids(false, Some("locality/0.05")).unwrap_err().to_string().starts_with("--experiment arm locality/0.05 needs"));
        assert_eq!(RouterSpec::new(None, 0, None, None, None, None, Bind::Auto).unwrap().name(), DEFAULT_POLICY);
        assert_eq!(Bind::NAMES.map(|n| Bind::parse(n).unwrap().as_str()), Bind::NAMES);
    }
}
