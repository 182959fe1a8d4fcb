//! Stage 3, the route: the decode worker for a request, by the core router from the
//! prefill's signature (or, bound early, without one), with what the drift monitor reads of
//! the decision; and the experts the chosen worker's request holds ([`ExpertLease`]). One
//! stage for both bindings: the decode stage calls [`choose_decode`] before each decode
//! attempt, its first and every failover.

use std::sync::Arc;

use eldr_core::distance::Counts;
use eldr_core::payload::DecodedCounts;
use eldr_core::router::Routed;
use eldr_core::{ExpertGuard, ExpertProfile, NoSignature, RouteError, Router};

use crate::counters::names;
use crate::errors::FlowError;
use crate::plane::{DriftSample, Plane, RequestArm};
use crate::reservoir::{Draw, Ticket};

/// What the prefill's stream gave: decoded counts, or why none (bound early: none).
pub struct PrefillSignature {
    pub counts: Option<DecodedCounts>,
    /// Why there are no counts (None: the route's own reason says it).
    pub reason: Option<String>,
    pub wait_s: f64,
    /// The locality balancer's profile, built once so a failover acquires the same one.
    pub profile: Option<Arc<ExpertProfile>>,
}

impl PrefillSignature {
    pub(crate) fn none(reason: Option<&str>, wait_s: f64) -> PrefillSignature {
        PrefillSignature { counts: None, reason: reason.map(str::to_owned), wait_s, profile: None }
    }
}

/// A decode choice with what the headers and metrics show of it.
pub struct DecodeChoice {
    pub worker: usize,
    pub reason: String,
    pub band: Option<Vec<usize>>,
    pub profile: Option<Arc<ExpertProfile>>,
}

/// Route with the core router; on a re-send, the least loaded routable decode worker not
/// tried yet.
pub fn choose_decode(plane: &Plane, arm: &RequestArm, sig: &PrefillSignature, tried: &[usize]) -> Result<DecodeChoice, FlowError> {
    let router = &arm.router;
    let t0 = std::time::Instant::now();
    // the reservoir's draw for this request, before routing: the route keeps the signature
    // only when the reservoir will store it (re-sends are not offers)
    let ticket = match (&plane.drift, &sig.counts) {
        (Some(feed), Some(_)) if tried.is_empty() => Some(feed.sampler.begin()),
        _ => None,
    };
    let keep = ticket.as_ref().is_some_and(|t| t.keeps());
    let why = fallback_why(sig); // the decision's reason when the counts are missing
    let (routed, profile) = if router.policy().uses_profile() { locality_route(plane, router, sig, why) } else {
        let r = match &sig.counts {
            Some(c) => router.route_counts(c, keep, true),
            None => router.route(|_| Err(why), true),
        };
        (r, None)
    };
    let r = match routed {
        Ok(r) => r,
        Err(RouteError::NoHealthyWorker) => return panic_route(plane, tried),
    };
    let worker = r.decision.worker.expect("route returns a worker or an error");
    let mut choice = DecodeChoice { worker, reason: r.decision.reason.label(), band: r.decision.band.clone(), profile };
    if tried.contains(&worker) {
        let loads = &r.loads;
        let routable = plane.decode.routable_all();
        // a worker that joined since the route read its loads is not among them
        let other = (0..routable.len().min(loads.len())).filter(|k| routable[*k] && !tried.contains(k)).min_by_key(|&k| (loads[k], k));
        let Some(k) = other else { return Err(FlowError::NoHealthyWorker) };
        choice = DecodeChoice { worker: k, reason: "retry".into(), band: None, profile: choice.profile };
    }
    plane.counters.route_seconds.observe(t0.elapsed().as_secs_f64());
    count_choice(plane, router, &choice, &r);
    if let (Some(feed), true) = (&plane.drift, choice.reason != "retry") {
        feed.push(drift_sample(router, sig, &choice, r, ticket));
    }
    Ok(choice)
}

/// The route's counters: by worker and reason, the band's figures, and the fallbacks.
fn count_choice(plane: &Plane, router: &Router, choice: &DecodeChoice, r: &Routed) {
    let head = choice.reason.split(':').next().unwrap_or("");
    plane.counters.inc(names::ROUTES, &[&choice.worker.to_string(), head]);
    if choice.reason == "band" {
        if let (Some(b), Some(dc), Some(d)) = (&choice.band, r.chosen_distance, r.decision.d_star) {
            plane.counters.band_size.observe(b.len() as f64);
            plane.counters.d_star.observe(d);
            plane.counters.d_chosen.observe(dc);
        }
    } else if eldr_core::is_counts_policy(router.policy_name()) && choice.reason != "retry" && choice.reason != "profile" {
        // the decision names the fallback: 'no_signature:<why>' or 'no_centroids'
        let why = choice.reason.split_once(':').map_or(choice.reason.as_str(), |(_, w)| w);
        plane.counters.inc(names::FALLBACKS, &[why]);
    }
}

