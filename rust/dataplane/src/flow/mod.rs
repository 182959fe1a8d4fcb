//! The per-request PD flow: prefill, the signature, late-bound decode, failover, streaming back.
//!
//! Late binding: pick a prefill worker, draw a bootstrap room, POST the request there
//! (always streamed); read its stream until the `eldr_signature` event (or the signature
//! timeout: then the fallback); route with the core router (the expert lease and the
//! worker's in-flight slot taken); POST the
//! same request with the same room to that decode worker. The client gets nothing until
//! the decode's first chunk, so a decode that fails before it is charged and the request
//! moves to another decode with the same room (the prefill keeps the KV parked); a prefill
//! that fails before its signature is charged and the request starts over on another
//! prefill with a new room (at most `retries` re-sends of each, within the retry budget).
//! After the first byte a failure ends the client's stream with an error event. Every
//! slot, trial and in-flight count is held by a guard, so it is released exactly once
//! whatever ends the request, a client that goes away (its future dropped) included.
//!
//! Early binding (the baselines): decode is picked first and both legs are sent at once; a
//! failure of either before the first byte is re-sent on a fresh pair with a new room, after
//! a back-off (50 ms, x1.5 each time), within the same `retries` and budget.
//!
//! One module per stage, in the order a request meets them; each is called from one place
//! and calls only the stages after it. [`request`] admits the request and drives its
//! attempts (a prefill bound to a decode, re-sent within `retries` and the retry budget),
//! and counts the answer; then:
//! 1. [`body`]: the client's body read (within the bound on body bytes held) and validated;
//! 2. [`prefill`]: one attempt's prefill leg: its room and bodies, then bound late the leg
//!    sent and its signature awaited ([`drain`] reads the rest of its stream), bound early
//!    the leg made ready to go out beside the decode's;
//! 3. [`route`]: the decode choice with the core router and its expert lease, the one
//!    routing call for both bindings, made by the decode stage before each decode attempt;
//! 4. [`decode`]: the decode leg, with failover to another decode until the first byte;
//! 5. [`pump`]: from the first byte, the rest of the decode's stream to the client.
//!
//! [`context`] holds what every stage knows of the request. The shared state (`Plane`, with
//! every `impl Plane`) is [`crate::plane`]; worker calls are [`crate::upstream`].
//!
//! Paths other than the three eldr endpoints go to the control plane ([`crate::forward`]).

pub mod body;
pub mod context;
pub mod decode;
pub mod drain;
pub mod prefill;
pub mod pump;
pub mod request;
pub mod route;

pub use body::Kind;
pub use request::handle;
