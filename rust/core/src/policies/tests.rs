use proptest::prelude::*;

use super::*;

fn ctx<'a>(loads: &'a [i64], healthy: &'a [bool], d: Option<&'a [f64]>, tau: f64) -> RouteContext<'a> {
    RouteContext { loads, healthy, distances: d, fallback: Reason::NoCentroids, tau, load_factor: None, explain: true }
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
