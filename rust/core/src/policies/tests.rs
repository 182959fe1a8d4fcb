use std::sync::Arc;

use proptest::prelude::*;

use super::*;

fn ctx<'a>(loads: &'a [i64], healthy: &'a [bool], d: Option<&'a [f64]>, tau: f64) -> RouteContext<'a> {
    RouteContext { loads, healthy, distances: d, fallback: Reason::NoCentroids, tau, load_factor: None, profile: None, explain: true }
}

fn case() -> impl Strategy<Value = (Vec<i64>, Vec<bool>, Vec<f64>, f64)> {
    (1usize..24).prop_flat_map(|k| {
        (
            prop::collection::vec(0i64..6, k),
            prop::collection::vec(prop::bool::weighted(0.8), k),
            prop::collection::vec(0.0f64..2.0, k),
            0.0f64..0.5,
        )
    })
}

proptest! {
    #[test]
    fn band_contains_nearest_and_choice_is_in_band((loads, mut healthy, d, tau) in case()) {
        healthy[0] = true;
        let dec = Eldr.choose(&ctx(&loads, &healthy, Some(&d), tau));
        let band = dec.band.clone().unwrap();
        let d_star = dec.d_star.unwrap();
        let nearest = (0..d.len()).filter(|&k| healthy[k]).min_by(|&a, &b| d[a].total_cmp(&d[b])).unwrap();
        prop_assert!(band.contains(&nearest));
        let w = dec.worker.unwrap();
        prop_assert!(band.contains(&w));
        prop_assert!(healthy[w]);
        // shortest queue within the band, ties to smaller distance
        for &k in &band {
            prop_assert!(loads[w] < loads[k] || (loads[w] == loads[k] && d[w] <= d[k]));
            prop_assert!(d[k] <= d_star + tau);
        }
        // band is exactly the healthy workers within d* + tau
        for k in 0..d.len() {
            prop_assert_eq!(band.contains(&k), healthy[k] && d[k] <= d_star + tau);
        }
    }

    #[test]
    fn bounded_loads_cap_the_chosen_worker((loads, mut healthy, d, tau) in case(), f in 0.0f64..1.0) {
        healthy[0] = true;
        let mut c = ctx(&loads, &healthy, Some(&d), tau);
        c.load_factor = Some(f);
        let w = Eldr.choose(&c).worker.unwrap();
        let (n, total) = (0..d.len()).filter(|&k| healthy[k]).fold((0i64, 0i64), |(n, t), k| (n + 1, t + loads[k]));
        let cap = ((1.0 + f) * (total + 1) as f64 / n as f64).ceil() as i64;
        prop_assert!(healthy[w] && loads[w] < cap, "load {} cap {}", loads[w], cap);
        // with a huge factor it is the plain band rule
        c.load_factor = Some(1e9);
        let plain = Eldr.choose(&ctx(&loads, &healthy, Some(&d), tau)).worker;
        prop_assert_eq!(Eldr.choose(&c).worker, plain);
    }

    #[test]
    fn tau_zero_is_pure_nearest((loads, mut healthy, d, _t) in case()) {
        healthy[0] = true;
        let w = Eldr.choose(&ctx(&loads, &healthy, Some(&d), 0.0)).worker.unwrap();
        let best = (0..d.len()).filter(|&k| healthy[k]).map(|k| d[k]).fold(f64::INFINITY, f64::min);
        prop_assert_eq!(d[w], best);
    }

    #[test]
    fn huge_tau_is_pure_shortest_queue((loads, mut healthy, d, _t) in case()) {
        healthy[0] = true;
        let w = Eldr.choose(&ctx(&loads, &healthy, Some(&d), 1e9)).worker.unwrap();
        let min_load = (0..d.len()).filter(|&k| healthy[k]).map(|k| loads[k]).min().unwrap();
        prop_assert_eq!(loads[w], min_load);
        prop_assert!(healthy[w]);
    }

    #[test]
    fn no_policy_picks_an_unhealthy_worker((loads, healthy, d, tau) in case(), seed in any::<u64>()) {
        for name in POLICY_NAMES {
            let p = make_policy(name, seed).unwrap();
            for _ in 0..4 {
                let dec = p.choose(&ctx(&loads, &healthy, Some(&d), tau));
                match dec.worker {
                    Some(w) => prop_assert!(healthy[w], "{} chose unhealthy {}", name, w),
                    None => prop_assert!(healthy.iter().all(|h| !h)),
                }
            }
        }
    }
}

