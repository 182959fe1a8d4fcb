//! Stage 1, the client's body: read within the body timeout, the size limit and the bound
//! on body bytes held at once ([`read_body`]); parsed and validated for its endpoint, the
//! router's own fields taken out ([`parse_body`]; the prefill stage writes them back for
//! each leg).

use std::collections::HashMap;

use bytes::Bytes;
use hyper::body::Incoming;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::timeout;

use crate::admission::{Rejected, Reserved};
use crate::config::secs;
use crate::errors::{BadRequest, FlowError};
use crate::plane::Plane;
use crate::upstream::next_chunk;

/// Client bodies above this are parsed on the blocking pool, off the accept/IO threads.
const LARGE_BODY_BYTES: usize = 256 << 10;

/// The eldr endpoints, each with its own body rules.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Generate,
    Completions,
    Chat,
}

impl Kind {
    pub fn of(path: &str) -> Option<Kind> {
        match path {
            "/generate" => Some(Kind::Generate),
            "/v1/completions" => Some(Kind::Completions),
            "/v1/chat/completions" => Some(Kind::Chat),
            _ => None,
        }
    }
    pub fn label(self) -> &'static str {
        match self {
            Kind::Generate => "generate",
            Kind::Completions => "completions",
            Kind::Chat => "chat",
        }
    }
}

/// The client's body read (see [`read_body`]) and parsed for its endpoint (see
/// [`parse_body`]): its JSON without the router's fields, its stream flag, and its share of
/// the bound on body bytes held (the raw bytes are dropped once parsed).
pub async fn read_request(plane: &Plane, kind: Kind, body: Incoming, content_length: Option<u64>) -> Result<(Bytes, bool, Reserved), FlowError> {
    let (raw, held) = read_body(plane, body, content_length).await?;
    let (base, client_stream) = parse_off_loop_if_large(kind, raw).await?;
    Ok((base, client_stream, held))
}

/// [`parse_body`], on the blocking pool for a body above [`LARGE_BODY_BYTES`] so that the
/// threads serving other requests (and `/health`) never wait on a long check.
async fn parse_off_loop_if_large(kind: Kind, raw: Bytes) -> Result<(Bytes, bool), FlowError> {
    if raw.len() > LARGE_BODY_BYTES {
        let parsed = tokio::task::spawn_blocking(move || parse_body(kind, &raw)).await;
        Ok(parsed.map_err(|_| BadRequest::with_status(503, "the request body could not be parsed"))??)
    } else {
        let parsed = parse_body(kind, &raw);
        drop(raw); // the client's bytes go now, not when the request ends
        Ok(parsed?)
    }
}

/// Most of an over-limit body read (and dropped) so the client can finish sending and read
/// its 413; past it the connection is closed on the client.
const MAX_DISCARD_BYTES: usize = 64 << 20;

/// The client's body, within the body timeout, the size limit and the bound on the bytes of
/// bodies held at once (its share of that bound is held with it, by the returned guard).
pub async fn read_body(plane: &Plane, mut body: Incoming, content_length: Option<u64>) -> Result<(Bytes, Reserved), FlowError> {
    let max = plane.cfg.max_payload_size;
    let limit = secs(plane.cfg.client_body_timeout_s);
    let mut held = plane.bodies.start();
    let mut over = content_length.is_some_and(|n| n > max as u64);
    // a declared length is taken from the bound at once (the buffer is allocated for it)
    let declared = content_length.filter(|_| !over).map_or(0, |n| n as usize);
    if !held.grow(declared) {
        discard(plane, body);
        return Err(FlowError::Overloaded(plane.admission.reject(Rejected::BufferFull)));
    }
    let mut buf: Vec<u8> = Vec::with_capacity(declared);
    let (mut seen, mut taken, mut full) = (0usize, declared, false);
    let read = async {
        while let Some(chunk) = next_chunk(&mut body).await? {
            seen += chunk.len();
            if seen > max {
                over = true;
            }
            if over {
                buf = Vec::new();
                if seen > MAX_DISCARD_BYTES {
                    break;
                }
            } else {
                // bytes past the declared length (or a chunked body's) are taken as they come
                if seen > taken {
                    if !held.grow(seen - taken) {
                        full = true;
                        break;
                    }
                    taken = seen;
                }
                buf.extend_from_slice(&chunk);
            }
        }
        Ok::<(), hyper::Error>(())
    };
    let r = timeout(limit, read).await;
    if full {
        drop(buf);
        discard(plane, body);
        return Err(FlowError::Overloaded(plane.admission.reject(Rejected::BufferFull)));
    }
    match r {
        Err(_) => Err(BadRequest::with_status(408, format!("the request body did not arrive within {} s", plane.cfg.client_body_timeout_s)).into()),
        _ if over => Err(BadRequest::with_status(413, format!("the request body is larger than {max} bytes (the router's --max-payload-size)")).into()),
        Ok(Err(_)) => Err(BadRequest::with_status(499, "the client went away while sending its body").into()),
        Ok(Ok(())) => Ok((Bytes::from(buf), held)),
    }
}

