//! Per-worker availability: health checks plus outlier ejection, for prefill and decode
//! alike (the semantics the retired Python plane had, as Envoy's outlier detection):
//!
//! - closed: routable; `consecutive` counts failures since the last success;
//! - open (ejected): after `threshold` failures in a row, for `base * 2^(n-1)` seconds (n =
//!   ejections since the last full recovery, capped at `max`);
//! - half-open: when the ejection ends the worker gets exactly one trial request (trial);
//!   success closes the circuit and resets the back-off, failure opens it again for longer.
//!
//! At most half the workers of a role (rounded up) are out at once, and never the last
//! routable one (Envoy's max_ejection_percent). Health checks (the Python control plane) feed
//! `set_health`. For decode, every change of routability is mirrored into the core router's
//! queue tracker, which the policies read.
//!
//! Overload is not a fault. A timeout counts towards ejection when another routable worker of
//! the role made progress (a first byte, a signature, an answer) while the timed-out request
//! waited, or when the others are idle (nothing to compare with). It does not count when the
//! others are busy or timing out too and none of them made progress meanwhile: the cluster is
//! slow (the whole machine or every worker overloaded), and ejecting would only move the load
//! onto fewer workers. Those timeouts are counted (`eldr_router_overload_timeouts`) and their
//! requests still fail over. A worker that hangs while the others answer, or answers 5xx, is
//! ejected as before.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eldr_core::QueueTracker;
use serde::Serialize;

use crate::config::Role;
use crate::counters::{names, Counters};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Circuit {
    Closed,
    Open,
    HalfOpen,
    Trial,
}

#[derive(Debug)]
struct Worker {
    url: String,
    health_ok: bool,
    circuit: Circuit,
    consecutive: u32,
    ejections: u32,
    ejected_total: u64,
    ejected_until: Instant,
    last_failure: Option<String>,
    routable: bool,
    /// Bumped on each ejection: a probation timer of an older ejection does nothing.
    epoch: u64,
    /// Its last verdict was a timeout.
    timing_out: bool,
    /// When it last answered (a first byte, a signature, a whole answer).
    last_progress: Option<Instant>,
}

impl Worker {
    fn routable(&self) -> bool {
        self.health_ok && matches!(self.circuit, Circuit::Closed | Circuit::HalfOpen)
    }
}

/// One worker's state, as `/eldr/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    pub url: String,
    pub health_ok: bool,
    pub circuit: Circuit,
    pub consecutive_failures: u32,
    pub ejections: u64,
    pub ejected_for_s: f64,
    pub last_failure: Option<String>,
    pub inflight: i64,
}

pub struct WorkerPool {
    role: Role,
    workers: Mutex<Vec<Worker>>,
    inflight: Box<[AtomicI64]>,
    threshold: u32,
    base: Duration,
    max: Duration,
    /// Decode: the core router's tracker, whose health flags the policies read.
    tracker: Option<Arc<QueueTracker>>,
    counters: Arc<Counters>,
    /// A request abandoned (its client gone) after this long without a byte from the worker
    /// counts as that worker's timeout (milliseconds; 0: off). See [`Attempt`]'s drop.
    silence_ms: AtomicU64,
}

