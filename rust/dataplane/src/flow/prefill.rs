//! Stage 2, the prefill leg of one attempt: a fresh bootstrap room and the bodies for both
//! legs; bound late, the request POSTed to the prefill worker and its stream read until
//! the signature (or the signature timeout: then the fallback), the rest drained in the
//! background; bound early, the prefill leg made ready to go out beside the decode's. Then
//! the decode stage ([`super::decode`]), which routes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eldr_core::payload::{DecodeLimits, DEFAULT_MAX_BYTES};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Response;
use serde_json::{Map, Value};
use tokio::time::{timeout, timeout_at, Instant};

use super::decode::{decode_with_failover, Bootstrap, PrefillSide, UnsentPrefill};
use super::drain::{Drain, PrefillLeg};
use super::context::RequestCtx;
use super::route::PrefillSignature;
use crate::config::{secs, PrefillWorker, Role};
use crate::counters::{names, Histogram};
use crate::errors::{FlowError, UpstreamError};
use crate::outlier::Attempt;
use crate::plane::Plane;
use crate::response::Body;
use crate::sse::{ended_message, inspect, sse_data, Found, Line, LineReader, MAX_EVENT_BYTES};
use crate::upstream::{self, Leg, ReqBody};

/// One attempt on the prefill worker of `trial` (`signs`: whether it streams a signature,
/// when known): a fresh bootstrap room, the bodies for both legs, the prefill leg sent and
/// its signature awaited (bound late) or made ready to go out beside the decode's (bound
/// early), then the decode stage, which routes. `tried_decode`: the decode workers that
/// failed this request's early-bound attempts.
pub(crate) async fn attempt(plane: &Arc<Plane>, req: &RequestCtx<'_>, base: &Bytes, trial: Attempt, signs: Option<bool>, tried_decode: &mut Vec<usize>) -> Result<Response<Body>, FlowError> {
    let p = trial.worker;
    plane.counters.inc(names::PREFILL_ROUTES, &[&p.to_string()]);
    let w = plane.prefill_worker(p);
    let room = plane.rng.next_u64() >> 1; // 63 bits, as SGLang's bootstrap rooms
    // a late-binding arm whose prefill never streams a signature does not wait for one
    let no_sig = req.arm.late && signs == Some(false);
    let late = req.arm.late && !no_sig;
    let (decode_body, prefill_body) = bootstrap_bodies(base, &w, room, late, req.client_stream);
    let send = PrefillSend {
        url: format!("{}{}", w.url, req.path),
        body: prefill_body,
        attempt: trial,
        timing: plane.counters.latency.prefill(req.arm.label, req.endpoint),
    };
    let ctx = Bootstrap { req, prefill_worker: p, room, decode_body: &decode_body };
    let mut own_tried = Vec::new();
    let (sig, prefill, tried) = if late {
        // a failed decode moves to another decode with the same room: its own tried list
        let (sig, leg) = signature(plane, &ctx, send).await?;
        (sig, PrefillSide::Late(leg), &mut own_tried)
    } else {
        let sig = PrefillSignature::none(no_sig.then_some("prefill_no_signature"), 0.0);
        (sig, PrefillSide::Early(Some(early_prefill(plane, send, req.deadline))), tried_decode)
    };
    decode_with_failover(plane, &ctx, sig, prefill, tried).await
}

/// The request as each leg gets it, with the room's bootstrap fields: the decode streams as
/// the client asked; the prefill streams too when the signature is awaited from it.
fn bootstrap_bodies(base: &Bytes, w: &PrefillWorker, room: u64, late: bool, client_stream: bool) -> (ReqBody, ReqBody) {
    let mut boot = Map::new();
    boot.insert("bootstrap_host".into(), Value::String(w.host.clone()));
    boot.insert("bootstrap_port".into(), w.bootstrap_port.map_or(Value::Null, Value::from));
    boot.insert("bootstrap_room".into(), Value::from(room));
    boot.insert("stream".into(), Value::Bool(client_stream));
    let decode_body = with_fields(base, &boot);
    boot.insert("stream".into(), Value::Bool(late || client_stream));
    (decode_body, with_fields(base, &boot))
}

