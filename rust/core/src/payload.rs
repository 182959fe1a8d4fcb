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

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;

use crate::centroid_file::CentroidSet;
use crate::signature::{norm_of, NoSignature, SignatureSpec, SparseSignature};

pub const PAYLOAD_VERSION: u64 = 1;
/// The stream-event key that carries the payload (in `meta_info` or `sglext`).
pub const META_KEY: &str = "eldr_signature";
/// Largest count grid a payload may claim (L*E): DeepSeek-V3 is 61 x 256 with its dense layers.
pub const MAX_ENTRIES: usize = 1 << 20;
pub const MAX_LAYERS: usize = 4096;
/// A count (and a log-quantizer maximum) is at most the tokens counted.
pub const MAX_COUNT: u64 = 1 << 40;
pub const MAX_EXPERTS: u64 = 1 << 16;
/// Default bound on the input and on the base64 field.
pub const DEFAULT_MAX_BYTES: usize = 1 << 20;

/// Why a payload was refused. The router counts it as malformed and falls back.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PayloadError {
    #[error("payload of {size} bytes exceeds {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("payload is not JSON ({0})")]
    NotJson(String),
    #[error("payload must be a JSON object, got {0}")]
    NotObject(&'static str),
    #[error("unsupported payload version {0} (expected 1)")]
    Version(String),
    /// A header field is missing or of the wrong type or range; the message says which.
    #[error("field '{field}' {problem}")]
    Field { field: &'static str, problem: String },
    #[error("field 'layers' repeats a layer id")]
    RepeatedLayer,
    #[error("{layers} layers x {experts} experts exceeds {MAX_ENTRIES} counts")]
    TooManyEntries { layers: usize, experts: usize },
    #[error("unknown encoding {0:?} (expected dense, sparse or log)")]
    Encoding(String),
    #[error("field 'd' is not valid base64 ({0})")]
    Base64(String),
    #[error("packed data holds {got} bytes, expected {want} for {values} values of {bits} bits")]
    DataLength { got: usize, want: usize, values: usize, bits: u32 },
    #[error("sparse data holds {got} bytes, expected {want} for {nnz} entries")]
    SparseLength { got: usize, want: usize, nnz: usize },
    #[error("sparse indices must be increasing and below layers*E")]
    SparseIndex,
    #[error("log encoding uses at most 16 bits")]
    LogBits,
    #[error("payload has {got} experts per layer, the centroids {want}")]
    Experts { got: usize, want: usize },
    #[error("payload covers {layers} layers (max id {max_id}), the centroids {want}: cannot align them")]
    Layers { layers: usize, max_id: u32, want: usize },
}

/// How the counts are packed.
#[derive(Debug, Clone, PartialEq)]
pub enum Encoding {
    /// Every count, row-major.
    Dense,
    /// `nnz` increasing flat indices (u16 when L*E <= 65536, else u32), then their counts.
    Sparse { nnz: usize },
    /// Per-row log quantization: `c = expm1(code * ln(1 + q[row]) / (2^bits - 1))` (lossy).
    Log { q: Vec<u64> },
}

/// What a payload carries: counts, or the prefill's reason for sending none (`{"v":1,"none":..}`).
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    Counts(DecodedCounts),
    NoCounts(String),
}

/// Bounds and the expected layout for [`decode`].
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    pub max_bytes: usize,
    /// `(num_layers, num_experts)` of the centroid file: a payload that cannot fit is refused unread.
    pub layout: Option<(usize, usize)>,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits { max_bytes: DEFAULT_MAX_BYTES, layout: None }
    }
}

/// Validated counts, still packed: `fill_signature` reads them in the route.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedCounts {
    layers: Vec<u32>,
    layers_ascending: bool,
    experts: usize,
    num_tokens: u64,
    bits: u32,
    encoding: Encoding,
    /// The base64-decoded bytes, followed by [`PAD`] zero bytes so every value reads one u64
    /// and every block of 8 values one 16-byte window.
    data: Vec<u8>,
    /// Length of the base64 field (the size the prefill sent).
    data_bytes: usize,
}

#[derive(Deserialize)]
struct Header<'a> {
    #[serde(borrow, default)]
    v: Option<&'a RawValue>,
    #[serde(borrow, default)]
    none: Option<&'a RawValue>,
    /// Captured raw, then read as integers (see [`U64List`]).
    #[serde(default)]
    layers: Option<U64List>,
    #[serde(borrow, default, rename = "E")]
    experts: Option<&'a RawValue>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    enc: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bits: Option<&'a RawValue>,
    #[serde(borrow, default)]
    nnz: Option<&'a RawValue>,
    #[serde(default)]
    q: Option<U64List>,
    /// Borrowed from the input when it holds no escape (base64 has none).
    #[serde(borrow, default)]
    d: Option<Text<'a>>,
}

/// A JSON string, borrowed from the input when it holds no escape. (serde's own `Cow<str>`
/// borrows only as a field's whole type, not inside an `Option`.)
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// A header list of non-negative integers. Any other value, or any other element, makes it
/// `Bad` instead of failing the header's parse, so the field gets its own message (and the
/// payload is counted as malformed). The list is captured raw first: serde_json refuses a
/// number past f64's range (`1e400`, a 400-digit integer) as it parses it, which would fail
/// the whole event, while skipping it as a raw value never converts it. It accepts what
/// `Vec<u64>`'s own deserializer accepts.
enum U64List {
    Ok(Vec<u64>),
    Bad,
}

impl<'de> Deserialize<'de> for U64List {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        if let Some(v) = plain_u64_list(raw.get().as_bytes()) {
            return Ok(U64List::Ok(v));
        }
        Ok(match serde_json::from_str::<Vec<u64>>(raw.get()) {
            Ok(v) => U64List::Ok(v),
            Err(_) => U64List::Bad,
        })
    }
}

/// A JSON list of plain decimal integers that fit u64 (digits only: no sign, fraction or
/// exponent, no leading zero), read directly: the form every encoder sends, for which serde's
/// `Vec<u64>` gives the same values. None for anything
/// else, which serde then reads. This runs twice per payload (`layers` and `q`), where
/// serde's second pass over the captured text cost about a sixth of the decode.
fn plain_u64_list(s: &[u8]) -> Option<Vec<u64>> {
    let ws = |i: &mut usize| {
        while *i < s.len() && matches!(s[*i], b' ' | b'\t' | b'\n' | b'\r') {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if s.get(i) != Some(&b'[') {
        return None;
    }
    i += 1;
    ws(&mut i);
    let mut out = Vec::with_capacity(s.len() / 2);
    if s.get(i) == Some(&b']') {
        i += 1;
        ws(&mut i);
        return (i == s.len()).then_some(out);
    }
    loop {
        let start = i;
        let mut v: u64 = 0;
        while let Some(&c) = s.get(i).filter(|c| c.is_ascii_digit()) {
            v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
            i += 1;
        }
        // JSON has no leading zeros: "00" is serde's to refuse (a captured RawValue never holds
        // one, but the reader does not lean on that)
        if i == start || (s[start] == b'0' && i - start > 1) {
            return None;
        }
        out.push(v);
        ws(&mut i);
        match s.get(i) {
            Some(b',') => {
                i += 1;
                ws(&mut i);
            }
            Some(b']') => {
                i += 1;
                ws(&mut i);
                return (i == s.len()).then_some(out);
            }
            _ => return None,
        }
    }
}

/// The list a [`U64List`] field holds, or the field's message.
fn u64_list<W: std::fmt::Display>(list: Option<U64List>, name: &'static str, what: impl Fn() -> W) -> Result<Vec<u64>, PayloadError> {
    match list {
        Some(U64List::Ok(v)) => Ok(v),
        _ => Err(PayloadError::Field { field: name, problem: format!("must be {}", what()) }),
    }
}

#[derive(Deserialize)]
struct Holder<'a> {
    #[serde(borrow, default)]
    eldr_signature: Option<Found<'a>>,
}

/// The value under the payload key, read in the same pass as the event: a payload object, a
/// list (meta_info lists per-request values: its first item), a JSON string of a payload, or
/// anything else (refused).
enum Found<'a> {
    Header(Header<'a>),
    Text(Cow<'a, str>),
    Null,
    Other(&'static str),
}

impl<'de: 'a, 'a> Deserialize<'de> for Found<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Found<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a counts payload")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Header::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Found::Header)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Found<'a>>()?.unwrap_or(Found::Other("an empty list"));
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(first)
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Found::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Found::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Found::Null)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Found::Null)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Found::Other("a boolean"))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Found::Other("a number"))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Found::Other("a number"))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Found::Other("a number"))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A stream event, parsed in one pass: the payload is captured unparsed. An event whose
/// `meta_info` / `sglext` is not an object fails this parse and is left to the caller's parser.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    meta_info: Option<Holder<'a>>,
    #[serde(borrow, default)]
    sglext: Option<Holder<'a>>,
}

/// A header that serde refused: a non-string `d` gets the field's own message.
fn header_error(text: &str, e: serde_json::Error) -> PayloadError {
    if e.is_data() && serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.get("d").is_some_and(|d| !d.is_string())) {
        return PayloadError::Field { field: "d", problem: "must be a base64 string".into() };
    }
    PayloadError::NotJson(e.to_string())
}

fn first_byte(s: &str) -> Option<u8> {
    s.bytes().find(|b| !b.is_ascii_whitespace())
}

fn kind_of(s: &str) -> &'static str {
    match first_byte(s) {
        Some(b'[') => "a list",
        Some(b'"') => "a string",
        Some(b'n') => "null",
        Some(b't') | Some(b'f') => "a boolean",
        None => "nothing",
        _ => "a number",
    }
}

/// What `layers` must be.
const LAYERS_WHAT: &str = "a non-empty list of at most 4096 layer ids in [0, 4096)";
const _: () = assert!(MAX_LAYERS == 4096);

/// `what` is called only on failure: the message is not built for a good payload.
fn field<'de, T: Deserialize<'de>, W: std::fmt::Display>(raw: Option<&'de RawValue>, name: &'static str, what: impl Fn() -> W) -> Result<T, PayloadError> {
    let problem = || PayloadError::Field { field: name, problem: format!("must be {}", what()) };
    let raw = raw.ok_or_else(problem)?;
    serde_json::from_str(raw.get()).map_err(|_| problem())
}

