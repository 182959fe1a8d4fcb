//! The hyper accept loop, and the response body types.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::config::secs;
use crate::flow::{self, Kind};
use crate::plane::Plane;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;

pub fn full(b: Bytes) -> Body {
    Full::new(b).map_err(|never: Infallible| match never {}).boxed()
}

/// A streamed response body fed by the task that reads the decode worker. Dropping it (the
/// client went away) closes the channel, which that task notices at once.
pub struct ChannelBody(mpsc::Receiver<Bytes>);

impl ChannelBody {
    pub fn boxed(rx: mpsc::Receiver<Bytes>) -> Body {
        ChannelBody(rx).boxed()
    }
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

async fn route(plane: Arc<Plane>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let kind = if req.method() == hyper::Method::POST { Kind::of(req.uri().path()) } else { None };
    Ok(match kind {
        Some(k) => flow::handle(plane, k, req).await,
        None => flow::forward(plane, req).await,
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
                // out of file descriptors and the like: back off instead of spinning
                eprintln!("eldr.dataplane WARNING accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let plane = Arc::clone(&plane);
        tokio::spawn(async move {
            let svc = service_fn(move |req| route(Arc::clone(&plane), req));
            let conn = http1::Builder::new().timer(TokioTimer::new()).header_read_timeout(header_timeout).keep_alive(true).serve_connection(TokioIo::new(stream), svc);
            let _ = conn.await;
        });
    }
}