/// `base` (a compact JSON object from [`super::body::parse_body`]) with `fields` set, without re-encoding
/// or copying it: the body shares `base` and owns only the fields.
pub fn with_fields(base: &Bytes, fields: &Map<String, Value>) -> ReqBody {
    let mut extra = serde_json::to_vec(fields).expect("json");
    if &base[..] == b"{}" || base.len() < 2 {
        return ReqBody::from(Bytes::from(extra));
    }
    if extra.len() > 2 {
        extra[0] = b','; // `{"a":1}` + `{"f":2}` -> `{"a":1` + `,"f":2}`
    } else {
        extra.remove(0); // no fields: `}`
    }
    ReqBody::new(base.slice(..base.len() - 1), Bytes::from(extra))
}

/// The prefill leg about to be sent: where, what, its worker's trial and its latency metric.
struct PrefillSend {
    url: String,
    body: ReqBody,
    attempt: Attempt,
    timing: Arc<Histogram>,
}

/// Late binding: the prefill leg sent and its stream read until its signature, which
/// routes the decode; the rest of the prefill's stream is drained in the background.
async fn signature(plane: &Arc<Plane>, ctx: &Bootstrap<'_>, send: PrefillSend) -> Result<(PrefillSignature, Arc<PrefillLeg>), FlowError> {
    let PrefillSend { url, body: prefill_body, mut attempt, timing } = send;
    let (p, deadline) = (ctx.prefill_worker, ctx.req.deadline);
    let leg = Leg { role: Role::Prefill, worker: p, counters: &plane.counters };
    let t0 = Instant::now();
    let presp = open_prefill(plane, leg, &url, prefill_body, Some((secs(plane.cfg.first_byte_timeout_s), "first_byte")), deadline, &mut attempt).await?;
    let mut body = presp.into_body();
    let remaining = deadline.saturating_duration_since(Instant::now());
    let limit = secs(plane.cfg.signature_timeout_s).min(remaining);
    let sig = match timeout(limit, await_signature(plane, &mut body, t0)).await {
        Err(_) => PrefillSignature::none(Some("timeout"), t0.elapsed().as_secs_f64()),
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
    let prefill = Arc::new(PrefillLeg { worker: p, attempt: Mutex::new(attempt), drain: Drain::start(body, deadline, Some((timing, t0))) });
    Ok((sig, prefill))
}

/// Open a prefill leg; a failure is charged to its worker.
async fn open_prefill(plane: &Plane, leg: Leg<'_>, url: &str, body: ReqBody, head: Option<(Duration, &'static str)>, deadline: Instant, attempt: &mut Attempt) -> Result<Response<Incoming>, UpstreamError> {
    let pool = &plane.prefill;
    upstream::post(&plane.client, pool, leg, url, body, head, deadline).await.inspect_err(|e| {
        if let Some(c) = &e.cause {
            attempt.failure(c);
        }
    })
}

/// Early binding's prefill leg, not sent yet: when polled it is sent and its answer read
/// whole (the KV handed over), which charges or clears its worker.
fn early_prefill(plane: &Arc<Plane>, send: PrefillSend, deadline: Instant) -> UnsentPrefill {
    let plane = Arc::clone(plane);
    Box::pin(async move {
        let PrefillSend { url, body, mut attempt, timing } = send;
        let r = send_early_prefill(&plane, &url, body, deadline, &mut attempt, &timing).await;
        drop(attempt);
        r
    })
}

