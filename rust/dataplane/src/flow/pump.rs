//! Stage 5, the stream pump: the rest of the decode's answer to the client. After the first
//! byte a failure ends the client's stream with an error event.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

use super::drain::PrefillLeg;
use super::route::ExpertLease;
use crate::config::{secs, Role};
use crate::counters::{names, scan_chunk, Latency};
use crate::errors::UpstreamError;
use crate::outlier::Attempt;
use crate::plane::{Plane, RequestArm};
use crate::response::{Body, ChannelBody};
use crate::upstream::{next_chunk, Leg};

/// A streamed answer's timing: the latency metrics of its (policy, decode worker, endpoint),
/// when the request came and its first and latest token chunks, the SSE events seen and the
/// last `completion_tokens` count. Per chunk: a timestamp, a counter and one scan.
pub(crate) struct Timing {
    lat: Arc<Latency>,
    /// The request's experiment tag (its block's statistics take its TPOT; held to the end).
    tag: Option<Arc<crate::experiment::Tag>>,
    policy: &'static str,
    endpoint: &'static str,
    t0: Instant,
    t_first: Instant,
    t_last: Instant,
    events: u64,
    tokens: Option<u64>,
}

impl Timing {
    /// The decode's first chunk, about to go to the client: its time to first token, into
    /// `lat`, the latency metrics of (the arm's policy, the decode worker, `endpoint`).
    /// `t0` is when the client's request arrived, `now` when the chunk came.
    pub(crate) fn first(lat: Arc<Latency>, arm: &RequestArm, (t0, now): (Instant, Instant), endpoint: &'static str, chunk: &[u8]) -> Timing {
        let policy = arm.label;
        lat.ttft.observe((now - t0).as_secs_f64());
        let (events, tokens) = scan_chunk(chunk);
        Timing { lat, tag: arm.tag.clone(), policy, endpoint, t0, t_first: now, t_last: now, events, tokens }
    }

    fn chunk(&mut self, chunk: &[u8]) {
        let (n, tokens) = scan_chunk(chunk);
        if tokens.is_some() {
            self.tokens = tokens;
        }
        if n > 0 {
            let now = Instant::now();
            self.lat.itl.observe((now - self.t_last).as_secs_f64());
            self.t_last = now;
            self.events += n;
        }
    }

    /// The answer ended whole: end to end, time per output token ((last - first) / (tokens
    /// - 1), tokens from SGLang's count when it sent one, else the events), the tokens.
    fn end(&self, plane: &Plane, worker: usize) {
        self.lat.e2e.observe(self.t0.elapsed().as_secs_f64());
        let tokens = self.tokens.unwrap_or(self.events);
        if tokens >= 2 {
            let tpot = (self.t_last - self.t_first).as_secs_f64() / (tokens - 1) as f64;
            self.lat.tpot.observe(tpot);
            if let Some(t) = &self.tag {
                t.record_tpot(tpot);
            }
        }
        plane.counters.add(names::OUTPUT_TOKENS, &[self.policy, &worker.to_string(), self.endpoint], tokens);
    }
}

/// Every guard of a request the pump holds to the answer's end: the decode worker's trial,
/// the expert lease, and the prefill side of a late-bound request.
pub(crate) struct Guards {
    pub(crate) attempt: Attempt,
    pub(crate) lease: ExpertLease,
    pub(crate) prefill: Option<Arc<PrefillLeg>>,
}

/// The decode's first chunk came: from here the pump owns the stream. The chunk, then the
/// rest as it comes, go to the client through a channel, whose receiving end is the
/// returned body; a task reads the decode.
pub(crate) fn hand_over(plane: &Arc<Plane>, body: Incoming, first: Bytes, guards: Guards, deadline: Instant, timing: Timing) -> Body {
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let _ = tx.try_send(first);
    tokio::spawn(pump(Arc::clone(plane), body, tx, guards, deadline, timing));
    ChannelBody::boxed(rx)
}

/// Stream the rest of the decode's answer to the client, each chunk within the stall
/// timeout. Owns every guard of the request: they are released when it ends, the client
/// going away included (its body is dropped, which closes the channel).
async fn pump(plane: Arc<Plane>, mut body: Incoming, tx: mpsc::Sender<Bytes>, guards: Guards, deadline: Instant, mut timing: Timing) {
    let Guards { mut attempt, lease, prefill } = guards;
    let w = attempt.worker;
    let leg = Leg { role: Role::Decode, worker: w, counters: &plane.counters };
    let stall = secs(plane.cfg.stall_timeout_s);
    let mut failed: Option<UpstreamError> = None;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let (limit, phase) = if stall < remaining { (stall, "stall") } else { (remaining, "total") };
        let next = tokio::select! {
            _ = tx.closed() => None,
            r = timeout(limit, next_chunk(&mut body)) => Some(r),
        };
        match next {
            None => {
                plane.counters.inc(names::DISCONNECTS, &[]);
                return; // the client went away: no verdict on the worker; guards drop
            }
            Some(Err(_)) => {
                leg.timeout(phase);
                failed = Some(UpstreamError::retryable(504, &format!("decode worker {w} sent no next chunk in {:.3} s", limit.as_secs_f64()), Role::Decode, format!("{phase}_timeout")));
                break;
            }
            Some(Ok(Err(e))) => {
                leg.error("stream");
                failed = Some(UpstreamError::retryable(502, &format!("decode worker {w} stream failed: {e}"), Role::Decode, "stream"));
                break;
            }
            Some(Ok(Ok(None))) => break,
            Some(Ok(Ok(Some(c)))) => {
                timing.chunk(&c);
                if tx.send(c).await.is_err() {
                    plane.counters.inc(names::DISCONNECTS, &[]);
                    return;
                }
            }
        }
    }
    if let Some(leg) = &prefill {
        leg.keep_draining();
    }
    match failed {
        Some(f) => {
            attempt.failure(f.cause.as_deref().unwrap_or("stream"));
            let mut ev = Vec::with_capacity(f.body.len() + 8);
            ev.extend_from_slice(b"data: ");
            ev.extend_from_slice(&f.body);
            ev.extend_from_slice(b"\n\n");
            let _ = tx.send(Bytes::from(ev)).await;
        }
        None => {
            attempt.success();
            timing.end(&plane, w);
        }
    }
    drop(lease);
}
