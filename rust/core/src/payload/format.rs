//! What a payload is: its version and limits, its errors, and the decoded counts (the
//! packed bytes kept as they came, with the header's fields).

use thiserror::Error;

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
    pub(super) layers: Vec<u32>,
    pub(super) layers_ascending: bool,
    pub(super) experts: usize,
    pub(super) num_tokens: u64,
    pub(super) bits: u32,
    pub(super) encoding: Encoding,
    /// The base64-decoded bytes, followed by [`PAD`] zero bytes so every value reads one u64
    /// and every block of 8 values one 16-byte window.
    pub(super) data: Vec<u8>,
    /// Length of the base64 field (the size the prefill sent).
    pub(super) data_bytes: usize,
}

/// Zero bytes after the decoded data (see [`DecodedCounts`]'s `data`).
pub(super) const PAD: usize = 16;

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
}