fn int_in(raw: Option<&RawValue>, name: &'static str, lo: u64, hi: u64) -> Result<u64, PayloadError> {
    // the message is built only on failure: this runs for every payload
    let bad = |got: &str| PayloadError::Field { field: name, problem: format!("must be an integer in [{lo}, {hi}], got {}", shown(got)) };
    let v: i128 = match raw {
        Some(r) => serde_json::from_str::<i128>(r.get()).map_err(|_| bad(r.get()))?,
        None => return Err(bad("nothing")),
    };
    if v < lo as i128 || v > hi as i128 {
        return Err(bad(&v.to_string()));
    }
    Ok(v as u64)
}

fn shown(s: &str) -> String {
    if s.len() > 40 {
        format!("{}...", &s[..s.char_indices().nth(40).map_or(s.len(), |(i, _)| i)])
    } else {
        s.to_owned()
    }
}

/// Zero bytes after the decoded data (see [`DecodedCounts`]'s `data`).
const PAD: usize = 16;

/// As Python's b64decode(validate=True): the standard alphabet, padding required. (SIMD: the
/// base64 field is most of the payload's bytes.)
const BASE64: base64_simd::Base64 = base64_simd::STANDARD;

/// Decode a payload (its JSON text: an object, a one-request list `[obj]` as meta_info gives
/// it, or a JSON string holding the object).
pub fn decode(json: &[u8], limits: &DecodeLimits) -> Result<Payload, PayloadError> {
    if json.len() > limits.max_bytes {
        return Err(PayloadError::TooLarge { size: json.len(), limit: limits.max_bytes });
    }
    let raw: &RawValue = serde_json::from_slice(json).map_err(|e| PayloadError::NotJson(e.to_string()))?;
    decode_value(raw, limits, 0)
}

/// Find and decode the payload in one stream event (`data:` JSON of an SSE line). `Ok(None)`:
/// the event is not JSON, not an object, or carries no payload; the caller's own parser sees it.
pub fn decode_event(event: &[u8], limits: &DecodeLimits) -> Result<Option<Payload>, PayloadError> {
    if let Some(Ok(found)) = decode_event_split(event, limits) {
        return Ok(found);
    }
    // No `d` to split off, or a refusal: the one-pass parse of the whole event decides (and
    // words every error as it always has).
    decode_event_whole(event, limits)
}

/// [`decode_event`] with the base64 field cut out before the JSON parse. That field is almost
/// all of an event's bytes, and a JSON parser reads a string byte by byte; base64 has no
/// escapes, so its end is the next quote, which memchr finds with SIMD. The event less the
/// field's text is parsed as usual (a few hundred bytes), and the cut is taken for the
/// payload's `d` only if serde's `d` is the empty string left at the very place of the cut:
/// then the whole event would have parsed the same, with that text as `d`. Base64 decoding
/// then validates the text (anything outside the alphabet fails it). None: no such field, or
/// serde's `d` is another one (a key `d` elsewhere, a payload sent as a JSON string).
fn decode_event_split(event: &[u8], limits: &DecodeLimits) -> Option<Result<Option<Payload>, PayloadError>> {
    let (start, end) = find_data_field(event)?;
    let mut rest = Vec::with_capacity(event.len() - (end - start));
    rest.extend_from_slice(&event[..start]);
    rest.extend_from_slice(&event[end..]);
    let ev = serde_json::from_slice::<Event>(&rest).ok()?;
    let cut = rest.as_ptr().wrapping_add(start);
    for h in [ev.meta_info, ev.sglext].into_iter().flatten() {
        match h.eldr_signature {
            None | Some(Found::Null) => continue,
            Some(Found::Header(h)) => {
                let at_cut = matches!(&h.d, Some(Text(Cow::Borrowed(d))) if d.is_empty() && d.as_ptr() == cut);
                return at_cut.then(|| from_header(h, Some(&event[start..end]), limits).map(Some));
            }
            _ => return None,
        }
    }
    None
}

/// The byte range of the text of the first `"d": "..."` in `event` whose text holds no quote
/// and no backslash (so it ends at the next quote).
fn find_data_field(event: &[u8]) -> Option<(usize, usize)> {
    let skip_ws = |mut i: usize| {
        while i < event.len() && matches!(event[i], b' ' | b'\t' | b'\n' | b'\r') {
            i += 1;
        }
        i
    };
    for key in memchr::memmem::find_iter(event, b"\"d\"") {
        let colon = skip_ws(key + 3);
        if event.get(colon) != Some(&b':') {
            continue;
        }
        let quote = skip_ws(colon + 1);
        if event.get(quote) != Some(&b'"') {
            continue;
        }
        let start = quote + 1;
        let len = memchr::memchr2(b'"', b'\\', &event[start..])?;
        return (event[start + len] == b'"').then_some((start, start + len));
    }
    None
}

/// [`decode_event`] by one serde pass over the whole event.
fn decode_event_whole(event: &[u8], limits: &DecodeLimits) -> Result<Option<Payload>, PayloadError> {
    // One pass over the event; one that does not fit the schema (a field of another type,
    // a payload header serde cannot read) is left to the caller's parser.
    let Ok(ev) = serde_json::from_slice::<Event>(event) else { return Ok(None) };
    for h in [ev.meta_info, ev.sglext].into_iter().flatten() {
        match h.eldr_signature {
            None | Some(Found::Null) => continue,
            Some(Found::Header(h)) => return from_header_own_d(h, limits).map(Some),
            Some(Found::Text(t)) => return decode(t.as_bytes(), limits).map(Some),
            Some(Found::Other(kind)) => return Err(PayloadError::NotObject(kind)),
        }
    }
    Ok(None)
}

fn decode_value(raw: &RawValue, limits: &DecodeLimits, depth: u8) -> Result<Payload, PayloadError> {
    let text = raw.get();
    match first_byte(text) {
        Some(b'{') => {}
        Some(b'[') if depth == 0 => {
            // meta_info lists per-request values; a one-request batch holds one payload
            let items: Vec<&RawValue> = serde_json::from_str(text).map_err(|e| PayloadError::NotJson(e.to_string()))?;
            return match items.first() {
                Some(first) => decode_value(first, limits, depth + 1),
                None => Err(PayloadError::NotObject("an empty list")),
            };
        }
        Some(b'"') if depth == 0 => {
            let inner: Cow<str> = serde_json::from_str(text).map_err(|e| PayloadError::NotJson(e.to_string()))?;
            let raw: &RawValue = serde_json::from_str(&inner).map_err(|e| PayloadError::NotJson(e.to_string()))?;
            return decode_value(raw, limits, depth + 1);
        }
        _ => return Err(PayloadError::NotObject(kind_of(text))),
    }
    from_header_own_d(serde_json::from_str(text).map_err(|e| header_error(text, e))?, limits)
}

fn from_header_own_d(mut h: Header<'_>, limits: &DecodeLimits) -> Result<Payload, PayloadError> {
    let d = h.d.take();
    from_header(h, d.as_ref().map(|t| t.0.as_bytes()), limits)
}

/// A parsed header, with the text of its base64 field `d` (None: the field is missing).
fn from_header(h: Header<'_>, d: Option<&[u8]>, limits: &DecodeLimits) -> Result<Payload, PayloadError> {
    let version_ok = h.v.is_some_and(|v| serde_json::from_str::<u64>(v.get()).ok() == Some(PAYLOAD_VERSION));
    if !version_ok {
        return Err(PayloadError::Version(h.v.map_or("None".into(), |v| shown(v.get()))));
    }
    if let Some(why) = h.none {
        let reason = serde_json::from_str::<String>(why.get()).unwrap_or_else(|_| why.get().to_owned());
        return Ok(Payload::NoCounts(reason));
    }
    let layers: Vec<u64> = u64_list(h.layers, "layers", || LAYERS_WHAT)?;
    if layers.is_empty() || layers.len() > MAX_LAYERS || layers.iter().any(|&l| l >= MAX_LAYERS as u64) {
        return Err(PayloadError::Field { field: "layers", problem: format!("must be {LAYERS_WHAT}") });
    }
    let layers: Vec<u32> = layers.into_iter().map(|l| l as u32).collect();
    let mut seen = [0u64; MAX_LAYERS / 64]; // a bitset on the stack: no allocation per payload
    for &l in &layers {
        let (word, bit) = (l as usize / 64, 1u64 << (l % 64));
        if seen[word] & bit != 0 {
            return Err(PayloadError::RepeatedLayer);
        }
        seen[word] |= bit;
    }
    let experts = int_in(h.experts, "E", 1, MAX_EXPERTS)? as usize;
    let num_tokens = int_in(h.n, "n", 0, MAX_COUNT)?;
    let bits = int_in(h.bits, "bits", 1, 32)? as u32;
    let rows = layers.len();
    if rows * experts > MAX_ENTRIES {
        return Err(PayloadError::TooManyEntries { layers: rows, experts });
    }
    let max_id = *layers.iter().max().expect("non-empty");
    if let Some((num_layers, num_experts)) = limits.layout {
        if experts != num_experts {
            return Err(PayloadError::Experts { got: experts, want: num_experts });
        }
        if rows != num_layers && max_id as usize >= num_layers {
            return Err(PayloadError::Layers { layers: rows, max_id, want: num_layers });
        }
    }
    let enc: Cow<str> = field(h.enc, "enc", || "a string")?;
    let d = d.ok_or_else(|| PayloadError::Field { field: "d", problem: "must be a base64 string".into() })?;
    if d.len() > limits.max_bytes {
        return Err(PayloadError::TooLarge { size: d.len(), limit: limits.max_bytes });
    }
    let size = rows * experts;
    // decoded straight into a buffer that has room for the padding (no copy, and not zeroed
    // first: the decoder writes every byte it reports)
    let mut data: Vec<u8> = Vec::with_capacity(BASE64.estimated_decoded_length(d.len()) + PAD);
    let got = BASE64.decode(d, base64_simd::Out::from_uninit_slice(data.spare_capacity_mut())).map_err(|e| PayloadError::Base64(e.to_string()))?.len();
    // SAFETY: the decode initialized the first `got` bytes of the spare capacity.
    unsafe { data.set_len(got) };
    let packed = |n: usize| (n * bits as usize).div_ceil(8);
    let encoding = match enc.as_ref() {
        "dense" => {
            if got != packed(size) {
                return Err(PayloadError::DataLength { got, want: packed(size), values: size, bits });
            }
            Encoding::Dense
        }
        "sparse" => {
            let nnz = int_in(h.nnz, "nnz", 0, size as u64)? as usize;
            let ib = nnz * index_width(size);
            if got != ib + packed(nnz) {
                return Err(PayloadError::SparseLength { got, want: ib + packed(nnz), nnz });
            }
            let mut prev: i64 = -1;
            for t in 0..nnz {
                let i = read_index(&data, size, t) as i64;
                if i <= prev || i >= size as i64 {
                    return Err(PayloadError::SparseIndex);
                }
                prev = i;
            }
            Encoding::Sparse { nnz }
        }
        "log" => {
            let q_what = || format!("a list of one maximum count in [0, {MAX_COUNT}] per layer");
            let q: Vec<u64> = u64_list(h.q, "q", q_what)?;
            if q.len() != rows || q.iter().any(|&x| x > MAX_COUNT) {
                return Err(PayloadError::Field { field: "q", problem: format!("must be {}", q_what()) });
            }
            if bits > 16 {
                return Err(PayloadError::LogBits);
            }
            if got != packed(size) {
                return Err(PayloadError::DataLength { got, want: packed(size), values: size, bits });
            }
            Encoding::Log { q }
        }
        other => return Err(PayloadError::Encoding(shown(other))),
    };
    data.extend_from_slice(&[0u8; PAD]);
    let layers_ascending = layers.windows(2).all(|w| w[0] < w[1]);
    Ok(Payload::Counts(DecodedCounts { layers, layers_ascending, experts, num_tokens, bits, encoding, data, data_bytes: d.len() }))
}

