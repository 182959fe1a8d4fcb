//! The client's request from its arrival to its answer: admitted (the bound on requests in
//! flight), its body read and parsed ([`super::body`]), then its attempts, each a prefill
//! ([`super::prefill`]) bound to a decode; the answer, or the refusal, counted by endpoint
//! and status.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use tokio::time::Instant;

use super::body::{discard, read_request, Kind};
use super::context::RequestCtx;
use super::prefill;
use crate::admission::{PermitBody, Rejected};
use crate::config::{secs, Role};
use crate::counters::names;
use crate::errors::{error_json, FlowError, UpstreamError};
use crate::outlier::Attempt;
use crate::plane::Plane;
use crate::response::{full, json_response, Body};

/// Serve one client request on an eldr endpoint (the server sends every other path to the
/// control plane).
pub async fn handle(plane: Arc<Plane>, kind: Kind, req: Request<Incoming>) -> Response<Body> {
    let t0 = Instant::now(); // the latency metrics count from here, as the client does
    let mut outcome = Outcome { plane: &plane, kind, status: None };
    let resp = match serve(&plane, kind, req, t0).await {
        Ok(r) => r,
        Err(e) => error_response(e),
    };
    outcome.status = Some(resp.status().as_u16());
    resp
}

async fn serve(plane: &Arc<Plane>, kind: Kind, req: Request<Incoming>, t0: Instant) -> Result<Response<Body>, FlowError> {
    let path = req.uri().path().to_owned();
    let clen = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok());
    let body = req.into_body();
    // Admitted before the body is read (issue 33): a refused request's body is never held;
    // it is read and dropped behind the answer, so the client can read it.
    let permit = match plane.admission.admit().await {
        Ok(p) => p,
        Err(why) => {
            let refused = overloaded_response(plane, why);
            discard(plane, body);
            return Ok(refused);
        }
    };
    let (base, client_stream, _held) = match read_request(plane, kind, body, clen).await {
        Err(FlowError::Overloaded(why)) => return Ok(overloaded_response(plane, why)),
        read => read?,
    };
    // the decode policy it is routed by (under an experiment, its block's arm, to its end)
    let arm = plane.arm();
    let deadline = Instant::now() + secs(plane.cfg.request_timeout_s);
    let req = RequestCtx { arm: &arm, path: &path, client_stream, deadline, t0, endpoint: kind.label() };
    let resp = attempts(plane, &req, &base).await?;
    Ok(resp.map(|b| PermitBody::wrap(b, permit)))
}