#[test]
fn eldr_without_signature_is_shortest_queue() {
    let loads = [3, 1, 1, 0];
    let healthy = [true, true, true, false];
    let mut c = ctx(&loads, &healthy, None, 0.1);
    c.fallback = Reason::NoSignature(crate::NoSignature::Empty);
    let dec = Eldr.choose(&c);
    assert_eq!(dec.worker, Some(1));
    assert_eq!(dec.reason.label(), "no_signature:empty");
}

#[test]
fn eldr_band_tie_goes_to_smaller_distance() {
    let loads = [2, 1, 1, 0];
    let healthy = [true; 4];
    let d = [0.10, 0.25, 0.15, 0.50];
    let dec = Eldr.choose(&ctx(&loads, &healthy, Some(&d), 0.2));
    assert_eq!(dec.band, Some(vec![0, 1, 2]));
    assert_eq!(dec.worker, Some(2));
}

#[test]
fn round_robin_cycles_over_healthy() {
    let p = RoundRobin::default();
    let loads = [0; 4];
    let healthy = [true, false, true, true];
    let picks: Vec<usize> = (0..6).map(|_| p.choose(&ctx(&loads, &healthy, None, 0.0)).worker.unwrap()).collect();
    assert_eq!(picks, vec![0, 2, 2, 3, 0, 2]);
}

#[test]
fn power_of_two_picks_lighter_of_two_and_random_covers_all() {
    let p2 = PowerOfTwo::new(7);
    let loads = [5, 0, 5, 5];
    let healthy = [true; 4];
    let mut counts = [0usize; 4];
    for _ in 0..4000 {
        counts[p2.choose(&ctx(&loads, &healthy, None, 0.0)).worker.unwrap()] += 1;
    }
    // worker 1 wins whenever it is one of the two samples: probability 1/2.
    assert!((1800..2200).contains(&counts[1]), "{counts:?}");
    let r = Random::new(3);
    let mut seen = [0usize; 4];
    for _ in 0..4000 {
        seen[r.choose(&ctx(&loads, &healthy, None, 0.0)).worker.unwrap()] += 1;
    }
    assert!(seen.iter().all(|&c| (850..1150).contains(&c)), "{seen:?}");
}

#[test]
fn the_policy_list_says_which_policies_use_counts() {
    assert_eq!(POLICY_NAMES.to_vec(), POLICIES.iter().map(|p| p.name).collect::<Vec<_>>());
    for info in POLICIES {
        let p = make_policy(info.name, 0).unwrap();
        assert_eq!(p.name(), info.name);
        assert_eq!(p.uses_signature() || p.uses_profile(), info.uses_counts, "{}", info.name);
    }
}

#[test]
fn the_factory_builds_every_listed_policy_and_the_defaults_are_listed() {
    for info in POLICIES {
        let cfg = PolicyConfig::parse(info.name, 7).unwrap();
        assert_eq!((cfg.name(), cfg.info()), (info.name, &info));
        assert_eq!(cfg.build().name(), info.name);
        assert_eq!(info.binds_late(), info.uses_counts);
        // prefill placement reads loads and health only
        assert!(!(info.prefill && info.uses_counts), "{}", info.name);
    }
    assert_eq!(counts_policies(), vec!["eldr", "locality"]);
    assert_eq!(prefill_policies(), vec!["random", "round_robin", "shortest_queue"]);
    assert!(policy_info(DEFAULT_POLICY).is_some() && is_prefill_policy(DEFAULT_PREFILL_POLICY));
    assert!(!is_prefill_policy("power_of_two") && !is_counts_policy("nope"));
    assert!(DEFAULT_TAU > 0.0 && DEFAULT_LOAD_FACTOR > 0.0);
    assert_eq!(crate::router::DEFAULT_TAU, DEFAULT_TAU);
}

#[test]
fn one_fallback_vocabulary() {
    let names = fallback_reasons();
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    for w in NoSignature::ALL {
        assert_eq!(NoSignature::parse(w.as_str()), Some(w));
        assert_eq!(w.to_string(), w.as_str());
        assert_eq!(Reason::NoSignature(w).label(), format!("no_signature:{w}"));
    }
    assert!(names.contains(&Reason::NoCentroids.label().as_str()));
    assert_eq!(NoSignature::parse("no_centroids"), None);
}