fn index_width(size: usize) -> usize {
    if size <= 1 << 16 {
        2
    } else {
        4
    }
}

#[inline(always)]
fn read_index(data: &[u8], size: usize, t: usize) -> u32 {
    if index_width(size) == 2 {
        u16::from_le_bytes([data[2 * t], data[2 * t + 1]]) as u32
    } else {
        u32::from_le_bytes([data[4 * t], data[4 * t + 1], data[4 * t + 2], data[4 * t + 3]])
    }
}

/// Little-endian bit packing, the encoder's side of what this module unpacks (as
/// `eldr_sglang.sglang_ext.payload._pack`): the tests and benches build payloads with it.
pub fn pack_bits(values: &[u32], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; (values.len() * bits as usize).div_ceil(8)];
    for (i, &v) in values.iter().enumerate() {
        for b in 0..bits as usize {
            if (v >> b) & 1 == 1 {
                let bit = i * bits as usize + b;
                out[bit / 8] |= 1 << (bit % 8);
            }
        }
    }
    out
}

/// Value `i` of a little-endian bit-packed run starting at byte `base`.
///
/// # Safety
/// `base + (i * bits) / 8 + 8 <= data.len()` (the decoder pads the data with PAD zero bytes).
#[inline(always)]
unsafe fn unpack(data: &[u8], base: usize, i: usize, bits: u32) -> u32 {
    let bp = i * bits as usize;
    let p = data.as_ptr().add(base + (bp >> 3)) as *const [u8; 8];
    let w = u64::from_le_bytes(p.read_unaligned());
    ((w >> (bp & 7)) & ((1u64 << bits) - 1)) as u32
}

/// `out.len()` consecutive values of a bit-packed run, starting at bit `start`.
///
/// # Safety
/// Every value's 8-byte window lies in `data` (the decoder pads the data with PAD zero bytes).
#[inline(always)]
unsafe fn unpack_run(data: &[u8], start: usize, bits: u32, out: &mut [u32]) {
    let mask = (1u64 << bits) - 1;
    let p = data.as_ptr();
    let mut bp = start;
    for o in out.iter_mut() {
        let w = u64::from_le_bytes((p.add(bp >> 3) as *const [u8; 8]).read_unaligned());
        *o = ((w >> (bp & 7)) & mask) as u32;
        bp += bits as usize;
    }
}

/// Append `(base + e, x[e])` for every nonzero `x[e]` at `out[len..]` (branch-free, as
/// `SignatureSpec::compact`); returns the new length.
///
/// # Safety
/// `out` must have capacity for `len + x.len()` entries.
#[inline(always)]
unsafe fn compact_run_scalar(out: &mut SparseSignature, mut len: usize, base: u32, x: &[f32]) -> usize {
    let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
    for (e, &v) in x.iter().enumerate() {
        ip.add(len).write(base + e as u32);
        vp.add(len).write(v);
        len += (v.to_bits() << 1 != 0) as usize;
    }
    len
}

/// For each 8-bit mask, the lanes whose bit is set, in order (the left-pack permutation of
/// the AVX2 row kernel).
#[cfg(target_arch = "x86_64")]
static LEFT_PACK: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let (mut k, mut lane) = (0, 0);
        while lane < 8 {
            if m & (1 << lane) != 0 {
                t[m][k] = lane as u32;
                k += 1;
            }
            lane += 1;
        }
        m += 1;
    }
    t
};

/// How the payload's rows map onto a `[num_layers, E]` layout: identity (the file holds only
/// the listed layers, in order) or by hidden-layer id.
#[derive(Clone, Copy)]
enum RowMap {
    Identity,
    ById,
}