/// Read and drop the rest of a refused request's body behind its answer (at most
/// MAX_DISCARD_BYTES, within the body timeout): the client can finish sending and read its
/// answer, and no byte of it is held.
pub(crate) fn discard(plane: &Plane, mut body: Incoming) {
    let limit = secs(plane.cfg.client_body_timeout_s);
    tokio::spawn(async move {
        let _ = timeout(limit, async {
            let mut seen = 0usize;
            while let Ok(Some(c)) = next_chunk(&mut body).await {
                seen += c.len();
                if seen > MAX_DISCARD_BYTES {
                    break;
                }
            }
        })
        .await;
    });
}

/// Fields only the router writes: a client's own are dropped (`eldr_profile`, the request's
/// expert profile a decode worker sums for its occupancy report, goes only from the router, or
/// a client could skew what every replica reads of that worker's batch).
const ROUTER_FIELDS: [&str; 5] = ["bootstrap_host", "bootstrap_port", "bootstrap_room", "stream", "eldr_profile"];

/// Parse and validate a client body: (its JSON without the router's own fields, compact;
/// its stream flag). Values are kept as the client wrote them (raw JSON: a number no
/// machine type holds passes through unchanged, as Python's int does); only the fields the
/// router checks are looked into.
pub fn parse_body(kind: Kind, raw: &[u8]) -> Result<(Bytes, bool), BadRequest> {
    let syntax = |e: serde_json::Error| {
        if e.to_string().contains("recursion limit") {
            BadRequest::new("the request body is nested too deeply")
        } else {
            BadRequest::new("the request body is not valid JSON")
        }
    };
    if nesting_depth(raw) > MAX_BODY_DEPTH {
        return Err(BadRequest::new("the request body is nested too deeply"));
    }
    // values borrowed from `raw`, not copied: the prompt is in memory twice at most while
    // parsing (the client's bytes and the compact body), once after
    let body: HashMap<String, &RawValue> = match serde_json::from_slice(raw) {
        Ok(b) => b,
        Err(e) => {
            let first = raw.iter().find(|b| !b.is_ascii_whitespace()).copied();
            if first != Some(b'{') {
                // valid JSON of another kind, or not JSON (Value's parse bounds the depth)
                return Err(match serde_json::from_slice::<Value>(raw) {
                    Ok(_) => BadRequest::new("the request body must be a JSON object"),
                    Err(e) => syntax(e),
                });
            }
            return Err(syntax(e));
        }
    };
    validate(kind, &body)?;
    let stream = body.get("stream").is_some_and(|v| v.get() == "true");
    let mut out = Vec::with_capacity(raw.len() + 2);
    out.push(b'{');
    for (k, v) in body.iter().filter(|(k, _)| !ROUTER_FIELDS.contains(&k.as_str())) {
        if out.len() > 1 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).expect("json");
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    out.push(b'}');
    Ok((Bytes::from(out), stream))
}

/// Deepest nesting a client body may have (raw values are not parsed, so serde's own
/// recursion limit does not see inside them; Python's json refuses about 1000 levels).
const MAX_BODY_DEPTH: usize = 512;

