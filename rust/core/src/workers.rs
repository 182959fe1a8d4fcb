//! The one home of worker state: per worker of a role (prefill or decode), its health (the
//! control plane's checks), its circuit (outlier ejection) and its in-flight requests. The
//! data plane and the control plane (through `_core`) read and write it; nothing else keeps
//! health or in-flight counts.
//!
//! Circuit semantics (the retired Python plane's, as Envoy's outlier detection):
//!
//! - closed: routable; `consecutive` counts failures since the last success;
//! - open (ejected): after `threshold` failures in a row, for `base * 2^(n-1)` seconds (n =
//!   ejections since the last full recovery, capped at `max`);
//! - half-open: when the ejection ends the worker gets exactly one trial request (trial);
//!   success closes the circuit and resets the back-off, failure opens it again for longer.
//!
//! At most half the workers of a role (rounded up) are out at once, and never the last
//! routable one (Envoy's max_ejection_percent).
//!
//! Overload is not a fault. A timeout counts towards ejection when another routable worker of
//! the role made progress (a first byte, a signature, an answer) while the timed-out request
//! waited, or when the others are idle (nothing to compare with). It does not count when the
//! others are busy or timing out too and none of them made progress meanwhile: the cluster is
//! slow, and ejecting would only move the load onto fewer workers.
//!
//! In-flight counts and the routable bit live in the role's [`QueueTracker`] slots (lock-free:
//! the decode policies read them on every route); the set writes the routable bit whenever
//! its state changes. The set has no clock task of its own: an ejection returns
//! [`Event::Ejected`] and its owner calls [`WorkerSet::probation`] when it ends (the data
//! plane's runtime timer), so the core stays free of an async runtime.
//!
//! Membership (issue 31): workers join ([`WorkerSet::add`]) and leave ([`WorkerSet::remove`])
//! while the router serves. Index = slot: a removed worker keeps its slot, not routable,
//! until its in-flight requests finish (draining), and only then may a joining worker take
//! it, with fresh state (no circuit, no failures, no load report). A worker re-added at the
//! same URL while its old slot drains gets another slot. The ejection rules count members
//! only.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use thiserror::Error;

use crate::queue::{LoadGuard, QueueTracker};

