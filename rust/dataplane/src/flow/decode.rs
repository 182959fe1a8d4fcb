//! Stage 4, the decode leg: the request POSTed to the chosen decode worker with the
//! prefill's room. Until the client's first byte a failed decode is charged and the request
//! fails over to another decode (the prefill keeps the KV parked), unless the prefill went
//! away meanwhile: then it starts over from a prefill.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::Response;
use tokio::sync::mpsc;
use tokio::time::{timeout, timeout_at, Instant};

use super::drain::{kv_lost_error, PrefillLeg};
use super::pump::{pump, Timing};
use super::route::{Choice, Lease, Sig};
use crate::config::{secs, Role};
use crate::counters::{names, scan_chunk};
use crate::errors::{FlowError, UpstreamError};
use crate::outlier::Attempt;
use crate::plane::{ArmRef, Plane};
use crate::response::{full, Body, ChannelBody};
use crate::upstream::{next_chunk, Leg, ReqBody};

pub(crate) struct DecodeCtx<'a> {
    pub(crate) arm: &'a ArmRef,
    pub(crate) path: &'a str,
    pub(crate) room: u64,
    pub(crate) p: usize,
    pub(crate) dbody: &'a ReqBody,
    pub(crate) client_stream: bool,
    pub(crate) deadline: Instant,
    /// When the client's request arrived (the latency metrics count from it).
    pub(crate) t0: Instant,
    pub(crate) endpoint: &'static str,
}

pub(crate) async fn decode_with_failover(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, mut sig: Sig, prefill: &Arc<PrefillLeg>) -> Result<Response<Body>, FlowError> {
    let mut tried: Vec<usize> = Vec::new();
    let mut first: Option<UpstreamError> = None;
    let mut last_cause = String::new();
    for attempt in 0..plane.cfg.decode.len().min(1 + plane.cfg.retries as usize) {
        if attempt > 0 && !plane.may_retry(Role::Decode) {
            break;
        }
        let choice = match plane.route(ctx.arm, &sig, &tried) {
            Ok(c) => c,
            Err(e) if first.is_none() => return Err(e),
            Err(_) => break,
        };
        if sig.profile.is_none() {
            sig.profile = choice.profile.clone();
        }
        let _retrying = (attempt > 0).then(|| {
            plane.counters.inc(names::DECODE_FAILOVERS, &[]);
            plane.counters.inc(names::RETRIES, &["decode", &last_cause]);
            plane.budget.retrying()
        });
        tried.push(choice.worker);
        match decode(plane, ctx, &choice, Some(prefill)).await {
            Ok(r) => return Ok(r),
            Err(FlowError::Upstream(e)) if e.is_retryable() => {
                if e.role == Role::Prefill {
                    return Err(e.into()); // the KV is gone: start over from a prefill
                }
                last_cause = e.cause.clone().unwrap_or_default();
                first.get_or_insert(e);
                if Instant::now() >= ctx.deadline {
                    break;
                }
            }
            // a re-send refused (e.g. 409: the failed worker had taken the room's KV): the first failure is what went wrong
            Err(e) if first.is_none() => return Err(e),
            Err(_) => break,
        }
    }
    // not the prefill's fault: a plain upstream error (no prefill retry)
    Err(first.expect("at least one decode attempt").final_().into())
}

impl Plane {
    /// Charge decode worker `w` with a failure before the client's first byte, unless the
    /// prefill broke meanwhile: then the request starts over on another prefill.
    async fn blame(&self, attempt: &mut Attempt, cause: &str, prefill: Option<&Arc<PrefillLeg>>) -> Result<(), UpstreamError> {
        if let Some(leg) = prefill {
            if leg.drain.broke().await {
                self.counters.inc(names::WORKER_ERRORS, &["prefill", &leg.worker.to_string(), "kv_lost"]);
                return Err(kv_lost_error());
            }
        }
        attempt.failure(cause);
        Ok(())
    }
}

