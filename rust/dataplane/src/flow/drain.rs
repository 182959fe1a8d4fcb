//! The prefill's stream after its signature: read to its end in the background (closing it
//! early would abort the KV transfer). The prefill stage starts it; the decode stage asks it
//! whether the prefill, and its parked KV, went away.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{timeout, timeout_at, Instant};

use crate::config::Role;
use crate::counters::Histogram;
use crate::errors::UpstreamError;
use crate::outlier::Attempt;
use crate::upstream::next_chunk;

/// A background task that is aborted when its handle drops, unless kept.
pub(crate) struct Background {
    join: JoinHandle<()>,
    keep: AtomicBool,
}

impl Background {
    pub(crate) fn new(join: JoinHandle<()>) -> Background {
        Background { join, keep: AtomicBool::new(false) }
    }

    pub(crate) fn keep(&self) {
        self.keep.store(true, Ordering::Relaxed);
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if !self.keep.load(Ordering::Relaxed) {
            self.join.abort(); // drops the upstream response: closing it aborts the worker's request
        }
    }
}

const PENDING: u8 = 0;
const ENDED: u8 = 1;
const BROKE: u8 = 2;
const DEADLINE: u8 = 3;

/// The rest of the prefill's stream, read to its end (closing it early would abort the KV
/// transfer), at most until the request's deadline. Whether it broke says if the prefill
/// (and its parked KV) went away.
pub(crate) struct Drain {
    task: Background,
    state: watch::Receiver<u8>,
}

impl Drain {
    /// `timing`: the prefill leg's histogram and when the leg was sent, observed when the
    /// stream ends whole (the KV handed over).
    pub(crate) fn start(mut body: Incoming, deadline: Instant, timing: Option<(Arc<Histogram>, Instant)>) -> Drain {
        let (tx, rx) = watch::channel(PENDING);
        let join = tokio::spawn(async move {
            let read_all = async {
                while next_chunk(&mut body).await?.is_some() {}
                Ok::<(), hyper::Error>(())
            };
            let s = match timeout_at(deadline, read_all).await {
                Ok(Ok(())) => {
                    if let Some((h, t0)) = &timing {
                        h.observe(t0.elapsed().as_secs_f64());
                    }
                    ENDED
                }
                Ok(Err(_)) => BROKE,
                Err(_) => DEADLINE,
            };
            let _ = tx.send(s);
        });
        Drain { task: Background::new(join), state: rx }
    }

    pub(crate) fn done(&self) -> bool {
        *self.state.borrow() != PENDING
    }

    pub(crate) async fn wait_done(&self) {
        let mut rx = self.state.clone();
        let _ = rx.wait_for(|s| *s != PENDING).await;
    }

    /// Did the prefill's stream break? (A decode may notice a dead prefill a moment before
    /// the router does: wait for it briefly.)
    pub(crate) async fn broke(&self) -> bool {
        if !self.done() {
            let _ = timeout(Duration::from_millis(100), self.wait_done()).await;
        }
        *self.state.borrow() == BROKE
    }
}

/// The prefill side of a late-bound request: held until the decode's answer ends.
pub(crate) struct PrefillLeg {
    pub(crate) worker: usize,
    pub(crate) attempt: Mutex<Attempt>,
    pub(crate) drain: Drain,
}

impl PrefillLeg {
    /// The request succeeded: the prefill's last event may trail the decode's answer.
    pub(crate) fn keep_draining(&self) {
        self.drain.task.keep();
    }
}

pub(crate) fn kv_lost_error() -> UpstreamError {
    UpstreamError::retryable(502, "the prefill worker went away before the KV reached a decode worker", Role::Prefill, "kv_lost")
}
