//! Runtime membership (issue 31) as the router sees it: the worker set adds and removes
//! workers on the router's own tracker, and the router's centroid map and the locality
//! balancer's state follow.

use std::path::Path;
use std::sync::Arc;

use eldr_core::{CentroidWriter, ExpertProfile, PolicyConfig, Reason, Router, RouterSpec, WorkerSet};

fn write(path: &Path, k: usize) {
    let (l, e) = (4usize, 8usize);
    let weights = vec![0.0, 1.0, 1.0, 0.5];
    let idf = vec![1.0f32; l * e];
    let cents: Vec<f32> = (0..k * 3 * e).map(|i| (i % 7) as f32 + 0.5).collect();
    CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| format!("w{i}")).collect(), provenance: "{}" }
        .write(path)
        .unwrap();
}

fn urls(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("http://w{i}")).collect()
}

/// The worker ELDR picks for these per-centroid distances, and why.
fn pick(r: &Router, d: &[f64]) -> (usize, Reason) {
    let d = d.to_vec();
    let routed = r.route(move |_| Ok(d), false).unwrap();
    (routed.decision.worker.unwrap(), routed.decision.reason)
}

#[test]
fn membership_centroids_follow_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 3);
    let router = Router::new(RouterSpec::of(PolicyConfig::Eldr), Some(3), Some(&p), 0, 1000).unwrap();
    let set = WorkerSet::new("decode", &urls(3), 2, 0.05, 1.0, Arc::clone(router.tracker()));
    assert_eq!(pick(&router, &[0.5, 0.1, 0.9]).0, 1);

    let draining = set.dispatch(1).0; // w1 leaves with a request in flight: its slot is not reused
    set.remove("http://w1").unwrap();
    router.sync_membership();
    assert_eq!(router.centroid_of_slots(), vec![Some(0), None, Some(2)], "a leaver's centroid is dropped");
    assert_eq!(set.add("http://w3"), Ok(3));
    router.sync_membership();
    assert_eq!(router.centroid_of_slots(), vec![Some(0), None, Some(2), None], "a joiner has none until a refit");
    assert_eq!(pick(&router, &[0.5, 0.1, 0.9]), (0, Reason::Band), "the joiner is outside every band");

    // with the band's workers at the bounded-load cap, the joiner takes the fallback's share
    router.set_load_factor(Some(0.0)).unwrap();
    let _busy: Vec<_> = [0, 0, 2, 2].iter().map(|&w| router.tracker().acquire(w, 0)).collect();
    assert_eq!(pick(&router, &[0.5, 0.1, 0.9]), (3, Reason::NoCentroids));
    router.set_load_factor(None).unwrap();
    drop(draining);

    // a file for the old K is refused; one centroid per member maps them in slot order
    std::thread::sleep(std::time::Duration::from_millis(20));
    write(&p, 4);
    let err = router.reload().unwrap_err().to_string();
    assert!(err.contains("K=3 (its decode workers now)"), "{err}");
    assert_eq!(router.store().unwrap().generation(), 1);
    write(&p, 3);
    router.reload().unwrap();
    assert_eq!(router.centroid_of_slots(), vec![Some(0), None, Some(1), Some(2)]);
    assert_eq!(pick(&router, &[0.9, 0.9, 0.1]), (3, Reason::Band), "the joiner's new centroid is used");
}

#[test]
fn membership_locality_state_grows_with_the_workers() {
    let router = Router::new(RouterSpec::of(PolicyConfig::Locality { request_cost: 0.0 }), Some(2), None, 0, 1000).unwrap();
    let set = WorkerSet::new("decode", &urls(2), 2, 0.05, 1.0, Arc::clone(router.tracker()));
    let prof = |e: u64| ExpertProfile::from_sparse(2, 8, &[e, 8 + e], &[4.0, 4.0], 4).unwrap();
    let route = |p: &ExpertProfile| router.route_profiled(|_| Err(eldr_core::NoSignature::Missing), Some(p), false).unwrap();
    let a = Arc::new(prof(1));
    let first = route(&a).decision;
    assert_eq!(first.reason, Reason::Profile);
    let _g = router.policy().track(router.num_workers(), first.worker.unwrap(), Arc::clone(&a)).unwrap().unwrap();

    assert_eq!(set.add("http://w2"), Ok(2));
    let b = Arc::new(prof(5));
    let r = route(&b);
    assert_eq!((r.decision.reason, r.loads.len()), (Reason::Profile, 3), "the balancer keeps routing after a join");
    let g = router.policy().track(3, 2, Arc::clone(&b)).expect("a locality policy tracks").expect("the new slot is tracked");
    assert!(router.policy().expert_distinct().unwrap()[2] > 0.0);
    drop(g);
    // a route that read the slot count before the join finds no state for it: a fallback, not a panic
    assert!(router.policy().track(2, 0, Arc::clone(&b)).unwrap().is_err());
}

#[test]
fn membership_changes_while_routing_never_fail_a_route() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 3);
    let router = Arc::new(Router::new(RouterSpec::of(PolicyConfig::Eldr), Some(3), Some(&p), 0, 1000).unwrap());
    router.set_load_factor(Some(0.05)).unwrap();
    let set = WorkerSet::new("decode", &urls(3), 2, 0.05, 1.0, Arc::clone(router.tracker()));
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let (router, stop) = (Arc::clone(&router), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let d = vec![0.1 * t as f64, 0.2, 0.3];
                    let r = router.route(move |_| Ok(d), true).expect("a member is always routable");
                    let w = r.decision.worker.unwrap();
                    assert!(w < r.loads.len() && w < router.num_workers());
                    let _g = router.tracker().acquire(w, 1);
                    n += 1;
                }
                n
            })
        })
        .collect();
    for i in 0..300 {
        std::thread::sleep(std::time::Duration::from_micros(300)); // routes run between changes
        let url = format!("http://extra{}", i % 7);
        if set.add(&url).is_ok() {
            router.sync_membership();
        }
        if i % 2 == 1 {
            let leaving = format!("http://extra{}", (i + 3) % 7);
            if set.remove(&leaving).is_ok() {
                router.sync_membership();
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let routed: u64 = threads.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(routed > 0);
    assert!(router.num_workers() <= 3 + 7, "drained slots are reused: {}", router.num_workers());
    for (i, u) in set.members() {
        assert!(router.tracker().is_member(i), "{u}");
    }
}