impl DecodedCounts {
    pub fn layers(&self) -> &[u32] {
        &self.layers
    }
    pub fn num_experts(&self) -> usize {
        self.experts
    }
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }
    pub fn encoding(&self) -> &Encoding {
        &self.encoding
    }
    pub fn encoding_name(&self) -> &'static str {
        match self.encoding {
            Encoding::Dense => "dense",
            Encoding::Sparse { .. } => "sparse",
            Encoding::Log { .. } => "log",
        }
    }
    pub fn bits(&self) -> u32 {
        self.bits
    }
    pub fn exact(&self) -> bool {
        !matches!(self.encoding, Encoding::Log { .. })
    }
    /// Length of the base64 data field.
    pub fn data_bytes(&self) -> usize {
        self.data_bytes
    }

    fn row_map(&self, num_layers: usize, num_experts: usize) -> Result<RowMap, PayloadError> {
        if self.experts != num_experts {
            return Err(PayloadError::Experts { got: self.experts, want: num_experts });
        }
        if self.layers.len() == num_layers {
            return Ok(RowMap::Identity);
        }
        let max_id = *self.layers.iter().max().expect("non-empty");
        if (max_id as usize) < num_layers {
            Ok(RowMap::ById)
        } else {
            Err(PayloadError::Layers { layers: self.layers.len(), max_id, want: num_layers })
        }
    }

    #[inline(always)]
    fn layer_of(&self, map: RowMap, row: usize) -> usize {
        match map {
            RowMap::Identity => row,
            RowMap::ById => self.layers[row] as usize,
        }
    }

    /// Call `f(row, e, count)` for every nonzero count, in payload order.
    pub fn for_each_nonzero(&self, mut f: impl FnMut(usize, usize, f32)) {
        let (e_n, bits) = (self.experts, self.bits);
        let size = self.layers.len() * e_n;
        match &self.encoding {
            Encoding::Dense => {
                for i in 0..size {
                    // SAFETY: the length was checked at decode and the data is padded.
                    let v = unsafe { unpack(&self.data, 0, i, bits) };
                    if v != 0 {
                        f(i / e_n, i % e_n, v as f32);
                    }
                }
            }
            Encoding::Sparse { nnz } => {
                let base = nnz * index_width(size);
                for t in 0..*nnz {
                    let i = read_index(&self.data, size, t) as usize;
                    // SAFETY: as above.
                    let v = unsafe { unpack(&self.data, base, t, bits) };
                    if v != 0 {
                        f(i / e_n, i % e_n, v as f32);
                    }
                }
            }
            Encoding::Log { q } => {
                let mut lut = LogRow::default();
                for (row, &qmax) in q.iter().enumerate() {
                    lut.prepare(qmax, bits, e_n);
                    for e in 0..e_n {
                        // SAFETY: as above.
                        let code = unsafe { unpack(&self.data, 0, row * e_n + e, bits) };
                        if code != 0 {
                            f(row, e, lut.value(code));
                        }
                    }
                }
            }
        }
    }

    /// Dense counts `[rows, E]` in payload row order (tests, tools; the route never makes this).
    pub fn to_dense(&self) -> Vec<f32> {
        let e_n = self.experts;
        let mut out = vec![0f32; self.layers.len() * e_n];
        self.for_each_nonzero(|row, e, c| out[row * e_n + e] = c);
        out
    }

    /// Dense counts in a centroid file's `[num_layers, E]` layout: rows in order when the file
    /// holds only the listed layers, else placed at their hidden-layer ids (others stay zero).
    pub fn to_layout(&self, num_layers: usize, num_experts: usize) -> Result<Vec<f32>, PayloadError> {
        let map = self.row_map(num_layers, num_experts)?;
        let mut out = vec![0f32; num_layers * num_experts];
        self.for_each_nonzero(|row, e, c| out[self.layer_of(map, row) * num_experts + e] = c);
        Ok(out)
    }

    /// The request's signature into `out` (cleared first), for `spec`'s layout: only the rows of
    /// selected layers are unpacked, each count weighted as it is read. Same values, order and
    /// norm as [`SignatureSpec::fill_dense`] of [`Self::to_layout`].
    pub fn fill_signature(&self, spec: &SignatureSpec, out: &mut SparseSignature) -> Result<(), NoSignature> {
        self.fill_signature_with(spec, out, RowKernel::detect())
    }

    /// Distances from the request's signature to `set`'s centroids, read straight from the
    /// packed counts: each value is dotted into its centroid row as it is unpacked, with no
    /// signature in between unless `keep` asks for it (then it is written there, as
    /// [`Self::fill_signature`] writes it). The same bits as [`crate::distance::from_fill`] of
    /// `fill_signature` (both sum in [`crate::distance::order`]; `fused_matches_fill` checks).
    pub fn distances(&self, set: &CentroidSet, keep: Option<&mut SparseSignature>) -> Result<Vec<f64>, NoSignature> {
        self.distances_with(set, keep, RowKernel::detect())
    }

    fn distances_with(&self, set: &CentroidSet, keep: Option<&mut SparseSignature>, kernel: RowKernel) -> Result<Vec<f64>, NoSignature> {
        #[cfg(target_arch = "x86_64")]
        if kernel == RowKernel::Avx2 && self.fusable() {
            // SAFETY: AVX2 was detected (RowKernel::Avx2 is only made so), and the checks of fusable.
            unsafe {
                match set.num_workers() {
                    8 => return self.distances_avx2::<8>(set, keep),
                    16 => return self.distances_avx2::<16>(set, keep),
                    32 => return self.distances_avx2::<32>(set, keep),
                    64 => return self.distances_avx2::<64>(set, keep),
                    _ => {}
                }
            }
        }
        crate::distance::from_fill(set, keep, |spec, sig| self.fill_signature_with(spec, sig, kernel))
    }

    /// Whether the fused AVX2 route reads this payload: packed dense or log rows of at most
    /// `AVX2_MAX_BITS` bits, every log row tabled, and rows of whole 8-lane blocks (E a
    /// multiple of 8, so a block's lanes are its positions mod 8).
    #[cfg(target_arch = "x86_64")]
    fn fusable(&self) -> bool {
        let tabled = match self.encoding {
            Encoding::Dense => true,
            Encoding::Log { .. } => LogRow::tabled(self.bits, self.experts),
            Encoding::Sparse { .. } => false,
        };
        tabled && self.bits <= AVX2_MAX_BITS && self.experts % 8 == 0
    }

    /// # Safety
    /// AVX2 is available, `self.fusable()`, and K is the set's number of workers.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn distances_avx2<const K: usize>(&self, set: &CentroidSet, keep: Option<&mut SparseSignature>) -> Result<Vec<f64>, NoSignature> {
        let spec = set.spec();
        let map = self.row_map(spec.num_layers(), spec.num_experts()).map_err(|_| NoSignature::Shape)?;
        let (e_n, bits) = (self.experts, self.bits);
        // the payload row of each layer, so rows are read in signature order (ascending positions)
        let mut row_of = Vec::new();
        if let RowMap::ById = map {
            row_of = vec![usize::MAX; spec.num_layers()];
            for (row, &l) in self.layers.iter().enumerate() {
                row_of[l as usize] = row;
            }
        }
        let mut none = SparseSignature::default();
        let (out, keeping) = match keep {
            Some(out) => {
                out.index.clear();
                out.value.clear();
                out.index.reserve(spec.dim() + 8); // the SIMD stores write up to 8 past the last kept value
                out.value.reserve(spec.dim() + 8);
                (out, true)
            }
            None => (&mut none, false),
        };
        let m = set.centroid_blocks().as_ptr();
        let (scales, table) = (spec.scales(), spec.table());
        let mut st = crate::distance::avx2::Blocks::<K>::new();
        let (mut dots, mut n2) = (vec![0f64; K], 0f64);
        let mut lut = LogRow::default();
        // rows start at whole bytes: E is a multiple of 8 (fusable)
        let up = Unpack::new(bits, 0);
        let mut buf = vec![crate::centroid_file::Block8::default(); e_n / 8];
        let mut len = 0;
        // the payload rows of the selected layers, in signature order (a selected layer the
        // payload does not hold is zeros: skipped)
        let rows: Vec<(usize, usize)> = spec
            .selected_layers()
            .iter()
            .map(|&l| (l, match map {
                RowMap::Identity => l,
                RowMap::ById => row_of[l],
            }))
            .filter(|&(_, row)| row != usize::MAX)
            .collect();
        // small log tables (the default 6-bit codes) of every row at once, before the rows
        let mut tables = Vec::new();
        if let Encoding::Log { q } = &self.encoding {
            if LogRow::tabled(bits, e_n) && (1usize << bits) <= 64 {
                LogRow::prepare_small(rows.iter().map(|&(_, row)| q[row]), bits, &mut tables);
            }
        }
        for (at, &(l, row)) in rows.iter().enumerate() {
            let row_scales = &scales[l * e_n..(l + 1) * e_n];
            let base = table[l * e_n].0;
            let args = (&self.data[..], row * e_n, &up, row_scales, base, m, &mut st, &mut dots[..], &mut n2, &mut buf[..], &mut *out, len);
            macro_rules! row {
                ($log:expr, $regs:expr, $table:expr) => {
                    if keeping { fused_row::<K, $log, $regs, true>($table, args) } else { fused_row::<K, $log, $regs, false>($table, args) }
                };
            }
            len = match &self.encoding {
                Encoding::Log { .. } if !tables.is_empty() => {
                    let t = tables[at * LogRow::SMALL_BLOCKS..].as_ptr() as *const f32;
                    match (1usize << bits).div_ceil(8).next_power_of_two() {
                        1 => row!(true, 1, t),
                        2 => row!(true, 2, t),
                        4 => row!(true, 4, t),
                        _ => row!(true, 8, t),
                    }
                }
                Encoding::Log { q } => {
                    // more than 64 codes (tabled: fusable): the row's table is gathered
                    lut.prepare(q[row], bits, e_n);
                    row!(true, 0, lut.table().as_ptr())
                }
                _ => row!(false, 0, std::ptr::null()),
            };
        }
        st.flush::<true>(&mut dots, &mut n2);
        let norm = crate::signature::norm_from_squares(n2)?;
        if keeping {
            out.index.set_len(len);
            out.value.set_len(len);
            out.norm = norm;
        }
        let inv = 1.0 / norm;
        Ok(dots.into_iter().map(|v| 1.0 - v * inv).collect())
    }

    fn fill_signature_with(&self, spec: &SignatureSpec, out: &mut SparseSignature, kernel: RowKernel) -> Result<(), NoSignature> {
        out.index.clear();
        out.value.clear();
        let map = self.row_map(spec.num_layers(), spec.num_experts()).map_err(|_| NoSignature::Shape)?;
        let (e_n, bits) = (self.experts, self.bits);
        let table = spec.table();
        let weights = spec.layer_weights();
        let size = self.layers.len() * e_n;
        let cap = match self.encoding {
            Encoding::Sparse { nnz } => nnz,
            _ => spec.dim(),
        };
        out.index.reserve(cap + 8); // the SIMD stores write up to 8 past the last kept value
        out.value.reserve(cap + 8);
        let mut len = 0usize;
        match &self.encoding {
            Encoding::Dense | Encoding::Log { .. } => {
                let scales = spec.scales();
                let mut lut = LogRow::default();
                let mut scratch = RowScratch::default();
                for row in 0..self.layers.len() {
                    let l = self.layer_of(map, row);
                    if weights[l] <= 0.0 {
                        continue; // masked: never unpacked
                    }
                    let values = match &self.encoding {
                        Encoding::Log { q } => {
                            lut.prepare(q[row], bits, e_n);
                            RowValues::Log(&lut)
                        }
                        _ => RowValues::Counts,
                    };
                    // The row's output indices are consecutive (slot * E + e), so only the
                    // scales are read from the table.
                    let row_scales = &scales[l * e_n..(l + 1) * e_n];
                    let base = table[l * e_n].0;
                    // SAFETY: the data length was checked at decode and it is padded; at most E
                    // values per selected row, cap = selected rows * E, plus 8.
                    len = unsafe { kernel.fill_row(&self.data, row * e_n, bits, values, row_scales, base, out, len, &mut scratch) };
                }
            }
            Encoding::Sparse { nnz } => {
                let base = nnz * index_width(size);
                let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
                for t in 0..*nnz {
                    let i = read_index(&self.data, size, t) as usize;
                    let l = self.layer_of(map, i / e_n);
                    let (o, w) = table[l * e_n + i % e_n];
                    // SAFETY: as above; t < nnz = cap.
                    unsafe {
                        let x = w * unpack(&self.data, base, t, bits) as f32;
                        ip.add(len).write(o);
                        vp.add(len).write(x);
                        len += (x.to_bits() << 1 != 0) as usize;
                    }
                }
            }
        }
        // SAFETY: len <= cap values were written.
        unsafe {
            out.index.set_len(len);
            out.value.set_len(len);
        }
        if !self.layers_ascending && matches!(map, RowMap::ById) {
            SignatureSpec::sort_merge(out);
        }
        out.norm = norm_of(&out.index, &out.value)?;
        Ok(())
    }
}

/// What a packed dense-layout row's codes are: the counts themselves, or log codes.
#[derive(Clone, Copy)]
enum RowValues<'a> {
    Counts,
    Log(&'a LogRow),
}

/// Reused buffers of the portable row path.
#[derive(Default)]
struct RowScratch {
    codes: Vec<u32>,
    vals: Vec<f32>,
}

/// How a row of packed codes becomes signature entries. Both kernels write the same values in
/// the same order (`x = value(code) * scale[e]` in f32, zeros dropped), so a signature does not
/// depend on the machine (the `kernels_agree` property test checks it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum RowKernel {
    /// Three tight loops (unpack, value, weight + compact) that the compiler keeps in registers.
    Portable,
    /// AVX2, eight codes at a time: one gather reads their bit windows, a variable shift and a
    /// mask extract them, a second gather looks up log values in the row's table (counts are
    /// converted instead), one multiply weights them, and a left-pack keeps the nonzeros.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl RowKernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return RowKernel::Avx2;
        }
        RowKernel::Portable
    }

    /// Append the nonzero entries of the row of `scales.len()` codes starting at value `first`
    /// at `out[len..]`, output indices from `base`; returns the new length.
    ///
    /// # Safety
    /// Every code's 8-byte window lies in `data` (the decoder pads it with PAD zero bytes), and
    /// `out` has capacity for `len + scales.len() + 8` entries.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn fill_row(self, data: &[u8], first: usize, bits: u32, values: RowValues<'_>, scales: &[f32], base: u32, out: &mut SparseSignature, len: usize, scratch: &mut RowScratch) -> usize {
        #[cfg(target_arch = "x86_64")]
        if self == RowKernel::Avx2 && bits <= AVX2_MAX_BITS {
            // counts below 2^24 convert to f32 exactly, as `c as f32` does; a 4-byte window holds
            // any code of at most 25 bits at any bit offset
            match values {
                RowValues::Counts => return fill_row_avx2::<false>(data, first, bits, &[], scales, base, out, len),
                RowValues::Log(lut) if lut.table().len() == 1 << bits => return fill_row_avx2::<true>(data, first, bits, lut.table(), scales, base, out, len),
                RowValues::Log(_) => {}
            }
        }
        fill_row_portable(data, first, bits, values, scales, base, out, len, scratch)
    }
}

