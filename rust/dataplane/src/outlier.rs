//! The data plane's side of worker availability: the state itself (health, circuit, in-flight)
//! is the core's [`WorkerSet`] (rust/core/src/workers.rs, the semantics are described there);
//! this pool turns its events into counters (`eldr_router_ejections`, probation trials,
//! `eldr_router_overload_timeouts`) and runtime timers (an ejection's end), and holds the
//! silence rule for clients that leave. [`Attempt`] is one request on one worker.
//!
//! Health checks (the Python control plane) feed `set_health` / `health_check`. For decode
//! the set's tracker is the core router's, whose routable bits and in-flight counts the
//! policies read.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eldr_core::{LoadGuard, QueueTracker, WorkerEvent, WorkerSet};

use crate::config::Role;
use crate::counters::{names, Counters};

pub use eldr_core::{Circuit, WorkerView};

pub struct WorkerPool {
    role: Role,
    set: WorkerSet,
    counters: Arc<Counters>,
    /// A request abandoned (its client gone) after this long without a byte from the worker
    /// counts as that worker's timeout (milliseconds; 0: off). See [`Attempt`]'s drop.
    silence_ms: AtomicU64,
}

/// Reads (routable, in-flight, state, panic pick, health) go straight to the core set.
impl Deref for WorkerPool {
    type Target = WorkerSet;
    fn deref(&self) -> &WorkerSet {
        &self.set
    }
}

impl WorkerPool {
    /// `tracker`: the decode router's (its policies read it); None for a tracker of the
    /// pool's own (prefill).
    pub fn new(role: Role, urls: &[String], threshold: u32, base_s: f64, max_s: f64, tracker: Option<Arc<QueueTracker>>, counters: Arc<Counters>) -> Arc<Self> {
        let tracker = tracker.unwrap_or_else(|| Arc::new(QueueTracker::new(urls.len(), 0)));
        let set = WorkerSet::new(role.as_str(), urls, threshold, base_s, max_s, tracker);
        Arc::new(WorkerPool { role, set, counters, silence_ms: AtomicU64::new(0) })
    }

    /// Count requests whose client left after `d` without a byte from the worker as timeouts
    /// of the worker (the overload rule applies as to any timeout); `Duration::ZERO`: off.
    pub fn set_silence(&self, d: Duration) {
        self.silence_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }

    /// A request goes to worker i: its in-flight slot, released when the guard drops.
    fn dispatched(self: &Arc<Self>, i: usize) -> LoadGuard {
        let (guard, ev) = self.set.dispatch(i);
        self.on_event(i, ev);
        guard
    }

    pub fn failure(self: &Arc<Self>, i: usize, kind: &str) {
        self.failure_since(i, kind, None)
    }

    /// A failure of a request sent at `since` (None: unknown).
    pub fn failure_since(self: &Arc<Self>, i: usize, kind: &str, since: Option<Instant>) {
        let ev = self.set.failure(i, kind, since);
        self.on_event(i, ev);
    }

    fn on_event(self: &Arc<Self>, i: usize, ev: Option<WorkerEvent>) {
        let labels = [self.role.as_str(), &i.to_string()];
        match ev {
            None => {}
            Some(WorkerEvent::Trial) => self.counters.inc(names::PROBATION_TRIALS, &labels),
            Some(WorkerEvent::OverloadTimeout) => self.counters.inc(names::OVERLOAD_TIMEOUTS, &labels),
            Some(WorkerEvent::Ejected { after, epoch }) => {
                self.counters.inc(names::EJECTIONS, &labels);
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let pool = Arc::clone(self);
                    rt.spawn(async move {
                        tokio::time::sleep(after).await;
                        pool.set.probation(i, epoch);
                    });
                }
            }
        }
    }
}

/// One request on one worker of a pool: counted in flight until dropped, and `abandoned`
/// unless a verdict (success or failure) was given.
pub struct Attempt {
    pool: Arc<WorkerPool>,
    pub worker: usize,
    verdict: bool,
    progressed: bool,
    started: Instant,
    /// The worker's in-flight count (the one count: status, metrics and policies read it).
    _slot: LoadGuard,
}

impl Attempt {
    pub fn start(pool: &Arc<WorkerPool>, worker: usize) -> Self {
        let slot = pool.dispatched(worker);
        Attempt { pool: Arc::clone(pool), worker, verdict: false, progressed: false, started: Instant::now(), _slot: slot }
    }
    pub fn success(&mut self) {
        self.pool.success(self.worker);
        self.verdict = true;
    }
    /// The worker answered its first byte (the verdict comes at the end).
    pub fn progress(&mut self) {
        self.progressed = true;
        self.pool.progress(self.worker);
    }
    pub fn failure(&mut self, kind: &str) {
        self.pool.failure_since(self.worker, kind, Some(self.started));
        self.verdict = true;
    }
}

