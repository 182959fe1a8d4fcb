//! Lock-free per-worker load tracking.
//!
//! Each decode worker has a cache-line-padded slot of atomics: in-flight requests and tokens
//! this router placed there, the latest external load report (a decode worker's `/v1/loads`,
//! which also counts other router replicas' requests), and a health flag. In the router
//! service the health flag and in-flight count are the storage of a [`crate::WorkerSet`], which
//! decides them (health checks, ejection) and takes the slots; a standalone Router (the
//! simulator, bindings) sets them directly. A [`LoadGuard`]
//! releases its slot exactly once, on drop or on explicit release, whatever path the request
//! takes (success, error, cancellation).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[repr(align(64))]
#[derive(Default)]
struct Slot {
    inflight: AtomicI64,
    tokens: AtomicI64,
    ext_running: AtomicI64,
    /// Milliseconds since `epoch` + 1 of the last report; 0 = never reported.
    ext_at_ms: AtomicU64,
    unhealthy: AtomicBool,
}

pub struct QueueTracker {
    slots: Box<[Slot]>,
    epoch: Instant,
    report_ttl_ms: u64,
}

impl QueueTracker {
    /// `report_ttl_ms`: how long an external load report stays in the blend.
    pub fn new(workers: usize, report_ttl_ms: u64) -> Self {
        QueueTracker { slots: (0..workers).map(|_| Slot::default()).collect(), epoch: Instant::now(), report_ttl_ms }
    }

    pub fn num_workers(&self) -> usize {
        self.slots.len()
    }

    /// Count one request (and its tokens) on `worker`. Returns a guard that releases it.
    pub fn acquire(self: &Arc<Self>, worker: usize, tokens: i64) -> LoadGuard {
        self.add(worker, tokens);
        LoadGuard { tracker: Arc::clone(self), worker, tokens, released: AtomicBool::new(false) }
    }

    /// Raw increment; pair with exactly one [`QueueTracker::sub`]. Prefer [`QueueTracker::acquire`].
    #[inline]
    pub fn add(&self, worker: usize, tokens: i64) {
        let s = &self.slots[worker];
        s.inflight.fetch_add(1, Ordering::AcqRel);
        if tokens != 0 {
            s.tokens.fetch_add(tokens, Ordering::AcqRel);
        }
    }

    #[inline]
    pub fn sub(&self, worker: usize, tokens: i64) {
        let s = &self.slots[worker];
        s.inflight.fetch_sub(1, Ordering::AcqRel);
        if tokens != 0 {
            s.tokens.fetch_sub(tokens, Ordering::AcqRel);
        }
    }

    /// Requests this router has in flight on `worker`.
    pub fn inflight(&self, worker: usize) -> i64 {
        self.slots[worker].inflight.load(Ordering::Acquire)
    }

    pub fn tokens(&self, worker: usize) -> i64 {
        self.slots[worker].tokens.load(Ordering::Acquire)
    }

    /// Record a worker's own report of the requests it holds.
    pub fn report(&self, worker: usize, running: i64) {
        let s = &self.slots[worker];
        s.ext_running.store(running.max(0), Ordering::Release);
        s.ext_at_ms.store(self.epoch.elapsed().as_millis() as u64 + 1, Ordering::Release);
    }

    /// The worker's last own report of the requests it holds, however old (None: never
    /// reported); what status pages show. The load the policies see is [`QueueTracker::load`].
    pub fn reported(&self, worker: usize) -> Option<i64> {
        let s = &self.slots[worker];
        (s.ext_at_ms.load(Ordering::Acquire) != 0).then(|| s.ext_running.load(Ordering::Acquire))
    }

    /// The load the policies see: our own in-flight count, raised to the worker's fresh report
    /// when it says more (other router replicas also send it work). A stale report is ignored,
    /// so a dead poller never freezes the picture.
    #[inline]
    pub fn load(&self, worker: usize) -> i64 {
        let s = &self.slots[worker];
        let local = s.inflight.load(Ordering::Acquire);
        let at = s.ext_at_ms.load(Ordering::Acquire);
        if at != 0 && (self.epoch.elapsed().as_millis() as u64 + 1).saturating_sub(at) <= self.report_ttl_ms {
            local.max(s.ext_running.load(Ordering::Acquire))
        } else {
            local
        }
    }

