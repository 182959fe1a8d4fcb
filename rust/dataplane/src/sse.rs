//! Reading the prefill's stream up to its signature: a bounded SSE line reader, and the
//! search for the `eldr_signature` payload in each event (decoded by `eldr_core::payload`
//! straight from the event's bytes, into the packed form the route reads).

use bytes::{Buf, Bytes, BytesMut};
use eldr_core::payload::{self, DecodeLimits, DecodedCounts, Payload, PayloadError};
use hyper::body::Incoming;
use serde_json::Value;

use crate::upstream::next_chunk;

/// Bound on one stream event (the signature one is <= 16 KiB by default).
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// Lines of a body, each at most `limit` bytes; only what is needed is read.
pub struct LineReader {
    buf: BytesMut,
    limit: usize,
    done: bool,
}

pub enum Line {
    Data(Bytes),
    TooLong,
}

impl LineReader {
    pub fn new(limit: usize) -> Self {
        LineReader { buf: BytesMut::new(), limit, done: false }
    }

    /// The next line (with its newline), `Ok(None)` at the end of the body.
    pub async fn next(&mut self, body: &mut Incoming) -> Result<Option<Line>, hyper::Error> {
        loop {
            if let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                if nl + 1 > self.limit {
                    return Ok(Some(Line::TooLong));
                }
                return Ok(Some(Line::Data(self.buf.split_to(nl + 1).freeze())));
            }
            if self.buf.len() > self.limit {
                return Ok(Some(Line::TooLong));
            }
            if self.done {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                let rest = self.buf.split().freeze();
                return Ok(Some(Line::Data(rest)));
            }
            match next_chunk(body).await? {
                Some(c) => self.buf.extend_from_slice(c.chunk()),
                None => self.done = true,
            }
        }
    }
}

/// The JSON of an SSE `data:` line; None for other lines, empty data and `[DONE]`.
pub fn sse_data(line: &[u8]) -> Option<&[u8]> {
    let line = line.trim_ascii();
    let data = line.strip_prefix(b"data:")?.trim_ascii();
    if data.is_empty() || data == b"[DONE]" {
        return None;
    }
    Some(data)
}

/// What one event said about the signature.
pub enum Found {
    /// Decoded counts.
    Counts(DecodedCounts),
    /// The prefill sent none, and why.
    NoCounts(String),
    /// The payload is malformed.
    Malformed(PayloadError),
    /// The event is an error: the prefill ended the request. The message says how.
    Ended(String),
}

const KEY: &[u8] = b"\"eldr_signature\"";

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn from_payload(r: Result<Payload, PayloadError>) -> Found {
    match r {
        Ok(Payload::Counts(c)) => Found::Counts(c),
        Ok(Payload::NoCounts(why)) => Found::NoCounts(why),
        Err(e) => Found::Malformed(e),
    }
}

/// Look at one event's JSON. `last` keeps the latest event that parsed, so the error of a
/// stream that ends without a signature can say why.
pub fn inspect(data: &[u8], limits: &DecodeLimits, last: &mut Option<Value>) -> Option<Found> {
    let signed = contains(data, KEY);
    if signed {
        match payload::decode_event(data, limits) {
            Ok(Some(p)) => return Some(from_payload(Ok(p))),
            Err(e) => return Some(Found::Malformed(e)),
            Ok(None) => {} // not in the shape the fast path reads: the generic parse below
        }
    }
    let event: Value = match serde_json::from_slice(data) {
        Ok(v) => v,
        Err(e) if e.to_string().contains("recursion limit") => {
            return Some(Found::Malformed(PayloadError::NotJson("event nested too deeply".into())))
        }
        // an event that names the signature but is no JSON (`"n": NaN`) is a malformed
        // signature, as any other (the fallback); passed over, the stream would end "without
        // a signature" and its prefill be charged for it
        Err(e) if signed => return Some(Found::Malformed(PayloadError::NotJson(format!("signature event: {e}")))),
        Err(_) => return None,
    };
    let obj = event.as_object()?;
    for holder in ["meta_info", "sglext"] {
        if let Some(raw) = obj.get(holder).and_then(|m| m.get(payload::META_KEY)).filter(|v| !v.is_null()) {
            return Some(from_value(raw, limits));
        }
    }
    let is_error = matches!(obj.get("error"), Some(Value::Object(_)) | Some(Value::String(_)));
    *last = Some(event);
    if is_error {
        return Some(Found::Ended(ended_message(last.as_ref())));
    }
    None
}