#[test]
fn unknown_policy_is_named() {
    let err = make_policy("fastest", 0).err().unwrap();
    assert_eq!(err.name, "fastest");
    let msg = err.to_string();
    assert!(msg.contains("fastest") && msg.contains("shortest_queue"));
}

// ---------------- the locality balancer ----------------

const LL: usize = 3;
const EE: usize = 8;

fn profile_strategy() -> impl Strategy<Value = ExpertProfile> {
    (prop::collection::vec((0u64..(LL * EE) as u64, 0u32..20), 0..20), 1u64..30).prop_map(|(cells, t)| {
        let (idx, c): (Vec<u64>, Vec<f64>) = cells.into_iter().map(|(i, c)| (i, c as f64)).unzip();
        ExpertProfile::from_sparse(LL, EE, &idx, &c, t).unwrap()
    })
}

/// Direct formula: mean over layers of sum over experts of 1 - prod(1 - p).
fn direct_distinct(profiles: &[&ExpertProfile]) -> f64 {
    let mut keep = vec![1.0f64; LL * EE];
    for p in profiles {
        let mut dense = vec![0.0f64; LL * EE];
        let (i, pr) = p.parts();
        for (&c, &v) in i.iter().zip(pr) {
            dense[c as usize] = v;
        }
        for (k, d) in keep.iter_mut().zip(dense) {
            *k *= 1.0 - d;
        }
    }
    keep.iter().map(|k| 1.0 - k).sum::<f64>() / LL as f64
}

proptest! {
    #[test]
    fn expert_state_matches_formula_and_release_restores_it(
        profiles in prop::collection::vec(profile_strategy(), 1..12),
        order in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let load = Arc::new(ExpertLoad::new(2, LL, EE));
        let profiles: Vec<Arc<ExpertProfile>> = profiles.into_iter().map(Arc::new).collect();
        let mut guards: Vec<Option<ExpertGuard>> = Vec::new();
        for p in &profiles {
            let before = load.distinct(0);
            let delta = load.added(0, p);
            guards.push(Some(load.acquire(0, Arc::clone(p)).unwrap()));
            // Delta is exactly the increase of D (up to the fixed-point grain)
            prop_assert!((load.distinct(0) - before - delta).abs() < 1e-5, "{} {} {}", before, delta, load.distinct(0));
        }
        let refs: Vec<&ExpertProfile> = profiles.iter().map(|p| p.as_ref()).collect();
        prop_assert!((load.distinct(0) - direct_distinct(&refs)).abs() < 1e-4);
        prop_assert_eq!(load.distinct(1), 0.0);
        // release in an arbitrary order, then everything is back to zero exactly
        for ix in order {
            let i = ix.index(guards.len());
            if let Some(g) = guards[i].take() {
                prop_assert!(g.release());
                prop_assert!(!g.release());
            }
        }
        guards.clear();
        prop_assert_eq!(load.distinct(0), 0.0);
        let empty = ExpertProfile::from_sparse(LL, EE, &[], &[], 1).unwrap();
        prop_assert_eq!(load.added(0, &empty), 0.0);
    }

    #[test]
    fn locality_picks_the_least_marginal_cost_under_the_cap(
        resident in prop::collection::vec((0usize..4, profile_strategy()), 0..16),
        req in profile_strategy(),
        mut healthy in prop::collection::vec(prop::bool::weighted(0.8), 4),
        f in prop::option::of(0.0f64..1.0),
    ) {
        healthy[0] = true;
        let pol = Locality::default();
        let mut loads = vec![0i64; 4];
        let mut guards = Vec::new();
        for (w, p) in resident {
            guards.push(pol.track(4, w, Arc::new(p)).unwrap().unwrap());
            loads[w] += 1;
        }
        let mut c = ctx(&loads, &healthy, None, 0.0);
        c.load_factor = f;
        c.profile = Some(&req);
        let dec = pol.choose(&c);
        let w = dec.worker.unwrap();
        prop_assert!(healthy[w]);
        if req.is_empty() {
            prop_assert_eq!(Some(w), shortest_healthy(&loads, &healthy));
            return Ok(());
        }
        let cap = f.map(|f| load_cap(&c, f));
        prop_assert!(cap.is_none_or(|cap| loads[w] < cap));
        let load = pol.load_for(4, &req).unwrap();
        let cost = |k: usize| load.distinct(k) + (loads[k] + 1) as f64 * load.added(k, &req);
        for k in 0..4 {
            if healthy[k] && cap.is_none_or(|cap| loads[k] < cap) {
                prop_assert!(cost(w) <= cost(k), "chose {} cost {} but {} costs {}", w, cost(w), k, cost(k));
            }
        }
        drop(guards);
        prop_assert_eq!(load.distinct(w), 0.0);
    }
}