async fn send_early_prefill(plane: &Plane, url: &str, body: ReqBody, deadline: Instant, attempt: &mut Attempt, timing: &Histogram) -> Result<(), UpstreamError> {
    let leg = Leg { role: Role::Prefill, worker: attempt.worker, counters: &plane.counters };
    let t0 = Instant::now();
    let resp = open_prefill(plane, leg, url, body, None, deadline, attempt).await?;
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
async fn await_signature(plane: &Plane, body: &mut Incoming, t0: Instant) -> Result<PrefillSignature, SigError> {
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
                return Ok(PrefillSignature::none(Some("malformed"), t0.elapsed().as_secs_f64()));
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
                PrefillSignature::none(Some("prefill_none"), wait) // its reason goes to the log, not the label
            }
            _ if layout.is_none() => PrefillSignature::none(Some("no_centroids"), wait),
            Found::Malformed(e) => {
                plane.counters.inc(names::MALFORMED, &[]);
                plane.warn_malformed(&format!("malformed signature payload: {}", label_safe(&e.to_string(), 200)));
                PrefillSignature::none(Some("malformed"), wait)
            }
            Found::Counts(c) => {
                plane.counters.sig_bytes.observe(c.data_bytes() as f64);
                PrefillSignature { counts: Some(c), reason: None, wait_s: wait, profile: None }
            }
            Found::Ended(_) => unreachable!(),
        });
    }
}

/// Printable ASCII, at most `n` characters (worker-given text in labels and logs).
pub fn label_safe(s: &str, n: usize) -> String {
    s.chars().take(n).map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::body::{parse_body, Kind};

    #[test]
    fn router_fields_are_replaced_not_duplicated() {
        let (base, stream) = parse_body(Kind::Generate, br#"{"text":"a","bootstrap_room":5,"stream":true}"#).unwrap();
        assert!(stream);
        let mut f = Map::new();
        f.insert("bootstrap_room".into(), Value::from(7));
        let out: Value = serde_json::from_slice(&with_fields(&base, &f).to_vec()).unwrap();
        assert_eq!(out, serde_json::json!({"text": "a", "bootstrap_room": 7}));
        assert_eq!(&with_fields(&Bytes::from_static(b"{}"), &f).to_vec()[..], br#"{"bootstrap_room":7}"#);
        assert_eq!(&with_fields(&base, &Map::new()).to_vec()[..], br#"{"text":"a"}"#);
        // the legs share the client's bytes: the body's head is a view of `base`, not a copy
        let (big, _) = parse_body(Kind::Generate, format!(r#"{{"text":"{}"}}"#, "x".repeat(1 << 20)).as_bytes()).unwrap();
        let leg = with_fields(&big, &f);
        assert_eq!(leg.len(), big.len() + r#","bootstrap_room":7"#.len());
        assert!(leg.to_vec().ends_with(br#"xx","bootstrap_room":7}"#));
        assert_eq!(leg.head().as_ptr(), big.as_ptr());
    }

    #[test]
    fn a_decode_body_carries_the_profile_as_one_more_field() {
        let p = eldr_core::ExpertProfile::from_sparse(2, 4, &[1, 6], &[3.0, 1.0], 3).unwrap();
        let wire: Value = serde_json::from_str(p.to_wire_json()).unwrap();
        assert_eq!(wire["layers"], serde_json::json!([0, 1]));
        assert_eq!(wire["experts"], serde_json::json!(4));
        assert_eq!(wire["cells"], serde_json::json!([1, 6]));
        let lk: Vec<i64> = p.log_keep().to_vec();
        assert_eq!(wire["log_keep"], serde_json::json!(lk));
        assert!(lk.iter().all(|&v| v < 0));
        let mut f = Map::new();
        f.insert("bootstrap_room".into(), Value::from(7));
        let (base, _) = parse_body(Kind::Generate, br#"{"text":"a"}"#).unwrap();
        for body in [with_fields(&base, &f), with_fields(&base, &Map::new()), with_fields(&Bytes::from_static(b"{}"), &f),
                     with_fields(&Bytes::from_static(b"{}"), &Map::new())] {
            let before: Value = serde_json::from_slice(&body.to_vec()).unwrap();
            let out: Value = serde_json::from_slice(&body.with_field("eldr_profile", p.to_wire_json()).to_vec()).unwrap();
            let mut want = before.as_object().unwrap().clone();
            want.insert("eldr_profile".into(), wire.clone());
            assert_eq!(out, Value::Object(want));
        }
    }
}