impl WorkerPool {
    /// Count requests whose client left after `d` without a byte from the worker as timeouts
    /// of the worker (the overload rule applies as to any timeout); `Duration::ZERO`: off.
    pub fn set_silence(&self, d: Duration) {
        self.silence_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn new(role: Role, urls: &[String], threshold: u32, base_s: f64, max_s: f64, tracker: Option<Arc<QueueTracker>>, counters: Arc<Counters>) -> Arc<Self> {
        let now = Instant::now();
        let workers = urls
            .iter()
            .map(|u| Worker { url: u.clone(), health_ok: true, circuit: Circuit::Closed, consecutive: 0, ejections: 0, ejected_total: 0, ejected_until: now, last_failure: None, routable: true, epoch: 0, timing_out: false, last_progress: None })
            .collect();
        Arc::new(WorkerPool {
            role,
            workers: Mutex::new(workers),
            inflight: urls.iter().map(|_| AtomicI64::new(0)).collect(),
            threshold: threshold.max(1),
            base: Duration::from_secs_f64(base_s),
            max: Duration::from_secs_f64(max_s.max(base_s)),
            tracker,
            counters,
            silence_ms: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Worker>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.inflight.len()
    }
    pub fn is_empty(&self) -> bool {
        self.inflight.is_empty()
    }

    pub fn routable(&self, i: usize) -> bool {
        self.lock()[i].routable()
    }

    pub fn routable_all(&self) -> Vec<bool> {
        self.lock().iter().map(Worker::routable).collect()
    }

    pub fn inflight(&self, i: usize) -> i64 {
        self.inflight[i].load(Ordering::Relaxed)
    }

    pub fn inflight_all(&self) -> Vec<i64> {
        self.inflight.iter().map(|a| a.load(Ordering::Relaxed)).collect()
    }

    pub fn state(&self) -> Vec<WorkerView> {
        let now = Instant::now();
        self.lock()
            .iter()
            .enumerate()
            .map(|(i, w)| WorkerView {
                url: w.url.clone(),
                health_ok: w.health_ok,
                circuit: w.circuit,
                consecutive_failures: w.consecutive,
                ejections: w.ejected_total,
                ejected_for_s: if w.circuit == Circuit::Open { (w.ejected_until.saturating_duration_since(now).as_secs_f64() * 1000.0).round() / 1000.0 } else { 0.0 },
                last_failure: w.last_failure.clone(),
                inflight: self.inflight(i),
            })
            .collect()
    }

    /// Panic mode's pick when no worker is routable: the least loaded worker not in `tried`,
    /// those whose health check passes first (outlier ejection alone put them out).
    pub fn panic_pick(&self, tried: &[usize]) -> Option<usize> {
        let ws = self.lock();
        (0..ws.len()).filter(|j| !tried.contains(j)).min_by_key(|&j| (!ws[j].health_ok, self.inflight(j), j))
    }

    /// A request goes to worker i: a half-open worker's one trial is now out.
    pub fn dispatched(&self, i: usize) {
        self.inflight[i].fetch_add(1, Ordering::Relaxed);
        let mut ws = self.lock();
        if ws[i].circuit == Circuit::HalfOpen {
            ws[i].circuit = Circuit::Trial;
            self.counters.inc(names::PROBATION_TRIALS, &[self.role.as_str(), &i.to_string()]);
            self.sync(&mut ws, i);
        }
    }

    pub fn finished(&self, i: usize) {
        self.inflight[i].fetch_sub(1, Ordering::Relaxed);
    }

    pub fn success(&self, i: usize) {
        let mut ws = self.lock();
        let w = &mut ws[i];
        w.consecutive = 0;
        w.timing_out = false;
        w.last_progress = Some(Instant::now());
        if matches!(w.circuit, Circuit::Trial | Circuit::HalfOpen) {
            eprintln!("eldr.dataplane WARNING {} worker {i} ({}) passed its probation: back in rotation", self.role, w.url);
            w.circuit = Circuit::Closed;
            w.ejections = 0;
            self.sync(&mut ws, i);
        }
    }

    /// Worker i answered something (not yet a verdict): evidence it is alive.
    pub fn progress(&self, i: usize) {
        self.lock()[i].last_progress = Some(Instant::now());
    }

    pub fn failure(self: &Arc<Self>, i: usize, kind: &str) {
        self.failure_since(i, kind, None)
    }

    /// A failure of a request sent at `since` (None: unknown).
    pub fn failure_since(self: &Arc<Self>, i: usize, kind: &str, since: Option<Instant>) {
        let mut ws = self.lock();
        ws[i].last_failure = Some(kind.to_owned());
        let timeout = is_timeout(kind);
        ws[i].timing_out = timeout;
        if timeout && self.cluster_slow(&ws, i, since) {
            // not this worker's fault: no step towards ejection; a trial gets another go
            self.counters.inc(names::OVERLOAD_TIMEOUTS, &[self.role.as_str(), &i.to_string()]);
            if ws[i].circuit == Circuit::Trial {
                ws[i].circuit = Circuit::HalfOpen;
                self.sync(&mut ws, i);
            }
            return;
        }
        ws[i].consecutive += 1;
        match ws[i].circuit {
            Circuit::Trial | Circuit::HalfOpen => self.eject(&mut ws, i, &format!("probation request failed ({kind})")),
            Circuit::Closed if ws[i].consecutive >= self.threshold => {
                let others = (0..ws.len()).filter(|&j| j != i && ws[j].routable()).count();
                if others == 0 {
                    return; // never eject the last routable worker
                }
                if ws.iter().filter(|w| w.circuit != Circuit::Closed).count() >= ws.len().div_ceil(2) {
                    return; // at most half of them (rounded up) out at once
                }
                let why = format!("{} consecutive failures, last: {kind}", ws[i].consecutive);
                self.eject(&mut ws, i, &why);
            }
            _ => {}
        }
    }

    /// The request ended without a verdict on the worker (client gone): free a trial slot.
    pub fn abandoned(&self, i: usize) {
        let mut ws = self.lock();
        if ws[i].circuit == Circuit::Trial {
            ws[i].circuit = Circuit::HalfOpen;
            self.sync(&mut ws, i);
        }
    }

    pub fn set_health(&self, i: usize, ok: bool) {
        let mut ws = self.lock();
        if ws[i].health_ok != ok {
            eprintln!("eldr.dataplane WARNING {} worker {i} ({}) health: {}", self.role, ws[i].url, if ok { "passing" } else { "FAILING" });
        }
        ws[i].health_ok = ok;
        self.sync(&mut ws, i);
    }

    fn eject(self: &Arc<Self>, ws: &mut [Worker], i: usize, why: &str) {
        let w = &mut ws[i];
        w.ejections += 1;
        w.ejected_total += 1;
        w.epoch += 1;
        let factor = 2f64.powi(w.ejections.saturating_sub(1).min(60) as i32);
        let secs = self.max.min(self.base.mul_f64(factor));
        w.circuit = Circuit::Open;
        w.ejected_until = Instant::now() + secs;
        eprintln!("eldr.dataplane WARNING {} worker {i} ({}) ejected for {:.1} s: {why}", self.role, w.url, secs.as_secs_f64());
        self.counters.inc(names::EJECTIONS, &[self.role.as_str(), &i.to_string()]);
        let epoch = w.epoch;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let pool = Arc::clone(self);
            rt.spawn(async move {
                tokio::time::sleep(secs).await;
                pool.probation(i, epoch);
            });
        }
        self.sync(ws, i);
    }

    fn probation(&self, i: usize, epoch: u64) {
        let mut ws = self.lock();
        if ws[i].circuit == Circuit::Open && ws[i].epoch == epoch {
            ws[i].circuit = Circuit::HalfOpen;
            self.sync(&mut ws, i);
        }
    }

    fn sync(&self, ws: &mut [Worker], i: usize) {
        let ok = ws[i].routable();
        if ok != ws[i].routable {
            ws[i].routable = ok;
            if let Some(t) = &self.tracker {
                t.set_healthy(i, ok);
            }
        }
    }
}

/// A failure cause that is a timeout (first byte, stall, total, connect).
fn is_timeout(kind: &str) -> bool {
    kind.ends_with("timeout")
}

impl WorkerPool {
    /// Is worker i's timeout the cluster's slowness rather than its own fault? Yes when no
    /// other routable worker made progress since the request was sent and at least one of
    /// them is busy or timing out too.
    fn cluster_slow(&self, ws: &[Worker], i: usize, since: Option<Instant>) -> bool {
        let mut slow = false;
        for (j, w) in ws.iter().enumerate().filter(|(j, w)| *j != i && w.routable()) {
            if since.is_some_and(|s| w.last_progress.is_some_and(|p| p > s)) {
                return false; // another worker answered while this one did not
            }
            slow |= w.timing_out || self.inflight(j) > 0;
        }
        slow
    }
}

/// One request on one worker of a pool: `finished` on drop, and `abandoned` unless a
/// verdict (success or failure) was given.
pub struct Attempt {
    pool: Arc<WorkerPool>,
    pub worker: usize,
    verdict: bool,
    progressed: bool,
    started: Instant,
}

impl Attempt {
    pub fn start(pool: &Arc<WorkerPool>, worker: usize) -> Self {
        pool.dispatched(worker);
        Attempt { pool: Arc::clone(pool), worker, verdict: false, progressed: false, started: Instant::now() }
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
        self.pool.finished(self.worker);
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
        assert!(!p.tracker.as_ref().unwrap().is_healthy(1));
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
        assert!(p.tracker.as_ref().unwrap().is_healthy(0));
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

    #[test]
    fn abandoned_trial_frees_the_slot() {
        let p = pool(2);
        {
            let mut ws = p.lock();
            ws[0].circuit = Circuit::HalfOpen;
        }
        drop(Attempt::start(&p, 0));
        assert_eq!(p.state()[0].circuit, Circuit::HalfOpen);
    }
}
