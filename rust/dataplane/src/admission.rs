//! Admission control: a bound on the requests in flight through the router, a bounded wait
//! queue in front of it, and a queue timeout (the SGLang gateway's `--max-concurrent-requests`,
//! `--queue-size`, `--queue-timeout-secs`; here a FIFO tokio semaphore, so the oldest waiter
//! is admitted first).
//!
//! Past the bound the router answers at once instead of passing the load on to workers that
//! would fall behind, time out and be ejected: a full queue is a 429, a wait past the queue
//! timeout a 503, both JSON with `Retry-After`. A permit is held until the response body has
//! been sent or dropped (the client went away), so streamed answers count for as long as they
//! stream. A waiter whose client goes away drops its future, which frees its queue place and
//! its turn in the semaphore. A request is admitted before its body is read, and the body
//! bytes held at once over all requests are bounded ([`BodyBudget`], `--max-buffered-bytes`).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::counters::{names, Counters};
use crate::response::{Body, BoxError};

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// Every slot busy and the wait queue full: answered at once.
    QueueFull,
    /// Waited the queue timeout without a slot.
    QueueTimeout,
    /// The request bodies held at once would pass `--max-buffered-bytes`.
    BufferFull,
}

impl Rejected {
    pub fn label(self) -> &'static str {
        match self {
            Rejected::QueueFull => "queue_full",
            Rejected::QueueTimeout => "queue_timeout",
            Rejected::BufferFull => "buffer_full",
        }
    }
    pub fn status(self) -> u16 {
        match self {
            Rejected::QueueFull => 429,
            Rejected::QueueTimeout | Rejected::BufferFull => 503,
        }
    }
}

pub struct Admission {
    /// None: admission control off (`--max-concurrent-requests 0`).
    slots: Option<Arc<Semaphore>>,
    limit: usize,
    queue_size: usize,
    queue_timeout: Duration,
    waiting: Arc<AtomicUsize>,
    counters: Arc<Counters>,
}

