//! A decode worker's expert occupancy report blended into the locality balancer's state
//! (issue 32), and a request's profile as the decode worker receives it to sum one.
//!
//! With several router replicas each one's [`ExpertLoad`] holds only its own requests. A
//! worker reports, per cell, the chance that no request of its whole batch selects the expert
//! in a step; the report replaces the others' part of the state at each poll: the cell's
//! `S` becomes `own + mirror + report`, where `report = min(0, log(idle) - own at the poll)`
//! (it can show requests this router did not send, never that its own are gone) and `mirror`
//! the images of this router's requests since the last report (`--router-replicas`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use thiserror::Error;

use super::locality::{exp_tables, mass, ExpertLoad, ExpertProfile, LOG_SCALE};

/// Why a worker's occupancy report cannot be applied (the router counts and drops it).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum OccupancyError {
    #[error("the report has {got} cells, the balancer tracks {want} (another layer selection)")]
    Cells { got: usize, want: usize },
    #[error("an idle fraction must be in [0, 1], got {0}")]
    BadIdle(f64),
    #[error("worker {worker} out of range 0..{workers}")]
    Worker { worker: usize, workers: usize },
    #[error("the balancer's expert state changed during the poll")]
    Changed,
}

/// This router's own `S` on one worker when a load poll was sent: what the worker's answer
/// counts of ours (an occupancy report is blended as load reports are).
pub struct OwnAtPoll {
    load: Arc<ExpertLoad>,
    worker: usize,
    own: Vec<i64>,
}

impl OwnAtPoll {
    pub fn load(&self) -> &Arc<ExpertLoad> {
        &self.load
    }
}

impl ExpertLoad {
    /// This router's own sums on `worker` now, to send with a load poll (None: no such worker).
    pub fn own_at_poll(self: &Arc<Self>, worker: usize) -> Option<OwnAtPoll> {
        let sums = self.log_sum.get(worker)?.lock().unwrap_or_else(|e| e.into_inner());
        Some(OwnAtPoll { load: Arc::clone(self), worker, own: sums.own.clone() })
    }

    /// Apply `worker`'s occupancy report: per cell (layer-major, `layout()` order) the share of
    /// its recent decode steps in which no request selected the expert. From now on the worker's
    /// cells read the report plus this router's requests since `at_poll` (started, minus ended).
    pub fn report_occupancy(&self, at_poll: &OwnAtPoll, idle: &[f64]) -> Result<(), OccupancyError> {
        if !std::ptr::eq(Arc::as_ptr(&at_poll.load), self) {
            return Err(OccupancyError::Changed);
        }
        let want = self.layer_ids.len() * self.experts;
        if idle.len() != want {
            return Err(OccupancyError::Cells { got: idle.len(), want });
        }
        if let Some(&bad) = idle.iter().find(|v| !(0.0..=1.0).contains(*v)) {
            return Err(OccupancyError::BadIdle(bad));
        }
        // an expert idle in none of the window's steps: as good as always used (exp(-64) ~ 0)
        // The others' share, never below none: a report can show requests we did not send, but
        // not that ours are gone (one just sent has not reached the worker yet, one just ended
        // has not been released here yet; both would read as negative use).
        let base = idle.iter().zip(&at_poll.own).map(|(&f, &own)| ((f.max(1e-12).ln() * LOG_SCALE).round() as i64 - own).min(0)).collect();
        self.set_report(at_poll.worker, Some(base));
        Ok(())
    }

    /// Forget `worker`'s occupancy report: its cells read this router's requests alone again.
    pub fn clear_occupancy(&self, worker: usize) -> Result<(), OccupancyError> {
        if worker >= self.num_workers() {
            return Err(OccupancyError::Worker { worker, workers: self.num_workers() });
        }
        self.set_report(worker, None);
        Ok(())
    }

    /// Whether `worker` routes on an occupancy report now.
    pub fn has_occupancy(&self, worker: usize) -> bool {
        self.log_sum.get(worker).is_some_and(|m| !m.lock().unwrap_or_else(|e| e.into_inner()).report.is_empty())
    }

    /// Install a report (its images of our requests end: it counts the others' real ones), or
    /// forget the last one (None; the images stay).
    pub(super) fn set_report(&self, worker: usize, report: Option<Vec<i64>>) {
        let (t, k) = (exp_tables(), self.workers);
        let mut sums = self.log_sum[worker].lock().unwrap_or_else(|e| e.into_inner());
        match report {
            None if sums.report.is_empty() => return,
            None => sums.report = Vec::new(),
            Some(r) => {
                sums.report = r;
                sums.mirror = Vec::new();
                sums.epoch += 1;
            }
        }
        let mut d = 0i64;
        for c in 0..sums.own.len() {
            let cell = &self.keep[c * k + worker];
            let (old, new) = (cell.load(Ordering::Relaxed) as i64, mass(t, sums.effective(c)));
            cell.store(new as u32, Ordering::Relaxed);
            d += old - new;
        }
        self.distinct[worker].0.fetch_add(d, Ordering::Release);
    }

}

impl ExpertProfile {
    /// [`Self::build_wire_json`], built on the first call and kept (64 us and 25 KB for
    /// DeepSeek-V3 at 8 selected layers: a failover's re-send costs nothing more).
    pub fn to_wire_json(&self) -> &str {
        self.wire.0.get_or_init(|| self.build_wire_json().into_boxed_str())
    }

    /// The profile as the decode request's `eldr_profile` field: `{"layers": [..], "experts":
    /// E, "cells": [..], "log_keep": [..]}`, cells layer-major over `layers`, `log_keep` in
    /// units of 2^-24 (a worker adds them per cell over its running requests; the sum's
    /// `exp(s / 2^24)` is the cell's idle share, what an occupancy report carries).
    pub(super) fn build_wire_json(&self) -> String {
        use std::fmt::Write;
        let mut s = String::with_capacity(48 + 4 * self.layer_ids.len() + 20 * self.cells.len());
        let list = |s: &mut String, it: &mut dyn Iterator<Item = i64>| {
            s.push('[');
            for (i, v) in it.enumerate() {
                if i > 0 {
                    s.push(',');
                }
                let _ = write!(s, "{v}");
            }
            s.push(']');
        };
        s.push_str("{\"layers\":");
        list(&mut s, &mut self.layer_ids.iter().map(|&v| v as i64));
        let _ = write!(s, ",\"experts\":{},\"cells\":", self.experts);
        list(&mut s, &mut self.cells.iter().map(|&v| v as i64));
        s.push_str(",\"log_keep\":");
        list(&mut s, &mut self.log_keep.iter().copied());
        s.push('}');
        s
    }
}
