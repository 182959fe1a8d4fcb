//! The per-request PD flow: prefill, the signature, late-bound decode, failover, streaming back.
//!
//! Late binding: pick a prefill worker, draw a bootstrap room, POST the request there
//! (always streamed); read its stream until the `eldr_signature` event (or the signature
//! timeout: then the fallback); route with the core router and take a queue slot; POST the
//! same request with the same room to that decode worker. The client gets nothing until
//! the decode's first chunk, so a decode that fails before it is charged and the request
//! moves to another decode with the same room (the prefill keeps the KV parked); a prefill
//! that fails before its signature is charged and the request starts over on another
//! prefill with a new room (at most `retries` re-sends of each, within the retry budget).
//! After the first byte a failure ends the client's stream with an error event. Every
//! slot, trial and in-flight count is held by a guard, so it is released exactly once
//! whatever ends the request, a client that goes away (its future dropped) included.
//!
//! Early binding (the baselines): decode is picked first and both legs are sent at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eldr_core::distance::Counts;
use eldr_core::payload::{DecodeLimits, DecodedCounts, DEFAULT_MAX_BYTES};
use eldr_core::{ExpertGuard, ExpertProfile, LoadGuard, NoSignature, RouteError};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{timeout, timeout_at, Instant};

use crate::admission::{PermitBody, Rejected};
use crate::config::{secs, Role};
use crate::counters::names;
use crate::errors::{error_json, BadRequest, FlowError, UpstreamError};
use crate::plane::{DriftSample, Plane};
use crate::reservoir::Ticket;
use crate::server::{full, Body, ChannelBody};
use crate::sse::{ended_message, inspect, sse_data, Found, Line, LineReader, MAX_EVENT_BYTES};
use crate::upstream::{self, next_chunk, Leg, Refused};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Generate,
    Completions,
    Chat,
}

impl Kind {
    pub fn of(path: &str) -> Option<Kind> {
        match path {
            "/generate" => Some(Kind::Generate),
            "/v1/completions" => Some(Kind::Completions),
            "/v1/chat/completions" => Some(Kind::Chat),
            _ => None,
        }
    }
    pub fn label(self) -> &'static str {
        match self {
            Kind::Generate => "generate",
            Kind::Completions => "completions",
            Kind::Chat => "chat",
        }
    }
}

/// Client bodies above this are parsed on the blocking pool, off the accept/IO threads.
const LARGE_BODY_BYTES: usize = 256 << 10;
const ROUTER_FIELDS: [&str; 4] = ["bootstrap_host", "bootstrap_port", "bootstrap_room", "stream"];

// ------------------------------------------------------------------ entry

/// Serve one client request on an eldr endpoint (the server sends every other path to the
/// control plane).
pub async fn handle(plane: Arc<Plane>, kind: Kind, req: Request<Incoming>) -> Response<Body> {
    let mut outcome = Outcome { plane: &plane, kind, status: None };
    let resp = match serve(&plane, kind, req).await {
        Ok(r) => r,
        Err(FlowError::Overloaded(why)) => overloaded_response(&plane, why),
        Err(e) => error_response(e),
    };
    outcome.status = Some(resp.status().as_u16());
    resp
}

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

pub fn json_response(status: u16, body: Bytes) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

// ------------------------------------------------------------------ client body

/// Most of an over-limit body read (and dropped) so the client can finish sending and read
/// its 413; past it the connection is closed on the client.
const MAX_DISCARD_BYTES: usize = 64 << 20;

/// The client's body, within the body timeout and the size limit.
pub async fn read_body(plane: &Plane, mut body: Incoming, content_length: Option<u64>) -> Result<Bytes, BadRequest> {
    let max = plane.cfg.max_payload_size;
    let limit = secs(plane.cfg.client_body_timeout_s);
    let mut buf: Vec<u8> = Vec::with_capacity(content_length.map_or(0, |n| n.min(max as u64) as usize));
    let mut over = content_length.is_some_and(|n| n > max as u64);
    let mut seen = 0usize;
    let read = async {
        while let Some(chunk) = next_chunk(&mut body).await? {
            seen += chunk.len();
            if seen > max {
                over = true;
            }
            if over {
                buf = Vec::new();
                if seen > MAX_DISCARD_BYTES {
                    break;
                }
            } else {
                buf.extend_from_slice(&chunk);
            }
        }
        Ok::<(), hyper::Error>(())
    };
    match timeout(limit, read).await {
        Err(_) => Err(BadRequest::with_status(408, format!("the request body did not arrive within {} s", plane.cfg.client_body_timeout_s))),
        _ if over => Err(BadRequest::with_status(413, format!("the request body is larger than {max} bytes (the router's --max-payload-size)"))),
        Ok(Err(_)) => Err(BadRequest::with_status(499, "the client went away while sending its body")),
        Ok(Ok(())) => Ok(Bytes::from(buf)),
    }
}