/// Why a membership change was refused.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MembershipError {
    #[error("{role} worker {url} is already a member")]
    Duplicate { role: &'static str, url: String },
    #[error("{role} worker {url} is not a member")]
    NotMember { role: &'static str, url: String },
    #[error("{url} is the last {role} worker: add another before removing it")]
    Last { role: &'static str, url: String },
    #[error("no free {role} slot: at most {capacity} {role} workers, counting removed ones still draining")]
    Full { role: &'static str, capacity: usize },
}

/// A slot's place in the membership, as `/eldr/status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotState {
    /// A member: routable when healthy and not ejected.
    Serving,
    /// Removed, requests still in flight.
    Draining,
    /// Removed and drained: a joining worker may take the slot.
    Free,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Circuit {
    Closed,
    Open,
    HalfOpen,
    Trial,
}

/// What a change of state asks of the set's owner (counters, timers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// A half-open worker's one trial request went out.
    Trial,
    /// A timeout blamed on the cluster's slowness, not on the worker.
    OverloadTimeout,
    /// The worker was ejected for `after`: call `probation(i, epoch)` then.
    Ejected { after: Duration, epoch: u64 },
}

#[derive(Debug)]
struct Worker {
    url: String,
    health_ok: bool,
    /// Failed health checks in a row ([`WorkerSet::health_check`]).
    checks_failed: u32,
    circuit: Circuit,
    consecutive: u32,
    ejections: u32,
    ejected_total: u64,
    ejected_until: Instant,
    last_failure: Option<String>,
    /// Bumped on each ejection: a probation timer of an older ejection does nothing.
    epoch: u64,
    /// Its last verdict was a timeout.
    timing_out: bool,
    /// When it last answered (a first byte, a signature, a whole answer).
    last_progress: Option<Instant>,
    /// A current member (see the module docs).
    member: bool,
}

impl Worker {
    fn new(url: &str, now: Instant) -> Self {
        Worker { url: url.to_owned(), health_ok: true, checks_failed: 0, circuit: Circuit::Closed, consecutive: 0, ejections: 0, ejected_total: 0, ejected_until: now, last_failure: None, epoch: 0, timing_out: false, last_progress: None, member: true }
    }
    fn routable(&self) -> bool {
        self.member && self.health_ok && matches!(self.circuit, Circuit::Closed | Circuit::HalfOpen)
    }
}

/// One worker's state, as `/eldr/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    pub slot: usize,
    pub url: String,
    pub state: SlotState,
    pub health_ok: bool,
    pub circuit: Circuit,
    pub consecutive_failures: u32,
    pub ejections: u64,
    pub ejected_for_s: f64,
    pub last_failure: Option<String>,
    pub inflight: i64,
}

pub struct WorkerSet {
    role: &'static str,
    workers: Mutex<Vec<Worker>>,
    /// In-flight counts and the routable bit (decode: the core router's, which its policies read).
    tracker: Arc<QueueTracker>,
    threshold: u32,
    base: Duration,
    max: Duration,
}

impl WorkerSet {
    /// `role` names the workers in log lines. `tracker` must have one slot per url.
    pub fn new(role: &'static str, urls: &[String], threshold: u32, base_s: f64, max_s: f64, tracker: Arc<QueueTracker>) -> Self {
        assert_eq!(tracker.num_workers(), urls.len(), "one tracker slot per worker");
        let now = Instant::now();
        for i in 0..urls.len() {
            tracker.set_healthy(i, true);
        }
        WorkerSet {
            role,
            workers: Mutex::new(urls.iter().map(|u| Worker::new(u, now)).collect()),
            tracker,
            threshold: threshold.max(1),
            base: Duration::from_secs_f64(base_s),
            max: Duration::from_secs_f64(max_s.max(base_s)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Worker>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn role(&self) -> &'static str {
        self.role
    }
    pub fn len(&self) -> usize {
        self.tracker.num_workers()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn tracker(&self) -> &Arc<QueueTracker> {
        &self.tracker
    }

    pub fn routable(&self, i: usize) -> bool {
        self.lock()[i].routable()
    }
    pub fn routable_all(&self) -> Vec<bool> {
        self.lock().iter().map(Worker::routable).collect()
    }
    pub fn inflight(&self, i: usize) -> i64 {
        self.tracker.inflight(i)
    }
    pub fn inflight_all(&self) -> Vec<i64> {
        (0..self.len()).map(|i| self.inflight(i)).collect()
    }

    pub fn state(&self) -> Vec<WorkerView> {
        let now = Instant::now();
        self.lock()
            .iter()
            .enumerate()
            .map(|(i, w)| WorkerView {
                slot: i,
                url: w.url.clone(),
                state: self.slot_state(w, i),
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

    fn slot_state(&self, w: &Worker, i: usize) -> SlotState {
        match (w.member, self.inflight(i) > 0) {
            (true, _) => SlotState::Serving,
            (false, true) => SlotState::Draining,
            (false, false) => SlotState::Free,
        }
    }

    /// Panic mode's pick when no worker is routable: the least loaded member not in `tried`,
    /// those whose health check passes first (outlier ejection alone put them out).
    pub fn panic_pick(&self, tried: &[usize]) -> Option<usize> {
        let ws = self.lock();
        (0..ws.len()).filter(|&j| ws[j].member && !tried.contains(&j)).min_by_key(|&j| (!ws[j].health_ok, self.inflight(j), j))
    }

    // ------------------------------------------------------------------ membership
    /// The members, `(slot, url)` in slot order.
    pub fn members(&self) -> Vec<(usize, String)> {
        self.lock().iter().enumerate().filter(|(_, w)| w.member).map(|(i, w)| (i, w.url.clone())).collect()
    }

    pub fn member_count(&self) -> usize {
        self.lock().iter().filter(|w| w.member).count()
    }

    pub fn is_member(&self, i: usize) -> bool {
        self.lock().get(i).is_some_and(|w| w.member)
    }

    /// Slot i's URL (a removed worker's too, while its requests drain).
    pub fn url(&self, i: usize) -> String {
        self.lock()[i].url.clone()
    }

    /// A worker joins: the first free slot (removed and drained), else a new one. Its state is
    /// fresh either way. Returns its slot.
    pub fn add(&self, url: &str) -> Result<usize, MembershipError> {
        let mut ws = self.lock();
        if ws.iter().any(|w| w.member && w.url == url) {
            return Err(MembershipError::Duplicate { role: self.role, url: url.to_owned() });
        }
        let now = Instant::now();
        let free = (0..ws.len()).find(|&j| !ws[j].member && self.inflight(j) == 0);
        let i = match free {
            Some(j) => {
                // keep the epoch rising: a probation timer of the slot's last occupant does nothing
                let epoch = ws[j].epoch;
                ws[j] = Worker { epoch, ..Worker::new(url, now) };
                self.tracker.reuse(j);
                j
            }
            None => {
                if ws.len() >= self.tracker.capacity() {
                    return Err(MembershipError::Full { role: self.role, capacity: self.tracker.capacity() });
                }
                ws.push(Worker::new(url, now)); // before the tracker's count grows: readers index both
                self.tracker.push_slot().expect("capacity checked above")
            }
        };
        self.sync(&ws, i);
        eprintln!("eldr.dataplane WARNING {} worker {i} ({url}) joined", self.role);
        Ok(i)
    }

    /// A worker leaves: no new requests; those in flight finish (draining). Never the last
    /// member. Returns its slot.
    pub fn remove(&self, url: &str) -> Result<usize, MembershipError> {
        let mut ws = self.lock();
        let Some(i) = (0..ws.len()).find(|&j| ws[j].member && ws[j].url == url) else {
            return Err(MembershipError::NotMember { role: self.role, url: url.to_owned() });
        };
        if ws.iter().filter(|w| w.member).count() == 1 {
            return Err(MembershipError::Last { role: self.role, url: url.to_owned() });
        }
        ws[i].member = false;
        self.tracker.set_member(i, false);
        self.sync(&ws, i);
        eprintln!("eldr.dataplane WARNING {} worker {i} ({url}) left: draining {} request(s)", self.role, self.inflight(i));
        Ok(i)
    }

    /// A request goes to worker i: counted in flight until the guard drops; a half-open
    /// worker's one trial is now out ([`Event::Trial`]).
    pub fn dispatch(&self, i: usize) -> (LoadGuard, Option<Event>) {
        let guard = self.tracker.acquire(i, 0);
        let mut ws = self.lock();
        if ws[i].circuit != Circuit::HalfOpen {
            return (guard, None);
        }
        ws[i].circuit = Circuit::Trial;
        self.sync(&ws, i);
        (guard, Some(Event::Trial))
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
            self.sync(&ws, i);
        }
    }

    /// Worker i answered something (not yet a verdict): evidence it is alive.
    pub fn progress(&self, i: usize) {
        self.lock()[i].last_progress = Some(Instant::now());
    }

    /// A failure (`kind`: its cause) of a request sent at `since` (None: unknown).
    pub fn failure(&self, i: usize, kind: &str, since: Option<Instant>) -> Option<Event> {
        let mut ws = self.lock();
        ws[i].last_failure = Some(kind.to_owned());
        let timeout = kind.ends_with("timeout"); // first byte, stall, total, connect, silent
        ws[i].timing_out = timeout;
        if timeout && self.cluster_slow(&ws, i, since) {
            // not this worker's fault: no step towards ejection; a trial gets another go
            if ws[i].circuit == Circuit::Trial {
                ws[i].circuit = Circuit::HalfOpen;
                self.sync(&ws, i);
            }
            return Some(Event::OverloadTimeout);
        }
        ws[i].consecutive += 1;
        match ws[i].circuit {
            Circuit::Trial | Circuit::HalfOpen => Some(self.eject(&mut ws, i, &format!("probation request failed ({kind})"))),
            Circuit::Closed if ws[i].consecutive >= self.threshold => {
                let others = (0..ws.len()).filter(|&j| j != i && ws[j].routable()).count();
                if others == 0 {
                    return None; // never eject the last routable worker
                }
                let members = ws.iter().filter(|w| w.member).count();
                if ws.iter().filter(|w| w.member && w.circuit != Circuit::Closed).count() >= members.div_ceil(2) {
                    return None; // at most half of them (rounded up) out at once
                }
                let why = format!("{} consecutive failures, last: {kind}", ws[i].consecutive);
                Some(self.eject(&mut ws, i, &why))
            }
            _ => None,
        }
    }

    /// The request ended without a verdict on the worker (client gone): free a trial slot.
    pub fn abandoned(&self, i: usize) {
        let mut ws = self.lock();
        if ws[i].circuit == Circuit::Trial {
            ws[i].circuit = Circuit::HalfOpen;
            self.sync(&ws, i);
        }
    }

    /// A health verdict on worker i, given outright (a refused connection, an operator): a
    /// passing check does not end an outlier ejection (a hung worker's /health may answer).
    /// The failed checks in a row are [`WorkerSet::health_check`]'s alone.
    pub fn set_health(&self, i: usize, ok: bool) {
        let mut ws = self.lock();
        self.set_health_locked(&mut ws, i, ok);
    }

    /// One health check's result: a pass marks worker i healthy at once, `threshold` failures
    /// in a row mark it unhealthy; in between nothing changes (a refused request may have
    /// marked it down already). The failures in a row are counted here, across callers.
    pub fn health_check(&self, i: usize, ok: bool, threshold: u32) {
        let mut ws = self.lock();
        if ok {
            ws[i].checks_failed = 0;
            self.set_health_locked(&mut ws, i, true);
            return;
        }
        ws[i].checks_failed = ws[i].checks_failed.saturating_add(1);
        if ws[i].checks_failed >= threshold {
            self.set_health_locked(&mut ws, i, false);
        }
    }

    fn set_health_locked(&self, ws: &mut [Worker], i: usize, ok: bool) {
        if ws[i].health_ok != ok {
            eprintln!("eldr.dataplane WARNING {} worker {i} ({}) health: {}", self.role, ws[i].url, if ok { "passing" } else { "FAILING" });
        }
        ws[i].health_ok = ok;
        self.sync(ws, i);
    }

    /// The ejection of `epoch` has run its time: its one trial may go (a later ejection's
    /// epoch differs, so an older timer does nothing).
    pub fn probation(&self, i: usize, epoch: u64) {
        let mut ws = self.lock();
        if ws[i].circuit == Circuit::Open && ws[i].epoch == epoch {
            ws[i].circuit = Circuit::HalfOpen;
            self.sync(&ws, i);
        }
    }

    fn eject(&self, ws: &mut [Worker], i: usize, why: &str) -> Event {
        let w = &mut ws[i];
        w.ejections += 1;
        w.ejected_total += 1;
        w.epoch += 1;
        let factor = 2f64.powi(w.ejections.saturating_sub(1).min(60) as i32);
        let after = self.max.min(self.base.mul_f64(factor));
        w.circuit = Circuit::Open;
        w.ejected_until = Instant::now() + after;
        eprintln!("eldr.dataplane WARNING {} worker {i} ({}) ejected for {:.1} s: {why}", self.role, w.url, after.as_secs_f64());
        let epoch = w.epoch;
        self.sync(ws, i);
        Event::Ejected { after, epoch }
    }

    /// Publish worker i's routability to the tracker the policies read.
    fn sync(&self, ws: &[Worker], i: usize) {
        self.tracker.set_healthy(i, ws[i].routable());
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn set(n: usize) -> WorkerSet {
        let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}")).collect();
        WorkerSet::new("decode", &urls, 2, 0.05, 1.0, Arc::new(QueueTracker::new(n, 1000)))
    }

    #[test]
    fn consecutive_failures_eject_and_publish_to_the_tracker() {
        let s = set(3);
        assert_eq!(s.failure(1, "http_500", None), None);
        assert!(s.routable(1));
        assert!(matches!(s.failure(1, "http_500", None), Some(Event::Ejected { epoch: 1, .. })));
        assert!(!s.routable(1) && !s.tracker().is_healthy(1));
        assert_eq!(s.state()[1].circuit, Circuit::Open);
        // at most half (rounded up: 2 of 3) out at once, and never the last routable one
        s.failure(0, "x", None);
        s.failure(0, "x", None);
        assert!(!s.routable(0));
        s.failure(2, "x", None);
        assert_eq!(s.failure(2, "x", None), None);
        assert!(s.routable(2));
    }

    #[test]
    fn probation_gives_one_trial_and_backs_off() {
        let s = set(2);
        s.failure(0, "a", None);
        let Some(Event::Ejected { after, epoch }) = s.failure(0, "a", None) else { panic!("not ejected") };
        assert_eq!(after, Duration::from_millis(50));
        s.probation(0, epoch - 1); // an older ejection's timer: nothing
        assert_eq!(s.state()[0].circuit, Circuit::Open);
        s.probation(0, epoch);
        assert!(s.routable(0) && s.tracker().is_healthy(0));
        let (g, ev) = s.dispatch(0);
        assert_eq!(ev, Some(Event::Trial));
        assert!(!s.routable(0), "the one trial is out");
        assert_eq!(s.inflight(0), 1);
        let Some(Event::Ejected { after, epoch }) = s.failure(0, "b", None) else { panic!("not re-ejected") };
        assert_eq!(after, Duration::from_millis(100), "second ejection lasts twice as long");
        drop(g);
        assert_eq!(s.inflight(0), 0);
        s.probation(0, epoch);
        let (_g, _) = s.dispatch(0);
        s.success(0);
        assert_eq!(s.state()[0].circuit, Circuit::Closed);
        assert_eq!(s.state()[0].ejections, 2);
    }

    #[test]
    fn abandoned_trial_frees_the_slot() {
        let s = set(2);
        s.lock()[0].circuit = Circuit::HalfOpen;
        let (_g, _) = s.dispatch(0);
        assert_eq!(s.state()[0].circuit, Circuit::Trial);
        s.abandoned(0);
        assert_eq!(s.state()[0].circuit, Circuit::HalfOpen);
    }

    #[test]
    fn timeouts_while_the_others_are_busy_are_overload() {
        let s = set(3);
        let _busy = [s.dispatch(1).0, s.dispatch(2).0];
        let since = Some(Instant::now());
        for _ in 0..3 {
            assert_eq!(s.failure(0, "first_byte_timeout", since), Some(Event::OverloadTimeout));
        }
        assert!(s.routable(0));
        s.progress(1); // another worker answered meanwhile: the timeout is worker 0's own
        s.failure(0, "first_byte_timeout", since);
        assert!(matches!(s.failure(0, "first_byte_timeout", since), Some(Event::Ejected { .. })));
    }

    #[test]
    fn health_checks_count_failures_in_a_row() {
        let s = set(2);
        s.health_check(1, false, 3);
        s.health_check(1, false, 3);
        assert!(s.routable(1), "two of three failed checks: unchanged");
        s.health_check(1, true, 3);
        s.health_check(1, false, 3);
        s.health_check(1, false, 3);
        assert!(s.routable(1), "a pass resets the count");
        s.health_check(1, false, 3);
        assert!(!s.routable(1) && !s.state()[1].health_ok && !s.tracker().is_healthy(1));
        s.health_check(1, true, 3);
        assert!(s.routable(1) && s.tracker().is_healthy(1));
        // a health pass never ends an ejection
        s.failure(0, "x", None);
        s.failure(0, "x", None);
        s.health_check(0, true, 3);
        assert!(!s.routable(0));
    }

    #[test]
    fn membership_add_remove_drain_and_fresh_reuse() {
        let s = set(2);
        let g = s.dispatch(1).0; // a request in flight on w1
        s.failure(1, "x", None);
        assert_eq!(s.remove("http://w1"), Ok(1));
        assert!(!s.routable(1) && !s.tracker().is_healthy(1) && !s.tracker().is_member(1));
        assert_eq!(s.state()[1].state, SlotState::Draining);
        assert_eq!(s.remove("http://w0"), Err(MembershipError::Last { role: "decode", url: "http://w0".into() }));
        assert!(matches!(s.remove("http://nope"), Err(MembershipError::NotMember { .. })));
        // re-added while its old slot drains: another slot, fresh
        assert_eq!(s.add("http://w1"), Ok(2));
        assert!(matches!(s.add("http://w1"), Err(MembershipError::Duplicate { .. })));
        assert_eq!(s.len(), 3);
        assert_eq!(s.state()[2].consecutive_failures, 0);
        drop(g);
        assert_eq!(s.state()[1].state, SlotState::Free);
        // the drained slot is taken by the next worker, with no trace of its last occupant
        s.tracker().report(1, 7, Some(0));
        assert_eq!(s.add("http://w3"), Ok(1));
        let v = &s.state()[1];
        assert_eq!((v.url.as_str(), v.state, v.consecutive_failures, v.last_failure.clone()), ("http://w3", SlotState::Serving, 0, None));
        assert_eq!(s.tracker().reported(1), None, "no stale load report");
        assert!(s.routable(1) && s.tracker().is_healthy(1));
        assert_eq!(s.members().iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn membership_ejection_rules_count_members_only() {
        let s = set(3);
        let _draining = s.dispatch(1).0;
        s.remove("http://w1").unwrap();
        assert_eq!(s.add("http://w3"), Ok(3)); // members: slots 0, 2, 3; slot 1 drains
        s.failure(0, "x", None);
        assert!(matches!(s.failure(0, "x", None), Some(Event::Ejected { .. })));
        s.failure(2, "x", None);
        assert!(matches!(s.failure(2, "x", None), Some(Event::Ejected { .. })), "2 of 3 members may be out");
        s.failure(3, "x", None);
        assert_eq!(s.failure(3, "x", None), None, "never the last routable member");
        assert_eq!(s.panic_pick(&[]).map(|i| s.is_member(i)), Some(true));
    }

    #[test]
    fn membership_stale_probation_timer_does_nothing_to_a_new_occupant() {
        let s = set(2);
        s.failure(1, "x", None);
        let Some(Event::Ejected { epoch, .. }) = s.failure(1, "x", None) else { panic!("not ejected") };
        s.remove("http://w1").unwrap();
        assert_eq!(s.add("http://w9"), Ok(1));
        s.failure(1, "y", None);
        let Some(Event::Ejected { epoch: e2, .. }) = s.failure(1, "y", None) else { panic!("not ejected") };
        assert!(e2 > epoch);
        s.probation(1, epoch); // the old occupant's timer
        assert_eq!(s.state()[1].circuit, Circuit::Open);
    }
}