/// A payload the fast path passed over, as a parsed JSON value.
fn from_value(raw: &Value, limits: &DecodeLimits) -> Found {
    let raw = match raw {
        Value::Array(items) if !items.is_empty() => &items[0], // meta_info holds per-token values
        v => v,
    };
    if let Value::Object(o) = raw {
        if o.contains_key("none") && o.get("v").and_then(Value::as_u64) == Some(1) {
            let why = match o.get("none") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            return Found::NoCounts(why);
        }
    }
    let text = match raw {
        Value::String(s) => s.clone().into_bytes(),
        v => serde_json::to_vec(v).expect("json"),
    };
    from_payload(payload::decode(&text, limits))
}

/// "prefill worker ended the request before its signature[: why]".
pub fn ended_message(last: Option<&Value>) -> String {
    let mut msg = String::from("prefill worker ended the request before its signature");
    if let Some(ev) = last {
        let fr = ev.get("meta_info").and_then(|m| m.get("finish_reason")).filter(|v| !v.is_null()).or_else(|| ev.get("error").filter(|v| !v.is_null()));
        if let Some(fr) = fr {
            let s = fr.to_string();
            let cut: String = s.chars().take(500).collect();
            msg.push_str(": ");
            msg.push_str(&cut);
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_data_lines() {
        assert_eq!(sse_data(b"data: {\"a\":1}\n"), Some(&b"{\"a\":1}"[..]));
        assert_eq!(sse_data(b"data: [DONE]\n"), None);
        assert_eq!(sse_data(b": comment\n"), None);
        assert_eq!(sse_data(b"\n"), None);
    }

    #[test]
    fn prefill_none_and_errors_and_plain_events() {
        let lim = DecodeLimits::default();
        let mut last = None;
        let none = br#"{"meta_info": {"eldr_signature": {"v": 1, "none": "disabled"}}}"#;
        assert!(matches!(inspect(none, &lim, &mut last), Some(Found::NoCounts(w)) if w == "disabled"));
        assert!(inspect(br#"{"text": "hi", "meta_info": {}}"#, &lim, &mut last).is_none());
        let err = br#"{"error": {"message": "boom"}}"#;
        assert!(matches!(inspect(err, &lim, &mut last), Some(Found::Ended(m)) if m.contains("boom")));
        let bad = br#"{"sglext": {"eldr_signature": {"v": 1, "layers": "x"}}}"#;
        assert!(matches!(inspect(bad, &lim, &mut last), Some(Found::Malformed(_))));
        let deep = [b"[".repeat(300), b"]".repeat(300)].concat();
        assert!(inspect(&deep, &lim, &mut last).is_some_and(|f| matches!(f, Found::Malformed(_))));
    }

    #[test]
    fn a_signature_event_that_is_not_json_is_malformed() {
        // issue 33: `"n": NaN` made the event fail to parse, and it was passed over as a
        // plain event: the stream ended "without a signature" and the prefill was charged
        let lim = DecodeLimits::default();
        let mut last = None;
        let nan = br#"{"text": "", "meta_info": {"eldr_signature": {"v": 1, "layers": [0], "E": 4, "n": NaN, "enc": "dense", "bits": 8, "d": "AAAA"}}}"#;
        assert!(matches!(inspect(nan, &lim, &mut last), Some(Found::Malformed(_))));
        let cut = br#"{"sglext": {"eldr_signature": {"v": 1, "layers": [0"#;
        assert!(matches!(inspect(cut, &lim, &mut last), Some(Found::Malformed(_))));
        // an event that is not JSON and names no signature is still no business of the route
        assert!(inspect(br#"{"text": NaN}"#, &lim, &mut last).is_none());
        assert!(last.is_none());
    }
}