/// One admitted request's slot: released on drop.
pub struct Permit(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// A place in the wait queue, given back on drop (admitted, timed out, or the client gone).
struct Waiting(Arc<AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(limit: usize, queue_size: usize, queue_timeout: Duration, counters: Arc<Counters>) -> Self {
        Admission {
            slots: (limit > 0).then(|| Arc::new(Semaphore::new(limit))),
            limit,
            queue_size,
            queue_timeout,
            waiting: Arc::new(AtomicUsize::new(0)),
            counters,
        }
    }

    /// A slot now, or after waiting in the queue; a rejection when the queue is full or the
    /// wait runs past the queue timeout.
    pub async fn admit(&self) -> Result<Permit, Rejected> {
        let Some(slots) = &self.slots else { return Ok(Permit(None)) };
        if let Ok(p) = Arc::clone(slots).try_acquire_owned() {
            self.counters.inc(names::ADMITTED, &["immediate"]);
            return Ok(Permit(Some(p)));
        }
        // Reserve a queue place first, so the queue never holds more than queue_size.
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queue_size {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(self.reject(Rejected::QueueFull));
        }
        let _place = Waiting(Arc::clone(&self.waiting));
        self.counters.inc(names::QUEUED, &[]);
        match tokio::time::timeout(self.queue_timeout, Arc::clone(slots).acquire_owned()).await {
            Ok(Ok(p)) => {
                self.counters.inc(names::ADMITTED, &["queued"]);
                Ok(Permit(Some(p)))
            }
            // the semaphore is never closed; a timeout is the only other way out
            _ => Err(self.reject(Rejected::QueueTimeout)),
        }
    }

    pub(crate) fn reject(&self, why: Rejected) -> Rejected {
        self.counters.inc(names::REJECTED, &[why.label()]);
        why
    }

    pub fn enabled(&self) -> bool {
        self.slots.is_some()
    }

    /// The bound (0: off).
    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn queue_size(&self) -> usize {
        self.queue_size
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.slots.as_ref().map_or(0, |s| self.limit - s.available_permits())
    }

    /// Requests waiting in the queue now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Every slot taken (new requests wait or are refused).
    pub fn saturated(&self) -> bool {
        self.slots.as_ref().is_some_and(|s| s.available_permits() == 0)
    }
}

/// The bound on the bytes of request bodies the router holds at once, over all connections
/// (issue 33: 100 connections each holding 7.9 MB less a byte took it from 101 to 914 MB).
pub struct BodyBudget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

/// Bytes of the budget one request holds, given back on drop.
pub struct Reserved {
    used: Arc<AtomicUsize>,
    n: usize,
    limit: usize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Self {
        BodyBudget { used: Arc::new(AtomicUsize::new(0)), limit }
    }
    /// An empty reservation, grown as the body arrives.
    pub fn start(&self) -> Reserved {
        Reserved { used: Arc::clone(&self.used), n: 0, limit: self.limit }
    }
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl Reserved {
    /// `n` more bytes, or false (nothing taken) when they would pass the bound.
    pub fn grow(&mut self, n: usize) -> bool {
        let ok = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(n).filter(|&t| t <= self.limit)).is_ok();
        if ok {
            self.n += n;
        }
        ok
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.used.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// A response body that holds its request's admission slot until it has been sent in full
/// or dropped.
pub struct PermitBody {
    inner: Body,
    _permit: Permit,
}

impl PermitBody {
    pub fn wrap(inner: Body, permit: Permit) -> Body {
        if permit.0.is_none() {
            return inner;
        }
        PermitBody { inner, _permit: permit }.boxed()
    }
}

impl hyper::body::Body for PermitBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adm(limit: usize, queue: usize, timeout_ms: u64) -> (Admission, Arc<Counters>) {
        let c = Arc::new(Counters::default());
        (Admission::new(limit, queue, Duration::from_millis(timeout_ms), Arc::clone(&c)), c)
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn bound_queue_and_timeout() {
        let (a, c) = adm(2, 1, 100);
        let p1 = a.admit().await.unwrap();
        let _p2 = a.admit().await.unwrap();
        assert!(a.saturated());
        assert_eq!(a.in_flight(), 2);
        // the third waits; the fourth finds the queue full
        let a = Arc::new(a);
        let a3 = Arc::clone(&a);
        let third = tokio::spawn(async move { a3.admit().await });
        tokio::task::yield_now().await;
        assert_eq!(a.waiting(), 1);
        assert_eq!(a.admit().await.err(), Some(Rejected::QueueFull));
        // a slot freed: the waiter gets it
        drop(p1);
        let _p3 = third.await.unwrap().expect("the waiter is admitted");
        assert_eq!(a.waiting(), 0);
        // nothing frees: the waiter times out, and its place is given back
        let r = a.admit();
        assert_eq!(r.await.err(), Some(Rejected::QueueTimeout));
        assert_eq!(a.waiting(), 0);
        assert_eq!(c.get(names::ADMITTED, &["immediate"]), 2);
        assert_eq!(c.get(names::ADMITTED, &["queued"]), 1);
        assert_eq!(c.get(names::QUEUED, &[]), 2);
        assert_eq!(c.get(names::REJECTED, &["queue_full"]), 1);
        assert_eq!(c.get(names::REJECTED, &["queue_timeout"]), 1);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_waiter_that_goes_away_frees_its_place() {
        let (a, _) = adm(1, 1, 10_000);
        let held = a.admit().await.unwrap();
        {
            let w = a.admit();
            tokio::pin!(w);
            // poll it once so it is queued, then drop it (the client went away)
            assert!(futures_poll_once(w.as_mut()).await.is_none());
            assert_eq!(a.waiting(), 1);
        }
        assert_eq!(a.waiting(), 0);
        drop(held);
        assert_eq!(a.in_flight(), 0);
        assert!(a.admit().await.is_ok());
    }

    #[test]
    fn body_bytes_held_at_once_are_bounded() {
        let b = BodyBudget::new(100);
        let mut r1 = b.start();
        assert!(r1.grow(60));
        let mut r2 = b.start();
        assert!(!r2.grow(41), "past the bound: refused, nothing taken");
        assert!(r2.grow(40));
        assert_eq!(b.used(), 100);
        drop(r1);
        assert_eq!(b.used(), 40);
        assert!(r2.grow(60));
        drop(r2);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn off_admits_everything() {
        let (a, _) = adm(0, 0, 1);
        for _ in 0..1000 {
            std::mem::forget(a.admit().await.unwrap());
        }
        assert!(!a.enabled() && !a.saturated());
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
        let mut f = f;
        std::future::poll_fn(|cx| Poll::Ready(match Pin::new(&mut f).poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        }))
        .await
    }
}
