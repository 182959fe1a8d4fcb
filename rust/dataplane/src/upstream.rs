//! Worker calls: one pooled hyper client, a POST whose response head must come within a
//! limit, chunk reads with their own limits. Every failure is an [`UpstreamError`], counted
//! (worker_errors, upstream_timeouts) with the role, worker and phase.

use std::time::Duration;

use bytes::buf::Chain;
use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::{timeout, Instant};

use crate::config::Role;
use crate::counters::{names, Counters};
use crate::errors::{error_json, UpstreamError};
use crate::outlier::WorkerPool;

pub type HttpClient = Client<HttpConnector, Full<Chain<Bytes, Bytes>>>;

/// A request body as two shared pieces: the client's JSON without its closing brace, held
/// once per request, and a leg's own fields. Each leg and each re-send costs the few bytes
/// of its tail, never a copy of the prompt (a 1 MB prompt held 3 MB of router memory when
/// the prefill and decode bodies were each a full copy beside the parsed body).
#[derive(Clone, Debug)]
pub struct ReqBody {
    head: Bytes,
    tail: Bytes,
}

impl ReqBody {
    pub fn new(head: Bytes, tail: Bytes) -> ReqBody {
        ReqBody { head, tail }
    }
    pub fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }
    /// The shared part (the client's JSON up to its closing brace).
    pub fn head(&self) -> &Bytes {
        &self.head
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The body with one more top-level field (`value`: its JSON), the shared head untouched.
    pub fn with_field(&self, key: &str, value: &str) -> ReqBody {
        let (head, tail) = if self.tail.is_empty() { (self.head.slice(..self.head.len().saturating_sub(1)), &b""[..]) } else { (self.head.clone(), &self.tail[..self.tail.len() - 1]) };
        let empty = head.len() <= 1 && tail.is_empty(); // `{`: no field yet
        let mut t = Vec::with_capacity(tail.len() + key.len() + value.len() + 6);
        t.extend_from_slice(tail);
        if !empty {
            t.push(b',');
        }
        t.push(b'"');
        t.extend_from_slice(key.as_bytes());
        t.extend_from_slice(b"\":");
        t.extend_from_slice(value.as_bytes());
        t.push(b'}');
        ReqBody { head, tail: Bytes::from(t) }
    }
    /// The body as one buffer (a copy: for tests and small bodies).
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.head[..], &self.tail[..]].concat()
    }
    fn into_full(self) -> Full<Chain<Bytes, Bytes>> {
        Full::new(self.head.chain(self.tail))
    }
}

impl From<Bytes> for ReqBody {
    fn from(b: Bytes) -> ReqBody {
        ReqBody { head: b, tail: Bytes::new() }
    }
}

impl From<ReqBody> for Full<Chain<Bytes, Bytes>> {
    fn from(b: ReqBody) -> Self {
        b.into_full()
    }
}

/// Most of a worker's error body passed on to the client.
pub const MAX_ERROR_BYTES: usize = 64 << 10;

pub fn client(connect_timeout: Duration) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(90)).build(conn)
}

/// The next data chunk of a body; `Ok(None)` at its end.
pub async fn next_chunk(body: &mut Incoming) -> Result<Option<Bytes>, hyper::Error> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(e),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    if d.has_remaining() {
                        return Ok(Some(d));
                    }
                }
            }
        }
    }
}

/// What an upstream call is, for its error messages and metric labels.
#[derive(Clone, Copy)]
pub struct Leg<'a> {
    pub role: Role,
    pub worker: usize,
    pub counters: &'a Counters,
}

impl Leg<'_> {
    pub fn error(&self, kind: &str) {
        self.counters.inc(names::WORKER_ERRORS, &[self.role.as_str(), &self.worker.to_string(), kind]);
    }
    pub fn timeout(&self, phase: &str) {
        self.counters.inc(names::TIMEOUTS, &[self.role.as_str(), &self.worker.to_string(), phase]);
        self.error("timeout");
    }
}