/// The deepest `[`/`{` nesting of a JSON text (brackets inside strings do not count).
fn nesting_depth(raw: &[u8]) -> usize {
    let (mut depth, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for &b in raw {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

#[derive(PartialEq, Clone, Copy)]
enum Json {
    Null,
    Bool,
    Number,
    String,
    Array,
    Object,
}

fn json_kind(v: &RawValue) -> Json {
    match v.get().as_bytes().first() {
        Some(b'n') => Json::Null,
        Some(b't') | Some(b'f') => Json::Bool,
        Some(b'"') => Json::String,
        Some(b'[') => Json::Array,
        Some(b'{') => Json::Object,
        _ => Json::Number,
    }
}

fn items(v: &RawValue) -> Vec<&RawValue> {
    serde_json::from_str(v.get()).unwrap_or_default()
}

fn is_integer(v: &RawValue) -> bool {
    json_kind(v) == Json::Number && !v.get().bytes().any(|b| matches!(b, b'.' | b'e' | b'E'))
}

fn validate(kind: Kind, body: &HashMap<String, &RawValue>) -> Result<(), BadRequest> {
    let bad = |m: &str| Err(BadRequest::new(m));
    let field = |k: &str| body.get(k).map(|v| (*v, json_kind(v))).filter(|(_, t)| *t != Json::Null);
    if body.get("stream").is_some_and(|v| json_kind(v) != Json::Bool) {
        return bad("'stream' must be true or false");
    }
    match kind {
        Kind::Generate => {
            let Some(key) = ["text", "input_ids", "input_embeds"].into_iter().find(|k| field(k).is_some()) else {
                return bad("/generate needs 'text' or 'input_ids'");
            };
            let (v, t) = field(key).expect("present");
            if key == "text" && t != Json::String {
                return if t == Json::Array { bad("batch requests (a list of texts) are not supported: send one prompt per request") } else { bad("'text' must be a string") };
            }
            if key == "input_ids" {
                let ids = if t == Json::Array { items(v) } else { Vec::new() };
                if ids.is_empty() {
                    return bad("'input_ids' must be a non-empty list of token ids");
                }
                if json_kind(ids[0]) == Json::Array {
                    return bad("batch requests (a list of id lists) are not supported: send one prompt per request");
                }
                if !ids.iter().all(|t| is_integer(t)) {
                    return bad("'input_ids' must hold integers");
                }
            }
            if field("sampling_params").is_some_and(|(_, t)| t != Json::Object) {
                return bad("'sampling_params' must be an object");
            }
        }
        Kind::Completions => match field("prompt") {
            None => return bad("/v1/completions needs 'prompt'"),
            Some((v, Json::Array)) => {
                let p = items(v);
                if !p.is_empty() && matches!(json_kind(p[0]), Json::String | Json::Array) && p.len() != 1 {
                    return bad("batch prompts are not supported: send one prompt per request");
                }
            }
            Some((_, Json::String)) => {}
            Some(_) => return bad("'prompt' must be a string or a list of token ids"),
        },
        Kind::Chat => {
            let ok = field("messages").is_some_and(|(v, t)| {
                let m = if t == Json::Array { items(v) } else { Vec::new() };
                !m.is_empty() && m.iter().all(|x| json_kind(x) == Json::Object)
            });
            if !ok {
                return bad("/v1/chat/completions needs 'messages', a non-empty list of objects");
            }
        }
    }
    let n_ok = match body.get("n") {
        None => true,
        Some(v) => match json_kind(v) {
            Json::Number => v.get().parse::<f64>().ok() == Some(1.0),
            Json::Bool => v.get() == "true", // Python: True == 1
            _ => false,
        },
    };
    if !n_ok {
        return bad("n > 1 is not supported by the PD router");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// On a one-thread runtime, a task beside the parse runs while a large body is checked
    /// (the check is off the serving thread), and does not while a small one is (a control:
    /// the counter can stay at zero). Counts, not times: deterministic on shared cores.
    #[tokio::test(flavor = "current_thread")]
    async fn large_bodies_are_checked_off_the_serving_thread() {
        async fn ticks_during(raw: Bytes) -> (usize, Result<(Bytes, bool), FlowError>) {
            let ticks = Arc::new(AtomicUsize::new(0));
            let ticker = tokio::spawn({
                let ticks = ticks.clone();
                async move {
                    loop {
                        ticks.fetch_add(1, Ordering::Relaxed);
                        tokio::task::yield_now().await;
                    }
                }
            });
            let parsed = parse_off_loop_if_large(Kind::Generate, raw).await;
            let seen = ticks.load(Ordering::Relaxed);
            ticker.abort();
            (seen, parsed)
        }
        let ids = |n: usize| Bytes::from(format!(r#"{{"input_ids":[{}1],"n":2}}"#, "1,".repeat(n)));
        let large = ids(2_000_000); // ~4 MB, tens of milliseconds to check
        assert!(large.len() > LARGE_BODY_BYTES);
        let (seen, parsed) = ticks_during(large).await;
        assert!(matches!(parsed, Err(FlowError::Bad(ref e)) if e.message.contains("n > 1")));
        assert!(seen > 0, "the serving thread was held for the whole check of a large body");
        let small = ids(1_000);
        assert!(small.len() <= LARGE_BODY_BYTES);
        let (seen, parsed) = ticks_during(small).await;
        assert!(parsed.is_err());
        assert_eq!(seen, 0, "a small body is checked in place, without yielding");
    }

    #[test]
    fn client_bodies_are_validated_per_endpoint() {
        let ok = |k, b: &str| parse_body(k, b.as_bytes()).map(|(_, s)| s);
        let err = |k, b: &str| parse_body(k, b.as_bytes()).unwrap_err().message;
        assert_eq!(ok(Kind::Generate, r#"{"text":"hi","stream":true}"#).unwrap(), true);
        assert!(err(Kind::Generate, r#"{"text":["a","b"]}"#).contains("batch requests"));
        assert!(err(Kind::Generate, r#"{"input_ids":[[1],[2]]}"#).contains("batch requests"));
        assert!(err(Kind::Generate, r#"{"input_ids":[1.5]}"#).contains("integers"));
        assert!(err(Kind::Generate, r#"{"text":"a","n":2}"#).contains("n > 1"));
        assert!(err(Kind::Generate, r#"{"text":"a","stream":"yes"}"#).contains("'stream'"));
        assert!(err(Kind::Generate, r#"{}"#).contains("needs 'text'"));
        assert!(err(Kind::Generate, "[1]").contains("JSON object"));
        assert!(err(Kind::Generate, "{").contains("not valid JSON"));
        let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
        assert!(err(Kind::Generate, &deep).contains("nested too deeply"));
        let deep = format!(r#"{{"text":"a","x":{}{}}}"#, "[".repeat(1_000_000), "]".repeat(1_000_000));
        assert_eq!(nesting_depth(br#"{"a":"[[[[\"{{","b":[{}]}"#), 3);
        assert!(err(Kind::Generate, &deep).contains("nested too deeply"));
        assert!(err(Kind::Completions, r#"{"prompt":["a","b"]}"#).contains("batch prompts"));
        assert!(ok(Kind::Completions, r#"{"prompt":["a"]}"#).is_ok());
        assert!(ok(Kind::Completions, r#"{"prompt":[1,2,3]}"#).is_ok());
        assert!(err(Kind::Chat, r#"{"messages":[]}"#).contains("messages"));
        assert!(ok(Kind::Chat, r#"{"messages":[{"role":"user","content":"x"}],"n":1}"#).is_ok());
        // the router's own fields are dropped from a client's body (the router writes them)
        let kept = parse_body(Kind::Generate, br#"{"text":"a","eldr_profile":{"cells":[1]},"bootstrap_room":7}"#).unwrap().0;
        assert_eq!(serde_json::from_slice::<Value>(&kept).unwrap(), serde_json::json!({"text": "a"}));
        // a number no machine type holds passes through as written
        let big = format!(r#"{{"text":"a","x":1{}}}"#, "0".repeat(400));
        assert!(String::from_utf8(parse_body(Kind::Generate, big.as_bytes()).unwrap().0.to_vec()).unwrap().contains(&"0".repeat(400)));
    }
}