/// Parse and validate a client body: (its JSON without the router's own fields, compact;
/// its stream flag). Values are kept as the client wrote them (raw JSON: a number no
/// machine type holds passes through unchanged, as Python's int does); only the fields the
/// router checks are looked into.
pub fn parse_body(kind: Kind, raw: &[u8]) -> Result<(Vec<u8>, bool), BadRequest> {
    let syntax = |e: serde_json::Error| {
        if e.to_string().contains("recursion limit") {
            BadRequest::new("the request body is nested too deeply")
        } else {
            BadRequest::new("the request body is not valid JSON")
        }
    };
    if nesting_depth(raw) > MAX_BODY_DEPTH {
        return Err(BadRequest::new("the request body is nested too deeply"));
    }
    let body: HashMap<String, Box<RawValue>> = match serde_json::from_slice(raw) {
        Ok(b) => b,
        Err(e) => {
            let first = raw.iter().find(|b| !b.is_ascii_whitespace()).copied();
            if first != Some(b'{') {
                // valid JSON of another kind, or not JSON (Value's parse bounds the depth)
                return Err(match serde_json::from_slice::<Value>(raw) {
                    Ok(_) => BadRequest::new("the request body must be a JSON object"),
                    Err(e) => syntax(e),
                });
            }
            return Err(syntax(e));
        }
    };
    validate(kind, &body)?;
    let stream = body.get("stream").is_some_and(|v| v.get() == "true");
    let mut out = Vec::with_capacity(raw.len() + 2);
    out.push(b'{');
    for (k, v) in body.iter().filter(|(k, _)| !ROUTER_FIELDS.contains(&k.as_str())) {
        if out.len() > 1 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).expect("json");
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    out.push(b'}');
    Ok((out, stream))
}

/// Deepest nesting a client body may have (raw values are not parsed, so serde's own
/// recursion limit does not see inside them; Python's json refuses about 1000 levels).
const MAX_BODY_DEPTH: usize = 512;

