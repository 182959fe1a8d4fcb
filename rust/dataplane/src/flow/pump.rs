//! Stage 5, the stream pump: the rest of the decode's answer to the client. After the first
//! byte a failure ends the client's stream with an error event.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

use super::drain::PrefillLeg;
use super::route::Lease;
use crate::config::{secs, Role};
use crate::counters::names;
use crate::errors::UpstreamError;
use crate::outlier::Attempt;
use crate::plane::Plane;
use crate::upstream::{next_chunk, Leg};

/// Stream the rest of the decode's answer to the client, each chunk within the stall
/// timeout. Owns every guard of the request: they are released when it ends, the client
/// going away included (its body is dropped, which closes the channel).
pub(crate) async fn pump(plane: Arc<Plane>, mut body: Incoming, tx: mpsc::Sender<Bytes>, mut attempt: Attempt, lease: Lease, prefill: Option<Arc<PrefillLeg>>, deadline: Instant) {
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
        None => attempt.success(),
    }
    drop(lease);
}
