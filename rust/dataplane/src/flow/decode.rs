//! Stage 4, the decode leg with failover: before each decode attempt the route stage
//! ([`super::route`]) chooses the worker; the request is POSTed there with the prefill's
//! room. Bound late, until the client's first byte a failed decode is charged and the
//! request fails over to another decode (the prefill keeps the KV parked), unless the
//! prefill went away meanwhile: then it starts over from a prefill. Bound early, the
//! prefill leg goes out beside the one decode attempt, and a failure of either is re-sent
//! by the request's attempts on a fresh pair. From the first byte on, the pump
//! ([`super::pump`]) owns the stream.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::Response;
use tokio::sync::oneshot;
use tokio::time::{timeout, timeout_at, Instant};

use super::drain::{kv_lost_error, Background, PrefillLeg};
use super::pump::{hand_over, Guards, Timing};
use super::context::RequestCtx;
use super::route::{choose_decode, lease_experts, DecodeChoice, ExpertLease, PrefillSignature};
use crate::config::{secs, Role};
use crate::counters::{names, scan_chunk};
use crate::errors::{FlowError, UpstreamError};
use crate::outlier::Attempt;
use crate::plane::Plane;
use crate::response::{full, Body};
use crate::upstream::{self, next_chunk, Leg, ReqBody};

/// The request bound to one prefill: the prefill worker, the bootstrap room its KV is
/// parked under, and the body every decode attempt is sent.
pub(crate) struct Bootstrap<'a> {
    pub(crate) req: &'a RequestCtx<'a>,
    pub(crate) prefill_worker: usize,
    pub(crate) room: u64,
    pub(crate) decode_body: &'a ReqBody,
}

/// The prefill leg as the decode stage sees it.
pub(crate) enum PrefillSide {
    /// Bound late: the prefill's stream past its signature (its KV parked until a decode
    /// takes it).
    Late(Arc<PrefillLeg>),
    /// Bound early: the prefill leg, not sent yet; it goes out with the decode attempt.
    Early(Option<UnsentPrefill>),
}

/// An early-bound prefill leg, ready to be sent (a future not yet polled); it ends with the
/// prefill's answer read whole, or its failure.
pub(crate) type UnsentPrefill = Pin<Box<dyn Future<Output = Result<(), UpstreamError>> + Send>>;

/// Route and decode, failing over to another decode until the client's first byte (bound
/// late: up to `retries` re-sends; bound early: one attempt, the re-sends are the request's).
/// `tried`: the decode workers that failed this request, not chosen again while another is
/// left. A late-bound prefill that went away meanwhile is charged here.
pub(crate) async fn decode_with_failover(plane: &Arc<Plane>, ctx: &Bootstrap<'_>, sig: PrefillSignature, mut prefill: PrefillSide, tried: &mut Vec<usize>) -> Result<Response<Body>, FlowError> {
    let out = failover(plane, ctx, sig, &mut prefill, tried).await;
    if let (PrefillSide::Late(leg), Err(FlowError::Upstream(e))) = (&prefill, &out) {
        if let (true, Some(c)) = (e.role == Role::Prefill, &e.cause) {
            leg.attempt.lock().unwrap_or_else(|x| x.into_inner()).failure(c);
        }
    }
    out
}

