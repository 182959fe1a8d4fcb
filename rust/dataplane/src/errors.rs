//! What can go wrong on the request path, typed: the client's fault (4xx), a worker's
//! failure (retryable or passed on), no worker to route to, or a bad configuration.

use bytes::Bytes;
use thiserror::Error;

pub use crate::config::ConfigError;
use crate::config::Role;

/// The client's request is malformed: answered with `status` and this message.
#[derive(Debug, Error)]
#[error("{message}")]
pub struct BadRequest {
    pub status: u16,
    pub message: String,
}

impl BadRequest {
    pub fn new(message: impl Into<String>) -> Self {
        BadRequest { status: 400, message: message.into() }
    }
    pub fn with_status(status: u16, message: impl Into<String>) -> Self {
        BadRequest { status, message: message.into() }
    }
}

/// A worker call failed. With a `cause` it failed before any byte reached the client
/// (refused, timed out, 5xx, a stream that broke early): another worker may take the
/// request, and `cause` is what the outlier detector is told. Without one the worker's
/// answer (a 4xx: the client's own fault) is passed on as it is.
#[derive(Debug, Error)]
#[error("{role} worker answered HTTP {status}")]
pub struct UpstreamError {
    pub status: u16,
    pub body: Bytes,
    pub content_type: Option<String>,
    pub role: Role,
    pub cause: Option<String>,
}

impl UpstreamError {
    pub fn retryable(status: u16, message: &str, role: Role, cause: impl Into<String>) -> Self {
        UpstreamError { status, body: error_json(message), content_type: None, role, cause: Some(cause.into()) }
    }
    pub fn is_retryable(&self) -> bool {
        self.cause.is_some()
    }
    /// The same failure, no longer eligible for a re-send.
    pub fn final_(mut self) -> Self {
        self.cause = None;
        self
    }
}

/// Why a request ended without a worker's answer.
#[derive(Debug, Error)]
pub enum FlowError {
    #[error(transparent)]
    Bad(#[from] BadRequest),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("no healthy decode worker")]
    NoHealthyWorker,
    #[error("the router is overloaded ({})", .0.label())]
    Overloaded(crate::admission::Rejected),
}

/// `{"error": {"message": ...}}`, the body of every error the router makes itself.
pub fn error_json(message: &str) -> Bytes {
    Bytes::from(serde_json::to_vec(&serde_json::json!({"error": {"message": message}})).expect("json"))
}