fn explain_headers(plane: &Plane, ctx: &DecodeCtx<'_>, choice: &Choice, r: &mut Response<Body>) {
    if !plane.cfg.explain_headers {
        return;
    }
    let h = r.headers_mut();
    let mut put = |k: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    };
    put("x-eldr-decode-worker", choice.worker.to_string());
    put("x-eldr-prefill-worker", ctx.p.to_string());
    put("x-eldr-reason", choice.reason.clone());
    put("x-eldr-bootstrap-room", ctx.room.to_string());
    if let Some(b) = &choice.band {
        put("x-eldr-band", b.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","));
    }
    if let Some(t) = &ctx.arm.tag {
        // the experiment's block and arm this request runs in, and whether it is warm-up
        put("x-eldr-experiment-block", t.block.to_string());
        put("x-eldr-experiment-arm", ctx.arm.label.to_owned());
        put("x-eldr-experiment-warmup", (t.warmup as u8).to_string());
    }
}

pub(crate) async fn decode(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, choice: &Choice, prefill: Option<&Arc<PrefillLeg>>) -> Result<Response<Body>, FlowError> {
    let w = choice.worker;
    let t_start = Instant::now();
    // the queue slot and the worker's trial are held from here to the answer's end (the pump
    // owns them once the stream is handed to the client)
    let lease = plane.lease(ctx.arm, w, choice.profile.as_ref());
    let attempt = Attempt::start(&plane.decode, w);
    let leg = DecodeLeg { choice, prefill, url: format!("{}{}", plane.cfg.decode[w], ctx.path), t_start };
    if ctx.client_stream {
        decode_streamed(plane, ctx, leg, lease, attempt).await
    } else {
        decode_whole(plane, ctx, leg, lease, attempt).await
    }
}

/// One decode attempt: the worker chosen, the prefill whose KV it takes, where it is sent
/// and when the attempt began (the first-byte timeout counts from it).
struct DecodeLeg<'a> {
    choice: &'a Choice,
    prefill: Option<&'a Arc<PrefillLeg>>,
    url: String,
    t_start: Instant,
}

/// A non-streamed answer: read whole (its KV take bounds the wait, see [`open_watched`]),
/// then counted and returned; a failure before it is whole may still fail over.
async fn decode_whole(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, d: DecodeLeg<'_>, lease: Lease, mut attempt: Attempt) -> Result<Response<Body>, FlowError> {
    let (w, prefill) = (d.choice.worker, d.prefill);
    let leg = Leg { role: Role::Decode, worker: w, counters: &plane.counters };
    let resp = match open_watched(plane, leg, &d.url, ctx.dbody.clone(), ctx.deadline, prefill).await {
        Ok(r) => r,
        Err(e) => {
            plane.blame(&mut attempt, e.cause.as_deref().unwrap_or("error"), prefill).await?;
            return Err(e.into());
        }
    };
    let ctype = resp.headers().get(CONTENT_TYPE).cloned();
    let data = match timeout_at(ctx.deadline, resp.into_body().collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        failed => {
            let (status, cause, what) = if failed.is_err() { (504, "total_timeout", "timeout") } else { (502, "stream", "stream error") };
            plane.blame(&mut attempt, cause, prefill).await?;
            return Err(UpstreamError::retryable(status, &format!("decode worker {w} answer cut: {what}"), Role::Decode, cause).into());
        }
    };
    attempt.success();
    if let Some(leg) = prefill {
        leg.keep_draining();
    }
    drop(lease);
    // non-streamed: the end-to-end time and the tokens are all that can be known
    let policy = ctx.arm.label;
    plane.counters.latency.decode(policy, w, ctx.endpoint).e2e.observe(ctx.t0.elapsed().as_secs_f64());
    if let (_, Some(n)) = scan_chunk(&data) {
        plane.counters.add(names::OUTPUT_TOKENS, &[policy, &w.to_string(), ctx.endpoint], n);
    }
    let mut r = Response::new(full(data));
    r.headers_mut().insert(CONTENT_TYPE, ctype.unwrap_or(HeaderValue::from_static("application/json")));
    explain_headers(plane, ctx, d.choice, &mut r);
    Ok(r)
}

