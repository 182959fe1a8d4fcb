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
    /// The base64-decoded bytes, followed by 8 zero bytes so every value reads one u64.
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
    #[serde(borrow, default)]
    layers: Option<&'a RawValue>,
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
    #[serde(borrow, default)]
    q: Option<&'a RawValue>,
    /// Borrowed from the input (base64 has no escapes), so the largest field is scanned once.
    #[serde(borrow, default)]
    d: Option<Cow<'a, str>>,
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

fn field<'de, T: Deserialize<'de>>(raw: Option<&'de RawValue>, name: &'static str, what: &str) -> Result<T, PayloadError> {
    let problem = || PayloadError::Field { field: name, problem: format!("must be {what}") };
    let raw = raw.ok_or_else(problem)?;
    serde_json::from_str(raw.get()).map_err(|_| problem())
}

fn int_in(raw: Option<&RawValue>, name: &'static str, lo: u64, hi: u64) -> Result<u64, PayloadError> {
    let what = format!("an integer in [{lo}, {hi}]");
    let v: i128 = match raw {
        Some(r) => serde_json::from_str::<i128>(r.get()).map_err(|_| PayloadError::Field { field: name, problem: format!("must be {what}, got {}", shown(r.get())) })?,
        None => return Err(PayloadError::Field { field: name, problem: format!("must be {what}, got nothing") }),
    };
    if v < lo as i128 || v > hi as i128 {
        return Err(PayloadError::Field { field: name, problem: format!("must be {what}, got {}", shown(&v.to_string())) });
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

/// Find and decode the payload in one stream event (`data:` JSON of an SSE line). `Ok(None)`:
/// the event is not JSON, not an object, or carries no payload; the caller's own parser sees it.
pub fn decode_event(event: &[u8], limits: &DecodeLimits) -> Result<Option<Payload>, PayloadError> {
    // One pass over the event; one that does not fit the schema (a field of another type,
    // a payload header serde cannot read) is left to the caller's parser.
    let Ok(ev) = serde_json::from_slice::<Event>(event) else { return Ok(None) };
    for h in [ev.meta_info, ev.sglext].into_iter().flatten() {
        match h.eldr_signature {
            None | Some(Found::Null) => continue,
            Some(Found::Header(h)) => return from_header(h, limits).map(Some),
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
    from_header(serde_json::from_str(text).map_err(|e| header_error(text, e))?, limits)
}

fn from_header(h: Header<'_>, limits: &DecodeLimits) -> Result<Payload, PayloadError> {
    let version_ok = h.v.is_some_and(|v| serde_json::from_str::<u64>(v.get()).ok() == Some(PAYLOAD_VERSION));
    if !version_ok {
        return Err(PayloadError::Version(h.v.map_or("None".into(), |v| shown(v.get()))));
    }
    if let Some(why) = h.none {
        let reason = serde_json::from_str::<String>(why.get()).unwrap_or_else(|_| why.get().to_owned());
        return Ok(Payload::NoCounts(reason));
    }
    let layers_what = format!("a non-empty list of at most {MAX_LAYERS} layer ids in [0, {MAX_LAYERS})");
    let layers: Vec<u64> = field(h.layers, "layers", &layers_what)?;
    if layers.is_empty() || layers.len() > MAX_LAYERS || layers.iter().any(|&l| l >= MAX_LAYERS as u64) {
        return Err(PayloadError::Field { field: "layers", problem: format!("must be {layers_what}") });
    }
    let layers: Vec<u32> = layers.into_iter().map(|l| l as u32).collect();
    let mut seen = vec![false; MAX_LAYERS];
    for &l in &layers {
        if std::mem::replace(&mut seen[l as usize], true) {
            return Err(PayloadError::RepeatedLayer);
        }
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
    let enc: Cow<str> = field(h.enc, "enc", "a string")?;
    let d = h.d.ok_or_else(|| PayloadError::Field { field: "d", problem: "must be a base64 string".into() })?;
    if d.len() > limits.max_bytes {
        return Err(PayloadError::TooLarge { size: d.len(), limit: limits.max_bytes });
    }
    let size = rows * experts;
    let mut data = BASE64.decode_to_vec(d.as_bytes()).map_err(|e| PayloadError::Base64(e.to_string()))?;
    let got = data.len();
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
            let q_what = format!("a list of one maximum count in [0, {MAX_COUNT}] per layer");
            let q: Vec<u64> = field(h.q, "q", &q_what)?;
            if q.len() != rows || q.iter().any(|&x| x > MAX_COUNT) {
                return Err(PayloadError::Field { field: "q", problem: format!("must be {q_what}") });
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
    data.extend_from_slice(&[0u8; 8]);
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

/// Value `i` of a little-endian bit-packed run starting at byte `base`.
///
/// # Safety
/// `base + (i * bits) / 8 + 8 <= data.len()` (the decoder pads the data with 8 zero bytes).
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
/// Every value's 8-byte window lies in `data` (the decoder pads the data with 8 zero bytes).
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

/// Append `(base + e, x[e])` for every nonzero `x[e]` at `out[len..]`; returns the new length.
/// With AVX2, eight lanes at a time (a compare, a left-pack permutation from a table, two
/// stores); otherwise branch-free scalar code, as `SignatureSpec::compact`. Same output.
///
/// # Safety
/// `out` must have capacity for `len + x.len() + 8` entries.
#[inline(always)]
unsafe fn compact_run(out: &mut SparseSignature, len: usize, base: u32, x: &[f32], avx2: bool) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return compact_run_avx2(out, len, base, x);
    }
    let _ = avx2;
    compact_run_scalar(out, len, base, x, 0)
}

#[inline(always)]
unsafe fn compact_run_scalar(out: &mut SparseSignature, mut len: usize, base: u32, x: &[f32], from: usize) -> usize {
    let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
    for (e, &v) in x.iter().enumerate().skip(from) {
        ip.add(len).write(base + e as u32);
        vp.add(len).write(v);
        len += (v.to_bits() << 1 != 0) as usize;
    }
    len
}

/// For each 8-bit mask, the lanes whose bit is set, in order (the left-pack permutation).
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn compact_run_avx2(out: &mut SparseSignature, mut len: usize, base: u32, x: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let (ip, vp) = (out.index.as_mut_ptr(), out.value.as_mut_ptr());
    let zero = _mm256_setzero_ps();
    let step = _mm256_set1_epi32(8);
    let mut idx = _mm256_add_epi32(_mm256_set1_epi32(base as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    let full = x.len() / 8 * 8;
    let mut e = 0;
    while e < full {
        let v = _mm256_loadu_ps(x.as_ptr().add(e));
        // ordered not-equal: +-0 drop out (as the scalar test); x is never NaN here
        let mask = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NEQ_OQ>(v, zero)) as usize;
        let perm = _mm256_loadu_si256(LEFT_PACK[mask].as_ptr() as *const __m256i);
        _mm256_storeu_ps(vp.add(len), _mm256_permutevar8x32_ps(v, perm));
        _mm256_storeu_si256(ip.add(len) as *mut __m256i, _mm256_permutevar8x32_epi32(idx, perm));
        len += mask.count_ones() as usize;
        idx = _mm256_add_epi32(idx, step);
        e += 8;
    }
    compact_run_scalar(out, len, base, x, full)
}

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
                // Row by row, in three tight loops (unpack, value, weight + compact) that the
                // compiler keeps in registers, instead of one loop doing all three.
                let mut codes = vec![0u32; e_n];
                let mut vals = vec![0f32; e_n];
                let mut lut = LogRow::default();
                #[cfg(target_arch = "x86_64")]
                let avx2 = std::arch::is_x86_feature_detected!("avx2");
                #[cfg(not(target_arch = "x86_64"))]
                let avx2 = false;
                for row in 0..self.layers.len() {
                    let l = self.layer_of(map, row);
                    if weights[l] <= 0.0 {
                        continue; // masked: never unpacked
                    }
                    // SAFETY: the data length was checked at decode and it is padded.
                    unsafe { unpack_run(&self.data, row * e_n * bits as usize, bits, &mut codes) };
                    match &self.encoding {
                        Encoding::Log { q } => {
                            lut.prepare(q[row], bits, e_n);
                            lut.values(&codes, &mut vals);
                        }
                        _ => {
                            for (v, &c) in vals.iter_mut().zip(&codes) {
                                *v = c as f32;
                            }
                        }
                    }
                    // The row's output indices are consecutive (slot * E + e), so only the
                    // scales are read from the table.
                    let trow = &table[l * e_n..(l + 1) * e_n];
                    for (v, &(_, w)) in vals.iter_mut().zip(trow) {
                        *v *= w;
                    }
                    // SAFETY: at most E values per selected row; cap = selected rows * E, plus 8.
                    len = unsafe { compact_run(out, len, trow[0].0, &vals, avx2) };
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
        out.norm = norm_of(&out.value)?;
        Ok(())
    }
}

/// One row's log-decoded values `c(code) = expm1(code * ln(1 + q) / (2^bits - 1))`, as the
/// Python encoder defines them (f64, then rounded to f32). With no more codes than
/// max(E, 64) they are tabled once per row as `r^code - 1`, `r = exp(scale)`, by repeated
/// multiplication: one transcendental call per row instead of one per count. The f64 error
/// (about code ulps over `code * scale`) stays far below f32 rounding. Code 0 is always 0.
#[derive(Default)]
struct LogRow {
    scale: f64,
    table: Vec<f32>,
}

impl LogRow {
    fn prepare(&mut self, qmax: u64, bits: u32, experts: usize) {
        let levels = (1u64 << bits) - 1;
        self.scale = (qmax as f64).ln_1p() / levels as f64;
        self.table.clear();
        if levels as usize <= experts.max(64) {
            let r = self.scale.exp();
            let mut p = 1.0f64;
            self.table.push(0.0);
            for _ in 1..=levels {
                p *= r;
                self.table.push((p - 1.0) as f32);
            }
        }
    }

    fn values(&self, codes: &[u32], out: &mut [f32]) {
        let t = &self.table;
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
        match self.table.get(code as usize) {
            Some(&v) => v,
            None if code == 0 => 0.0,
            None => (code as f64 * self.scale).exp_m1() as f32,
        }
    }
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
