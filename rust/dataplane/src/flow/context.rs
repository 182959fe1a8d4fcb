//! What every stage of the flow knows of the client's request, built once when its body is
//! read ([`super::request`]). A leaf of the flow.

use tokio::time::Instant;

use crate::plane::RequestArm;

/// What every stage knows of the client's request.
pub(crate) struct RequestCtx<'a> {
    /// The decode policy it is routed by.
    pub(crate) arm: &'a RequestArm,
    pub(crate) path: &'a str,
    /// Whether the client asked for a streamed answer.
    pub(crate) client_stream: bool,
    /// The request timeout, from the start of its first attempt.
    pub(crate) deadline: Instant,
    /// When the client's request arrived (the latency metrics count from it).
    pub(crate) t0: Instant,
    pub(crate) endpoint: &'static str,
}
