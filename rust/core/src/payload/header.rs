//! The payload's JSON header: read in one pass (numbers and lists by a plain reader where
//! serde need not judge them), every field validated against the limits, and the base64 data
//! decoded into the padded packed bytes of a [`DecodedCounts`].

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::format::{DecodeLimits, DecodedCounts, Encoding, Payload, PayloadError, MAX_COUNT, MAX_ENTRIES, MAX_EXPERTS, MAX_LAYERS, PAD, PAYLOAD_VERSION};
use super::unpack::{index_width, read_index};

#[derive(Deserialize)]
pub(super) struct Header<'a> {
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
    pub(super) d: Option<Text<'a>>,
}

/// A JSON string, borrowed from the input when it holds no escape. (serde's own `Cow<str>`
/// borrows only as a field's whole type, not inside an `Option`.)
pub(super) struct Text<'a>(pub(super) Cow<'a, str>);

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
pub(super) fn plain_u64_list(s: &[u8]) -> Option<Vec<u64>> {
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
pub(super) fn field<'de, T: Deserialize<'de>, W: std::fmt::Display>(raw: Option<&'de RawValue>, name: &'static str, what: impl Fn() -> W) -> Result<T, PayloadError> {
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

pub(super) fn from_header_own_d(mut h: Header<'_>, limits: &DecodeLimits) -> Result<Payload, PayloadError> {
    let d = h.d.take();
    from_header(h, d.as_ref().map(|t| t.0.as_bytes()), limits)
}

/// The header's layer ids: a non-empty list of distinct ids in [0, MAX_LAYERS).
fn layer_ids(list: Option<U64List>) -> Result<Vec<u32>, PayloadError> {
    let layers: Vec<u64> = u64_list(list, "layers", || LAYERS_WHAT)?;
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
    Ok(layers)
}

/// A sparse payload's `nnz` indices: strictly ascending, each below `size`.
fn check_sparse_indices(data: &[u8], size: usize, nnz: usize) -> Result<(), PayloadError> {
    let mut prev: i64 = -1;
    for t in 0..nnz {
        let i = read_index(data, size, t) as i64;
        if i <= prev || i >= size as i64 {
            return Err(PayloadError::SparseIndex);
        }
        prev = i;
    }
    Ok(())
}

/// A parsed header, with the text of its base64 field `d` (None: the field is missing).
pub(super) fn from_header(h: Header<'_>, d: Option<&[u8]>, limits: &DecodeLimits) -> Result<Payload, PayloadError> {
    let version_ok = h.v.is_some_and(|v| serde_json::from_str::<u64>(v.get()).ok() == Some(PAYLOAD_VERSION));
    if !version_ok {
        return Err(PayloadError::Version(h.v.map_or("None".into(), |v| shown(v.get()))));
    }
    if let Some(why) = h.none {
        let reason = serde_json::from_str::<String>(why.get()).unwrap_or_else(|_| why.get().to_owned());
        return Ok(Payload::NoCounts(reason));
    }
    let layers = layer_ids(h.layers)?;
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
            check_sparse_indices(&data, size, nnz)?;
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