#[test]
fn locality_prefers_the_worker_that_already_uses_the_experts() {
    let pol = Locality::default();
    let a = Arc::new(ExpertProfile::from_sparse(1, 8, &[0, 1], &[10.0, 10.0], 10).unwrap());
    let b = Arc::new(ExpertProfile::from_sparse(1, 8, &[6, 7], &[10.0, 10.0], 10).unwrap());
    let _g0 = pol.track(2, 0, Arc::clone(&a)).unwrap().unwrap();
    let _g1 = pol.track(2, 1, Arc::clone(&b)).unwrap().unwrap();
    let loads = [1, 1];
    let healthy = [true, true];
    let mut c = ctx(&loads, &healthy, None, 0.0);
    c.profile = Some(&b);
    assert_eq!(pol.choose(&c).worker, Some(1));
    c.profile = Some(&a);
    assert_eq!(pol.choose(&c).worker, Some(0));
    // without a profile: shortest queue, and the reason says so
    c.profile = None;
    let dec = pol.choose(&c);
    assert_eq!((dec.worker, dec.reason.label()), (Some(0), "no_signature:missing".to_string()));
    // a profile of another shape is not counted and routes by queue
    let other = ExpertProfile::from_sparse(2, 8, &[0], &[1.0], 1).unwrap();
    c.profile = Some(&other);
    assert_eq!(pol.choose(&c).reason.label(), "no_signature:shape");
    assert!(pol.track(2, 0, Arc::new(other)).unwrap().is_err());
    // bad input is refused with a message
    assert_eq!(ExpertProfile::from_sparse(1, 8, &[9], &[1.0], 1).unwrap_err(), ProfileError::IndexOutOfRange { index: 9, cells: 8 });
    assert!(ExpertProfile::from_sparse(1, 8, &[1], &[f64::NAN], 1).unwrap_err().to_string().contains("finite"));
    assert!(ExpertProfile::from_sparse(1, 8, &[1], &[1.0], 0).is_err());
}