/// Why [`send`] failed at the connection level ([`post`] marks a refused worker down).
enum Refused {
    Yes,
    No,
}

/// POST `body` to worker `leg.worker` of `pool` at `url` (see [`send`]); a refused
/// connection marks the worker down at once (the health check brings it back).
pub async fn post(client: &HttpClient, pool: &WorkerPool, leg: Leg<'_>, url: &str, body: ReqBody, head: Option<(Duration, &'static str)>, deadline: Instant) -> Result<Response<Incoming>, UpstreamError> {
    send(client, leg, url, body, head, deadline).await.map_err(|(e, refused)| {
        if let Refused::Yes = refused {
            pool.set_health(leg.worker, false);
        }
        e
    })
}

/// POST `body` to `url`; the response once its head is in, within `head`'s limit, named by
/// its phase in the timeout counters and the cause (None: no bound but the deadline).
/// Connect errors, timeouts and 5xx are retryable; other non-200 statuses are the client's
/// fault and passed on.
async fn send(client: &HttpClient, leg: Leg<'_>, url: &str, body: ReqBody, head: Option<(Duration, &'static str)>, deadline: Instant) -> Result<Response<Incoming>, (UpstreamError, Refused)> {
    let (role, i) = (leg.role, leg.worker);
    let budget = deadline.saturating_duration_since(Instant::now());
    let (limit, phase) = match head {
        Some((fb, phase)) if fb < budget => (fb, phase),
        _ => (budget, "total"),
    };
    let req = Request::post(url).header("content-type", "application/json").body(body.into_full()).expect("request");
    let resp = match timeout(limit, client.request(req)).await {
        Err(_) => {
            leg.timeout(phase);
            let msg = format!("{role} worker {i} sent no response in {:.3} s", limit.as_secs_f64());
            return Err((UpstreamError::retryable(504, &msg, role, format!("{phase}_timeout")), Refused::No));
        }
        Ok(Err(e)) => {
            // Only a refused connection says nothing listens there (marked down at once). A
            // connect that timed out is what an overloaded worker's full accept queue does, and
            // one that failed here (out of file descriptors or ports) is the router's own
            // trouble: those are failures for the outlier detector, never a verdict of down.
            let kind = io_kind(&e);
            let refused = e.is_connect() && kind == Some(std::io::ErrorKind::ConnectionRefused);
            let cause = if e.is_connect() && kind == Some(std::io::ErrorKind::TimedOut) {
                leg.timeout("connect");
                "connect_timeout"
            } else {
                leg.error("connect");
                "connect"
            };
            let msg = if e.is_connect() { format!("{role} worker {i} unreachable: {e}") } else { format!("{role} worker {i} failed: {e}") };
            return Err((UpstreamError::retryable(502, &msg, role, cause), if refused { Refused::Yes } else { Refused::No }));
        }
        Ok(Ok(r)) => r,
    };
    let status = resp.status().as_u16();
    if status == 200 {
        return Ok(resp);
    }
    leg.error(&format!("http_{status}"));
    let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut body = resp.into_body();
    let data = match timeout(Duration::from_secs(5), read_bounded(&mut body, MAX_ERROR_BYTES)).await {
        Ok(Ok(d)) => d,
        _ => error_json(&format!("{role} worker {i} answered HTTP {status}")),
    };
    let cause = (status >= 500).then(|| format!("http_{status}"));
    Err((UpstreamError { status, body: data, content_type: ctype, role, cause }, Refused::No))
}

/// The kind of the first I/O error in an error's source chain.
fn io_kind(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cur = err.source();
    }
    None
}

/// At most `limit` bytes of a body (the rest is not read).
pub async fn read_bounded(body: &mut Incoming, limit: usize) -> Result<Bytes, hyper::Error> {
    let mut out = Vec::new();
    while out.len() < limit {
        match next_chunk(body).await? {
            Some(c) => out.extend_from_slice(&c[..c.len().min(limit - out.len())]),
            None => break,
        }
    }
    Ok(Bytes::from(out))
}
