//! Stage 1, the client's request: admitted (the bound on requests in flight), then its body
//! read within the body timeout, the size limit and the bound on body bytes held at once,
//! parsed and validated ([`super::body`]); the answer, or the refusal, counted by endpoint
//! and status.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use tokio::time::timeout;

use super::body::{parse_body, Kind};
use super::prefill::route_request;
use crate::admission::{PermitBody, Rejected, Reserved};
use crate::config::secs;
use crate::counters::names;
use crate::errors::{error_json, BadRequest, FlowError};
use crate::plane::Plane;
use crate::response::{full, json_response, Body};
use crate::upstream::next_chunk;

/// Client bodies above this are parsed on the blocking pool, off the accept/IO threads.
const LARGE_BODY_BYTES: usize = 256 << 10;

/// Serve one client request on an eldr endpoint (the server sends every other path to the
/// control plane).
pub async fn handle(plane: Arc<Plane>, kind: Kind, req: Request<Incoming>) -> Response<Body> {
    let t0 = tokio::time::Instant::now(); // the latency metrics count from here, as the client does
    let mut outcome = Outcome { plane: &plane, kind, status: None };
    let resp = match serve(&plane, kind, req, t0).await {
        Ok(r) => r,
        Err(FlowError::Overloaded(why)) => overloaded_response(&plane, why),
        Err(e) => error_response(e),
    };
    outcome.status = Some(resp.status().as_u16());
    resp
}

async fn serve(plane: &Arc<Plane>, kind: Kind, req: Request<Incoming>, t0: tokio::time::Instant) -> Result<Response<Body>, FlowError> {
    let path = req.uri().path().to_owned();
    let clen = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok());
    let body = req.into_body();
    // Admitted before the body is read (issue 33): a refused request's body is never held;
    // it is read and dropped behind the answer, so the client can read it.
    let permit = match plane.admission.admit().await {
        Ok(p) => p,
        Err(why) => {
            discard(plane, body);
            return Err(FlowError::Overloaded(why));
        }
    };
    let (raw, _held) = read_body(plane, body, clen).await?;
    let (base, client_stream) = if raw.len() > LARGE_BODY_BYTES {
        tokio::task::spawn_blocking(move || parse_body(kind, &raw)).await.map_err(|_| BadRequest::with_status(503, "the request body could not be parsed"))??
    } else {
        let parsed = parse_body(kind, &raw);
        drop(raw); // the client's bytes go now, not when the request ends
        parsed?
    };
    // the decode policy it is routed by (under an experiment, its block's arm, to its end)
    let arm = plane.arm();
    let resp = route_request(plane, &arm, &path, &base, client_stream, t0, kind.label()).await?;
    Ok(resp.map(|b| PermitBody::wrap(b, permit)))
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

// ------------------------------------------------------------------ client body

/// Most of an over-limit body read (and dropped) so the client can finish sending and read
/// its 413; past it the connection is closed on the client.
const MAX_DISCARD_BYTES: usize = 64 << 20;

/// The client's body, within the body timeout, the size limit and the bound on the bytes of
/// bodies held at once (its share of that bound is held with it, by the returned guard).
pub async fn read_body(plane: &Plane, mut body: Incoming, content_length: Option<u64>) -> Result<(Bytes, Reserved), FlowError> {
    let max = plane.cfg.max_payload_size;
    let limit = secs(plane.cfg.client_body_timeout_s);
    let mut held = plane.bodies.start();
    let mut over = content_length.is_some_and(|n| n > max as u64);
    // a declared length is taken from the bound at once (the buffer is allocated for it)
    let declared = content_length.filter(|_| !over).map_or(0, |n| n as usize);
    if !held.grow(declared) {
        discard(plane, body);
        return Err(FlowError::Overloaded(plane.admission.reject(Rejected::BufferFull)));
    }
    let mut buf: Vec<u8> = Vec::with_capacity(declared);
    let (mut seen, mut taken, mut full) = (0usize, declared, false);
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
                // bytes past the declared length (or a chunked body's) are taken as they come
                if seen > taken {
                    if !held.grow(seen - taken) {
                        full = true;
                        break;
                    }
                    taken = seen;
                }
                buf.extend_from_slice(&chunk);
            }
        }
        Ok::<(), hyper::Error>(())
    };
    let r = timeout(limit, read).await;
    if full {
        drop(buf);
        discard(plane, body);
        return Err(FlowError::Overloaded(plane.admission.reject(Rejected::BufferFull)));
    }
    match r {
        Err(_) => Err(BadRequest::with_status(408, format!("the request body did not arrive within {} s", plane.cfg.client_body_timeout_s)).into()),
        _ if over => Err(BadRequest::with_status(413, format!("the request body is larger than {max} bytes (the router's --max-payload-size)")).into()),
        Ok(Err(_)) => Err(BadRequest::with_status(499, "the client went away while sending its body").into()),
        Ok(Ok(())) => Ok((Bytes::from(buf), held)),
    }
}

/// Read and drop the rest of a refused request's body behind its answer (at most
/// MAX_DISCARD_BYTES, within the body timeout): the client can finish sending and read its
/// answer, and no byte of it is held.
fn discard(plane: &Plane, mut body: Incoming) {
    let limit = secs(plane.cfg.client_body_timeout_s);
    tokio::spawn(async move {
        let _ = timeout(limit, async {
            let mut seen = 0usize;
            while let Ok(Some(c)) = next_chunk(&mut body).await {
                seen += c.len();
                if seen > MAX_DISCARD_BYTES {
                    break;
                }
            }
        })
        .await;
    });
}
