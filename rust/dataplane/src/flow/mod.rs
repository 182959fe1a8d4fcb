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
//! Early binding (the baselines): decode is picked first and both legs are sent at once; a
//! failure of either before the first byte is re-sent on a fresh pair with a new room, after
//! a back-off (50 ms, x1.5 each time), within the same `retries` and budget.
//!
//! One module per stage, in the order a request meets them; each calls only the stages
//! after it (and [`drain`], which the prefill stage starts and the decode stage watches):
//! 1. [`request`]: admission, the client's body read (within the bound on body bytes held)
//!    and validated ([`body`]), the answer counted;
//! 2. [`prefill`]: the prefill leg, its re-sends, and the wait for the signature;
//! 3. [`route`]: the decode choice with the core router, and its queue slot (`Lease`);
//! 4. [`decode`]: the decode leg, with failover to another decode until the first byte;
//! 5. [`pump`]: the rest of the decode's stream to the client.
//!
//! Paths other than the three eldr endpoints go to the control plane ([`crate::forward`]).

pub mod body;
pub mod decode;
pub mod drain;
pub mod prefill;
pub mod pump;
pub mod request;
pub mod route;

pub use body::Kind;
pub use request::handle;
