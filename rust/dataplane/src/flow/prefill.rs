//! Stage 2, the prefill leg: a prefill worker by the prefill policy (a failed one is
//! re-sent to another, with a new room), the request POSTed there, and its stream read
//! until the signature (or the signature timeout: then the fallback). Early binding
//! routes first and sends both legs at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eldr_core::payload::{DecodeLimits, DEFAULT_MAX_BYTES};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Response;
use serde_json::{Map, Value};
use tokio::time::{timeout, timeout_at, Instant};

use super::body::with_fields;
use super::decode::{decode, decode_with_failover, DecodeCtx};
use super::drain::{Background, Drain, PrefillLeg};
use super::route::Sig;
use crate::config::{secs, PrefillWorker, Role};
use crate::counters::{names, Histogram};
use crate::errors::{FlowError, UpstreamError};
use crate::outlier::Attempt;
use crate::plane::{ArmRef, Plane};
use crate::response::Body;
use crate::sse::{ended_message, inspect, sse_data, Found, Line, LineReader, MAX_EVENT_BYTES};
use crate::upstream::{Leg, ReqBody};

pub(crate) async fn route_request(plane: &Arc<Plane>, arm: &ArmRef, path: &str, base: &Bytes, client_stream: bool, t0: Instant, endpoint: &'static str) -> Result<Response<Body>, FlowError> {
    let deadline = Instant::now() + secs(plane.cfg.request_timeout_s);
    let _active = plane.budget.active();
    let mut tried: Vec<usize> = Vec::new();
    let mut tried_decode: Vec<usize> = Vec::new();
    let mut last: Option<UpstreamError> = None;
    // Late binding re-sends a failed prefill to another one (a failed decode moves to another
    // decode inside, with the same room). Early binding re-sends any failure before the
    // client's first byte as the gateway does: a fresh prefill and decode pair (a prefill
    // already tried only when there is no other) with a new room, after a back-off.
    let early = !arm.late;
    let attempts = if early { 1 + plane.cfg.retries as usize } else { plane.cfg.prefill.len().min(1 + plane.cfg.retries as usize) };
    for attempt in 0..attempts {
        let p = match plane.pick_prefill(&tried) {
            Some(p) => p,
            None if early && attempt > 0 => match plane.pick_prefill(&[]) {
                Some(p) => p,
                None => break,
            },
            None => break,
        };
        let role = last.as_ref().map_or(Role::Prefill, |e| e.role);
        if attempt > 0 && !plane.may_retry(role) {
            break;
        }
        if early && attempt > 0 {
            let wait = Duration::from_secs_f64(RESEND_BACKOFF_S * RESEND_BACKOFF_GROWTH.powi(attempt as i32 - 1));
            if Instant::now() + wait >= deadline {
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
        let ctx = Leg0 { arm, path, p, client_stream, deadline, t0, endpoint };
        match serve_with_prefill(plane, base, ctx, &mut tried_decode).await {
            Ok(r) => return Ok(r),
            Err(FlowError::Upstream(e)) if e.is_retryable() => {
                last = Some(e);
                if Instant::now() >= deadline {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.map_or(FlowError::NoHealthyWorker, FlowError::Upstream))
}

/// What one prefill attempt of a request knows.
struct Leg0<'a> {
    arm: &'a ArmRef,
    path: &'a str,
    p: usize,
    client_stream: bool,
    deadline: Instant,
    t0: Instant,
    endpoint: &'static str,
}

/// Early binding's first re-send waits this long, each next one this many times longer (the
/// gateway's 50 ms x 1.5).
const RESEND_BACKOFF_S: f64 = 0.050;
const RESEND_BACKOFF_GROWTH: f64 = 1.5;

/// One prefill attempt: a fresh bootstrap room, the bodies for both legs, then the request
/// bound early (decode chosen first, both legs at once) or late (decode chosen from the
/// prefill's signature).
async fn serve_with_prefill(plane: &Arc<Plane>, base: &Bytes, c: Leg0<'_>, tried_decode: &mut Vec<usize>) -> Result<Response<Body>, FlowError> {
    let Leg0 { arm, path, p, client_stream, deadline, t0, endpoint } = c;
    plane.counters.inc(names::PREFILL_ROUTES, &[&p.to_string()]);
    let w = &plane.cfg.prefill[p];
    let room = plane.rng.next_u64() >> 1; // 63 bits, as SGLang's bootstrap rooms
    // a late-binding arm whose prefill never streams a signature does not wait for one
    let no_sig = arm.late && plane.prefill_signs(p) == Some(false);
    let late = arm.late && !no_sig;
    let (dbody, pbody) = bootstrap_bodies(base, w, room, late, client_stream);
    let send = PrefillSend {
        url: format!("{}{}", w.url, path),
        body: pbody,
        attempt: Attempt::start(&plane.prefill, p),
        timing: plane.counters.latency.prefill(arm.label, endpoint),
    };
    let ctx = DecodeCtx { arm, path, room, p, dbody: &dbody, client_stream, deadline, t0, endpoint };
    if late {
        late_bound(plane, &ctx, send).await
    } else {
        early_bound(plane, &ctx, send, no_sig, tried_decode).await
    }
}

/// The request as each leg gets it, with the room's bootstrap fields: the decode streams as
/// the client asked; the prefill streams too when the signature is awaited from it.
fn bootstrap_bodies(base: &Bytes, w: &PrefillWorker, room: u64, late: bool, client_stream: bool) -> (ReqBody, ReqBody) {
    let mut boot = Map::new();
    boot.insert("bootstrap_host".into(), Value::String(w.host.clone()));
    boot.insert("bootstrap_port".into(), w.bootstrap_port.map_or(Value::Null, Value::from));
    boot.insert("bootstrap_room".into(), Value::from(room));
    boot.insert("stream".into(), Value::Bool(client_stream));
    let dbody = with_fields(base, &boot);
    boot.insert("stream".into(), Value::Bool(late || client_stream));
    (dbody, with_fields(base, &boot))
}

/// The prefill leg about to be sent: where, what, its worker's trial and its latency metric.
struct PrefillSend {
    url: String,
    body: ReqBody,
    attempt: Attempt,
    timing: Arc<Histogram>,
}

/// Early binding: the decode is chosen without a signature and both legs go at once.
async fn early_bound(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, send: PrefillSend, no_sig: bool, tried_decode: &mut Vec<usize>) -> Result<Response<Body>, FlowError> {
    let sig = Sig::none(no_sig.then_some("prefill_no_signature"), 0.0);
    // a decode that failed this request is not chosen again while another is left
    let decision = match plane.route(ctx.arm, &sig, tried_decode) {
        Ok(d) => d,
        Err(_) if !tried_decode.is_empty() => plane.route(ctx.arm, &sig, &[])?,
        Err(e) => return Err(e),
    };
    if !tried_decode.contains(&decision.worker) {
        tried_decode.push(decision.worker);
    }
    let PrefillSend { url, body, mut attempt, timing } = send;
    let (etx, mut erx) = tokio::sync::oneshot::channel();
    let early = {
        let plane = Arc::clone(plane);
        let deadline = ctx.deadline;
        let join = tokio::spawn(async move {
            let r = early_prefill(&plane, &url, body, deadline, &mut attempt, &timing).await;
            drop(attempt);
            let _ = etx.send(r);
        });
        Background::new(join)
    };
    // A failed prefill ends this attempt (the decode leg would wait for KV that never comes);
    // either leg's failure before the first byte is re-sent by the caller on a fresh pair.
    let dec = decode(plane, ctx, &decision, None);
    tokio::pin!(dec);
    let out = tokio::select! {
        r = &mut dec => r,
        Ok(Err(perr)) = &mut erx => Err(FlowError::Upstream(perr)),
    };
    if out.is_ok() {
        early.keep();
    }
    out
}

/// Late binding: the prefill's stream is read until its signature, which routes the decode;
/// the rest of the prefill's stream is drained in the background.
async fn late_bound(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, send: PrefillSend) -> Result<Response<Body>, FlowError> {
    let PrefillSend { url, body: pbody, mut attempt, timing } = send;
    let (p, deadline) = (ctx.p, ctx.deadline);
    let leg = Leg { role: Role::Prefill, worker: p, counters: &plane.counters };
    let t0 = Instant::now();
    let presp = match plane.open(leg, &url, pbody, Some((secs(plane.cfg.first_byte_timeout_s), "first_byte")), deadline).await {
        Ok(r) => r,
        Err(e) => {
            if let Some(c) = &e.cause {
                attempt.failure(c);
            }
            return Err(e.into());
        }
    };
    let mut body = presp.into_body();
    let remaining = deadline.saturating_duration_since(Instant::now());
    let limit = secs(plane.cfg.signature_timeout_s).min(remaining);
    let sig = match timeout(limit, await_signature(plane, &mut body, t0)).await {
        Err(_) => Sig::none(Some("timeout"), t0.elapsed().as_secs_f64()),
        Ok(Err(SigError::Stream(e))) => {
            leg.error("stream");
            attempt.failure("stream");
            return Err(UpstreamError::retryable(502, &format!("prefill worker {p} stream failed: {e}"), Role::Prefill, "stream").into());
        }
        Ok(Err(SigError::Ended(msg))) => {
            leg.error("no_signature");
            attempt.failure("ended");
            return Err(UpstreamError::retryable(502, &msg, Role::Prefill, "ended").into());
        }
        Ok(Ok(s)) => s,
    };
    attempt.success();
    plane.counters.sig_wait.observe(sig.wait_s);
    let prefill = Arc::new(PrefillLeg { worker: p, attempt: Mutex::new(attempt), drain: Drain::spawn(body, deadline, Some((timing, t0))) });
    let out = decode_with_failover(plane, ctx, sig, &prefill).await;
    if let Err(FlowError::Upstream(e)) = &out {
        if let (true, Some(c)) = (e.role == Role::Prefill, &e.cause) {
            prefill.attempt.lock().unwrap_or_else(|x| x.into_inner()).failure(c);
        }
    }
    out
}

async fn early_prefill(plane: &Plane, url: &str, body: ReqBody, deadline: Instant, attempt: &mut Attempt, timing: &Histogram) -> Result<(), UpstreamError> {
    let leg = Leg { role: Role::Prefill, worker: attempt.worker, counters: &plane.counters };
    let t0 = Instant::now();
    let resp = match plane.open(leg, url, body, None, deadline).await {
        Ok(r) => r,
        Err(e) => {
            if let Some(c) = &e.cause {
                attempt.failure(c);
            }
            return Err(e);
        }
    };
    match timeout_at(deadline, resp.into_body().collect()).await {
        Ok(Ok(_)) => {
            attempt.success();
            timing.observe(t0.elapsed().as_secs_f64());
            Ok(())
        }
        _ => {
            attempt.failure("stream");
            Err(UpstreamError::retryable(504, &format!("prefill worker {} failed", attempt.worker), Role::Prefill, "stream").final_())
        }
    }
}

enum SigError {
    Stream(hyper::Error),
    Ended(String),
}

/// Read prefill stream events until the signature; the rest is left for the drain. A line
/// over the bound is a malformed signature (the fallback), not a failed request.
async fn await_signature(plane: &Plane, body: &mut Incoming, t0: Instant) -> Result<Sig, SigError> {
    let layout = plane.layout();
    let limits = DecodeLimits { max_bytes: DEFAULT_MAX_BYTES, layout };
    let mut reader = LineReader::new(MAX_EVENT_BYTES);
    let mut last = None;
    loop {
        let line = match reader.next(body).await.map_err(SigError::Stream)? {
            None => return Err(SigError::Ended(ended_message(last.as_ref()))),
            Some(Line::TooLong) => {
                plane.counters.inc(names::MALFORMED, &[]);
                plane.warn_malformed(&format!("prefill stream line over {MAX_EVENT_BYTES} bytes: signature ignored"));
                return Ok(Sig::none(Some("malformed"), t0.elapsed().as_secs_f64()));
            }
            Some(Line::Data(l)) => l,
        };
        let Some(data) = sse_data(&line) else { continue };
        let found = match inspect(data, &limits, &mut last) {
            None => continue,
            Some(Found::Ended(msg)) => return Err(SigError::Ended(msg)),
            Some(f) => f,
        };
        let wait = t0.elapsed().as_secs_f64();
        return Ok(match found {
            Found::NoCounts(why) => {
                plane.warn_malformed(&format!("the prefill sent no counts: {}", label_safe(&why, 200)));
                Sig::none(Some("prefill_none"), wait) // its reason goes to the log, not the label
            }
            _ if layout.is_none() => Sig::none(Some("no_centroids"), wait),
            Found::Malformed(e) => {
                plane.counters.inc(names::MALFORMED, &[]);
                plane.warn_malformed(&format!("malformed signature payload: {}", label_safe(&e.to_string(), 200)));
                Sig::none(Some("malformed"), wait)
            }
            Found::Counts(c) => {
                plane.counters.sig_bytes.observe(c.data_bytes() as f64);
                Sig { counts: Some(c), reason: None, wait_s: wait, profile: None }
            }
            Found::Ended(_) => unreachable!(),
        });
    }
}

/// Printable ASCII, at most `n` characters (worker-given text in labels and logs).
pub fn label_safe(s: &str, n: usize) -> String {
    s.chars().take(n).map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect()
}