/// A streamed answer: nothing reaches the client until the decode's first chunk, so until
/// then a failure is charged and the request can still move to another decode; from the
/// first chunk on, the pump owns the stream.
async fn decode_streamed(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, d: DecodeLeg<'_>, lease: Lease, mut attempt: Attempt) -> Result<Response<Body>, FlowError> {
    let (w, prefill) = (d.choice.worker, d.prefill);
    let leg = Leg { role: Role::Decode, worker: w, counters: &plane.counters };
    let first_byte = secs(plane.cfg.first_byte_timeout_s);
    // its response head first, within the short progress timeout: a decode at work sends it
    // before it runs anything (SGLang's StreamingResponse), so one that has not is hung, and
    // the request moves on long before a client gives up (issue 33: the 60 s first-byte
    // timeout outlasted 12 s clients, and a hung decode cost every request it met)
    let head = (secs(plane.cfg.decode_progress_timeout_s).min(first_byte), "progress");
    let resp = match plane.open(leg, &d.url, ctx.dbody.clone(), Some(head), ctx.deadline).await {
        Ok(r) => r,
        Err(e) => {
            plane.blame(&mut attempt, e.cause.as_deref().unwrap_or("error"), prefill).await?;
            return Err(e.into());
        }
    };
    let mut body = resp.into_body();
    let left = (d.t_start + first_byte).min(ctx.deadline).saturating_duration_since(Instant::now());
    let failed = match timeout(left, next_chunk(&mut body)).await {
        Ok(Ok(Some(first))) => {
            attempt.progress();
            let timing = Timing::first(plane, w, ctx.arm, ctx.t0, ctx.endpoint, &first);
            let head = &first[..first.len().min(8192)];
            if head.windows(7).any(|x| x == b"\"abort\"") {
                if let Some(leg) = prefill {
                    if leg.drain.broke().await {
                        return Err(kv_lost_error().into()); // aborted before any token: the KV is gone
                    }
                }
            }
            let (tx, rx) = mpsc::channel::<Bytes>(32);
            let _ = tx.try_send(first);
            tokio::spawn(pump(Arc::clone(plane), body, tx, attempt, lease, prefill.cloned(), ctx.deadline, timing));
            let mut r = Response::new(ChannelBody::boxed(rx));
            let h = r.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(hyper::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            explain_headers(plane, ctx, d.choice, &mut r);
            return Ok(r);
        }
        Ok(Ok(None)) => UpstreamError::retryable(502, &format!("decode worker {w} ended its stream without a byte"), Role::Decode, "empty"),
        Ok(Err(e)) => {
            leg.error("stream");
            UpstreamError::retryable(502, &format!("decode worker {w} stream failed: {e}"), Role::Decode, "stream")
        }
        Err(_) => {
            leg.timeout("first_byte");
            UpstreamError::retryable(504, &format!("decode worker {w} sent no first byte in {:.3} s", left.as_secs_f64()), Role::Decode, "first_byte_timeout")
        }
    };
    plane.blame(&mut attempt, failed.cause.as_deref().unwrap_or("error"), prefill).await?;
    Err(failed.into())
}

/// Open a non-streamed decode answer. It comes whole at the end, so no first byte can bound
/// it; the KV can: a decode at work takes the prefill's KV, which ends the prefill's stream,
/// within the first-byte timeout. One that has not by then is treated like a stream with
/// no first byte. Once the KV is taken, the request deadline bounds it.
async fn open_watched(plane: &Plane, leg: Leg<'_>, url: &str, body: ReqBody, deadline: Instant, prefill: Option<&Arc<PrefillLeg>>) -> Result<Response<Incoming>, UpstreamError> {
    let opening = plane.open(leg, url, body, None, deadline);
    tokio::pin!(opening);
    if let Some(leg_p) = prefill.filter(|l| !l.drain.done()) {
        let limit = secs(plane.cfg.first_byte_timeout_s).min(deadline.saturating_duration_since(Instant::now()));
        tokio::select! {
            r = &mut opening => return r,
            r = timeout(limit, leg_p.drain.wait_done()) => if r.is_err() {
                leg.timeout("first_byte");
                let w = leg.worker;
                return Err(UpstreamError::retryable(504, &format!("decode worker {w} took no KV in {:.3} s", limit.as_secs_f64()), Role::Decode, "first_byte_timeout"));
            }
        }
    }
    opening.await
}