impl Drop for Attempt {
    /// No verdict: the client went away first. A worker that had sent nothing for the pool's
    /// silence limit by then is charged a timeout all the same (clients that give up before
    /// the first-byte timeout must not keep a hung worker in rotation); otherwise no verdict.
    fn drop(&mut self) {
        if !self.verdict {
            let silence = self.pool.silence_ms.load(Ordering::Relaxed);
            if !self.progressed && silence > 0 && self.started.elapsed() >= Duration::from_millis(silence) {
                let role = self.pool.role.as_str();
                self.pool.counters.inc(names::TIMEOUTS, &[role, &self.worker.to_string(), "client_gone"]);
                self.pool.failure_since(self.worker, "silent_timeout", Some(self.started));
            } else {
                self.pool.abandoned(self.worker);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> Arc<WorkerPool> {
        let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}")).collect();
        WorkerPool::new(Role::Decode, &urls, 2, 0.05, 1.0, Some(Arc::new(QueueTracker::new(n, 1000))), Arc::new(Counters::default()))
    }

    #[test]
    fn consecutive_failures_eject_and_mirror_into_the_tracker() {
        let p = pool(3);
        p.failure(1, "http_500");
        assert!(p.routable(1));
        p.failure(1, "http_500");
        assert!(!p.routable(1));
        assert!(!p.tracker().is_healthy(1));
        assert_eq!(p.state()[1].circuit, Circuit::Open);
        // at most half (rounded up: 2 of 3) out at once, and never the last routable one
        p.failure(0, "x");
        p.failure(0, "x");
        assert!(!p.routable(0));
        p.failure(2, "x");
        p.failure(2, "x");
        assert!(p.routable(2));
    }

    #[test]
    fn silence_until_the_client_leaves_counts_against_the_worker() {
        let wait = |ms| std::thread::sleep(Duration::from_millis(ms));
        let p = pool(3);
        p.set_silence(Duration::from_millis(40));
        // worker 0 answers first bytes meanwhile: worker 1's silence is its own
        for _ in 0..2 {
            let a = Attempt::start(&p, 1);
            wait(50);
            p.progress(0);
            drop(a); // the client gave up
        }
        assert!(!p.routable(1), "two silent abandoned requests eject it (threshold 2)");
        assert_eq!(p.counters.get(names::TIMEOUTS, &["decode", "1", "client_gone"]), 2);
        // a client that leaves early, or after bytes came, says nothing about the worker
        let a = Attempt::start(&p, 2);
        drop(a);
        let mut b = Attempt::start(&p, 2);
        b.progress();
        wait(50);
        drop(b);
        assert_eq!(p.state()[2].consecutive_failures, 0);
        // off by default
        let q = pool(2);
        let a = Attempt::start(&q, 1);
        wait(50);
        drop(a);
        assert_eq!(q.state()[1].consecutive_failures, 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn ejection_ends_with_one_trial_and_backs_off() {
        let p = pool(2);
        p.failure(0, "a");
        p.failure(0, "a");
        assert!(!p.routable(0));
        tokio::time::sleep(Duration::from_millis(60)).await;
        tokio::task::yield_now().await;
        assert_eq!(p.state()[0].circuit, Circuit::HalfOpen);
        let mut a = Attempt::start(&p, 0);
        assert!(!p.routable(0), "the one trial is out");
        a.failure("b");
        drop(a);
        assert_eq!(p.state()[0].circuit, Circuit::Open);
        assert_eq!(p.state()[0].ejections, 2);
        tokio::time::sleep(Duration::from_millis(60)).await;
        tokio::task::yield_now().await;
        assert_eq!(p.state()[0].circuit, Circuit::Open, "second ejection lasts twice as long");
        tokio::time::sleep(Duration::from_millis(50)).await;
        tokio::task::yield_now().await;
        let mut a = Attempt::start(&p, 0);
        a.success();
        drop(a);
        assert_eq!(p.state()[0].circuit, Circuit::Closed);
        assert!(p.tracker().is_healthy(0));
        assert_eq!(p.inflight(0), 0);
    }

    #[test]
    fn timeouts_on_every_worker_are_overload_not_faults() {
        // the others idle: nothing to compare with, a hung worker is ejected as before
        let p = pool(3);
        p.failure(0, "first_byte_timeout");
        p.failure(0, "first_byte_timeout");
        assert!(!p.routable(0));
        // worker 0 times out while worker 1 answers: ejected
        let p = pool(3);
        let busy = [Attempt::start(&p, 1), Attempt::start(&p, 2)];
        let mut a = Attempt::start(&p, 0);
        let mut b = Attempt::start(&p, 0);
        p.progress(1);
        a.failure("first_byte_timeout");
        b.failure("first_byte_timeout");
        assert!(!p.routable(0));
        drop(busy);
        // every worker busy and none answering: the cluster is slow, nobody is ejected
        let p = pool(3);
        let mut all: Vec<Attempt> = (0..12).map(|k| Attempt::start(&p, k % 3)).collect();
        for a in all.iter_mut() {
            a.failure("first_byte_timeout");
        }
        assert_eq!(p.routable_all(), vec![true, true, true]);
        assert_eq!((0..3).map(|i| p.counters.get(names::OVERLOAD_TIMEOUTS, &["decode", &i.to_string()])).sum::<u64>(), 12);
        drop(all);
        // a 500-ing worker is ejected whatever the others do
        let busy = [Attempt::start(&p, 1), Attempt::start(&p, 2)];
        p.failure(0, "http_500");
        p.failure(0, "http_500");
        assert!(!p.routable(0));
        drop(busy);
    }
}