async fn failover(plane: &Arc<Plane>, ctx: &Bootstrap<'_>, mut sig: PrefillSignature, prefill: &mut PrefillSide, tried: &mut Vec<usize>) -> Result<Response<Body>, FlowError> {
    let early = matches!(prefill, PrefillSide::Early(_));
    let arm = ctx.req.arm;
    let mut first: Option<UpstreamError> = None;
    let mut last_cause = String::new();
    let attempts = if early { 1 } else { plane.decode.member_count().min(1 + plane.cfg.retries as usize) };
    for attempt in 0..attempts {
        if attempt > 0 && !plane.may_retry(Role::Decode) {
            break;
        }
        let choice = match choose_decode(plane, arm, &sig, tried) {
            Ok(c) => c,
            Err(_) if early && !tried.is_empty() => choose_decode(plane, arm, &sig, &[])?,
            Err(e) if first.is_none() => return Err(e),
            Err(_) => break,
        };
        // the expert lease and the worker's trial are held from here to the answer's end
        // (the pump owns them once the stream is handed to the client)
        let lease = lease_experts(plane, arm, choice.worker, choice.profile.as_ref());
        let trial = Attempt::start(&plane.decode, choice.worker);
        if sig.profile.is_none() {
            sig.profile = choice.profile.clone();
        }
        let _retrying = (attempt > 0).then(|| {
            plane.counters.inc(names::DECODE_FAILOVERS, &[]);
            plane.counters.inc(names::RETRIES, &["decode", &last_cause]);
            plane.budget.retrying()
        });
        if !tried.contains(&choice.worker) {
            tried.push(choice.worker);
        }
        let (leg, unsent) = match prefill {
            PrefillSide::Early(unsent) => (None, unsent.take()),
            PrefillSide::Late(leg) => (Some(&*leg), None),
        };
        let decoding = send_decode(plane, ctx, &choice, (lease, trial), leg);
        let out = match unsent {
            None => decoding.await,
            Some(unsent) => {
                // bound early: a failed prefill ends this attempt (the decode would wait for
                // KV that never comes)
                let (prefill, mut failed) = send_beside(unsent);
                tokio::pin!(decoding);
                let out = tokio::select! {
                    r = &mut decoding => r,
                    Ok(Err(e)) = &mut failed => Err(FlowError::Upstream(e)),
                };
                if out.is_ok() {
                    prefill.keep();
                }
                out
            }
        };
        if early {
            return out; // re-sent, if at all, by the request's attempts on a fresh pair
        }
        match out {
            Ok(r) => return Ok(r),
            Err(FlowError::Upstream(e)) if e.is_retryable() => {
                if e.role == Role::Prefill {
                    return Err(e.into()); // the KV is gone: start over from a prefill
                }
                last_cause = e.cause.clone().unwrap_or_default();
                first.get_or_insert(e);
                if Instant::now() >= ctx.req.deadline {
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

/// Early binding: the prefill leg sent beside the decode leg, in a task aborted when the
/// returned handle drops (unless kept); its outcome comes on the receiver.
fn send_beside(unsent: UnsentPrefill) -> (Background, oneshot::Receiver<Result<(), UpstreamError>>) {
    let (tx, rx) = oneshot::channel();
    let task = Background::new(tokio::spawn(async move {
        let _ = tx.send(unsent.await);
    }));
    (task, rx)
}

/// Charge decode worker `w` with a failure before the client's first byte, unless the
/// prefill broke meanwhile: then the request starts over on another prefill.
async fn blame(plane: &Plane, attempt: &mut Attempt, cause: &str, prefill: Option<&Arc<PrefillLeg>>) -> Result<(), UpstreamError> {
    if let Some(leg) = prefill {
        if leg.drain.broke().await {
            plane.counters.inc(names::WORKER_ERRORS, &["prefill", &leg.worker.to_string(), "kv_lost"]);
            return Err(kv_lost_error());
        }
    }
    attempt.failure(cause);
    Ok(())
}

fn explain_headers(plane: &Plane, ctx: &Bootstrap<'_>, choice: &DecodeChoice, h: &mut HeaderMap) {
    if !plane.cfg.explain_headers {
        return;
    }
    let mut put = |k: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    };
    put("x-eldr-decode-worker", choice.worker.to_string());
    put("x-eldr-prefill-worker", ctx.prefill_worker.to_string());
    put("x-eldr-reason", choice.reason.clone());
    put("x-eldr-bootstrap-room", ctx.room.to_string());
    if let Some(b) = &choice.band {
        put("x-eldr-band", b.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","));
    }
    if let Some(t) = &ctx.req.arm.tag {
        // the experiment's block and arm this request runs in, and whether it is warm-up
        put("x-eldr-experiment-block", t.block.to_string());
        put("x-eldr-experiment-arm", ctx.req.arm.label.to_owned());
        put("x-eldr-experiment-warmup", (t.warmup as u8).to_string());
    }
}

/// What a decode attempt holds from its route to the answer's end: the expert lease and the
/// worker's trial (the pump owns them once the stream is handed to the client).
type Held = (ExpertLease, Attempt);

/// One decode attempt on the chosen worker: the leg opened, then its answer read whole or
/// streamed as the client asked.
async fn send_decode(plane: &Arc<Plane>, ctx: &Bootstrap<'_>, choice: &DecodeChoice, (lease, mut attempt): Held, prefill: Option<&Arc<PrefillLeg>>) -> Result<Response<Body>, FlowError> {
    let w = choice.worker;
    let leg = DecodeLeg { choice, prefill, url: format!("{}{}", plane.decode.url(w), ctx.req.path), t_start: Instant::now() };
    // streamed, its response head first, within the short progress timeout: a decode at
    // work sends it before it runs anything (SGLang's StreamingResponse), so one that has
    // not is hung, and the request moves on long before a client gives up (issue 33: the
    // 60 s first-byte timeout outlasted 12 s clients, and a hung decode cost every request
    // it met)
    let first_byte = secs(plane.cfg.first_byte_timeout_s);
    let head = ctx.req.client_stream.then(|| (secs(plane.cfg.decode_progress_timeout_s).min(first_byte), "progress"));
    let resp = open_decode(plane, ctx, &leg, head, &mut attempt).await?;
    if !ctx.req.client_stream {
        decode_whole(plane, ctx, leg, resp, (lease, attempt)).await
    } else {
        decode_streamed(plane, ctx, leg, resp, (lease, attempt)).await
    }
}

/// One decode attempt: the worker chosen, the prefill whose KV it takes, where it is sent
/// and when the attempt began (the first-byte timeout counts from it).
struct DecodeLeg<'a> {
    choice: &'a DecodeChoice,
    prefill: Option<&'a Arc<PrefillLeg>>,
    url: String,
    t_start: Instant,
}

/// A non-streamed answer: read whole (its KV take bounds the wait, see [`open_decode`]),
/// then counted and returned; a failure before it is whole may still fail over.
async fn decode_whole(plane: &Arc<Plane>, ctx: &Bootstrap<'_>, d: DecodeLeg<'_>, resp: Response<Incoming>, (lease, mut attempt): Held) -> Result<Response<Body>, FlowError> {
    let (w, prefill) = (d.choice.worker, d.prefill);
    let ctype = resp.headers().get(CONTENT_TYPE).cloned();
    let data = match timeout_at(ctx.req.deadline, resp.into_body().collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        failed => {
            let (status, cause, what) = if failed.is_err() { (504, "total_timeout", "timeout") } else { (502, "stream", "stream error") };
            blame(plane, &mut attempt, cause, prefill).await?;
            return Err(UpstreamError::retryable(status, &format!("decode worker {w} answer cut: {what}"), Role::Decode, cause).into());
        }
    };
    attempt.success();
    if let Some(leg) = prefill {
        leg.keep_draining();
    }
    drop(lease);
    let e2e = ctx.req.t0.elapsed().as_secs_f64();
    let tokens = scan_chunk(&data).1;
    let mut r = Response::new(full(data));
    r.headers_mut().insert(CONTENT_TYPE, ctype.unwrap_or(HeaderValue::from_static("application/json")));
    explain_headers(plane, ctx, d.choice, r.headers_mut());
    // non-streamed: the end-to-end time and the tokens are all that can be known
    let policy = ctx.req.arm.label;
    plane.counters.latency.decode(policy, w, ctx.req.endpoint).e2e.observe(e2e);
    if let Some(n) = tokens {
        plane.counters.add(names::OUTPUT_TOKENS, &[policy, &w.to_string(), ctx.req.endpoint], n);
    }
    Ok(r)
}

/// A streamed answer: nothing reaches the client until the decode's first chunk, so until
/// then a failure is charged and the request can still move to another decode; from the
/// first chunk on, the pump owns the stream.
async fn decode_streamed(plane: &Arc<Plane>, ctx: &Bootstrap<'_>, d: DecodeLeg<'_>, resp: Response<Incoming>, (lease, mut attempt): Held) -> Result<Response<Body>, FlowError> {
    let (w, prefill) = (d.choice.worker, d.prefill);
    let leg = Leg { role: Role::Decode, worker: w, counters: &plane.counters };
    let first_byte = secs(plane.cfg.first_byte_timeout_s);
    let mut body = resp.into_body();
    let left = (d.t_start + first_byte).min(ctx.req.deadline).saturating_duration_since(Instant::now());
    let read = match timeout(left, next_chunk(&mut body)).await {
        Ok(Ok(Some(first))) => Ok(first),
        Ok(Ok(None)) => Err(UpstreamError::retryable(502, &format!("decode worker {w} ended its stream without a byte"), Role::Decode, "empty")),
        Ok(Err(e)) => {
            leg.error("stream");
            Err(UpstreamError::retryable(502, &format!("decode worker {w} stream failed: {e}"), Role::Decode, "stream"))
        }
        Err(_) => {
            leg.timeout("first_byte");
            Err(UpstreamError::retryable(504, &format!("decode worker {w} sent no first byte in {:.3} s", left.as_secs_f64()), Role::Decode, "first_byte_timeout"))
        }
    };
    let first = match read {
        Ok(first) => first,
        Err(failed) => {
            blame(plane, &mut attempt, failed.cause.as_deref().unwrap_or("error"), prefill).await?;
            return Err(failed.into());
        }
    };
    attempt.progress();
    let first_at = Instant::now(); // its time to first token
    let head = &first[..first.len().min(8192)];
    if head.windows(7).any(|x| x == b"\"abort\"") {
        if let Some(leg) = prefill {
            if leg.drain.broke().await {
                return Err(kv_lost_error().into()); // aborted before any token: the KV is gone
            }
        }
    }
    let mut r = Response::new(());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(hyper::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    explain_headers(plane, ctx, d.choice, r.headers_mut());
    // from here the pump owns the stream and every guard of the request
    let lat = plane.counters.latency.decode(ctx.req.arm.label, w, ctx.req.endpoint);
    let timing = Timing::first(lat, ctx.req.arm, (ctx.req.t0, first_at), ctx.req.endpoint, &first);
    let guards = Guards { attempt, lease, prefill: prefill.cloned() };
    Ok(r.map(|()| hand_over(plane, body, first, guards, ctx.req.deadline, timing)))
}

/// Whether decode worker `w` gets the request's expert profile (`eldr_profile`): the flag on,
/// and `w`'s last load poll carried an occupancy report, so it runs patch 0005 and sums the
/// profiles (an unpatched worker ignores the field, which for DeepSeek-V3 is 25 KB a request).
fn sends_profile(plane: &Plane, w: usize) -> bool {
    plane.cfg.forward_profile && plane.router.policy().expert_load().is_some_and(|l| l.has_occupancy(w))
}

/// Open the decode leg; a failure is charged to the worker (see [`blame`]). Streamed, its
/// response head is bounded by `head`. Not streamed (`head` None), the answer comes whole
/// at the end, so no first byte can bound it; the KV can: a decode at work takes the
/// prefill's KV, which ends the prefill's stream, within the first-byte timeout. One that
/// has not by then is treated like a stream with no first byte. Once the KV is taken, the
/// request deadline bounds it.
async fn open_decode(plane: &Plane, ctx: &Bootstrap<'_>, d: &DecodeLeg<'_>, head: Option<(Duration, &'static str)>, attempt: &mut Attempt) -> Result<Response<Incoming>, FlowError> {
    let leg = Leg { role: Role::Decode, worker: d.choice.worker, counters: &plane.counters };
    let deadline = ctx.req.deadline;
    let body = match &d.choice.profile {
        Some(p) if sends_profile(plane, d.choice.worker) => ctx.decode_body.with_field("eldr_profile", p.to_wire_json()),
        _ => ctx.decode_body.clone(),
    };
    let opening = upstream::post(&plane.client, &plane.decode, leg, &d.url, body, head, deadline);
    tokio::pin!(opening);
    let watched = d.prefill.filter(|l| head.is_none() && !l.drain.done());
    let opened = match watched {
        None => opening.await,
        Some(leg_p) => {
            let limit = secs(plane.cfg.first_byte_timeout_s).min(deadline.saturating_duration_since(Instant::now()));
            tokio::select! {
                r = &mut opening => r,
                r = timeout(limit, leg_p.drain.wait_done()) => match r {
                    Ok(()) => opening.await,
                    Err(_) => {
                        leg.timeout("first_byte");
                        let w = leg.worker;
                        Err(UpstreamError::retryable(504, &format!("decode worker {w} took no KV in {:.3} s", limit.as_secs_f64()), Role::Decode, "first_byte_timeout"))
                    }
                },
            }
        }
    };
    match opened {
        Ok(r) => Ok(r),
        Err(e) => {
            blame(plane, attempt, e.cause.as_deref().unwrap_or("error"), d.prefill).await?;
            Err(e.into())
        }
    }
}
