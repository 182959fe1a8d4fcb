//! Lock-free per-worker load tracking.
//!
//! Each decode worker has a cache-line-padded slot of atomics: in-flight requests and tokens
//! this router placed there, the latest external load report (a decode worker's `/v1/loads`,
//! which also counts other router replicas' requests), and a health flag. In the router
//! service the health flag and in-flight count are the storage of a [`crate::WorkerSet`], which
//! decides them (health checks, ejection) and takes the slots; a standalone Router (the
//! simulator, bindings) sets them directly.
//!
//! A report blends in as the part of it that is not this router's: `others = reported - ours`
//! (ours: this router's in-flight count on the worker when the report was taken), and the
//! load is `own in-flight now + others`. Only the other replicas' share is as old as the
//! report; this router's own share is always current. (Taking `max(own, report)` instead
//! re-counted this router's own requests as of the report: a poll every second is older than
//! a decode request's whole life on a fast GPU (32 tokens at 3 ms a step), so a worker whose
//! batch had just finished looked full and the bounded-load cap, computed from the inflated
//! total, stopped binding. The locality balancer then swung its batches between 0 and 17
//! on 4 workers at 32 in flight where round robin held 7-8: benchmarks/results/
//! switchback_emulated.md.) A [`LoadGuard`]
//! releases its slot exactly once, on drop or on explicit release, whatever path the request
//! takes (success, error, cancellation).
//!
//! Workers come and go at run time (issue 31): the slots are allocated once, up to
//! [`SLOT_CAPACITY`] (or the starting count if larger), and `len` slots are in use. A slot is a
//! worker's identity while it is a member; a removed worker keeps its slot (not a member, so
//! not routable) until its requests drain, and a later worker may then take it, fresh
//! ([`QueueTracker::reuse`]). Slots are never moved, so an index held by an in-flight request
//! or a guard stays valid.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[repr(align(64))]
#[derive(Default)]
struct Slot {
    inflight: AtomicI64,
    tokens: AtomicI64,
    ext_running: AtomicI64,
    /// The last report's share that is not this router's (see the module docs).
    ext_others: AtomicI64,
    /// Milliseconds since `epoch` + 1 of the last report; 0 = never reported.
    ext_at_ms: AtomicU64,
    unhealthy: AtomicBool,
    /// A current member (a removed worker draining its requests, or a free slot: false).
    member: AtomicBool,
    /// The other router replicas' requests projected since the last report (see
    /// [`QueueTracker::set_replicas`]).
    projected: AtomicI64,
    /// Reports taken so far: a guard whose request ends before the next report takes its
    /// projection back, one that ends after leaves the count (reset by the report) alone.
    reports: AtomicU64,
}

/// Slots a tracker can hold at most (workers added at run time beyond the starting ones):
/// 64 bytes each, allocated once so the lock-free reads never see a moving array.
pub const SLOT_CAPACITY: usize = 1024;

pub struct QueueTracker {
    slots: Box<[Slot]>,
    /// Slots in use (members, draining and free ones): what routes read.
    len: AtomicUsize,
    /// Router replicas beside this one, R - 1 (0: alone; see [`QueueTracker::set_replicas`]).
    mirrors: AtomicI64,
    epoch: Instant,
    report_ttl_ms: u64,
}

impl QueueTracker {
    /// `workers` members to start with; `report_ttl_ms`: how long an external load report
    /// stays in the blend.
    pub fn new(workers: usize, report_ttl_ms: u64) -> Self {
        let slots: Box<[Slot]> = (0..workers.max(SLOT_CAPACITY)).map(|_| Slot::default()).collect();
        for s in &slots[..workers] {
            s.member.store(true, Ordering::Relaxed);
        }
        QueueTracker { slots, len: AtomicUsize::new(workers), mirrors: AtomicI64::new(0), epoch: Instant::now(), report_ttl_ms }
    }

