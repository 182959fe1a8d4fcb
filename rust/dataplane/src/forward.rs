//! The control-plane forward: every path the data plane does not serve (admin endpoints,
//! /metrics, /health, ...) goes to the Python control plane.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use tokio::time::timeout;

use crate::config::secs;
use crate::errors::error_json;
use crate::flow::body::read_body;
use crate::flow::request::error_response;
use crate::plane::Plane;
use crate::response::{json_response, Body};

/// Send a request the data plane does not serve to the control plane (admin endpoints,
/// /metrics, /health, ...), its answer streamed back as it comes.
pub async fn forward(plane: Arc<Plane>, req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |x| x.as_str());
    let url = format!("{}{}", plane.cfg.control_url, pq);
    let clen = parts.headers.get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok());
    // the body's share of the buffered-bytes bound is held until it is forwarded
    let (data, _held) = if parts.method == Method::GET || parts.method == Method::HEAD {
        (Bytes::new(), None)
    } else {
        match read_body(&plane, body, clen).await {
            Ok((b, held)) => (b, Some(held)),
            Err(e) => return error_response(e),
        }
    };
    let mut b = Request::builder().method(parts.method).uri(url);
    for (k, v) in parts.headers.iter() {
        if !matches!(k.as_str(), "host" | "connection" | "keep-alive" | "transfer-encoding" | "content-length" | "upgrade") {
            b = b.header(k, v);
        }
    }
    let Ok(up) = b.body(crate::upstream::ReqBody::from(data).into()) else { return json_response(400, error_json("bad request")) };
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