#[cfg(target_arch = "x86_64")]
const AVX2_MAX_BITS: u32 = 24;

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fill_row_portable(data: &[u8], first: usize, bits: u32, values: RowValues<'_>, scales: &[f32], base: u32, out: &mut SparseSignature, len: usize, scratch: &mut RowScratch) -> usize {
    let e_n = scales.len();
    scratch.codes.resize(e_n, 0);
    scratch.vals.resize(e_n, 0.0);
    let (codes, vals) = (&mut scratch.codes[..], &mut scratch.vals[..]);
    unpack_run(data, first * bits as usize, bits, codes);
    match values {
        RowValues::Log(lut) => lut.values(codes, vals),
        RowValues::Counts => {
            for (v, &c) in vals.iter_mut().zip(codes.iter()) {
                *v = c as f32;
            }
        }
    }
    for (v, &w) in vals.iter_mut().zip(scales) {
        *v *= w;
    }
    compact_run_scalar(out, len, base, vals)
}

/// See [`RowKernel::Avx2`]. `lut` (when `LOG`) holds `2^bits` values, so every code indexes it.
///
/// # Safety
/// As [`RowKernel::fill_row`], with AVX2 available and `bits <= AVX2_MAX_BITS`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn fill_row_avx2<const LOG: bool>(data: &[u8], first: usize, bits: u32, lut: &[f32], scales: &[f32], base: u32, out: &mut SparseSignature, mut len: usize) -> usize {
    let n = scales.len();
    let full = n / 8 * 8;
    let up = Unpack::new(bits, (first * bits as usize) & 7);
    // a gathered table: this path also serves rows the fused route does not (ragged E)
    let mut rd = RowReader::<LOG, 0>::new(&up, data, first, lut.as_ptr(), scales);
    let mut pk = LeftPack::new(out, base);
    let mut e = 0;
    while e < full {
        len = pk.push(rd.next_block(&up, e), len);
        e += 8;
    }
    let ip = out.index.as_mut_ptr();
    let vp = out.value.as_mut_ptr();
    for (e, &w) in scales.iter().enumerate().skip(full) {
        let code = unpack(data, 0, first + e, bits);
        let c = if LOG { *lut.get_unchecked(code as usize) } else { code as f32 };
        let x = c * w;
        ip.add(len).write(base + e as u32);
        vp.add(len).write(x);
        len += (x.to_bits() << 1 != 0) as usize;
    }
    len
}

/// How blocks of 8 `bits`-bit codes starting `s0` bits into a byte are unpacked. A block
/// spans `bits` whole bytes: when it fits one 16-byte window, a byte shuffle lays each code's
/// 4-byte window into its lane (bytes past the window's end are zeros the mask would drop
/// anyway); otherwise one gather reads the windows. A 4-byte window holds any code of at most
/// 25 bits at any bit offset.
#[cfg(target_arch = "x86_64")]
struct Unpack {
    bits: u32,
    shuffled: bool,
    ctrl: std::arch::x86_64::__m256i,
    shifts: std::arch::x86_64::__m256i,
    mask: std::arch::x86_64::__m256i,
}

#[cfg(target_arch = "x86_64")]
impl Unpack {
    /// # Safety
    /// AVX2 is available; `bits <= AVX2_MAX_BITS`, `s0 < 8`.
    #[inline(always)]
    unsafe fn new(bits: u32, s0: usize) -> Self {
        use std::arch::x86_64::*;
        let b = bits as usize;
        let mut ctrl = [0x80u8; 32];
        let mut shifts = [0i32; 8];
        for (i, sh) in shifts.iter_mut().enumerate() {
            let at = s0 + i * b;
            *sh = (at & 7) as i32;
            for t in 0..4 {
                if (at >> 3) + t < 16 {
                    ctrl[(i / 4) * 16 + (i % 4) * 4 + t] = ((at >> 3) + t) as u8;
                }
            }
        }
        Unpack {
            bits,
            shuffled: s0 + 8 * b <= 128,
            ctrl: _mm256_loadu_si256(ctrl.as_ptr() as *const __m256i),
            shifts: _mm256_loadu_si256(shifts.as_ptr() as *const __m256i),
            mask: _mm256_set1_epi32(((1u64 << bits) - 1) as u32 as i32),
        }
    }
}

/// The shared front of the AVX2 row kernels: a row of packed codes read eight at a time
/// ([`Unpack`]), each block valued and weighted by its scales, `x = value(code) * scale[e]`
/// in f32. Counts convert exactly (below 2^24), as `c as f32` does. A log table is gathered
/// (`REGS` = 0) or, when it has at most 64 entries (codes of at most 6 bits, the default),
/// held as `REGS` 8-lane registers and read by permutes and a blend tree on the code's high
/// bits, which is cheaper than a gather on the machines measured (AMD Zen 3).
#[cfg(target_arch = "x86_64")]
struct RowReader<const LOG: bool, const REGS: usize> {
    window: *const u8,
    src: *const i32,
    pos: std::arch::x86_64::__m256i,
    scales: *const f32,
    /// The log table: `2^bits` values (gathered), or REGS aligned blocks of 8.
    table: *const f32,
}

#[cfg(target_arch = "x86_64")]
impl<const LOG: bool, const REGS: usize> RowReader<LOG, REGS> {
    /// # Safety
    /// AVX2 is available; every code's window lies in `data` (the decoder pads it with PAD
    /// zero bytes); `unpack` is for this row's bits and bit offset; with `LOG`, `table` holds
    /// every code's value (as REGS 32-byte aligned blocks of 8 when REGS > 0).
    #[inline(always)]
    unsafe fn new(unpack: &Unpack, data: &[u8], first: usize, table: *const f32, scales: &[f32]) -> Self {
        use std::arch::x86_64::*;
        let b = unpack.bits as usize;
        let lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(b as i32));
        RowReader {
            window: data.as_ptr().add((first * b) >> 3),
            src: data.as_ptr() as *const i32,
            // bit offsets stay below 2^31: at most MAX_ENTRIES values of at most 24 bits
            pos: _mm256_add_epi32(_mm256_set1_epi32((first * b) as i32), lanes),
            scales: scales.as_ptr(),
            table,
        }
    }

    /// The weighted values of the row's block at `e` (blocks are read in order, `e` = 0, 8, ..).
    #[inline(always)]
    unsafe fn next_block(&mut self, u: &Unpack, e: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let codes = if u.shuffled {
            // SAFETY: the window starts in the data and the data ends with PAD = 16 zero bytes
            let w = _mm256_broadcastsi128_si256(_mm_loadu_si128(self.window as *const __m128i));
            self.window = self.window.add(u.bits as usize);
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(w, u.ctrl), u.shifts), u.mask)
        } else {
            let words = _mm256_i32gather_epi32::<1>(self.src, _mm256_srli_epi32::<3>(self.pos));
            let codes = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_and_si256(self.pos, _mm256_set1_epi32(7))), u.mask);
            self.pos = _mm256_add_epi32(self.pos, _mm256_set1_epi32(8 * u.bits as i32));
            codes
        };
        let c = if !LOG {
            _mm256_cvtepi32_ps(codes)
        } else if REGS > 0 {
            self.permuted(codes)
        } else {
            _mm256_i32gather_ps::<4>(self.table, codes)
        };
        _mm256_mul_ps(c, _mm256_loadu_ps(self.scales.add(e)))
    }

    /// `table[codes]` from REGS registers: each permuted by the code's low 3 bits, then one
    /// blend per further bit (blendv reads the sign bit, where the bit is shifted).
    #[inline(always)]
    unsafe fn permuted(&self, codes: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // macros, not closures: a closure would not inherit the caller's AVX2
        let t = self.table;
        macro_rules! p {
            ($r:expr) => {
                _mm256_permutevar8x32_ps(_mm256_load_ps(t.add(8 * $r)), codes)
            };
        }
        if REGS == 1 {
            return p!(0);
        }
        let b3 = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(codes));
        macro_rules! pair {
            ($r:expr) => {
                _mm256_blendv_ps(p!($r), p!($r + 1), b3)
            };
        }
        if REGS == 2 {
            return pair!(0);
        }
        let b4 = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(codes));
        macro_rules! quad {
            ($r:expr) => {
                _mm256_blendv_ps(pair!($r), pair!($r + 2), b4)
            };
        }
        if REGS == 4 {
            return quad!(0);
        }
        let b5 = _mm256_castsi256_ps(_mm256_slli_epi32::<26>(codes));
        _mm256_blendv_ps(quad!(0), quad!(4), b5)
    }
}

/// The nonzeros of eight values at a time appended to a signature, with their output
/// positions (a left-pack by movemask; +-0 drop out and a NaN stays, as the scalar test).
#[cfg(target_arch = "x86_64")]
struct LeftPack {
    ip: *mut u32,
    vp: *mut f32,
    idx: std::arch::x86_64::__m256i,
}

