//! The hyper accept loop: each request goes to the PD flow ([`crate::flow`]) or, on any
//! other path, to the control plane ([`crate::forward`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::secs;
use crate::counters::names;
use crate::flow::{self, Kind};
use crate::forward::forward;
use crate::plane::Plane;
use crate::response::Body;

/// Why hyper closed a client connection.
fn connection_error_kind(e: &hyper::Error) -> &'static str {
    if e.is_timeout() {
        "header_timeout" // no complete request head within --client-header-timeout-secs (after an answer: idle_timeout)
    } else if e.is_parse() || e.is_parse_too_large() {
        "bad_request"
    } else if e.is_incomplete_message() {
        "incomplete" // the client closed mid-request
    } else if e.is_body_write_aborted() || e.is_canceled() {
        "aborted"
    } else {
        "io"
    }
}

async fn route(plane: Arc<Plane>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let kind = if req.method() == hyper::Method::POST { Kind::of(req.uri().path()) } else { None };
    Ok(match kind {
        Some(k) => flow::handle(plane, k, req).await,
        None => forward(plane, req).await,
    })
}

/// Accept connections until `stop` turns true. A connection that sends no complete request
/// head within the header timeout is closed (slowloris); a dropped connection drops its
/// request's future, and with it every guard the request holds.
pub async fn serve(listener: TcpListener, plane: Arc<Plane>, mut stop: watch::Receiver<bool>) {
    let header_timeout = secs(plane.cfg.client_header_timeout_s);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => return,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                // out of file descriptors and the like: back off instead of spinning (the
                // connection waits in the listen backlog meanwhile), and count it
                plane.counters.inc(names::CONNECTION_ERRORS, &["accept"]);
                plane.warn_malformed(&format!("accept failed: {e}"));
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let plane = Arc::clone(&plane);
        tokio::spawn(async move {
            let counters = Arc::clone(&plane.counters);
            let served = Arc::new(AtomicBool::new(false));
            let seen = Arc::clone(&served);
            let svc = service_fn(move |req| {
                seen.store(true, Ordering::Relaxed);
                route(Arc::clone(&plane), req)
            });
            // hyper's header read timeout runs from the moment it waits for a request head: on a
            // new connection, and between two requests of a kept-alive one (its idle timeout)
            let conn = http1::Builder::new().timer(TokioTimer::new()).header_read_timeout(header_timeout).keep_alive(true).serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                // a connection closed without an answer: the client sees a disconnect, so the
                // router counts why (these never reach the request counters)
                let kind = match connection_error_kind(&e) {
                    "header_timeout" if served.load(Ordering::Relaxed) => "idle_timeout",
                    k => k,
                };
                counters.inc(names::CONNECTION_ERRORS, &[kind]);
            }
        });
    }
}
