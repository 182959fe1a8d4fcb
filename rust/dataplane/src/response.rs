//! The response body types every stage answers with, and the router's own JSON answers.
//! A leaf: it names nothing else of the crate.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use tokio::sync::mpsc;

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

pub fn json_response(status: u16, body: Bytes) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}