#[cfg(target_arch = "x86_64")]
impl LeftPack {
    /// # Safety
    /// AVX2 is available; `out` has room for 8 entries past the last one pushed.
    #[inline(always)]
    unsafe fn new(out: &mut SparseSignature, base: u32) -> Self {
        use std::arch::x86_64::*;
        let idx = _mm256_add_epi32(_mm256_set1_epi32(base as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        LeftPack { ip: out.index.as_mut_ptr(), vp: out.value.as_mut_ptr(), idx }
    }

    /// Append the nonzeros of `x` (the next 8 positions) at `len`; returns the new length.
    #[inline(always)]
    unsafe fn push(&mut self, x: std::arch::x86_64::__m256, len: usize) -> usize {
        use std::arch::x86_64::*;
        let keep = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NEQ_UQ>(x, _mm256_setzero_ps())) as usize;
        let perm = _mm256_loadu_si256(LEFT_PACK[keep].as_ptr() as *const __m256i);
        _mm256_storeu_ps(self.vp.add(len), _mm256_permutevar8x32_ps(x, perm));
        _mm256_storeu_si256(self.ip.add(len) as *mut __m256i, _mm256_permutevar8x32_epi32(self.idx, perm));
        self.idx = _mm256_add_epi32(self.idx, _mm256_set1_epi32(8));
        len + keep.count_ones() as usize
    }
}

/// What [`fused_row`] reads and updates: the packed data, the row's first value, the unpack
/// constants, the row's scales, its first output position, the block-major centroids, the
/// lane sums, the f64 dot and norm totals, the row's value buffer, and the kept signature
/// with its length.
#[cfg(target_arch = "x86_64")]
type FusedArgs<'a, const K: usize> =
    (&'a [u8], usize, &'a Unpack, &'a [f32], u32, *const crate::centroid_file::Block8, &'a mut crate::distance::avx2::Blocks<K>, &'a mut [f64], &'a mut f64, &'a mut [crate::centroid_file::Block8], &'a mut SparseSignature, usize);

/// One row of the fused wire route, in two passes: the [`RowReader`] unpacks and values the
/// row eight codes at a time into a small buffer (with `KEEP`, the nonzeros are also
/// left-packed into the kept signature), then [`crate::distance::avx2::Blocks::add_run`] dots
/// each block into the K centroids' same eight positions and squares it into the norm, in
/// [`crate::distance::order`]. Two passes, because one would hold the lane sums, the table and
/// the unpack constants at once, more than the 16 vector registers (the spills cost more than
/// the buffer, which stays in L1). Returns the kept signature's length.
///
/// # Safety
/// As [`fill_row_avx2`] (the kept signature has room for D + 8 entries when `KEEP`), with
/// `table` as [`RowReader::new`] takes it; the row's positions lie below D, its first position
/// is a multiple of 8, the buffer holds a block per 8 of the row's values, and `blocks` is the
/// set's [`crate::centroid_file::CentroidSet::centroid_blocks`] for K centroids.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn fused_row<const K: usize, const LOG: bool, const REGS: usize, const KEEP: bool>(table: *const f32, args: FusedArgs<'_, K>) -> usize {
    use std::arch::x86_64::_mm256_store_ps;
    let (data, first, unpack, scales, base, blocks, st, dots, n2, buf, out, mut len) = args;
    let mut rd = RowReader::<LOG, REGS>::new(unpack, data, first, table, scales);
    let mut pk = LeftPack::new(out, base);
    let xs = &mut buf[..scales.len() / 8];
    for (i, x) in xs.iter_mut().enumerate() {
        let v = rd.next_block(unpack, 8 * i);
        if KEEP {
            len = pk.push(v, len);
        }
        _mm256_store_ps(x.0.as_mut_ptr(), v);
    }
    st.add_run(xs, base as usize, blocks, dots, n2);
    len
}

/// One row's log-decoded values `c(code) = expm1(code * ln(1 + q) / (2^bits - 1))`, as the
/// Python encoder defines them (f64, then rounded to f32). With no more codes than
/// max(E, 64) they are tabled once per row, for every code, by the recurrence
/// `u(a+b) = u(a) + u(b) + u(a) * u(b)` (`expm1` of a sum) from `u(1) = expm1(scale)`: one
/// transcendental call per row instead of one per count. Every term is positive, so nothing
/// cancels: the f64 error grows by a few ulps a step, far below f32 rounding, and a tabled
/// value is the formula's f32 or one f32 ulp from it (`lut_matches_formula` checks this).
/// Code 0 is always 0.
#[derive(Default)]
struct LogRow {
    scale: f64,
    /// Values in the table (0: none): every code `0..2^bits`.
    len: usize,
    /// A table of at most 64 values, in aligned blocks of 8 (zeros past its end, room for the
    /// chains' last block), the layout [`Self::prepare_small`] gives every row of the fused
    /// route at once; a larger one is in `big`.
    small: [crate::centroid_file::Block8; Self::SMALL_BLOCKS],
    big: Vec<f32>,
}

impl LogRow {
    fn prepare(&mut self, qmax: u64, bits: u32, experts: usize) {
        let levels = (1u64 << bits) - 1;
        self.scale = (qmax as f64).ln_1p() / levels as f64;
        self.len = 0;
        if !Self::tabled(bits, experts) {
            return;
        }
        // u(1..=8) in one chain, then eight independent chains u(j + 8i) (each step adds
        // u(8)), so the table is not one long chain of dependent multiply-adds
        let step = |u: f64, v: f64| u + v + u * v;
        let u1 = self.scale.exp_m1();
        let mut cur = [0f64; 8];
        let mut u = 0.0;
        for c in cur.iter_mut() {
            u = step(u, u1);
            *c = u;
        }
        let n = levels as usize + 1;
        // whole blocks of 8 from code 1: n + 7 values are written, the last ones past n
        let table: &mut [f32] = if n <= 64 {
            // SAFETY: Block8 is 8 f32s with no padding, so the 9 blocks are 72 f32s.
            unsafe { std::slice::from_raw_parts_mut(self.small.as_mut_ptr() as *mut f32, 72) }
        } else {
            self.big.clear();
            self.big.resize(n + 8, 0.0);
            &mut self.big
        };
        table[0] = 0.0;
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected. The same operations in the same order, on wider lanes.
            unsafe { table_chains_avx2(&mut table[1..n + 7], cur) };
        } else {
            table_chains(&mut table[1..n + 7], cur);
        }
        #[cfg(not(target_arch = "x86_64"))]
        table_chains(&mut table[1..n + 7], cur);
        if n <= 64 {
            table[n..].iter_mut().for_each(|v| *v = 0.0); // the permutes read whole blocks
        }
        self.len = n;
    }

    /// Aligned blocks of 8 per small table (see `small`).
    const SMALL_BLOCKS: usize = 9;

    /// The tables of many rows of at most 64 codes, `SMALL_BLOCKS` blocks each in `out`, with
    /// the bits `prepare` gives each row alone: the same f64 operations in the same order, with
    /// four rows in the lanes of one vector. A row alone is two chains of dependent
    /// multiply-adds; four rows at once keep the vector units busy instead of waiting on them.
    fn prepare_small(qs: impl ExactSizeIterator<Item = u64>, bits: u32, out: &mut Vec<crate::centroid_file::Block8>) {
        debug_assert!(bits <= 6);
        let rows = qs.len();
        out.clear();
        out.resize(rows.div_ceil(4) * 4 * Self::SMALL_BLOCKS, Default::default());
        let levels = (1u64 << bits) - 1;
        let n = levels as usize + 1;
        let mut q4 = [0u64; 4];
        let mut qs = qs;
        for group in 0..rows.div_ceil(4) {
            for q in q4.iter_mut() {
                *q = qs.next().unwrap_or(0);
            }
            // SAFETY: Block8 is 8 f32s with no padding: 4 rows of SMALL_BLOCKS blocks
            let t = unsafe {
                std::slice::from_raw_parts_mut(out[group * 4 * Self::SMALL_BLOCKS..].as_mut_ptr() as *mut f32, 4 * 8 * Self::SMALL_BLOCKS)
            };
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 was detected. The same operations in the same order, on wider lanes.
                unsafe { small_tables_avx2(t, q4, levels, n) };
                continue;
            }
            small_tables(t, q4, levels, n);
        }
        out.truncate(rows * Self::SMALL_BLOCKS);
    }

    /// The value of every code (empty: none tabled).
    fn table(&self) -> &[f32] {
        if self.len <= 64 {
            // SAFETY: as in `prepare`; len <= 64 < 72.
            unsafe { std::slice::from_raw_parts(self.small.as_ptr() as *const f32, self.len) }
        } else {
            &self.big[..self.len]
        }
    }

    /// Whether rows of `bits`-bit codes get a table (`prepare`).
    fn tabled(bits: u32, experts: usize) -> bool {
        ((1u64 << bits) - 1) as usize <= experts.max(64)
    }

    fn values(&self, codes: &[u32], out: &mut [f32]) {
        let t = self.table();
        // codes have `bits` bits, so c <= levels < t.len() whenever there is a table; the check
        // is one vectorized pass, and lets the lookups below run unchecked
        if !t.is_empty() && codes.iter().all(|&c| (c as usize) < t.len()) {
            for (v, &c) in out.iter_mut().zip(codes) {
                // SAFETY: checked just above
                *v = unsafe { *t.get_unchecked(c as usize) };
            }
        } else {
            for (v, &c) in out.iter_mut().zip(codes) {
                *v = self.value(c);
            }
        }
    }

    #[inline(always)]
    fn value(&self, code: u32) -> f32 {
        match self.table().get(code as usize) {
            Some(&v) => v,
            None if code == 0 => 0.0,
            None => (code as f64 * self.scale).exp_m1() as f32,
        }
    }
}

/// The table's eight chains from `u(1..=8)` (see [`LogRow`]): block i holds `u(j + 8i)`.
#[inline(always)]
fn table_chains(table: &mut [f32], mut cur: [f64; 8]) {
    let step = |u: f64, v: f64| u + v + u * v;
    let u8 = cur[7];
    for block in table.chunks_exact_mut(8) {
        for (t, c) in block.iter_mut().zip(cur.iter_mut()) {
            *t = *c as f32;
            *c = step(*c, u8);
        }
    }
}

/// Four rows' small tables (see [`LogRow::prepare_small`]) into `t`, 72 values a row: the
/// steps of [`LogRow::prepare`] and [`table_chains`], row `i` in lane `i`.
#[inline(always)]
fn small_tables(t: &mut [f32], q: [u64; 4], levels: u64, n: usize) {
    const W: usize = 8 * LogRow::SMALL_BLOCKS;
    assert!(t.len() >= 4 * W && (2..=64).contains(&n));
    // four lanes at once, each `u + v + u * v` as the scalar step (no fused multiply-add)
    #[inline(always)]
    fn step(u: [f64; 4], v: [f64; 4]) -> [f64; 4] {
        [u[0] + v[0] + u[0] * v[0], u[1] + v[1] + u[1] * v[1], u[2] + v[2] + u[2] * v[2], u[3] + v[3] + u[3] * v[3]]
    }
    let u1 = q.map(|q| ((q as f64).ln_1p() / levels as f64).exp_m1());
    // u(1..=8) of each row, then the eight chains u(j + 8i) (each step adds u(8))
    let mut cur = [[0f64; 4]; 8];
    let mut u = [0f64; 4];
    for c in cur.iter_mut() {
        u = step(u, u1);
        *c = u;
    }
    let u8 = cur[7];
    let p = t.as_mut_ptr();
    // table[1..n + 7] in whole blocks of 8, as `prepare` writes it
    for b in 0..(n + 6) / 8 {
        for (j, c) in cur.iter_mut().enumerate() {
            let x = c.map(|v| v as f32);
            for (i, &x) in x.iter().enumerate() {
                // SAFETY: 1 + 8b + j <= n + 6 <= 70 < W, and t holds 4 rows of W
                unsafe { *p.add(i * W + 1 + 8 * b + j) = x };
            }
            *c = step(*c, u8);
        }
    }
    for i in 0..4 {
        t[i * W] = 0.0;
        t[i * W + n..(i + 1) * W].iter_mut().for_each(|v| *v = 0.0); // the permutes read whole blocks
    }
}

