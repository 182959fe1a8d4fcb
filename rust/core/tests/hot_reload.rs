//! Hot reload: a route in flight finishes on its snapshot; bad files never replace good ones;
//! concurrent routing during 100 replacements never fails.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use eldr_core::distance::{from_counts, Counts};
use eldr_core::{CentroidStore, CentroidWriter, PolicyConfig, Router, RouterSpec};

fn write(path: &Path, seed: u32, k: usize) {
    let (l, e) = (4usize, 8usize);
    let weights = vec![0.0, 1.0, 1.0, 0.5];
    let idf = vec![1.0f32; l * e];
    let d = 3 * e;
    let cents: Vec<f32> = (0..k * d).map(|i| (((i as u32 + 1) * (seed + 7)) % 13) as f32 + 0.5).collect();
    CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| format!("w{i}")).collect(), provenance: "{}" }
        .write(path)
        .unwrap();
}

#[test]
fn in_flight_snapshot_survives_swap() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 1, 4);
    let store = CentroidStore::open(&p, Some(4), 0).unwrap();
    let old = store.set();
    let old_rows = old.centroids();
    write(&p, 2, 4);
    store.reload().unwrap();
    assert_eq!(store.generation(), 2);
    // The old snapshot (and its mapping of the replaced inode) is still intact.
    assert_eq!(old.centroids(), old_rows);
    assert_ne!(store.set().centroids(), old_rows);
}

#[test]
fn bad_replacement_keeps_old_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 1, 4);
    let store = CentroidStore::open(&p, Some(4), 0).unwrap();
    write(&p, 3, 5); // K mismatch
    let err = store.reload_if_changed().unwrap_err().to_string();
    assert!(err.contains("K=5"), "{err}");
    assert_eq!(store.generation(), 1);
    assert!(store.last_error().unwrap().contains("K=5"));
    // The same bad file is not re-read on every check.
    assert_eq!(store.reload_if_changed(), Ok(false));
    std::fs::write(&p, b"garbage").unwrap();
    assert!(store.reload_if_changed().is_err());
    assert_eq!(store.set().num_workers(), 4);
}

#[test]
fn routing_never_fails_across_100_replacements() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 0, 4);
    let router = Arc::new(Router::new(RouterSpec::of(PolicyConfig::Eldr), Some(4), Some(&p), 1, 1000).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (router, stop) = (Arc::clone(&router), Arc::clone(&stop));
            std::thread::spawn(move || {
                let counts: Vec<u32> = (0..32).map(|i| ((i + t) % 5) as u32).collect();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let r = router.route(|set| from_counts::<u32, u32>(set, Counts::Dense(&counts)), true).expect("route");
                    assert_eq!(r.decision.reason, eldr_core::Reason::Band);
                    let _g = router.tracker().acquire(r.decision.worker.unwrap(), 1);
                    n += 1;
                }
                n
            })
        })
        .collect();
    for i in 0..100u32 {
        if i % 10 == 9 {
            let tmp = dir.path().join("bad.tmp");
            std::fs::write(&tmp, b"ELDRCENT-not-really").unwrap();
            std::fs::rename(&tmp, &p).unwrap();
        } else {
            write(&p, i + 1, 4);
        }
        std::thread::sleep(std::time::Duration::from_millis(3));
        let _ = router.store().unwrap().reload_if_changed();
    }
    stop.store(true, Ordering::Relaxed);
    let routed: u64 = workers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(routed > 0);
    let store = router.store().unwrap();
    assert!(store.generation() > 50, "generation {}", store.generation());
    for w in 0..4 {
        assert_eq!(router.tracker().inflight(w), 0);
    }
}

#[test]
fn in_place_overwrite_cannot_touch_a_loaded_set() {
    // `cp new.eldr c.eldr` truncates and rewrites the same inode; a shared mapping of it
    // would fault (SIGBUS) on the next read. The loaded set holds a private copy.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 1, 4);
    let router = Router::new(RouterSpec::of(PolicyConfig::Eldr), Some(4), Some(&p), 0, 1000).unwrap();
    let before = router.store().unwrap().set().centroids();
    std::fs::write(&p, b"x").unwrap(); // truncate in place
    let counts: Vec<u32> = (0..32).map(|i| (i % 3) as u32).collect();
    let r = router.route(|set| from_counts::<u32, u32>(set, Counts::Dense(&counts)), true).unwrap();
    assert_eq!(r.decision.reason, eldr_core::Reason::Band);
    assert_eq!(router.store().unwrap().set().centroids(), before);
    assert!(router.store().unwrap().reload_if_changed().is_err());
    assert_eq!(router.store().unwrap().set().centroids(), before);
}