    /// Slots in use: every index a route sees is below this.
    pub fn num_workers(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// A new slot for a worker joining (a member, healthy, no report); None when all
    /// [`QueueTracker::capacity`] slots are in use. One writer at a time (the worker set's lock).
    pub fn push_slot(&self) -> Option<usize> {
        let i = self.num_workers();
        let s = self.slots.get(i)?;
        Self::fresh(s);
        self.len.store(i + 1, Ordering::Release);
        Some(i)
    }

    /// Slot `i`, freed by a drained worker, for a worker joining: member, healthy, and no load
    /// report of its previous occupant (in-flight counts are already zero: the caller checks).
    pub fn reuse(&self, i: usize) {
        Self::fresh(&self.slots[i]);
    }

    fn fresh(s: &Slot) {
        s.projected.store(0, Ordering::Release);
        s.ext_at_ms.store(0, Ordering::Release);
        s.ext_running.store(0, Ordering::Release);
        s.ext_others.store(0, Ordering::Release);
        s.unhealthy.store(false, Ordering::Release);
        s.member.store(true, Ordering::Release);
    }

    /// Mark slot `i` a member or not (removed: not routable, draining; see [`crate::WorkerSet`]).
    pub fn set_member(&self, i: usize, member: bool) {
        self.slots[i].member.store(member, Ordering::Release);
        if !member {
            self.slots[i].unhealthy.store(true, Ordering::Release);
        }
    }

    pub fn is_member(&self, i: usize) -> bool {
        i < self.num_workers() && self.slots[i].member.load(Ordering::Acquire)
    }

    /// The members' slots, in slot order.
    pub fn members(&self) -> Vec<usize> {
        (0..self.num_workers()).filter(|&i| self.is_member(i)).collect()
    }

    /// `replicas` router replicas route to these workers, this one among them (1: alone).
    /// Between two load reports of a worker the others' new requests are invisible, so every
    /// replica saw the same least-loaded worker and sent there until the next poll (herding:
    /// benchmarks/results/replicas_study.md). With R > 1 each request this router sends to a
    /// worker also counts R - 1 projected requests there (the others route as this one does),
    /// until that worker's next report, which counts the real ones, or until the request
    /// ends (theirs are assumed to end alike).
    pub fn set_replicas(&self, replicas: u32) {
        self.mirrors.store(i64::from(replicas.max(1)) - 1, Ordering::Relaxed);
    }

    pub fn replicas(&self) -> u32 {
        self.mirrors.load(Ordering::Relaxed) as u32 + 1
    }

    /// Count one request (and its tokens) on `worker`. Returns a guard that releases it.
    pub fn acquire(self: &Arc<Self>, worker: usize, tokens: i64) -> LoadGuard {
        self.add(worker, tokens);
        let mirrors = self.mirrors.load(Ordering::Relaxed);
        let s = &self.slots[worker];
        let epoch = s.reports.load(Ordering::Acquire);
        if mirrors > 0 {
            s.projected.fetch_add(mirrors, Ordering::AcqRel);
        }
        LoadGuard { tracker: Arc::clone(self), worker, tokens, released: AtomicBool::new(false), epoch, mirrors }
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

    /// Record a worker's own report of the requests it holds. `ours_at_poll`: this router's
    /// in-flight count on the worker when the poll was sent (None: taken now). Ours is the
    /// larger of that and the count now, so a request that ended while the answer was on its
    /// way is not mistaken for another replica's (the report's share that is not ours errs
    /// low, towards this router's exact count, never high).
    pub fn report(&self, worker: usize, running: i64, ours_at_poll: Option<i64>) {
        let s = &self.slots[worker];
        let running = running.max(0);
        let now = s.inflight.load(Ordering::Acquire);
        let ours = ours_at_poll.map_or(now, |o| o.max(now));
        s.ext_running.store(running, Ordering::Release);
        s.ext_others.store((running - ours).max(0), Ordering::Release);
        s.ext_at_ms.store(self.epoch.elapsed().as_millis() as u64 + 1, Ordering::Release);
        s.reports.fetch_add(1, Ordering::AcqRel);
        s.projected.store(0, Ordering::Release); // the report counts the others' requests
    }

    /// The worker's last own report of the requests it holds, however old (None: never
    /// reported); what status pages show. The load the policies see is [`QueueTracker::load`].
    pub fn reported(&self, worker: usize) -> Option<i64> {
        let s = &self.slots[worker];
        (s.ext_at_ms.load(Ordering::Acquire) != 0).then(|| s.ext_running.load(Ordering::Acquire))
    }

    /// The load the policies see: our own in-flight count now, plus the fresh report's share
    /// that is not ours (other router replicas' requests; see the module docs). A stale report
    /// is ignored, so a dead poller never freezes the picture.
    #[inline]
    pub fn load(&self, worker: usize) -> i64 {
        let s = &self.slots[worker];
        let local = s.inflight.load(Ordering::Acquire) + s.projected.load(Ordering::Acquire).max(0);
        let at = s.ext_at_ms.load(Ordering::Acquire);
        if at != 0 && (self.epoch.elapsed().as_millis() as u64 + 1).saturating_sub(at) <= self.report_ttl_ms {
            local + s.ext_others.load(Ordering::Acquire)
        } else {
            local
        }
    }

    pub fn loads_into(&self, out: &mut Vec<i64>) {
        out.clear();
        let used = &self.slots[..self.num_workers()];
        if self.mirrors.load(Ordering::Relaxed) > 0 || used.iter().any(|s| s.ext_at_ms.load(Ordering::Relaxed) != 0) {
            out.extend((0..used.len()).map(|w| self.load(w)));
        } else {
            out.extend(used.iter().map(|s| s.inflight.load(Ordering::Acquire)));
        }
    }

    pub fn set_healthy(&self, worker: usize, healthy: bool) {
        self.slots[worker].unhealthy.store(!healthy, Ordering::Release);
    }

    #[inline]
    pub fn is_healthy(&self, worker: usize) -> bool {
        !self.slots[worker].unhealthy.load(Ordering::Acquire)
    }

    /// Loads and health of the same slots (one read of the slot count, so a worker joining
    /// meanwhile never makes the two differ in length).
    pub fn state_into(&self, loads: &mut Vec<i64>, healthy: &mut Vec<bool>) {
        let n = self.num_workers();
        loads.clear();
        healthy.clear();
        let used = &self.slots[..n];
        let reported = self.mirrors.load(Ordering::Relaxed) > 0 || used.iter().any(|s| s.ext_at_ms.load(Ordering::Relaxed) != 0);
        loads.extend(used.iter().enumerate().map(|(w, s)| if reported { self.load(w) } else { s.inflight.load(Ordering::Acquire) }));
        healthy.extend(used.iter().map(|s| !s.unhealthy.load(Ordering::Acquire)));
    }

    pub fn healthy_into(&self, out: &mut Vec<bool>) {
        out.clear();
        out.extend(self.slots[..self.num_workers()].iter().map(|s| !s.unhealthy.load(Ordering::Acquire)));
    }
}

/// One request in flight on one worker. Released exactly once: by `release()` or on drop.
pub struct LoadGuard {
    tracker: Arc<QueueTracker>,
    worker: usize,
    tokens: i64,
    released: AtomicBool,
    /// The worker's report count at dispatch, and the projected requests this one brought.
    epoch: u64,
    mirrors: i64,
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
        let s = &self.tracker.slots[self.worker];
        if self.mirrors > 0 && s.reports.load(Ordering::Acquire) == self.epoch {
            s.projected.fetch_sub(self.mirrors, Ordering::AcqRel); // a report between reset it
        }
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
        t.report(0, 5, None);
        assert_eq!(t.load(0), 5, "1 ours + the report's 4 others");
        t.report(0, 0, None);
        assert_eq!(t.load(0), 1, "our own in-flight count is a floor");
        t.report(0, 9, None);
        std::thread::sleep(std::time::Duration::from_millis(80));
        assert_eq!(t.load(0), 1, "a stale report is ignored");
        assert_eq!(t.reported(0), Some(9), "but it is still the last report");
    }

    /// The case that broke the locality balancer: a report taken while this router had 8
    /// requests on the worker, all of which then finished. The worker is empty; the report
    /// (still fresh) must not make it look full.
    #[test]
    fn a_report_of_our_own_finished_requests_adds_nothing() {
        let t = Arc::new(QueueTracker::new(2, 60_000));
        let batch: Vec<LoadGuard> = (0..8).map(|_| t.acquire(0, 0)).collect();
        t.report(0, 8, None);
        assert_eq!(t.load(0), 8);
        drop(batch);
        assert_eq!(t.load(0), 0, "our requests ended: the worker is empty whatever the report said");
        let _g = t.acquire(0, 0);
        assert_eq!(t.load(0), 1, "and a new one counts at once");
        // another replica's 3 requests stay counted until the report goes stale
        let ours: Vec<LoadGuard> = (0..2).map(|_| t.acquire(1, 0)).collect();
        t.report(1, 5, None);
        drop(ours);
        assert_eq!(t.load(1), 3);
    }

    #[test]
    fn ours_is_the_larger_of_the_counts_at_poll_and_now() {
        let t = Arc::new(QueueTracker::new(1, 60_000));
        let g: Vec<LoadGuard> = (0..4).map(|_| t.acquire(0, 0)).collect();
        let at_poll = t.inflight(0);
        drop(g); // they end while the answer is on its way; the answer still counts them
        t.report(0, 4, Some(at_poll));
        assert_eq!(t.load(0), 0, "not mistaken for another replica's requests");
        let _g: Vec<LoadGuard> = (0..3).map(|_| t.acquire(0, 0)).collect();
        t.report(0, 1, Some(0)); // bound after the poll was sent: the answer missed them
        assert_eq!(t.load(0), 3);
    }

    #[test]
    fn reported_is_none_until_a_report() {
        let t = QueueTracker::new(2, 1000);
        assert_eq!((t.reported(0), t.reported(1)), (None, None));
        t.report(1, -3, None);
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

    #[test]
    fn membership_slots_grow_to_capacity_and_reads_agree_on_length() {
        let t = QueueTracker::new(2, 1000);
        assert_eq!((t.num_workers(), t.capacity()), (2, SLOT_CAPACITY));
        assert_eq!(t.push_slot(), Some(2));
        let (mut l, mut h) = (Vec::new(), Vec::new());
        t.state_into(&mut l, &mut h);
        assert_eq!((l.len(), h.len()), (3, 3));
        t.set_member(0, false);
        assert_eq!(t.members(), vec![1, 2]);
        t.state_into(&mut l, &mut h);
        assert_eq!(h, vec![false, true, true]);
        t.report(0, 5, Some(0));
        t.reuse(0);
        assert_eq!((t.reported(0), t.is_member(0), t.is_healthy(0)), (None, true, true));
        while t.push_slot().is_some() {}
        assert_eq!(t.num_workers(), SLOT_CAPACITY);
    }

    #[test]
    fn replicas_project_the_others_requests_until_the_next_report() {
        let t = Arc::new(QueueTracker::new(2, 60_000));
        t.set_replicas(3);
        let g = t.acquire(0, 0);
        assert_eq!((t.inflight(0), t.load(0), t.load(1)), (1, 3, 0), "one of ours and two projected");
        let (mut l, mut h) = (Vec::new(), Vec::new());
        t.state_into(&mut l, &mut h);
        assert_eq!(l, vec![3, 0]);
        drop(g);
        assert_eq!(t.load(0), 0, "a request that ends before a report takes its projection back");
        let g = t.acquire(0, 0);
        t.report(0, 4, Some(1)); // the report counts the others' real requests: 3
        assert_eq!(t.load(0), 1 + 3);
        drop(g);
        assert_eq!(t.load(0), 3, "a request that ends after a report leaves the report's count alone");
        t.set_replicas(1);
        let _g = t.acquire(1, 0);
        assert_eq!(t.load(1), 1, "alone: nothing projected");
    }
}