/// [`small_tables`] compiled for AVX2 (four f64 lanes: one row each); the same bits.
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn small_tables_avx2(t: &mut [f32], q: [u64; 4], levels: u64, n: usize) {
    small_tables(t, q, levels, n)
}

/// [`table_chains`] compiled for AVX2, whose 4-wide f64 lanes the compiler then uses (the
/// baseline target has 2-wide ones); the values are the same bits.
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn table_chains_avx2(table: &mut [f32], cur: [f64; 8]) {
    table_chains(table, cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(s: &str) -> Result<Payload, PayloadError> {
        decode(s.as_bytes(), &DecodeLimits::default())
    }

    #[test]
    fn dense_three_bits() {
        // values 1..=8 masked to 3 bits: 1,2,3,4,5,6,7,0 packed little-endian
        let vals: Vec<u32> = (1..=8).map(|v| v % 8).collect();
        let mut bitsv = Vec::new();
        for v in &vals {
            for b in 0..3 {
                bitsv.push((v >> b) & 1);
            }
        }
        let bytes: Vec<u8> = bitsv.chunks(8).map(|c| c.iter().enumerate().map(|(i, &b)| (b as u8) << i).sum()).collect();
        let d = base64_simd::STANDARD.encode_to_string(&bytes);
        let p = format!(r#"{{"v":1,"layers":[0,1],"E":4,"n":1,"enc":"dense","bits":3,"d":"{d}"}}"#);
        let Payload::Counts(c) = dec(&p).unwrap() else { panic!() };
        assert_eq!(c.to_dense(), vals.iter().map(|&v| v as f32).collect::<Vec<_>>());
    }

    proptest::proptest! {
        /// The direct list reader gives serde's `Vec<u64>` answer whenever it answers, and
        /// answers for every list of plain integers however spaced.
        #[test]
        fn plain_lists_read_as_serde_reads_them(vals in proptest::collection::vec(proptest::num::u64::ANY, 0..20), sep in "[ \t\n\r]{0,2}", junk in "[-0-9.eE+ ,\\[\\]a]{0,12}") {
            let text = format!("[{sep}{}{sep}]", vals.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(&format!("{sep},{sep}")));
            proptest::prop_assert_eq!(plain_u64_list(text.as_bytes()), Some(vals.clone()));
            for t in [junk.clone(), format!("[{junk}]"), format!("[1,{junk}]")] {
                if let Some(got) = plain_u64_list(t.as_bytes()) {
                    proptest::prop_assert_eq!(Some(got), serde_json::from_str::<Vec<u64>>(&t).ok(), "{}", t);
                }
            }
        }
    }

    #[test]
    fn plain_list_reader_refuses_what_serde_must_judge() {
        for t in ["[00]", "[1,007]", "[-0]", "[1.0]", "[1e3]", "[18446744073709551616]", "[1,]", "[,1]", "[1 2]", "{}", "[1]x", "1"] {
            assert_eq!(plain_u64_list(t.as_bytes()), None, "{t}");
        }
        assert_eq!(plain_u64_list(b" [ 0 , 18446744073709551615 ] "), Some(vec![0, u64::MAX]));
        assert_eq!(plain_u64_list(b"[]"), Some(vec![]));
    }

    #[test]
    fn malformed_is_typed() {
        assert!(matches!(dec("nope"), Err(PayloadError::NotJson(_))));
        assert!(matches!(dec("3"), Err(PayloadError::NotObject(_))));
        assert!(matches!(dec(r#"{"v":2}"#), Err(PayloadError::Version(_))));
        assert!(matches!(dec(r#"{"v":1,"layers":[0,0],"E":1,"n":0,"bits":1,"enc":"dense","d":""}"#), Err(PayloadError::RepeatedLayer)));
        assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":0,"bits":1,"enc":"dense","d":"***"}"#), Err(PayloadError::Base64(_))));
        assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":0,"bits":1,"enc":"dense","d":"AAAA"}"#), Err(PayloadError::DataLength { .. })));
        assert!(matches!(dec(r#"{"v":1,"layers":[true],"E":1,"n":0,"bits":1,"enc":"dense","d":""}"#), Err(PayloadError::Field { field: "layers", .. })));
        assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":-1,"bits":1,"enc":"dense","d":""}"#), Err(PayloadError::Field { field: "n", .. })));
        assert!(matches!(dec(r#"{"v":1,"layers":[0],"E":1,"n":1e400,"bits":1,"enc":"dense","d":""}"#), Err(_)));
        // crafted to allocate: refused before anything is made
        let big = format!(r#"{{"v":1,"layers":[{}],"E":65536,"n":1,"enc":"sparse","bits":1,"nnz":0,"d":""}}"#, (0..4096).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        assert!(matches!(dec(&big), Err(PayloadError::TooManyEntries { .. })));
        assert_eq!(dec(r#"{"v":1,"none":"too_long"}"#), Ok(Payload::NoCounts("too_long".into())));
    }


    /// A dense (`q` None) or log payload of `codes` `[rows, e]`, rows at hidden-layer `ids`.
    fn payload_of(codes: &[u32], ids: &[u32], e: usize, bits: u32, q: Option<&[u64]>) -> DecodedCounts {
        let d = base64_simd::STANDARD.encode_to_string(pack_bits(codes, bits));
        let enc = match q {
            None => r#""enc":"dense""#.to_owned(),
            Some(q) => format!(r#""enc":"log","q":{q:?}"#),
        };
        let p = format!(r#"{{"v":1,"layers":{ids:?},"E":{e},"n":5,"bits":{bits},{enc},"d":"{d}"}}"#);
        let Payload::Counts(c) = dec(&p).unwrap() else { panic!("{p}") };
        c
    }

    fn bits_of(sig: &SparseSignature) -> (Vec<u32>, Vec<u32>, u64) {
        (sig.index.clone(), sig.value.iter().map(|v| v.to_bits()).collect(), sig.norm.to_bits())
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    proptest::proptest! {
        /// The AVX2 row kernel and the portable one give the same signature to the bit, and both
        /// the one `fill_dense` gives for the decoded counts, for dense and log rows, every bit
        /// width, widths of E that leave a scalar tail, and rows placed by id out of order.
        #[test]
        fn kernels_agree(
            rows in 1usize..6, e in 1usize..40, bits in 1u32..=24, log in proptest::bool::ANY, seed in 0u64..u64::MAX,
            zeros in 0u32..4, by_id in proptest::bool::ANY,
        ) {
            let bits = if log { bits.min(16) } else { bits };
            let mut s = seed | 1;
            let mut next = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
            let codes: Vec<u32> = (0..rows * e).map(|_| if next() % 4 < zeros as u64 { 0 } else { (next() & ((1u64 << bits) - 1)) as u32 }).collect();
            let q: Vec<u64> = (0..rows).map(|_| next() % (1 << (next() % 41))).collect();
            let num_layers = if by_id { rows + 2 } else { rows };
            let mut ids: Vec<u32> = (0..num_layers as u32).collect();
            if by_id {
                ids.reverse();
                ids.truncate(rows);
            } else {
                ids.truncate(rows);
            }
            let c = payload_of(&codes, &ids, e, bits, log.then_some(&q[..]));
            let weights: Vec<f32> = (0..num_layers).map(|l| if l % 3 == 1 { 0.0 } else { 0.5 + (next() % 100) as f32 / 50.0 }).collect();
            proptest::prop_assume!(weights.iter().any(|&w| w > 0.0));
            let idf: Vec<f32> = (0..num_layers * e).map(|_| (next() % 400) as f32 / 100.0).collect();
            let spec = SignatureSpec::new(&weights, &idf).unwrap();
            let dense = c.to_layout(num_layers, e).unwrap();
            let want = spec.from_dense(&dense);
            let mut got = SparseSignature::default();
            let portable = c.fill_signature_with(&spec, &mut got, RowKernel::Portable).map(|_| bits_of(&got));
            proptest::prop_assert_eq!(&portable, &want.as_ref().map(bits_of).map_err(|e| *e));
            let auto = c.fill_signature(&spec, &mut got).map(|_| bits_of(&got));
            proptest::prop_assert_eq!(&auto, &portable);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                let simd = c.fill_signature_with(&spec, &mut got, RowKernel::Avx2).map(|_| bits_of(&got));
                proptest::prop_assert_eq!(&simd, &portable);
            }
        }

        /// The fused wire route (values dotted as they are unpacked) against the signature it
        /// replaces (`fill_signature`, then the sparse dot), to the bit: distances, and the kept
        /// signature's indices, values and norm; for dense and log rows, E a multiple of 8 or
        /// not (which leaves the fused path), K with and without a SIMD kernel, rows placed by
        /// id out of order, and selected layers the payload lacks.
        #[test]
        fn fused_matches_fill(
            rows in 1usize..6, e8 in 1usize..6, ragged in proptest::bool::ANY, bits in 1u32..=24, log in proptest::bool::ANY,
            seed in 0u64..u64::MAX, zeros in 0u32..4, by_id in proptest::bool::ANY,
            k in proptest::sample::select(vec![1usize, 3, 8, 16, 32]),
        ) {
            let e = if ragged { 8 * e8 + 3 } else { 8 * e8 };
            let bits = if log { bits.min(16) } else { bits };
            let mut s = seed | 1;
            let mut next = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
            let codes: Vec<u32> = (0..rows * e).map(|_| if next() % 4 < zeros as u64 { 0 } else { (next() & ((1u64 << bits) - 1)) as u32 }).collect();
            let q: Vec<u64> = (0..rows).map(|_| next() % (1 << (next() % 41))).collect();
            let num_layers = if by_id { rows + 2 } else { rows };
            let mut ids: Vec<u32> = (0..num_layers as u32).collect();
            if by_id {
                ids.reverse();
            }
            ids.truncate(rows);
            let c = payload_of(&codes, &ids, e, bits, log.then_some(&q[..]));
            let weights: Vec<f32> = (0..num_layers).map(|l| if l % 3 == 1 { 0.0 } else { 0.5 + (next() % 100) as f32 / 50.0 }).collect();
            proptest::prop_assume!(weights.iter().any(|&w| w > 0.0));
            let idf: Vec<f32> = (0..num_layers * e).map(|_| (next() % 400) as f32 / 100.0).collect();
            let dim = weights.iter().filter(|&&w| w > 0.0).count() * e;
            let cents: Vec<f32> = (0..k * dim).map(|_| (next() % 1000) as f32 / 997.0).collect();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.eldr");
            crate::CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| i.to_string()).collect(), provenance: "" }
                .write(&path)
                .unwrap();
            let set = CentroidSet::open(&path).unwrap();
            let mut want_sig = SparseSignature::default();
            let want = crate::distance::from_fill(&set, Some(&mut want_sig), |spec, sig| c.fill_signature_with(spec, sig, RowKernel::Portable));
            let bits_of_d = |d: &Result<Vec<f64>, NoSignature>| d.clone().map(|d| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            let mut kernels = vec![RowKernel::Portable];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                kernels.push(RowKernel::Avx2);
            }
            for kernel in kernels {
                let mut sig = SparseSignature { index: vec![7], value: vec![1.0], norm: 1.0 };
                let got = c.distances_with(&set, Some(&mut sig), kernel);
                proptest::prop_assert_eq!(bits_of_d(&got), bits_of_d(&want), "{:?}", kernel);
                if want.is_ok() {
                    proptest::prop_assert_eq!(bits_of(&sig), bits_of(&want_sig), "{:?}", kernel);
                }
                let unkept = c.distances_with(&set, None, kernel);
                proptest::prop_assert_eq!(bits_of_d(&unkept), bits_of_d(&want), "{:?}", kernel);
            }
        }

        /// Many rows' small tables at once are each row's own table, bit for bit (zeros past
        /// the codes included: the permutes read whole blocks), for any row count.
        #[test]
        fn small_tables_match_row_tables(qs in proptest::collection::vec(0u64..=MAX_COUNT, 0..11), bits in 1u32..=6) {
            let mut tables = Vec::new();
            LogRow::prepare_small(qs.iter().copied(), bits, &mut tables);
            proptest::prop_assert_eq!(tables.len(), qs.len() * LogRow::SMALL_BLOCKS);
            for (i, &q) in qs.iter().enumerate() {
                let mut lut = LogRow::default();
                lut.prepare(q, bits, 8);
                let want: Vec<u32> = lut.small.iter().flat_map(|b| b.0).map(f32::to_bits).collect();
                let got: Vec<u32> = tables[i * LogRow::SMALL_BLOCKS..(i + 1) * LogRow::SMALL_BLOCKS].iter().flat_map(|b| b.0).map(f32::to_bits).collect();
                proptest::prop_assert_eq!(got, want, "row {} (q {})", i, q);
            }
        }

        /// The log table against the formula it replaces, `expm1(code * ln(1 + q) / levels)`
        /// in f64 rounded to f32: within one f32 ulp for every code, 0 for code 0, and the
        /// decoded counts (which read the table) agree with the formula the same way.
        #[test]
        fn lut_matches_formula(qexp in 0u32..=40, qfrac in 0u64..u64::MAX, bits in 1u32..=16, experts in 1usize..300) {
            let q = if qexp == 0 { 0 } else { (1u64 << (qexp - 1)) + qfrac % (1u64 << (qexp - 1)) };
            let mut lut = LogRow::default();
            lut.prepare(q, bits, experts);
            let levels = (1u32 << bits) - 1;
            let scale = (q as f64).ln_1p() / levels as f64;
            let formula = |code: u32| (code as f64 * scale).exp_m1() as f32;
            if levels as usize <= experts.max(64) {
                proptest::prop_assert_eq!(lut.table().len(), 1usize << bits);
            }
            proptest::prop_assert_eq!(lut.value(0), 0.0);
            for code in 0..=levels.min(5000) {
                let (a, b) = (lut.value(code), formula(code));
                proptest::prop_assert!(ulps(a, b) <= 1, "code {} of {}: table {} vs formula {}", code, levels, a, b);
            }
            // the decoded counts of one row, through the table
            let e = (levels as usize + 1).min(64);
            let codes: Vec<u32> = (0..e as u32).map(|i| i * levels / (e as u32 - 1).max(1)).collect();
            let c = payload_of(&codes, &[0], e, bits, Some(&[q]));
            for (&code, &got) in codes.iter().zip(&c.to_dense()) {
                proptest::prop_assert!(ulps(got, formula(code)) <= 1, "code {}: {} vs {}", code, got, formula(code));
            }
        }
    }

    /// The event parsed with its base64 field cut out gives what the whole-event parse gives,
    /// for events where the cut is right and where it must be refused (a decoy key `d`
    /// elsewhere, a payload sent as a JSON string, an escaped `d`, text outside the base64
    /// alphabet), with either separator style; and it is taken for a plain event.
    #[test]
    fn split_parse_matches_whole_parse() {
        let lim = DecodeLimits::default();
        let d = base64_simd::STANDARD.encode_to_string([1u8, 2, 3, 4, 5, 6]);
        let head = r#""v":1,"layers":[0,1],"E":3,"n":1,"enc":"dense","bits":8"#;
        let payload = format!(r#"{{{head},"d":"{d}"}}"#);
        let spaced = format!(r#"{{"v": 1, "layers": [0, 1], "E": 3, "n": 1, "enc": "dense", "bits": 8, "d" :  "{d}"}}"#);
        let as_text = serde_json::to_string(&payload).unwrap();
        let events = [
            format!(r#"{{"text":"","meta_info":{{"id":"r0","eldr_signature":[{payload}]}}}}"#),
            format!(r#"{{"text": "", "meta_info": {{"id": "r0", "eldr_signature": [{spaced}]}}}}"#),
            format!(r#"{{"sglext":{{"eldr_signature":{payload}}}}}"#),
            format!(r#"{{"meta_info":{{"x":{{"d":"BwgJCgsM"}},"eldr_signature":{payload}}}}}"#),
            format!(r#"{{"meta_info":{{"d":"BwgJCgsM","eldr_signature":{payload}}}}}"#),
            format!(r#"{{"text":"say "d":"AAAA"","meta_info":{{"eldr_signature":{payload}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{as_text}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQID\/AUG"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQ ID"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAUG"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAU"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAUG""#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"AQIDBAUG","d":"AQIDBAUG"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[0,1.0],"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[0,-0],"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[[0],1],"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":{{"a":1}},"E":3,"n":1,"enc":"dense","bits":8,"d":"{d}"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"layers":[0,1],"E":3,"n":1,"enc":"log","bits":4,"q":[3,"x"],"d":"{d}"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,"none":"too_long","d":"{d}"}}}}}}"#),
            format!(r#"{{"meta_info":{{"eldr_signature":{{{head},"d":"{}"}}}}}}"#, "A".repeat(DEFAULT_MAX_BYTES + 4)),
        ];
        for ev in &events {
            assert_eq!(decode_event(ev.as_bytes(), &lim), decode_event_whole(ev.as_bytes(), &lim), "{ev}");
        }
        for ev in &events[..3] {
            assert!(matches!(decode_event_split(ev.as_bytes(), &lim), Some(Ok(Some(Payload::Counts(_))))), "{ev}");
        }
        let Ok(Some(Payload::Counts(c))) = decode_event(events[1].as_bytes(), &lim) else { panic!() };
        assert_eq!(c.to_dense(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        for ev in &events[3..7] {
            assert!(decode_event_split(ev.as_bytes(), &lim).is_none(), "{ev}");
        }
    }

    /// A number past f64's range in a header list is that field's error (the payload is
    /// malformed), not a failed parse of the whole event (which reads as "no payload here").
    #[test]
    fn out_of_range_numbers_in_header_lists_are_field_errors() {
        let lim = DecodeLimits::default();
        let huge = format!("1{}", "0".repeat(400));
        for (list, field) in [(format!(r#""layers":[0,1],"q":[{huge},3]"#), "q"), (format!(r#""layers":[0,{huge}],"q":[3,3]"#), "layers"), (r#""layers":[0,1],"q":[1e400,3]"#.to_string(), "q")] {
            let ev = format!(r#"{{"meta_info":{{"eldr_signature":{{"v":1,{list},"E":32,"n":5,"enc":"log","bits":4,"d":"AAAA"}}}}}}"#);
            match decode_event(ev.as_bytes(), &lim) {
                Err(PayloadError::Field { field: f, .. }) => assert_eq!(f, field, "{ev}"),
                other => panic!("{ev}: {other:?}"),
            }
        }
    }

    #[test]
    fn event_finds_meta_info_and_sglext() {
        let lim = DecodeLimits::default();
        let inner = r#"{"v":1,"layers":[0],"E":2,"n":1,"enc":"dense","bits":8,"d":"AQI="}"#;
        for ev in [format!(r#"{{"text":"x","meta_info":{{"id":"a","eldr_signature":[{inner}]}}}}"#), format!(r#"{{"sglext":{{"eldr_signature":{inner}}},"meta_info":null}}"#)] {
            let Some(Payload::Counts(c)) = decode_event(ev.as_bytes(), &lim).unwrap() else { panic!("{ev}") };
            assert_eq!(c.to_dense(), vec![1.0, 2.0]);
        }
        assert_eq!(decode_event(br#"{"meta_info":{"eldr_signature":null}}"#, &lim), Ok(None));
        assert_eq!(decode_event(b"[1]", &lim), Ok(None));
        assert!(decode_event(br#"{"meta_info":{"eldr_signature":{"v":1}}}"#, &lim).is_err());
    }
}