/// The deepest `[`/`{` nesting of a JSON text (brackets inside strings do not count).
fn nesting_depth(raw: &[u8]) -> usize {
    let (mut depth, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for &b in raw {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

#[derive(PartialEq, Clone, Copy)]
enum Json {
    Null,
    Bool,
    Number,
    String,
    Array,
    Object,
}

fn json_kind(v: &RawValue) -> Json {
    match v.get().as_bytes().first() {
        Some(b'n') => Json::Null,
        Some(b't') | Some(b'f') => Json::Bool,
        Some(b'"') => Json::String,
        Some(b'[') => Json::Array,
        Some(b'{') => Json::Object,
        _ => Json::Number,
    }
}

fn items(v: &RawValue) -> Vec<&RawValue> {
    serde_json::from_str(v.get()).unwrap_or_default()
}

fn is_integer(v: &RawValue) -> bool {
    json_kind(v) == Json::Number && !v.get().bytes().any(|b| matches!(b, b'.' | b'e' | b'E'))
}

fn validate(kind: Kind, body: &HashMap<String, Box<RawValue>>) -> Result<(), BadRequest> {
    let bad = |m: &str| Err(BadRequest::new(m));
    let field = |k: &str| body.get(k).map(|v| (v.as_ref(), json_kind(v))).filter(|(_, t)| *t != Json::Null);
    if body.get("stream").is_some_and(|v| json_kind(v) != Json::Bool) {
        return bad("'stream' must be true or false");
    }
    match kind {
        Kind::Generate => {
            let Some(key) = ["text", "input_ids", "input_embeds"].into_iter().find(|k| field(k).is_some()) else {
                return bad("/generate needs 'text' or 'input_ids'");
            };
            let (v, t) = field(key).expect("present");
            if key == "text" && t != Json::String {
                return if t == Json::Array { bad("batch requests (a list of texts) are not supported: send one prompt per request") } else { bad("'text' must be a string") };
            }
            if key == "input_ids" {
                let ids = if t == Json::Array { items(v) } else { Vec::new() };
                if ids.is_empty() {
                    return bad("'input_ids' must be a non-empty list of token ids");
                }
                if json_kind(ids[0]) == Json::Array {
                    return bad("batch requests (a list of id lists) are not supported: send one prompt per request");
                }
                if !ids.iter().all(|t| is_integer(t)) {
                    return bad("'input_ids' must hold integers");
                }
            }
            if field("sampling_params").is_some_and(|(_, t)| t != Json::Object) {
                return bad("'sampling_params' must be an object");
            }
        }
        Kind::Completions => match field("prompt") {
            None => return bad("/v1/completions needs 'prompt'"),
            Some((v, Json::Array)) => {
                let p = items(v);
                if !p.is_empty() && matches!(json_kind(p[0]), Json::String | Json::Array) && p.len() != 1 {
                    return bad("batch prompts are not supported: send one prompt per request");
                }
            }
            Some((_, Json::String)) => {}
            Some(_) => return bad("'prompt' must be a string or a list of token ids"),
        },
        Kind::Chat => {
            let ok = field("messages").is_some_and(|(v, t)| {
                let m = if t == Json::Array { items(v) } else { Vec::new() };
                !m.is_empty() && m.iter().all(|x| json_kind(x) == Json::Object)
            });
            if !ok {
                return bad("/v1/chat/completions needs 'messages', a non-empty list of objects");
            }
        }
    }
    let n_ok = match body.get("n") {
        None => true,
        Some(v) => match json_kind(v) {
            Json::Number => v.get().parse::<f64>().ok() == Some(1.0),
            Json::Bool => v.get() == "true", // Python: True == 1
            _ => false,
        },
    };
    if !n_ok {
        return bad("n > 1 is not supported by the PD router");
    }
    Ok(())
}

/// `base` (a compact JSON object) with `fields` set, without re-encoding it.
pub fn with_fields(base: &[u8], fields: &Map<String, Value>) -> Bytes {
    let extra = serde_json::to_vec(fields).expect("json");
    if base == b"{}" {
        return Bytes::from(extra);
    }
    let mut out = Vec::with_capacity(base.len() + extra.len());
    out.extend_from_slice(&base[..base.len() - 1]);
    out.push(b',');
    out.extend_from_slice(&extra[1..]);
    Bytes::from(out)
}

// ------------------------------------------------------------------ request

async fn serve(plane: &Arc<Plane>, kind: Kind, req: Request<Incoming>) -> Result<Response<Body>, FlowError> {
    let path = req.uri().path().to_owned();
    let clen = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok());
    let raw = read_body(plane, req.into_body(), clen).await?;
    let (base, client_stream) = if raw.len() > LARGE_BODY_BYTES {
        tokio::task::spawn_blocking(move || parse_body(kind, &raw)).await.map_err(|_| BadRequest::with_status(503, "the request body could not be parsed"))??
    } else {
        parse_body(kind, &raw)?
    };
    // Admitted after the body is read: a bad request gets its 4xx whatever the load, and a
    // refused one has nothing left unread (closing on an unread body can reset the answer).
    let permit = plane.admission.admit().await.map_err(FlowError::Overloaded)?;
    let resp = route_request(plane, &path, &base, client_stream).await?;
    Ok(resp.map(|b| PermitBody::wrap(b, permit)))
}

async fn route_request(plane: &Arc<Plane>, path: &str, base: &[u8], client_stream: bool) -> Result<Response<Body>, FlowError> {
    let deadline = Instant::now() + secs(plane.cfg.request_timeout_s);
    let _active = plane.budget.active();
    let mut tried: Vec<usize> = Vec::new();
    let mut last: Option<UpstreamError> = None;
    for attempt in 0..plane.cfg.prefill.len().min(1 + plane.cfg.retries as usize) {
        let Some(p) = plane.pick_prefill(&tried) else { break };
        if attempt > 0 && !plane.may_retry(Role::Prefill) {
            break;
        }
        tried.push(p);
        let _retrying = (attempt > 0).then(|| {
            let cause = last.as_ref().and_then(|e| e.cause.clone()).unwrap_or_else(|| "error".into());
            plane.counters.inc(names::RETRIES, &["prefill", &cause]);
            plane.budget.retrying()
        });
        match serve_with_prefill(plane, path, base, p, client_stream, deadline).await {
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

/// What the prefill's stream gave: decoded counts, or why none.
pub struct Sig {
    pub counts: Option<DecodedCounts>,
    /// Why there are no counts (None: the route's own reason says it).
    pub reason: Option<String>,
    pub wait_s: f64,
    /// The locality balancer's profile, built once so a failover acquires the same one.
    pub profile: Option<Arc<ExpertProfile>>,
}

impl Sig {
    fn none(reason: Option<&str>, wait_s: f64) -> Sig {
        Sig { counts: None, reason: reason.map(str::to_owned), wait_s, profile: None }
    }
}

/// A background task that is aborted when its handle drops, unless kept.
struct Background {
    join: JoinHandle<()>,
    keep: AtomicBool,
}

impl Background {
    fn keep(&self) {
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
struct Drain {
    task: Background,
    state: watch::Receiver<u8>,
}

impl Drain {
    fn spawn(mut body: Incoming, deadline: Instant) -> Drain {
        let (tx, rx) = watch::channel(PENDING);
        let join = tokio::spawn(async move {
            let read_all = async {
                while next_chunk(&mut body).await?.is_some() {}
                Ok::<(), hyper::Error>(())
            };
            let s = match timeout_at(deadline, read_all).await {
                Ok(Ok(())) => ENDED,
                Ok(Err(_)) => BROKE,
                Err(_) => DEADLINE,
            };
            let _ = tx.send(s);
        });
        Drain { task: Background { join, keep: AtomicBool::new(false) }, state: rx }
    }

    fn done(&self) -> bool {
        *self.state.borrow() != PENDING
    }

    async fn wait_done(&self) {
        let mut rx = self.state.clone();
        let _ = rx.wait_for(|s| *s != PENDING).await;
    }

    /// Did the prefill's stream break? (A decode may notice a dead prefill a moment before
    /// the router does: wait for it briefly.)
    async fn broke(&self) -> bool {
        if !self.done() {
            let _ = timeout(Duration::from_millis(100), self.wait_done()).await;
        }
        *self.state.borrow() == BROKE
    }
}

/// The prefill side of a late-bound request: held until the decode's answer ends.
struct PrefillLeg {
    worker: usize,
    attempt: Mutex<crate::outlier::Attempt>,
    drain: Drain,
}

impl PrefillLeg {
    /// The request succeeded: the prefill's last event may trail the decode's answer.
    fn keep_draining(&self) {
        self.drain.task.keep();
    }
}

fn kv_lost_error() -> UpstreamError {
    UpstreamError::retryable(502, "the prefill worker went away before the KV reached a decode worker", Role::Prefill, "kv_lost")
}

async fn serve_with_prefill(plane: &Arc<Plane>, path: &str, base: &[u8], p: usize, client_stream: bool, deadline: Instant) -> Result<Response<Body>, FlowError> {
    plane.counters.inc(names::PREFILL_ROUTES, &[&p.to_string()]);
    let w = &plane.cfg.prefill[p];
    let room = plane.rng.next_u64() >> 1; // 63 bits, as SGLang's bootstrap rooms
    let mut late = plane.cfg.late_binding;
    let no_sig = late && plane.prefill_signs(p) == Some(false);
    if no_sig {
        late = false; // this prefill never streams a signature: do not wait for one
    }
    let mut boot = Map::new();
    boot.insert("bootstrap_host".into(), Value::String(w.host.clone()));
    boot.insert("bootstrap_port".into(), w.bootstrap_port.map_or(Value::Null, Value::from));
    boot.insert("bootstrap_room".into(), Value::from(room));
    boot.insert("stream".into(), Value::Bool(client_stream));
    let dbody = with_fields(base, &boot);
    boot.insert("stream".into(), Value::Bool(late || client_stream));
    let pbody = with_fields(base, &boot);
    let purl = format!("{}{}", w.url, path);
    let mut attempt = crate::outlier::Attempt::start(&plane.prefill, p);
    let leg = Leg { role: Role::Prefill, worker: p, counters: &plane.counters };
    let ctx = DecodeCtx { path, room, p, dbody: &dbody, client_stream, deadline };

    if !late {
        let sig = Sig::none(no_sig.then_some("prefill_no_signature"), 0.0);
        let decision = plane.route(&sig, &[])?;
        let (etx, mut erx) = tokio::sync::oneshot::channel();
        let early = {
            let plane = Arc::clone(plane);
            let join = tokio::spawn(async move {
                let r = early_prefill(&plane, &purl, pbody, deadline, &mut attempt).await;
                drop(attempt);
                let _ = etx.send(r);
            });
            Background { join, keep: AtomicBool::new(false) }
        };
        // A failed prefill ends the request (the decode leg would wait for KV that never comes).
        let dec = decode(plane, &ctx, &decision, None);
        tokio::pin!(dec);
        let out = tokio::select! {
            r = &mut dec => r,
            Ok(Err(perr)) = &mut erx => Err(FlowError::Upstream(perr)),
        };
        let out = out.map_err(|e| match e {
            FlowError::Upstream(u) => FlowError::Upstream(u.final_()), // early binding does not re-send
            e => e,
        });
        if out.is_ok() {
            early.keep();
        }
        return out;
    }

    let t0 = Instant::now();
    let presp = match plane.open(leg, &purl, pbody, Some(secs(plane.cfg.first_byte_timeout_s)), deadline).await {
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
    let prefill = Arc::new(PrefillLeg { worker: p, attempt: Mutex::new(attempt), drain: Drain::spawn(body, deadline) });
    let out = decode_with_failover(plane, &ctx, sig, &prefill).await;
    if let Err(FlowError::Upstream(e)) = &out {
        if let (true, Some(c)) = (e.role == Role::Prefill, &e.cause) {
            prefill.attempt.lock().unwrap_or_else(|x| x.into_inner()).failure(c);
        }
    }
    out
}

async fn early_prefill(plane: &Plane, url: &str, body: Bytes, deadline: Instant, attempt: &mut crate::outlier::Attempt) -> Result<(), UpstreamError> {
    let leg = Leg { role: Role::Prefill, worker: attempt.worker, counters: &plane.counters };
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

// ------------------------------------------------------------------ routing

/// A decode choice with what the headers and metrics show of it.
pub struct Choice {
    pub worker: usize,
    pub reason: String,
    pub band: Option<Vec<usize>>,
    pub profile: Option<Arc<ExpertProfile>>,
}

impl Plane {
    /// Route with the core router; on a re-send, the least loaded routable decode worker
    /// not tried yet.
    pub fn route(&self, sig: &Sig, tried: &[usize]) -> Result<Choice, FlowError> {
        let t0 = std::time::Instant::now();
        // the reservoir's draw for this request, before routing: the route keeps the
        // signature only when the reservoir will store it (re-sends are not offers)
        let ticket = match (&self.drift, &sig.counts) {
            (Some(feed), Some(_)) if tried.is_empty() => Some(feed.sampler.begin()),
            _ => None,
        };
        let keep = ticket.as_ref().is_some_and(|t| t.keeps());
        let (routed, profile) = if self.router.policy().uses_profile() { self.locality_route(sig) } else {
            let r = match &sig.counts {
                Some(c) => self.router.route_counts(c, keep, true),
                None => self.router.route(|_| Err(fallback_why(sig)), true),
            };
            (r, None)
        };
        let r = match routed {
            Ok(r) => r,
            Err(RouteError::NoHealthyWorker) => return self.panic_route(tried),
        };
        let worker = r.decision.worker.expect("route returns a worker or an error");
        let mut choice = Choice { worker, reason: r.decision.reason.label(), band: r.decision.band.clone(), profile };
        if tried.contains(&worker) {
            let loads = &r.loads;
            let routable = self.decode.routable_all();
            let other = (0..routable.len()).filter(|k| routable[*k] && !tried.contains(k)).min_by_key(|&k| (loads[k], k));
            let Some(k) = other else { return Err(FlowError::NoHealthyWorker) };
            choice = Choice { worker: k, reason: "retry".into(), band: None, profile: choice.profile };
        }
        self.counters.route_seconds.observe(t0.elapsed().as_secs_f64());
        let head = choice.reason.split(':').next().unwrap_or("").to_owned();
        self.counters.inc(names::ROUTES, &[&choice.worker.to_string(), &head]);
        if choice.reason == "band" {
            if let (Some(b), Some(ds), Some(d)) = (&choice.band, &r.distances, r.decision.d_star) {
                self.counters.band_size.observe(b.len() as f64);
                self.counters.d_star.observe(d);
                self.counters.d_chosen.observe(ds[choice.worker]);
            }
        } else if self.cfg.counts_policy() && choice.reason != "retry" && choice.reason != "profile" {
            // the decision names the fallback: 'no_signature:<why>' or 'no_centroids'
            let why = choice.reason.split_once(':').map_or(choice.reason.as_str(), |(_, w)| w).to_owned();
            self.counters.inc(names::FALLBACKS, &[&why]);
        }
        if let (Some(feed), true) = (&self.drift, choice.reason != "retry") {
            feed.push(self.drift_sample(sig, &choice, r, ticket));
        }
        Ok(choice)
    }

    /// Panic mode (Envoy's panic threshold at its floor): no decode worker is routable (all
    /// ejected, on probation or failing their health checks, which overload alone can cause),
    /// so the request goes to the least loaded one not tried yet rather than failing with 503.
    /// A worker that really is down answers its own fast error, and the request fails over.
    fn panic_route(&self, tried: &[usize]) -> Result<Choice, FlowError> {
        let k = self.decode.panic_pick(tried).ok_or(FlowError::NoHealthyWorker)?;
        self.counters.inc(names::PANIC_ROUTES, &["decode"]);
        self.counters.inc(names::ROUTES, &[&k.to_string(), "panic"]);
        Ok(Choice { worker: k, reason: "panic".into(), band: None, profile: None })
    }

    /// What the drift monitor reads of a decision: its distances, every time the route
    /// computed them, and its signature only when the reservoir's draw (`ticket`) stores it.
    /// A decision with distances commits the draw (an offer); any other gives it back when
    /// the ticket drops. The distances measure how far traffic is from the fitted centroids,
    /// which the band rule's decision carries; under the locality balancer the distances of
    /// the same counts are computed here for the monitor alone.
    fn drift_sample(&self, sig: &Sig, choice: &Choice, r: eldr_core::router::Routed, ticket: Option<Ticket<'_>>) -> DriftSample {
        fn offer(ticket: Option<Ticket<'_>>, distances: &Option<Vec<f64>>, reason: &str) -> Option<crate::reservoir::Draw> {
            match ticket {
                Some(t) if distances.is_some() && reason == "band" => Some(t.commit()),
                _ => None, // dropped: the draw goes back
            }
        }
        if r.distances.is_some() || !self.router.policy().uses_profile() {
            let offer = offer(ticket, &r.distances, &choice.reason);
            let signature = r.signature.filter(|_| offer.is_some_and(|d| d.keeps()));
            return DriftSample { generation: r.generation, reason: choice.reason.clone(), distances: r.distances, signature, offer };
        }
        let (Some(c), Some(store)) = (&sig.counts, self.router.store()) else {
            return DriftSample { generation: r.generation, reason: choice.reason.clone(), distances: None, signature: None, offer: None };
        };
        let snap = store.snapshot();
        let keep = ticket.as_ref().is_some_and(|t| t.keeps());
        let mut kept = eldr_core::SparseSignature::default();
        match eldr_core::distance::from_fill(&snap.set, keep.then_some(&mut kept), |spec, out| c.fill_signature(spec, out)) {
            Ok(d) => {
                let d = Some(d);
                let offer = offer(ticket, &d, "band");
                DriftSample { generation: snap.generation, reason: "band".into(), distances: d, signature: keep.then_some(kept), offer }
            }
            Err(_) => DriftSample { generation: r.generation, reason: choice.reason.clone(), distances: None, signature: None, offer: None },
        }
    }

    /// The locality balancer: the request's expert profile over the centroid file's
    /// selected layers, built once (kept on the Sig by the caller through `Choice`).
    fn locality_route(&self, sig: &Sig) -> (Result<eldr_core::router::Routed, RouteError>, Option<Arc<ExpertProfile>>) {
        if let Some(p) = &sig.profile {
            return (self.router.route_profiled(|_| Err(NoSignature::Missing), Some(p), true), Some(Arc::clone(p)));
        }
        let (Some(c), Some((l, e))) = (&sig.counts, self.layout()) else {
            return (self.router.route(|_| Err(fallback_why(sig)), true), None);
        };
        let why = match c.to_layout(l, e) {
            Err(_) => NoSignature::Shape, // the centroid layout changed under a reload
            Ok(dense) => match self.router.profile::<u32, f32>(Counts::Dense(&dense), c.num_tokens().max(1)) {
                Some(Ok(p)) => {
                    let p = Arc::new(p);
                    return (self.router.route_profiled(|_| Err(NoSignature::Missing), Some(&p), true), Some(p));
                }
                Some(Err(why)) => why,
                None => NoSignature::Missing,
            },
        };
        (self.router.route(|_| Err(why), true), None)
    }
}

/// Why a request without usable counts falls back, in the one fallback vocabulary
/// (`NoSignature`; 'no_centroids' the router names itself when it has no centroid file).
fn fallback_why(sig: &Sig) -> NoSignature {
    match sig.reason.as_deref() {
        None | Some("no_centroids") => NoSignature::Missing,
        Some(r) => NoSignature::parse(r).unwrap_or(NoSignature::Missing),
    }
}

/// A queue slot on a decode worker (and the request's experts there, under locality).
struct Lease {
    _slot: LoadGuard,
    _experts: Option<ExpertGuard>,
}

impl Plane {
    fn lease(&self, w: usize, profile: Option<&Arc<ExpertProfile>>) -> Lease {
        let experts = profile.and_then(|p| match self.router.policy().track(self.router.num_workers(), w, Arc::clone(p)) {
            Some(Ok(g)) => Some(g),
            Some(Err(e)) => {
                self.warn_malformed(&format!("expert profile not counted: {e}"));
                None
            }
            None => None,
        });
        Lease { _slot: self.router.tracker().acquire(w, 0), _experts: experts }
    }
}

// ------------------------------------------------------------------ decode

struct DecodeCtx<'a> {
    path: &'a str,
    room: u64,
    p: usize,
    dbody: &'a Bytes,
    client_stream: bool,
    deadline: Instant,
}

async fn decode_with_failover(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, mut sig: Sig, prefill: &Arc<PrefillLeg>) -> Result<Response<Body>, FlowError> {
    let mut tried: Vec<usize> = Vec::new();
    let mut first: Option<UpstreamError> = None;
    let mut last_cause = String::new();
    for attempt in 0..plane.cfg.decode.len().min(1 + plane.cfg.retries as usize) {
        if attempt > 0 && !plane.may_retry(Role::Decode) {
            break;
        }
        let choice = match plane.route(&sig, &tried) {
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
    async fn blame(&self, attempt: &mut crate::outlier::Attempt, cause: &str, prefill: Option<&Arc<PrefillLeg>>) -> Result<(), UpstreamError> {
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
}

async fn decode(plane: &Arc<Plane>, ctx: &DecodeCtx<'_>, choice: &Choice, prefill: Option<&Arc<PrefillLeg>>) -> Result<Response<Body>, FlowError> {
    let w = choice.worker;
    let durl = format!("{}{}", plane.cfg.decode[w], ctx.path);
    let t_start = Instant::now();
    let lease = plane.lease(w, choice.profile.as_ref());
    let mut attempt = crate::outlier::Attempt::start(&plane.decode, w);
    let leg = Leg { role: Role::Decode, worker: w, counters: &plane.counters };
    let first_byte = secs(plane.cfg.first_byte_timeout_s);

    if !ctx.client_stream {
        let resp = match open_watched(plane, leg, &durl, ctx.dbody.clone(), ctx.deadline, prefill).await {
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
        let mut r = Response::new(full(data));
        r.headers_mut().insert(CONTENT_TYPE, ctype.unwrap_or(HeaderValue::from_static("application/json")));
        explain_headers(plane, ctx, choice, &mut r);
        return Ok(r);
    }

    let resp = match plane.open(leg, &durl, ctx.dbody.clone(), Some(first_byte), ctx.deadline).await {
        Ok(r) => r,
        Err(e) => {
            plane.blame(&mut attempt, e.cause.as_deref().unwrap_or("error"), prefill).await?;
            return Err(e.into());
        }
    };
    // The client sees nothing until the decode's first chunk: until then the request can
    // still move to another worker.
    let mut body = resp.into_body();
    let left = (t_start + first_byte).min(ctx.deadline).saturating_duration_since(Instant::now());
    let failed = match timeout(left, next_chunk(&mut body)).await {
        Ok(Ok(Some(first))) => {
            attempt.progress();
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
            tokio::spawn(pump(Arc::clone(plane), body, tx, attempt, lease, prefill.cloned(), ctx.deadline));
            let mut r = Response::new(ChannelBody::boxed(rx));
            let h = r.headers_mut();
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(hyper::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            explain_headers(plane, ctx, choice, &mut r);
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

/// Stream the rest of the decode's answer to the client, each chunk within the stall
/// timeout. Owns every guard of the request: they are released when it ends, the client
/// going away included (its body is dropped, which closes the channel).
async fn pump(plane: Arc<Plane>, mut body: Incoming, tx: mpsc::Sender<Bytes>, mut attempt: crate::outlier::Attempt, lease: Lease, prefill: Option<Arc<PrefillLeg>>, deadline: Instant) {
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

// ------------------------------------------------------------------ upstream helpers

impl Plane {
    /// POST to a worker (see `upstream::post`); a refused connection marks it down at once
    /// (the health check brings it back).
    async fn open(&self, leg: Leg<'_>, url: &str, body: Bytes, first_byte: Option<Duration>, deadline: Instant) -> Result<Response<Incoming>, UpstreamError> {
        upstream::post(&self.client, leg, url, body, first_byte, deadline).await.map_err(|(e, refused)| {
            if let Refused::Yes = refused {
                self.pool(leg.role).set_health(leg.worker, false);
            }
            e
        })
    }
}

/// Open a non-streamed decode answer. It comes whole at the end, so no first byte can bound
/// it; the KV can: a decode at work takes the prefill's KV, which ends the prefill's stream,
/// within the first-byte timeout. One that has not by then is treated like a stream with
/// no first byte. Once the KV is taken, the request deadline bounds it.
async fn open_watched(plane: &Plane, leg: Leg<'_>, url: &str, body: Bytes, deadline: Instant, prefill: Option<&Arc<PrefillLeg>>) -> Result<Response<Incoming>, UpstreamError> {
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

// ------------------------------------------------------------------ control plane

/// Send a request the data plane does not serve to the control plane (admin endpoints,
/// /metrics, /health, ...), its answer streamed back as it comes.
pub async fn forward(plane: Arc<Plane>, req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |x| x.as_str());
    let url = format!("{}{}", plane.cfg.control_url, pq);
    let clen = parts.headers.get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok());
    let data = if parts.method == Method::GET || parts.method == Method::HEAD {
        Bytes::new()
    } else {
        match read_body(&plane, body, clen).await {
            Ok(b) => b,
            Err(e) => return error_response(e.into()),
        }
    };
    let mut b = Request::builder().method(parts.method).uri(url);
    for (k, v) in parts.headers.iter() {
        if !matches!(k.as_str(), "host" | "connection" | "keep-alive" | "transfer-encoding" | "content-length" | "upgrade") {
            b = b.header(k, v);
        }
    }
    let Ok(up) = b.body(http_body_util::Full::new(data)) else { return json_response(400, error_json("bad request")) };
    match timeout(secs(plane.cfg.request_timeout_s), plane.client.request(up)).await {
        Ok(Ok(resp)) => {
            let (mut parts, body) = resp.into_parts();
            parts.headers.remove(hyper::header::CONNECTION);
            parts.headers.remove(hyper::header::TRANSFER_ENCODING);
            Response::from_parts(parts, body.map_err(Into::into).boxed())
        }
        Ok(Err(e)) => json_response(502, error_json(&format!("the router's control plane did not answer: {e}"))),
        Err(_) => json_response(504, error_json("the router's control plane did not answer in time")),
    }
}

/// Prefill signature support: 0 unknown, 1 yes, 2 no.
pub fn sign_state(v: Option<bool>) -> u8 {
    match v {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    }
}

pub fn sign_of(a: &AtomicU8) -> Option<bool> {
    match a.load(Ordering::Relaxed) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_matches_the_python_plane() {
        let ok = |k, b: &str| parse_body(k, b.as_bytes()).map(|(_, s)| s);
        let err = |k, b: &str| parse_body(k, b.as_bytes()).unwrap_err().message;
        assert_eq!(ok(Kind::Generate, r#"{"text":"hi","stream":true}"#).unwrap(), true);
        assert!(err(Kind::Generate, r#"{"text":["a","b"]}"#).contains("batch requests"));
        assert!(err(Kind::Generate, r#"{"input_ids":[[1],[2]]}"#).contains("batch requests"));
        assert!(err(Kind::Generate, r#"{"input_ids":[1.5]}"#).contains("integers"));
        assert!(err(Kind::Generate, r#"{"text":"a","n":2}"#).contains("n > 1"));
        assert!(err(Kind::Generate, r#"{"text":"a","stream":"yes"}"#).contains("'stream'"));
        assert!(err(Kind::Generate, r#"{}"#).contains("needs 'text'"));
        assert!(err(Kind::Generate, "[1]").contains("JSON object"));
        assert!(err(Kind::Generate, "{").contains("not valid JSON"));
        let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
        assert!(err(Kind::Generate, &deep).contains("nested too deeply"));
        let deep = format!(r#"{{"text":"a","x":{}{}}}"#, "[".repeat(1_000_000), "]".repeat(1_000_000));
        assert_eq!(nesting_depth(br#"{"a":"[[[[\"{{","b":[{}]}"#), 3);
        assert!(err(Kind::Generate, &deep).contains("nested too deeply"));
        assert!(err(Kind::Completions, r#"{"prompt":["a","b"]}"#).contains("batch prompts"));
        assert!(ok(Kind::Completions, r#"{"prompt":["a"]}"#).is_ok());
        assert!(ok(Kind::Completions, r#"{"prompt":[1,2,3]}"#).is_ok());
        assert!(err(Kind::Chat, r#"{"messages":[]}"#).contains("messages"));
        assert!(ok(Kind::Chat, r#"{"messages":[{"role":"user","content":"x"}],"n":1}"#).is_ok());
        // a number no machine type holds passes through as written
        let big = format!(r#"{{"text":"a","x":1{}}}"#, "0".repeat(400));
        assert!(String::from_utf8(parse_body(Kind::Generate, big.as_bytes()).unwrap().0).unwrap().contains(&"0".repeat(400)));
    }

    #[test]
    fn router_fields_are_replaced_not_duplicated() {
        let (base, stream) = parse_body(Kind::Generate, br#"{"text":"a","bootstrap_room":5,"stream":true}"#).unwrap();
        assert!(stream);
        let mut f = Map::new();
        f.insert("bootstrap_room".into(), Value::from(7));
        let out: Value = serde_json::from_slice(&with_fields(&base, &f)).unwrap();
        assert_eq!(out, serde_json::json!({"text": "a", "bootstrap_room": 7}));
        assert_eq!(&with_fields(b"{}", &f)[..], br#"{"bootstrap_room":7}"#);
    }
}
