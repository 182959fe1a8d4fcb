//! A decode worker's occupancy report blended into the locality balancer's expert state
//! (issue 32): the report is the worker's whole batch at poll time, this router's requests
//! since are added, and forgetting the report restores the router's own view exactly.

use std::sync::Arc;

use proptest::prelude::*;

use super::*;

const LL: usize = 2;
const EE: usize = 8;
const CELLS: usize = LL * EE;

fn prof(cells: &[u64], counts: &[f64], tokens: u64) -> Arc<ExpertProfile> {
    Arc::new(ExpertProfile::from_sparse(LL, EE, cells, counts, tokens).unwrap())
}

/// The worker's idle share per cell if its batch were exactly these requests.
fn idle_of(profiles: &[&ExpertProfile]) -> Vec<f64> {
    let mut idle = vec![1.0; CELLS];
    for p in profiles {
        let (cells, probs) = p.parts();
        for (&c, &pr) in cells.iter().zip(probs) {
            idle[c as usize] *= 1.0 - pr;
        }
    }
    idle
}

fn ctx<'a>(loads: &'a [i64], healthy: &'a [bool], p: &'a ExpertProfile) -> RouteContext<'a> {
    RouteContext { loads, healthy, distances: None, fallback: Reason::NoCentroids, tau: 0.0, load_factor: None, profile: Some(p), explain: true }
}

proptest! {
    #[test]
    fn a_report_of_our_own_batch_changes_nothing_and_our_requests_since_still_count(
        seed in prop::collection::vec((0u64..CELLS as u64, 1u32..9), 1..10), t in 2u64..20,
    ) {
        let load = Arc::new(ExpertLoad::new(2, LL, EE));
        let (idx, c): (Vec<u64>, Vec<f64>) = seed.iter().map(|&(i, c)| (i, c as f64)).unzip();
        let mut idx = idx;
        idx.sort_unstable();
        idx.dedup();
        let p = prof(&idx, &c[..idx.len()], t);
        let g = load.acquire(0, Arc::clone(&p)).unwrap();
        let before = load.distinct(0);
        let at = load.own_at_poll(0).unwrap();
        load.report_occupancy(&at, &idle_of(&[&p])).unwrap();
        prop_assert!(load.has_occupancy(0));
        prop_assert!((load.distinct(0) - before).abs() < 1e-5, "{} vs {}", load.distinct(0), before);
        // our request ends after the poll: the worker's picture loses it too
        g.release();
        prop_assert!(load.distinct(0).abs() < 1e-5);
        // a request of ours since the poll counts as before
        let g2 = load.acquire(0, Arc::clone(&p)).unwrap();
        prop_assert!((load.distinct(0) - before).abs() < 1e-5);
        drop(g2);
        load.clear_occupancy(0).unwrap();
        prop_assert_eq!(load.distinct(0), 0.0);
        prop_assert!(!load.has_occupancy(0));
    }
}

#[test]
fn the_other_replicas_requests_in_a_report_steer_the_route() {
    let pol = Locality::default();
    let a = prof(&[0, 1, 8, 9], &[9.0, 9.0, 9.0, 9.0], 9);
    let b = prof(&[6, 7, 14, 15], &[9.0, 9.0, 9.0, 9.0], 9);
    // this replica has one request of each kind, worker 0 a `b` and worker 1 an `a` ...
    let _g0 = pol.track(2, 0, Arc::clone(&b)).unwrap().unwrap();
    let _g1 = pol.track(2, 1, Arc::clone(&a)).unwrap().unwrap();
    let (loads, healthy) = ([3, 3], [true, true]);
    assert_eq!(pol.choose(&ctx(&loads, &healthy, &a)).worker, Some(1));
    // ... but the workers report two more of the other replicas' requests each, of the other
    // kind: worker 0 runs mostly `a` requests, worker 1 mostly `b`
    let load = pol.expert_load().unwrap();
    let at0 = load.own_at_poll(0).unwrap();
    let at1 = load.own_at_poll(1).unwrap();
    load.report_occupancy(&at0, &idle_of(&[&b, &a, &a])).unwrap();
    load.report_occupancy(&at1, &idle_of(&[&a, &b, &b])).unwrap();
    assert_eq!(pol.choose(&ctx(&loads, &healthy, &a)).worker, Some(0));
    assert_eq!(pol.choose(&ctx(&loads, &healthy, &b)).worker, Some(1));
    // forgotten, each worker is this replica's own view again
    load.clear_occupancy(0).unwrap();
    load.clear_occupancy(1).unwrap();
    assert_eq!(pol.choose(&ctx(&loads, &healthy, &a)).worker, Some(1));
}

