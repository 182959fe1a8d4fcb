//! The counts payload a prefill worker sends (the `eldr_signature` field of a stream event),
//! decoded straight into the sparse form a route uses.
//!
//! The format is defined (and encoded) by `eldr_sglang.sglang_ext.payload`: a JSON object
//! `{"v": 1, "layers": [...], "E": E, "n": tokens, "enc": "dense"|"sparse"|"log", "bits": b,
//! "nnz"?: .., "q"?: [..], "d": base64}` of little-endian bit-packed counts `c[row][e]`, one row
//! per listed hidden layer. [`decode`] validates everything (each failure is a typed
//! [`PayloadError`], never a panic) and keeps the packed bytes; [`DecodedCounts::fill_signature`]
//! then unpacks only the rows of the layers the signature selects, weighting each count as it
//! is read, so no dense `[L, E]` array is ever made on the route path.
//!
//! Work is bounded before anything is allocated: at most `max_bytes` of input, at most
//! [`MAX_ENTRIES`] counts, and with a layout (the centroid file's `[L, E]`) the payload must fit it.
//!
//! One module per concern: [`format`] (what a payload is: limits, errors, the decoded
//! counts), [`header`] (the JSON header read and validated, the base64 data decoded),
//! [`event`] (the payload found in a stream event, usually without parsing the whole event),
//! [`unpack`] (bit unpacking, the counts' dense views), [`log`] (the log encoding's value
//! tables), [`kernels`] (the row kernels, portable and AVX2) and [`fill`] (the signature and
//! the fused distances, read from the packed counts).

mod event;
mod fill;
mod format;
mod header;
mod kernels;
mod log;
mod unpack;

pub use event::decode_event;
pub use format::{DecodeLimits, DecodedCounts, Encoding, Payload, PayloadError, DEFAULT_MAX_BYTES, MAX_COUNT, MAX_ENTRIES, MAX_EXPERTS, MAX_LAYERS, META_KEY, PAYLOAD_VERSION};
pub use header::decode;
pub use unpack::pack_bits;

#[cfg(test)]
mod tests;