#[test]
fn expert_state_is_exact_under_8_threads() {
    let load = Arc::new(ExpertLoad::new(2, LL, EE));
    let p = Arc::new(ExpertProfile::from_sparse(LL, EE, &[0, 3, 9, 23], &[5.0, 1.0, 7.0, 2.0], 7).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let (load, p) = (Arc::clone(&load), Arc::clone(&p));
            std::thread::spawn(move || {
                for j in 0..20_000 {
                    let g = load.acquire((i + j) % 2, Arc::clone(&p)).unwrap();
                    if j % 2 == 0 {
                        g.release();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!((load.distinct(0), load.distinct(1)), (0.0, 0.0));
}

// ---------------- the locality balancer's fast path vs a brute-force recomputation ----------------

use crate::distance::Counts;
use crate::signature::{NoSignature, SignatureSpec};

const RL: usize = 5;
const RE: usize = 6;

/// A spec over RL x RE with at least one selected layer, and raw dense counts for it.
fn spec_and_counts() -> impl Strategy<Value = (SignatureSpec, Vec<u32>, u64)> {
    (prop::collection::vec(prop::bool::weighted(0.5), RL), prop::collection::vec(prop::option::weighted(0.4, 0u32..9), RL * RE), 1u64..12)
        .prop_map(|(mut sel, c, t)| {
            sel[2] = true;
            let w: Vec<f32> = sel.iter().map(|&s| if s { 1.0 } else { 0.0 }).collect();
            let spec = SignatureSpec::new(&w, &vec![1.0; RL * RE]).unwrap();
            (spec, c.into_iter().map(|v| v.unwrap_or(0)).collect(), t)
        })
}

/// The profile by its definition: selected layers in order, p = min(c, T) / (T + 1), zeros left out.
fn brute_profile(spec: &SignatureSpec, dense: &[u32], t: u64) -> (Vec<u32>, Vec<u32>, Vec<f64>) {
    let ids: Vec<u32> = spec.selected_layers().iter().map(|&l| l as u32).collect();
    let (mut cells, mut p) = (Vec::new(), Vec::new());
    for (s, &l) in spec.selected_layers().iter().enumerate() {
        for e in 0..RE {
            let c = dense[l * RE + e] as f64;
            if c > 0.0 {
                cells.push((s * RE + e) as u32);
                p.push(c.min(t as f64) / (t as f64 + 1.0));
            }
        }
    }
    (ids, cells, p)
}

/// Per worker, the profiles counted there: D, Delta and exp(S) straight from their p's.
struct Brute<'a> {
    on: Vec<Vec<&'a ExpertProfile>>,
}

impl Brute<'_> {
    fn keep(&self, w: usize, cells: usize) -> Vec<f64> {
        let mut keep = vec![1.0f64; cells];
        for p in &self.on[w] {
            let (i, pr) = p.parts();
            for (&c, &v) in i.iter().zip(pr) {
                keep[c as usize] *= 1.0 - v;
            }
        }
        keep
    }
    fn distinct(&self, w: usize, layers: usize, cells: usize) -> f64 {
        self.keep(w, cells).iter().map(|k| 1.0 - k).sum::<f64>() / layers as f64
    }
    fn added(&self, w: usize, q: &ExpertProfile, cells: usize) -> f64 {
        let keep = self.keep(w, cells);
        let (i, pr) = q.parts();
        i.iter().zip(pr).map(|(&c, &v)| v * keep[c as usize]).sum::<f64>() / q.layers() as f64
    }
}

proptest! {
    #[test]
    fn restricted_profile_equals_its_definition_dense_and_sparse((spec, dense, t) in spec_and_counts(), split in any::<bool>()) {
        let want = brute_profile(&spec, &dense, t);
        let d = ExpertProfile::from_counts::<u32, u32>(&spec, 7, Counts::Dense(&dense), t).unwrap();
        prop_assert_eq!(d.layer_ids(), &want.0[..]);
        prop_assert_eq!(d.generation(), 7);
        prop_assert_eq!(d.parts().0, &want.1[..]);
        for (a, b) in d.parts().1.iter().zip(&want.2) {
            prop_assert!((a - b).abs() < 1e-12);
        }
        // the same counts in sparse form, reversed, optionally split into repeated entries
        let (mut idx, mut val) = (Vec::new(), Vec::new());
        for (i, &c) in dense.iter().enumerate().rev() {
            if c == 0 { continue; }
            if split && c > 1 {
                idx.extend([i as u32, i as u32]);
                val.extend([c / 2, c - c / 2]);
            } else {
                idx.push(i as u32);
                val.push(c);
            }
        }
        let s = ExpertProfile::from_counts::<u32, u32>(&spec, 7, Counts::Sparse(&idx, &val), t).unwrap();
        prop_assert_eq!(&s, &d);
    }

    #[test]
    fn incremental_state_equals_brute_force_after_every_acquire_and_release(
        profs in prop::collection::vec(profile_strategy(), 1..10),
        ops in prop::collection::vec((0usize..3, any::<prop::sample::Index>(), any::<bool>()), 1..40),
        probe in profile_strategy(),
    ) {
        let cells = LL * EE;
        let load = Arc::new(ExpertLoad::new(3, LL, EE));
        let profs: Vec<Arc<ExpertProfile>> = profs.into_iter().map(Arc::new).collect();
        // (worker, profile index, guard) of what is in flight
        let mut live: Vec<(usize, usize, ExpertGuard)> = Vec::new();
        for (w, ix, release) in ops {
            if release && !live.is_empty() {
                let (_, _, g) = live.remove(ix.index(live.len()));
                prop_assert!(g.release());
            } else {
                let i = ix.index(profs.len());
                live.push((w, i, load.acquire(w, Arc::clone(&profs[i])).unwrap()));
            }
            let mut bf = Brute { on: vec![Vec::new(); 3] };
            for (w, i, _) in &live {
                bf.on[*w].push(profs[*i].as_ref());
            }
            for w in 0..3 {
                prop_assert!((load.distinct(w) - bf.distinct(w, LL, cells)).abs() < 1e-6, "D_{}", w);
                prop_assert!((load.added(w, &probe) - bf.added(w, &probe, cells)).abs() < 1e-6, "Delta_{}", w);
                let keep = bf.keep(w, cells);
                for (c, k) in keep.iter().enumerate() {
                    prop_assert!((load.keep_mass(w, c) - k).abs() < 1e-6, "exp(S) of cell {} on {}", c, w);
                }
            }
            let mut all = Vec::new();
            load.added_all(&probe, &mut all);
            for w in 0..3 {
                prop_assert!((all[w] - load.added(w, &probe)).abs() < 1e-12);
            }
        }
        drop(live);
        for w in 0..3 {
            prop_assert_eq!(load.distinct(w), 0.0);
            for c in 0..cells {
                prop_assert_eq!(load.keep_mass(w, c), 1.0);
            }
        }
    }

    #[test]
    fn locality_choice_is_the_brute_force_argmin(
        resident in prop::collection::vec((0usize..4, profile_strategy()), 0..16),
        req in profile_strategy(),
        mut healthy in prop::collection::vec(prop::bool::weighted(0.8), 4),
        f in prop::option::of(0.0f64..1.0),
    ) {
        healthy[0] = true;
        let pol = Locality::default();
        let resident: Vec<(usize, Arc<ExpertProfile>)> = resident.into_iter().map(|(w, p)| (w, Arc::new(p))).collect();
        let mut loads = vec![0i64; 4];
        let mut guards = Vec::new();
        let mut bf = Brute { on: vec![Vec::new(); 4] };
        for (w, p) in &resident {
            guards.push(pol.track(4, *w, Arc::clone(p)).unwrap().unwrap());
            loads[*w] += 1;
            bf.on[*w].push(p.as_ref());
        }
        let mut c = ctx(&loads, &healthy, None, 0.0);
        c.load_factor = f;
        c.profile = Some(&req);
        let w = pol.choose(&c).worker.unwrap();
        if req.is_empty() {
            return Ok(());
        }
        let cap = f.map(|f| load_cap(&c, f));
        let cost = |k: usize| bf.distinct(k, LL, LL * EE) + (loads[k] + 1) as f64 * bf.added(k, &req, LL * EE);
        let best = (0..4).filter(|&k| healthy[k] && cap.is_none_or(|cap| loads[k] < cap)).map(cost).fold(f64::INFINITY, f64::min);
        prop_assert!(cost(w) <= best + 1e-6, "chose {} at {} but the least cost is {}", w, cost(w), best);
    }
}

#[test]
fn a_newer_layer_selection_replaces_the_expert_state_and_an_older_one_falls_back() {
    let spec_a = SignatureSpec::new(&[1.0, 1.0, 0.0], &[1.0; 3 * 4]).unwrap();
    let spec_b = SignatureSpec::new(&[0.0, 1.0, 1.0], &[1.0; 3 * 4]).unwrap();
    let counts: Vec<u32> = (0..12).map(|i| i % 3).collect();
    let pa = Arc::new(ExpertProfile::from_counts::<u32, u32>(&spec_a, 1, Counts::Dense(&counts), 4).unwrap());
    let pb = Arc::new(ExpertProfile::from_counts::<u32, u32>(&spec_b, 2, Counts::Dense(&counts), 4).unwrap());
    let stale = ExpertProfile::from_counts::<u32, u32>(&spec_a, 1, Counts::Dense(&counts), 4).unwrap();
    let pol = Locality::default();
    let old = pol.track(2, 0, Arc::clone(&pa)).unwrap().unwrap();
    let (loads, healthy) = ([1, 0], [true, true]);
    let mut c = ctx(&loads, &healthy, None, 0.0);
    c.profile = Some(&pb);
    assert_eq!(pol.choose(&c).reason, Reason::Profile, "the newer generation's layout takes over");
    let newer = pol.track(2, 1, Arc::clone(&pb)).unwrap().unwrap();
    assert!(pol.load_for(2, &pb).unwrap().distinct(1) > 0.0);
    c.profile = Some(&stale);
    assert_eq!(pol.choose(&c).reason, Reason::NoSignature(NoSignature::Shape), "an older layout falls back");
    assert!(pol.track(2, 0, Arc::new(stale)).unwrap().is_err());
    assert!(old.release(), "a request of the old layout releases into the state it holds");
    assert!(newer.release());
    assert_eq!(pol.load_for(2, &pb).unwrap().distinct(1), 0.0);
}

#[test]
fn restricted_profile_rejects_bad_counts_with_the_signature_reasons() {
    let spec = SignatureSpec::new(&[1.0, 0.0], &[1.0; 2 * 3]).unwrap();
    let prof = |c: Counts<'_, u32, f32>, t| ExpertProfile::from_counts(&spec, 0, c, t);
    assert_eq!(prof(Counts::Dense(&[0.0; 5]), 1).unwrap_err(), NoSignature::Shape);
    assert_eq!(prof(Counts::Dense(&[0.0, 0.0, 0.0, 0.0, f32::NAN, 0.0]), 1).unwrap_err(), NoSignature::NonFinite);
    assert_eq!(prof(Counts::Dense(&[0.0, -1.0, 0.0, 0.0, 0.0, 0.0]), 1).unwrap_err(), NoSignature::Negative);
    assert_eq!(prof(Counts::Sparse(&[6], &[1.0]), 1).unwrap_err(), NoSignature::OutOfRange);
    assert_eq!(prof(Counts::Sparse(&[1, 2], &[1.0]), 1).unwrap_err(), NoSignature::Shape);
    assert_eq!(prof(Counts::Dense(&[1.0; 6]), 0).unwrap_err(), NoSignature::Empty);
    // only the selected layer's experts are kept: the unselected layer is not counted
    let p = prof(Counts::Dense(&[0.0, 2.0, 0.0, 5.0, 5.0, 5.0]), 3).unwrap();
    assert_eq!((p.layers(), p.nnz(), p.parts().0), (1, 1, &[1u32][..]));
}

// ---------------- the locality cost's per-request term r * (2 * B_w + 1) ----------------

proptest! {
    /// r = 0 chooses exactly as the rule without the term (the default balancer), and any r
    /// chooses the argmin of `D_w + (B_w + 1) * Delta_w + r * (2 * B_w + 1)` recomputed here.
    #[test]
    fn request_cost_zero_is_todays_rule_and_any_r_is_the_argmin(
        resident in prop::collection::vec((0usize..4, profile_strategy()), 0..16),
        req in profile_strategy(),
        mut healthy in prop::collection::vec(prop::bool::weighted(0.8), 4),
        f in prop::option::of(0.0f64..1.0),
        r in 0.0f64..3.0,
    ) {
        healthy[0] = true;
        let (today, zero, with_r) = (Locality::default(), Locality::with_request_cost(0.0), Locality::with_request_cost(r));
        let resident: Vec<(usize, Arc<ExpertProfile>)> = resident.into_iter().map(|(w, p)| (w, Arc::new(p))).collect();
        let mut loads = vec![0i64; 4];
        let mut guards = Vec::new();
        for (w, p) in &resident {
            for pol in [&today, &zero, &with_r] {
                guards.push(pol.track(4, *w, Arc::clone(p)).unwrap().unwrap());
            }
            loads[*w] += 1;
        }
        let mut c = ctx(&loads, &healthy, None, 0.0);
        c.load_factor = f;
        c.profile = Some(&req);
        prop_assert_eq!(zero.choose(&c), today.choose(&c));
        let w = with_r.choose(&c).worker.unwrap();
        if req.is_empty() {
            return Ok(());
        }
        let load = with_r.load_for(4, &req).unwrap();
        let cap = f.map(|f| load_cap(&c, f));
        let cost = |k: usize| load.distinct(k) + (loads[k] + 1) as f64 * load.added(k, &req) + r * (2 * loads[k] + 1) as f64;
        let best = (0..4).filter(|&k| healthy[k] && cap.is_none_or(|cap| loads[k] < cap)).map(cost).fold(f64::INFINITY, f64::min);
        prop_assert!(cost(w) <= best + 1e-9, "chose {} at {} but the least cost is {}", w, cost(w), best);
    }
}

/// Worker 0 runs three requests on the new request's experts, worker 1 one request on others.
/// Today's rule sends it to worker 0 (it adds almost no new experts there); a per-request cost
/// of one distinct expert per layer (r = 1) makes the longer queue dearer: worker 1.
#[test]
fn a_large_request_cost_prefers_the_shorter_queue_over_the_locality_match() {
    let a = Arc::new(ExpertProfile::from_sparse(1, 8, &[0, 1], &[10.0, 10.0], 10).unwrap());
    let b = Arc::new(ExpertProfile::from_sparse(1, 8, &[6, 7], &[10.0, 10.0], 10).unwrap());
    let (loads, healthy) = ([3i64, 1], [true, true]);
    let choice = |r: f64| {
        let pol = Locality::with_request_cost(r);
        let _g: Vec<_> = [0, 0, 0, 1].iter().zip([&a, &a, &a, &b]).map(|(&w, p)| pol.track(2, w, Arc::clone(p)).unwrap().unwrap()).collect();
        let mut c = ctx(&loads, &healthy, None, 0.0);
        c.profile = Some(&a);
        pol.choose(&c).worker
    };
    // D_0 ~ 2.00, Delta_0 ~ 0.0014; D_1 ~ 1.82, Delta_1 ~ 1.82: costs 2.00 + 7r and 5.45 + 3r
    assert_eq!(choice(0.0), Some(0), "today's rule: the locality match");
    assert_eq!(choice(0.5), Some(0), "r below the break-even 0.86 keeps it");
    assert_eq!(choice(1.0), Some(1), "r = 1: the shorter queue");
    // the paged cost's locality tie-break takes r too: C = E, every expert resident everywhere
    let paged = |r: f64| {
        let pol = PagedLocality::with_request_cost(8, r);
        let _g: Vec<_> = [0, 0, 0, 1].iter().zip([&a, &a, &a, &b]).map(|(&w, p)| pol.track(2, w, Arc::clone(p)).unwrap().unwrap()).collect();
        let mut c = ctx(&loads, &healthy, None, 0.0);
        c.profile = Some(&a);
        (pol.choose(&c).worker, pol.request_cost())
    };
    assert_eq!(paged(0.0), (Some(0), Some(0.0)));
    assert_eq!(paged(1.0), (Some(1), Some(1.0)));
}

#[test]
fn only_the_locality_policy_takes_a_request_cost_and_it_must_be_finite_and_non_negative() {
    let loc = PolicyConfig::parse("locality", 0).unwrap();
    assert_eq!(loc, PolicyConfig::Locality { request_cost: DEFAULT_REQUEST_COST }, "the default cost has the term");
    assert!(DEFAULT_REQUEST_COST > 0.0);
    assert_eq!(loc.with_request_cost(Some(0.4)), Ok(PolicyConfig::Locality { request_cost: 0.4 }));
    assert_eq!(loc.with_request_cost(None), Ok(loc));
    let paged = loc.with_paged_experts(Some(4)).unwrap().with_request_cost(Some(0.4)).unwrap();
    assert_eq!(paged, PolicyConfig::PagedLocality { resident: 4, request_cost: 0.4 });
    // the order does not matter: paged experts keep the request cost
    assert_eq!(loc.with_request_cost(Some(0.4)).unwrap().with_paged_experts(Some(4)), Ok(paged));
    assert_eq!(paged.build().request_cost(), Some(0.4));
    assert_eq!(paged.build().paged_experts(), Some(4));
    for bad in [-0.1, f64::NAN, f64::INFINITY] {
        let err = loc.with_request_cost(Some(bad)).unwrap_err();
        assert!(err.to_string().starts_with("--eldr-request-cost must be "), "{err}");
    }
    for name in ["eldr", "round_robin", "shortest_queue", "random", "power_of_two"] {
        let c = PolicyConfig::parse(name, 0).unwrap();
        assert_eq!(c.with_request_cost(Some(0.0)), Ok(c), "r = 0 is every policy's rule");
        let err = c.with_request_cost(Some(0.4)).unwrap_err();
        assert_eq!(err.to_string(), format!("--eldr-request-cost is a cost of the locality policy, not of --disagg-router {name}"));
        assert_eq!(c.build().request_cost(), None);
    }
}