#[test]
fn a_report_that_does_not_fit_is_refused_and_changes_nothing() {
    let load = Arc::new(ExpertLoad::new(2, LL, EE));
    let _g = load.acquire(1, prof(&[3], &[4.0], 4)).unwrap();
    let before = (load.distinct(0), load.distinct(1));
    let at = load.own_at_poll(1).unwrap();
    assert_eq!(load.report_occupancy(&at, &[1.0; CELLS - 1]), Err(OccupancyError::Cells { got: CELLS - 1, want: CELLS }));
    let mut idle = vec![1.0; CELLS];
    idle[2] = f64::NAN;
    assert!(matches!(load.report_occupancy(&at, &idle), Err(OccupancyError::BadIdle(_))));
    idle[2] = 1.5;
    assert!(load.report_occupancy(&at, &idle).unwrap_err().to_string().contains("[0, 1]"));
    // a snapshot of another state (the layer selection changed during the poll)
    let other = Arc::new(ExpertLoad::new(2, LL, EE));
    let stale = other.own_at_poll(1).unwrap();
    assert_eq!(load.report_occupancy(&stale, &[1.0; CELLS]), Err(OccupancyError::Changed));
    assert!(load.own_at_poll(2).is_none());
    assert_eq!(load.clear_occupancy(2), Err(OccupancyError::Worker { worker: 2, workers: 2 }));
    assert_eq!((load.distinct(0), load.distinct(1)), before);
    assert!(!load.has_occupancy(1));
    // an idle share of 0 (the expert ran in every step) is finite in the state
    let mut busy = vec![1.0; CELLS];
    busy[5] = 0.0;
    load.report_occupancy(&at, &busy).unwrap();
    assert!(load.distinct(1).is_finite());
}

#[test]
fn with_replicas_each_request_counts_as_r_alike_ones_until_a_report_shows_the_others() {
    let pol = Locality::default();
    let a = prof(&[0, 1, 8, 9], &[9.0, 9.0, 9.0, 9.0], 9);
    let one = {
        let g = pol.track(2, 0, Arc::clone(&a)).unwrap().unwrap();
        let d = pol.expert_distinct().unwrap()[0];
        g.release();
        d
    };
    pol.set_replicas(3);
    let g = pol.track(2, 0, Arc::clone(&a)).unwrap().unwrap();
    let load = pol.expert_load().unwrap();
    let three = idle_of(&[&a, &a, &a]);
    let d3 = three.iter().map(|k| 1.0 - k).sum::<f64>() / LL as f64;
    assert!((load.distinct(0) - d3).abs() < 1e-5 && load.distinct(0) > one, "{} {} {}", load.distinct(0), d3, one);
    // the worker reports our request and one other replica's: the state is the report
    let at = load.own_at_poll(0).unwrap();
    let two = idle_of(&[&a, &a]);
    load.report_occupancy(&at, &two).unwrap();
    let d2 = two.iter().map(|k| 1.0 - k).sum::<f64>() / LL as f64;
    assert!((load.distinct(0) - d2).abs() < 1e-5);
    // our request ends: its three images go, the other replica's request stays
    g.release();
    assert!((load.distinct(0) - one).abs() < 1e-5, "{} vs {}", load.distinct(0), one);
    load.clear_occupancy(0).unwrap();
    assert_eq!(load.distinct(0), 0.0);
    pol.set_replicas(1);
    let g = pol.track(2, 1, Arc::clone(&a)).unwrap().unwrap();
    assert!((pol.expert_distinct().unwrap()[1] - one).abs() < 1e-9);
    drop(g);
}

#[test]
fn a_profiles_wire_form_is_built_once_and_is_not_part_of_its_value() {
    let p = prof(&[1, 9, 15], &[3.0, 1.0, 4.0], 4);
    let fresh = ExpertProfile::from_sparse(LL, EE, &[1, 9, 15], &[3.0, 1.0, 4.0], 4).unwrap();
    let first = p.to_wire_json();
    assert_eq!(first, p.build_wire_json());
    assert!(std::ptr::eq(first, p.to_wire_json()), "a re-send reuses the first build");
    assert_eq!(*p, fresh, "a built wire form leaves the profile equal to one without");
    let wire: serde_json::Value = serde_json::from_str(first).unwrap();
    assert_eq!(wire["cells"], serde_json::json!([1, 9, 15]));
}