#[test]
fn decision_generation_names_the_centroids_it_used() {
    // Generation g is always file g (one reloader, auto reload off), and every file gives the
    // probe different distances, so a route's distances tell which set it really used. A
    // generation read apart from its snapshot disagrees with them now and then.
    const GENS: u32 = 400;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    let counts: Vec<u32> = (0..32).map(|i| (i % 5) as u32 + 1).collect();
    let mut expect: Vec<Vec<f64>> = vec![Vec::new()]; // index = generation
    for g in 1..=GENS {
        let staged = dir.path().join(format!("g{g}.eldr"));
        write(&staged, g, 4);
        let set = eldr_core::CentroidSet::open(&staged).unwrap();
        expect.push(from_counts::<u32, u32>(&set, Counts::Dense(&counts)).unwrap());
    }
    for g in 2..=GENS as usize {
        assert_ne!(expect[g], expect[g - 1], "files {g} and {} must be distinguishable", g - 1);
    }
    std::fs::rename(dir.path().join("g1.eldr"), &p).unwrap();
    let router = Arc::new(Router::new(RouterSpec::of(PolicyConfig::Eldr), Some(4), Some(&p), 0, 1000).unwrap());
    let expect = Arc::new(expect);
    let stop = Arc::new(AtomicBool::new(false));
    let routers: Vec<_> = (0..3)
        .map(|_| {
            let (router, stop, expect, counts) = (Arc::clone(&router), Arc::clone(&stop), Arc::clone(&expect), counts.clone());
            std::thread::spawn(move || {
                let (mut n, mut wrong) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let r = router.route(|set| from_counts::<u32, u32>(set, Counts::Dense(&counts)), true).unwrap();
                    assert_eq!(r.decision.reason, eldr_core::Reason::Band);
                    wrong += (r.distances.as_ref() != Some(&expect[r.generation as usize])) as u64;
                    n += 1;
                }
                (n, wrong)
            })
        })
        .collect();
    let store = router.store().unwrap();
    for g in 2..=GENS {
        std::fs::rename(dir.path().join(format!("g{g}.eldr")), &p).unwrap();
        store.reload().unwrap();
        assert_eq!(store.generation(), g as u64);
    }
    stop.store(true, Ordering::Relaxed);
    let (n, wrong) = routers.into_iter().map(|h| h.join().unwrap()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert!(n > 0);
    assert_eq!(wrong, 0, "{wrong} of {n} decisions named a generation other than the centroids they used");
}

#[test]
fn a_sibling_shares_workers_centroids_and_tau_not_its_policy() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.eldr");
    write(&p, 1, 4);
    let main = Router::new(RouterSpec::of(PolicyConfig::Locality { request_cost: 0.0 }), Some(4), Some(&p), 0, 0).unwrap();
    let arm = main.sibling(RouterSpec::of(PolicyConfig::RoundRobin)).unwrap();
    assert_eq!((main.policy_name(), arm.policy_name()), ("locality", "round_robin"));
    // one tracker: a request held through one router is load the other sees
    let _held = arm.tracker().acquire(2, 0);
    assert_eq!(main.tracker().inflight(2), 1);
    // one store: a reload through one serves the other
    write(&p, 2, 4);
    main.reload().unwrap();
    assert_eq!(arm.store().unwrap().generation(), 2);
    // one tau; the load factor is each router's own
    main.set_tau(0.3).unwrap();
    assert_eq!(arm.tau(), 0.3);
    let eldr = main.sibling(RouterSpec { load_factor: Some(0.2), ..RouterSpec::of(PolicyConfig::Eldr) }).unwrap();
    assert_eq!((eldr.load_factor(), main.load_factor()), (Some(0.2), None));
    assert!(main.sibling(RouterSpec { load_factor: Some(f64::NAN), ..RouterSpec::of(PolicyConfig::Eldr) }).is_err());
    // the typed config carries the locality costs to an arm
    let paged = main.sibling(RouterSpec { load_factor: Some(0.05), ..RouterSpec::of(PolicyConfig::PagedLocality { resident: 4, request_cost: 0.4 }) }).unwrap();
    assert_eq!((paged.policy_name(), paged.paged_experts(), paged.request_cost()), ("locality", Some(4), Some(0.4)));
}

#[test]
fn a_sibling_mirrors_as_many_replicas_as_its_main_router() {
    // --router-replicas R: the arm of an experiment counts each request's experts R times until
    // a report, as the main router's balancer does
    let distinct_with = |replicas: u32| {
        let main = Router::new(RouterSpec::of(PolicyConfig::Locality { request_cost: 0.0 }), Some(2), None, 0, 0).unwrap();
        main.tracker().set_replicas(replicas);
        main.policy().set_replicas(replicas);
        let arm = main.sibling(RouterSpec::of(PolicyConfig::Locality { request_cost: 0.0 })).unwrap();
        let p = Arc::new(eldr_core::ExpertProfile::from_sparse(1, 8, &[0, 3], &[1.0, 1.0], 2).unwrap());
        let _g = arm.policy().track(2, 0, Arc::clone(&p)).unwrap().unwrap();
        let _h = main.policy().track(2, 1, p).unwrap().unwrap();
        let (a, m) = (arm.policy().expert_distinct().unwrap(), main.policy().expert_distinct().unwrap());
        (a[0], m[1])
    };
    let (arm1, main1) = distinct_with(1);
    let (arm3, main3) = distinct_with(3);
    assert!((arm1 - main1).abs() < 1e-12 && (arm3 - main3).abs() < 1e-12, "{arm1} {main1} {arm3} {main3}");
    assert!(arm3 > arm1, "the arm counted no images of the other replicas: {arm3} vs {arm1}");
}
