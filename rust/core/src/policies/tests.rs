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
fn unknown_policy_is_named() {
    let err = make_policy("fastest", 0).err().unwrap();
    assert!(err.contains("fastest") && err.contains("shortest_queue"));
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
    assert!(ExpertProfile::from_sparse(1, 8, &[9], &[1.0], 1).unwrap_err().contains("out of range"));
    assert!(ExpertProfile::from_sparse(1, 8, &[1], &[f64::NAN], 1).unwrap_err().contains("finite"));
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