/// Panic mode (Envoy's panic threshold at its floor): no decode worker is routable (all
/// ejected, on probation or failing their health checks, which overload alone can cause),
/// so the request goes to the least loaded one not tried yet rather than failing with 503.
/// A worker that really is down answers its own fast error, and the request fails over.
fn panic_route(plane: &Plane, tried: &[usize]) -> Result<DecodeChoice, FlowError> {
    let k = plane.decode.panic_pick(tried).ok_or(FlowError::NoHealthyWorker)?;
    plane.counters.inc(names::PANIC_ROUTES, &["decode"]);
    plane.counters.inc(names::ROUTES, &[&k.to_string(), "panic"]);
    Ok(DecodeChoice { worker: k, reason: "panic".into(), band: None, profile: None })
}

/// What the drift monitor reads of a decision: its distances, every time the route computed
/// them, and its signature only when the reservoir's draw (`ticket`) stores it. A decision
/// with distances commits the draw (an offer); any other gives it back when the ticket
/// drops. The distances measure how far traffic is from the fitted centroids, which the band
/// rule's decision carries; under the locality balancer the distances of the same counts are
/// computed here for the monitor alone.
fn drift_sample(router: &Router, sig: &PrefillSignature, choice: &DecodeChoice, r: Routed, ticket: Option<Ticket<'_>>) -> DriftSample {
    fn offer(ticket: Option<Ticket<'_>>, distances: &Option<Vec<f64>>, reason: &str) -> Option<Draw> {
        match ticket {
            Some(t) if distances.is_some() && reason == "band" => Some(t.commit()),
            _ => None, // dropped: the draw goes back
        }
    }
    if r.distances.is_some() || !router.policy().uses_profile() {
        let offer = offer(ticket, &r.distances, &choice.reason);
        let signature = r.signature.filter(|_| offer.is_some_and(|d| d.keeps()));
        return DriftSample { generation: r.generation, reason: choice.reason.clone(), distances: r.distances, signature, offer };
    }
    let (Some(c), Some(store)) = (&sig.counts, router.store()) else {
        return DriftSample { generation: r.generation, reason: choice.reason.clone(), distances: None, signature: None, offer: None };
    };
    let snap = store.snapshot();
    let keep = ticket.as_ref().is_some_and(|t| t.keeps());
    let mut kept = eldr_core::SparseSignature::default();
    match eldr_core::distance::from_fill(&snap.set, keep.then_some(&mut kept), |spec, out| c.fill_signature(spec, out)) {
        Ok(d) => {
            let d = Some(d);
            let offer = offer(ticket, &d, "band");
            DriftSample { generation: snap.generation, reason: "band".into(), distances: d, signature: keep.then_some(kept), offer }
        }
        Err(_) => DriftSample { generation: r.generation, reason: choice.reason.clone(), distances: None, signature: None, offer: None },
    }
}

/// The locality balancer: the request's expert profile over the centroid file's selected
/// layers, built once (kept on the signature by the caller through `DecodeChoice`).
fn locality_route(plane: &Plane, router: &Router, sig: &PrefillSignature, missing: NoSignature) -> (Result<Routed, RouteError>, Option<Arc<ExpertProfile>>) {
    if let Some(p) = &sig.profile {
        return (router.route_profiled(|_| Err(NoSignature::Missing), Some(p), true), Some(Arc::clone(p)));
    }
    let (Some(c), Some((l, e))) = (&sig.counts, plane.layout()) else {
        return (router.route(|_| Err(missing), true), None);
    };
    let why = match c.to_layout(l, e) {
        Err(_) => NoSignature::Shape, // the centroid layout changed under a reload
        Ok(dense) => match router.profile::<u32, f32>(Counts::Dense(&dense), c.num_tokens().max(1)) {
            Some(Ok(p)) => {
                let p = Arc::new(p);
                return (router.route_profiled(|_| Err(NoSignature::Missing), Some(&p), true), Some(p));
            }
            Some(Err(why)) => why,
            None => NoSignature::Missing,
        },
    };
    (router.route(|_| Err(why), true), None)
}

/// Why a request without usable counts falls back, in the one fallback vocabulary
/// (`NoSignature`; 'no_centroids' the router names itself when it has no centroid file).
fn fallback_why(sig: &PrefillSignature) -> NoSignature {
    match sig.reason.as_deref() {
        None | Some("no_centroids") => NoSignature::Missing,
        Some(r) => NoSignature::parse(r).unwrap_or(NoSignature::Missing),
    }
}

/// The request's experts on its decode worker, under locality. (Its in-flight slot is its
/// decode `Attempt`'s: the worker set counts each request once, for policies and status alike.)
pub(crate) struct ExpertLease {
    _experts: Option<ExpertGuard>,
}

/// The arm's policy tracks the profile (its own state: a switch leaves it sane).
pub(crate) fn lease_experts(plane: &Plane, arm: &RequestArm, w: usize, profile: Option<&Arc<ExpertProfile>>) -> ExpertLease {
    let router = &arm.router;
    let experts = profile.and_then(|p| match router.policy().track(router.num_workers(), w, Arc::clone(p)) {
        Some(Ok(g)) => Some(g),
        Some(Err(e)) => {
            plane.warn_malformed(&format!("expert profile not counted: {e}"));
            None
        }
        None => None,
    });
    ExpertLease { _experts: experts }
}