/// The request's attempts, each a prefill bound to a decode. Late binding re-sends a failed
/// prefill to another one (a failed decode moves to another decode inside, with the same
/// room). Early binding re-sends any failure before the client's first byte as the gateway
/// does: a fresh prefill and decode pair (a prefill already tried only when there is no
/// other) with a new room, after a back-off.
async fn attempts(plane: &Arc<Plane>, req: &RequestCtx<'_>, base: &Bytes) -> Result<Response<Body>, FlowError> {
    let _active = plane.budget.active();
    let mut tried: Vec<usize> = Vec::new();
    let mut tried_decode: Vec<usize> = Vec::new();
    let mut last: Option<UpstreamError> = None;
    let early = !req.arm.late;
    let attempts = if early { 1 + plane.cfg.retries as usize } else { plane.prefill.member_count().min(1 + plane.cfg.retries as usize) };
    for attempt in 0..attempts {
        let p = match plane.pick_prefill(&tried) {
            Some(p) => p,
            None if early && attempt > 0 => match plane.pick_prefill(&[]) {
                Some(p) => p,
                None => break,
            },
            None => break,
        };
        let signs = plane.prefill_signs(p);
        let role = last.as_ref().map_or(Role::Prefill, |e| e.role);
        if attempt > 0 && !plane.may_retry(role) {
            break;
        }
        if early && attempt > 0 {
            let wait = Duration::from_secs_f64(RESEND_BACKOFF_S * RESEND_BACKOFF_GROWTH.powi(attempt as i32 - 1));
            if Instant::now() + wait >= req.deadline {
                break;
            }
            tokio::time::sleep(wait).await;
        }
        if !tried.contains(&p) {
            tried.push(p);
        }
        let _retrying = (attempt > 0).then(|| {
            let cause = last.as_ref().and_then(|e| e.cause.clone()).unwrap_or_else(|| "error".into());
            plane.counters.inc(names::RETRIES, &[role.as_str(), &cause]);
            if role == Role::Decode {
                plane.counters.inc(names::DECODE_FAILOVERS, &[]);
            }
            plane.budget.retrying()
        });
        // the prefill worker's trial: in flight from here, charged or cleared by the attempt
        let trial = Attempt::start(&plane.prefill, p);
        match prefill::attempt(plane, req, base, trial, signs, &mut tried_decode).await {
            Ok(r) => return Ok(r),
            Err(FlowError::Upstream(e)) if e.is_retryable() => {
                last = Some(e);
                if Instant::now() >= req.deadline {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.map_or(FlowError::NoHealthyWorker, FlowError::Upstream))
}

/// Early binding's first re-send waits this long, each next one this many times longer (the
/// gateway's 50 ms x 1.5).
const RESEND_BACKOFF_S: f64 = 0.050;
const RESEND_BACKOFF_GROWTH: f64 = 1.5;

/// Counts the request by endpoint and status when it ends; a request whose future is
/// dropped (the client went away) counts as a disconnect with status 499.
struct Outcome<'a> {
    plane: &'a Plane,
    kind: Kind,
    status: Option<u16>,
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        let status = self.status.unwrap_or_else(|| {
            self.plane.counters.inc(names::DISCONNECTS, &[]);
            499
        });
        self.plane.counters.inc(names::REQUESTS, &[self.kind.label(), &status.to_string()]);
    }
}

pub fn error_response(e: FlowError) -> Response<Body> {
    match e {
        FlowError::Bad(b) => {
            let body = serde_json::to_vec(&serde_json::json!({"error": {"message": b.message, "type": "invalid_request_error"}})).expect("json");
            json_response(b.status, Bytes::from(body))
        }
        FlowError::Upstream(u) => {
            let ctype = u.content_type.as_deref().unwrap_or("application/json").split(';').next().unwrap_or("application/json").trim().to_owned();
            let mut r = Response::new(full(u.body));
            *r.status_mut() = StatusCode::from_u16(u.status).unwrap_or(StatusCode::BAD_GATEWAY);
            if let Ok(v) = HeaderValue::from_str(&ctype) {
                r.headers_mut().insert(CONTENT_TYPE, v);
            }
            r
        }
        FlowError::NoHealthyWorker => json_response(503, error_json("no healthy decode worker")),
        FlowError::Overloaded(why) => refusal(why, format!("the router is overloaded ({}): retry later", why.label())),
    }
}

/// What a refused client is told to wait before trying again (seconds): the queue turns over
/// in about one request's time, so a short wait, not a back-off the router cannot estimate.
const RETRY_AFTER_S: &str = "1";

/// A refused request's answer, with the router's limits in its message (429 when the queue is
/// full, 503 after the queue timeout; both with Retry-After).
fn overloaded_response(plane: &Plane, why: Rejected) -> Response<Body> {
    let a = &plane.admission;
    let msg = match why {
        Rejected::QueueFull => format!(
            "the router is overloaded: all {} request slots are busy and the wait queue ({}) is full; retry later (--max-concurrent-requests, --queue-size)",
            a.limit(), a.queue_size()),
        Rejected::QueueTimeout => format!(
            "the router is overloaded: no request slot of {} came free within the queue timeout of {} s; retry later (--queue-timeout-secs)",
            a.limit(), plane.cfg.queue_timeout_s),
        Rejected::BufferFull => format!(
            "the router is overloaded: the request bodies it holds would pass {} bytes; retry later (--max-buffered-bytes)",
            plane.bodies.limit()),
    };
    refusal(why, msg)
}

/// `{"error": {"message", "type": "overloaded", "code"}}` with its status and Retry-After.
fn refusal(why: Rejected, msg: String) -> Response<Body> {
    let body = serde_json::to_vec(&serde_json::json!({"error": {"message": msg, "type": "overloaded", "code": why.status()}})).expect("json");
    let mut r = json_response(why.status(), Bytes::from(body));
    r.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_S));
    r
}