    pub fn loads_into(&self, out: &mut Vec<i64>) {
        out.clear();
        if self.slots.iter().any(|s| s.ext_at_ms.load(Ordering::Relaxed) != 0) {
            out.extend((0..self.slots.len()).map(|w| self.load(w)));
        } else {
            out.extend(self.slots.iter().map(|s| s.inflight.load(Ordering::Acquire)));
        }
    }

    pub fn set_healthy(&self, worker: usize, healthy: bool) {
        self.slots[worker].unhealthy.store(!healthy, Ordering::Release);
    }

    #[inline]
    pub fn is_healthy(&self, worker: usize) -> bool {
        !self.slots[worker].unhealthy.load(Ordering::Acquire)
    }

    pub fn healthy_into(&self, out: &mut Vec<bool>) {
        out.clear();
        out.extend(self.slots.iter().map(|s| !s.unhealthy.load(Ordering::Acquire)));
    }
}

/// One request in flight on one worker. Released exactly once: by `release()` or on drop.
pub struct LoadGuard {
    tracker: Arc<QueueTracker>,
    worker: usize,
    tokens: i64,
    released: AtomicBool,
}

impl LoadGuard {
    pub fn worker(&self) -> usize {
        self.worker
    }
    pub fn tokens(&self) -> i64 {
        self.tokens
    }
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }
    /// Release now. True the first time; false (and no effect) after.
    pub fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.tracker.sub(self.worker, self.tokens);
        true
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_releases_exactly_once() {
        let t = Arc::new(QueueTracker::new(2, 1000));
        let g = t.acquire(1, 10);
        assert_eq!((t.inflight(1), t.tokens(1)), (1, 10));
        assert!(g.release());
        assert!(!g.release());
        drop(g);
        assert_eq!((t.inflight(1), t.tokens(1)), (0, 0));
        {
            let _g = t.acquire(0, 3);
            assert_eq!(t.inflight(0), 1);
        }
        assert_eq!(t.inflight(0), 0);
    }

    #[test]
    fn external_report_blends_and_expires() {
        let t = Arc::new(QueueTracker::new(1, 50));
        let _g = t.acquire(0, 0);
        t.report(0, 5);
        assert_eq!(t.load(0), 5);
        t.report(0, 0);
        assert_eq!(t.load(0), 1, "our own in-flight count is a floor");
        t.report(0, 9);
        std::thread::sleep(std::time::Duration::from_millis(80));
        assert_eq!(t.load(0), 1, "a stale report is ignored");
        assert_eq!(t.reported(0), Some(9), "but it is still the last report");
    }

    #[test]
    fn reported_is_none_until_a_report() {
        let t = QueueTracker::new(2, 1000);
        assert_eq!((t.reported(0), t.reported(1)), (None, None));
        t.report(1, -3);
        assert_eq!((t.reported(0), t.reported(1)), (None, Some(0)), "negative counts clamp to 0");
    }

    #[test]
    fn stress_8_threads_1m_pairs() {
        let t = Arc::new(QueueTracker::new(4, 1000));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    let mut peak = 0;
                    for j in 0..125_000 {
                        let w = (i + j) % 4;
                        let g = t.acquire(w, 7);
                        peak = peak.max(t.inflight(w));
                        if j % 3 == 0 {
                            g.release();
                        } // else: released on drop
                    }
                    peak
                })
            })
            .collect();
        let peaks: Vec<i64> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(peaks.iter().all(|&p| (1..=8).contains(&p)), "{peaks:?}");
        for w in 0..4 {
            assert_eq!((t.inflight(w), t.tokens(w)), (0, 0), "worker {w} leaked");
        }
    }
}
