//! The `.eldr` centroid file, format version 1 (documented in docs/centroid-format.md).
//!
//! Little-endian. A fixed 128-byte header, then sections at the offsets the header gives:
//! worker names (UTF-8, '\n'-separated), provenance JSON (UTF-8), layer weights `f32[L]`,
//! IDF `f32[L*E]`, and the centroid matrix `f32[D*K]` stored feature-major (row `d` holds the K
//! centroid values of feature `d`, so a sparse signature dots into all K centroids with one
//! contiguous read per feature). The matrix starts on a 64-byte boundary. The file ends with an
//! 8-byte trailer: CRC-32 (IEEE) of every byte before it, then the end magic `ELDR`.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut};
use thiserror::Error;

use crate::signature::SignatureSpec;

pub const MAGIC: &[u8; 8] = b"ELDRCENT";
pub const END_MAGIC: &[u8; 4] = b"ELDR";
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_LEN: usize = 128;
pub const TRAILER_LEN: usize = 8;
pub const MATRIX_ALIGN: usize = 64;
/// The largest file a reader accepts (1 GiB). Real sets are a few MiB (K x D floats); the
/// bound keeps a stray huge file from being copied into memory before it can be rejected.
pub const MAX_FILE_LEN: u64 = 1 << 30;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum CentroidFileError {
    #[error("{path}: cannot read: {msg}")]
    Io { path: String, msg: String },
    #[error("{path}: not a regular file ({kind}); a centroid file must be a regular file")]
    NotRegular { path: String, kind: &'static str },
    #[error("{path}: refusing to write over {kind}; give a new path or a regular file")]
    WontReplace { path: String, kind: &'static str },
    #[error("{path}: {len} bytes is larger than the {MAX_FILE_LEN}-byte limit of a centroid file")]
    TooLarge { path: String, len: u64 },
    #[error("{path}: truncated: {what}")]
    Truncated { path: String, what: String },
    #[error("{path}: not an ELDR centroid file (bad magic)")]
    BadMagic { path: String },
    #[error("{path}: unsupported format version {found}; this build reads version {FORMAT_VERSION}")]
    Version { path: String, found: u32 },
    #[error("{path}: checksum mismatch: stored {stored:#010x}, computed {computed:#010x} (file corrupt)")]
    Checksum { path: String, stored: u32, computed: u32 },
    #[error("{path}: invalid field {field}: {msg}")]
    Field { path: String, field: &'static str, msg: String },
    #[error("{path}: mismatch: {msg}")]
    Mismatch { path: String, msg: String },
    #[error("invalid centroid data: {0}")]
    Invalid(String),
}

/// A validated centroid file, held in a private read-only memory map. Immutable: a reload
/// builds a new one.
///
/// The file's bytes are copied into an anonymous mapping rather than mapped in place: a
/// shared mapping of the user's file turns an in-place overwrite (`cp new.eldr c.eldr`)
/// into SIGBUS on the next route, and the files are small (K x D floats, a few MiB at most),
/// so the copy costs less than a millisecond. The mapping is page-aligned, so the
/// 64-byte-aligned centroid matrix is read in place from it.
pub struct CentroidSet {
    path: PathBuf,
    map: Mmap,
    k: usize,
    tau: f32,
    centroid_offset: usize,
    names: Vec<String>,
    provenance: String,
    spec: SignatureSpec,
    checksum: u32,
    /// The matrix again, block-major `[ceil(D/8)][K][8]` (see [`CentroidSet::centroid_blocks`]).
    blocks: Vec<Block8>,
}

/// Eight consecutive positions of one centroid, aligned to a 32-byte SIMD load.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub struct Block8(pub [f32; 8]);

/// `[ceil(D/8)][K][8]`: block `b`, centroid `c` holds `mu_c` at positions `8b..8b+8` (zeros
/// past D).
fn block_major(m: &[f32], k: usize, d: usize) -> Vec<Block8> {
    let nb = d.div_ceil(8);
    let mut out = vec![Block8::default(); nb * k];
    for j in 0..d {
        for c in 0..k {
            out[(j / 8) * k + c].0[j % 8] = m[j * k + c];
        }
    }
    out
}

impl std::fmt::Debug for CentroidSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CentroidSet").field("path", &self.path).field("k", &self.k).field("dim", &self.dim()).finish()
    }
}

fn rd_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn rd_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// What a non-regular file is, for messages; None for a regular file.
fn non_regular_kind(t: std::fs::FileType) -> Option<&'static str> {
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some("a directory");
    }
    if t.is_symlink() {
        return Some("a symlink");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some("a FIFO");
        } else if t.is_socket() {
            return Some("a socket");
        } else if t.is_block_device() {
            return Some("a block device");
        } else if t.is_char_device() {
            return Some("a character device");
        }
    }
    Some("not a file")
}

/// Refuse anything but a regular file, naming what it is.
fn regular_file(p: &str, meta: &std::fs::Metadata) -> Result<(), CentroidFileError> {
    match non_regular_kind(meta.file_type()) {
        None => Ok(()),
        Some(kind) => Err(CentroidFileError::NotRegular { path: p.to_owned(), kind }),
    }
}

/// Write `bytes` to `path` atomically, with the rules every eldr writer follows (the Python
/// twin is `eldr_sglang.io_safe`): refuse a destination that exists and is not a regular
/// file (a device such as /dev/full, a FIFO, a directory, a symlink), write a uniquely named
/// temporary file in the same directory, fsync it, rename it over the destination, fsync the
/// directory. On any failure the temporary file is removed and the destination is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CentroidFileError> {
    let p = path.display().to_string();
    let io = |e: std::io::Error| CentroidFileError::Io { path: p.clone(), msg: e.to_string() };
    match std::fs::symlink_metadata(path) {
        Ok(m) => {
            if let Some(kind) = non_regular_kind(m.file_type()) {
                return Err(CentroidFileError::WontReplace { path: p, kind });
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| io(std::io::Error::other("no file name")))?;
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666)); // less the umask, like File::create
    // The temporary file is deleted when `tmp` drops on any early return.
    let mut tmp = builder.tempfile_in(dir).map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    // Make the rename itself durable; a directory that cannot be opened or synced is no error.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Open for reading without blocking: opening a FIFO with no writer would otherwise wait
/// forever. O_NONBLOCK has no effect on reads of the regular file that `open` then insists on.
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut opts, libc::O_NONBLOCK);
    opts.open(path)
}

/// The checks that need only the header (`head`: the file's first bytes, up to HEADER_LEN)
/// and the file's real length: magic, version, and the length the header gives. Run before
/// the body is read, so a wrong or oversized file costs one header read.
fn check_header(p: &str, head: &[u8], actual_len: u64) -> Result<(), CentroidFileError> {
    let trunc = |what: String| CentroidFileError::Truncated { path: p.to_owned(), what };
    if head.len() < 8 || &head[..8] != MAGIC {
        if head.len() < 8 && MAGIC.starts_with(head) {
            return Err(trunc(format!("{} bytes, shorter than the header", head.len())));
        }
        return Err(CentroidFileError::BadMagic { path: p.to_owned() });
    }
    if actual_len < HEADER_LEN as u64 {
        return Err(trunc(format!("{actual_len} bytes, shorter than the {HEADER_LEN}-byte header")));
    }
    let version = rd_u32(head, 8);
    if version != FORMAT_VERSION {
        return Err(CentroidFileError::Version { path: p.to_owned(), found: version });
    }
    let file_len = rd_u64(head, 96);
    if file_len != actual_len {
        return Err(if actual_len < file_len {
            trunc(format!("header says {file_len} bytes, file has {actual_len}"))
        } else {
            CentroidFileError::Mismatch { path: p.to_owned(), msg: format!("header says {file_len} bytes, file has {actual_len} (trailing data)") }
        });
    }
    if file_len > MAX_FILE_LEN {
        return Err(CentroidFileError::TooLarge { path: p.to_owned(), len: file_len });
    }
    if file_len < (HEADER_LEN + TRAILER_LEN) as u64 {
        return Err(trunc(format!("header says {file_len} bytes, too short for the header and trailer")));
    }
    Ok(())
}

impl CentroidSet {
    /// Open, copy into a private mapping and fully validate a centroid file.
    ///
    /// Only a regular file is read (a symlink to one is followed): anything else is refused
    /// before it is opened, and the open itself is non-blocking, so a FIFO swapped in at the
    /// path (even between the check and the open) cannot hang the caller. The header is read
    /// and checked against the file's size first; the body is read only when they agree.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, CentroidFileError> {
        let path = path.as_ref();
        let p = path.display().to_string();
        let io = |e: std::io::Error| CentroidFileError::Io { path: p.clone(), msg: e.to_string() };
        regular_file(&p, &std::fs::metadata(path).map_err(io)?)?;
        let mut file = open_nonblocking(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        regular_file(&p, &meta)?;
        let len = meta.len();
        let mut head = [0u8; HEADER_LEN];
        let head_len = (len as usize).min(HEADER_LEN);
        file.read_exact(&mut head[..head_len]).map_err(io)?;
        check_header(&p, &head[..head_len], len)?;
        let mut map = MmapMut::map_anon(len as usize).map_err(io)?;
        map[..HEADER_LEN].copy_from_slice(&head);
        // A file that shrinks while being read fails here; one that changes is caught by the CRC.
        file.read_exact(&mut map[HEADER_LEN..]).map_err(io)?;
        Self::validate(path.to_path_buf(), map.make_read_only().map_err(io)?)
    }

    /// Validate a centroid file held in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CentroidFileError> {
        let io = |e: std::io::Error| CentroidFileError::Io { path: "<memory>".into(), msg: e.to_string() };
        if bytes.is_empty() {
            return Err(CentroidFileError::Truncated { path: "<memory>".into(), what: "no bytes".into() });
        }
        let mut map = MmapMut::map_anon(bytes.len()).map_err(io)?;
        map.copy_from_slice(bytes);
        Self::validate(PathBuf::from("<memory>"), map.make_read_only().map_err(io)?)
    }

    fn validate(path: PathBuf, map: Mmap) -> Result<Self, CentroidFileError> {
        let p = path.display().to_string();
        let b: &[u8] = &map;
        let field = |field: &'static str, msg: String| CentroidFileError::Field { path: p.clone(), field, msg };
        check_header(&p, &b[..b.len().min(HEADER_LEN)], b.len() as u64)?;
        let body = b.len() - TRAILER_LEN;
        if &b[body + 4..] != END_MAGIC {
            return Err(field("trailer", "end magic missing".into()));
        }
        let stored = rd_u32(b, body);
        let computed = crc32fast::hash(&b[..body]);
        if stored != computed {
            return Err(CentroidFileError::Checksum { path: p, stored, computed });
        }
        let flags = rd_u32(b, 12);
        if flags != 0 {
            return Err(field("flags", format!("unknown flags {flags:#x}")));
        }
        let (k, l, e, n_sel) = (rd_u32(b, 16) as usize, rd_u32(b, 20) as usize, rd_u32(b, 24) as usize, rd_u32(b, 28) as usize);
        for (name, v) in [("K", k), ("L", l), ("E", e), ("selected_layers", n_sel)] {
            if v == 0 || v > crate::limits::MAX_DIM {
                return Err(field(name, format!("{v} is out of range 1..={}", crate::limits::MAX_DIM)));
            }
        }
        if n_sel > l {
            return Err(field("selected_layers", format!("{n_sel} selected layers but L={l}")));
        }
        let tau = f32::from_le_bytes(b[32..36].try_into().unwrap());
        if !tau.is_finite() || tau < 0.0 {
            return Err(field("tau", format!("{tau} must be finite and >= 0")));
        }
        let d = n_sel * e;
        let section = |name: &'static str, off_at: usize, len: usize, align: usize| -> Result<&[u8], CentroidFileError> {
            let off = rd_u64(b, off_at) as usize;
            let end = off.checked_add(len).ok_or_else(|| field(name, "offset overflows".into()))?;
            if off < HEADER_LEN || end > body {
                return Err(field(name, format!("section {off}..{end} lies outside the file body 128..{body}")));
            }
            if off % align != 0 {
                return Err(field(name, format!("offset {off} is not {align}-byte aligned")));
            }
            Ok(&b[off..end])
        };
        let names_len = rd_u64(b, 48) as usize;
        let names_raw = section("worker_names", 40, names_len, 1)?;
        let names_txt = std::str::from_utf8(names_raw).map_err(|_| field("worker_names", "not UTF-8".into()))?;
        let names: Vec<String> = names_txt.split('\n').map(str::to_owned).collect();
        if names.len() != k {
            return Err(field("worker_names", format!("{} names for K={k} workers", names.len())));
        }
        let prov_len = rd_u64(b, 64) as usize;
        let prov = section("provenance", 56, prov_len, 1)?;
        let provenance = std::str::from_utf8(prov).map_err(|_| field("provenance", "not UTF-8".into()))?.to_owned();
        let weights = f32s(section("layer_weights", 72, l * 4, 4)?);
        let idf = f32s(section("idf", 80, l * e * 4, 4)?);
        let spec = SignatureSpec::new(&weights, &idf).map_err(|e| field("layer_weights/idf", e.to_string()))?;
        if spec.selected_layers().len() != n_sel {
            return Err(field("selected_layers", format!("header says {n_sel}, weights select {}", spec.selected_layers().len())));
        }
        let mat = section("centroids", 88, d * k * 4, MATRIX_ALIGN)?;
        let centroid_offset = mat.as_ptr() as usize - b.as_ptr() as usize;
        let mut set = CentroidSet { path, map, k, tau, centroid_offset, names, provenance, spec, checksum: stored, blocks: Vec::new() };
        let m = set.centroids_t();
        if let Some(i) = m.iter().position(|v| !v.is_finite()) {
            return Err(field("centroids", format!("value {} of centroid {} is not finite", i / k, i % k)));
        }
        for c in 0..k {
            let n2: f64 = (0..d).map(|j| (m[j * k + c] as f64).powi(2)).sum();
            if (n2.sqrt() - 1.0).abs() > 1e-3 {
                return Err(field("centroids", format!("centroid {c} has norm {:.6}, expected 1", n2.sqrt())));
            }
        }
        set.blocks = block_major(m, k, d);
        Ok(set)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn num_workers(&self) -> usize {
        self.k
    }
    pub fn num_layers(&self) -> usize {
        self.spec.num_layers()
    }
    pub fn num_experts(&self) -> usize {
        self.spec.num_experts()
    }
    pub fn dim(&self) -> usize {
        self.spec.dim()
    }
    pub fn tau(&self) -> f32 {
        self.tau
    }
    pub fn worker_names(&self) -> &[String] {
        &self.names
    }
    pub fn provenance(&self) -> &str {
        &self.provenance
    }
    pub fn spec(&self) -> &SignatureSpec {
        &self.spec
    }
    pub fn checksum(&self) -> u32 {
        self.checksum
    }

    /// The centroid matrix, feature-major `[D][K]`, straight from the mapping.
    pub fn centroids_t(&self) -> &[f32] {
        let bytes = &self.map[self.centroid_offset..self.centroid_offset + self.dim() * self.k * 4];
        // SAFETY: the offset is 64-byte aligned (checked in `validate`) within a page-aligned
        // private mapping, so the pointer is f32-aligned; the length is a multiple of 4, and
        // every bit pattern is a valid f32. Nothing else can write to the mapping.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4) }
    }

    /// The centroid matrix block-major, `[ceil(D/8)][K][8]`: the dense route kernels
    /// ([`crate::distance::blocks`]) multiply eight consecutive positions of a signature by
    /// one aligned load per centroid, instead of broadcasting each position across a
    /// feature-major row. Built once at load (the size of the matrix).
    pub fn centroid_blocks(&self) -> &[Block8] {
        &self.blocks
    }

    /// The centroid matrix as `[K][D]` rows (a copy, for inspection).
    pub fn centroids(&self) -> Vec<f32> {
        let (k, d, m) = (self.k, self.dim(), self.centroids_t());
        let mut out = vec![0f32; k * d];
        for j in 0..d {
            for c in 0..k {
                out[c * d + j] = m[j * k + c];
            }
        }
        out
    }
}

/// Builds and writes a centroid file.
pub struct CentroidWriter<'a> {
    pub centroids: &'a [f32], // [K][D] rows; normalized on write
    pub k: usize,
    pub layer_weights: &'a [f32],
    pub idf: &'a [f32],
    pub tau: f32,
    pub worker_names: Vec<String>,
    pub provenance: &'a str,
}

impl CentroidWriter<'_> {
    /// Validate and serialize to bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, CentroidFileError> {
        let bad = |m: String| CentroidFileError::Invalid(m);
        let spec = SignatureSpec::new(self.layer_weights, self.idf).map_err(|e| bad(e.to_string()))?;
        let (k, d) = (self.k, spec.dim());
        if k == 0 {
            return Err(bad("K must be at least 1".into()));
        }
        if self.centroids.len() != k * d {
            return Err(bad(format!(
                "centroids have {} values; K={k} x D={d} (= {} selected layers x E={}) expected",
                self.centroids.len(),
                spec.selected_layers().len(),
                spec.num_experts()
            )));
        }
        if !self.tau.is_finite() || self.tau < 0.0 {
            return Err(bad(format!("tau {} must be finite and >= 0", self.tau)));
        }
        if self.worker_names.len() != k {
            return Err(bad(format!("{} worker names for K={k}", self.worker_names.len())));
        }
        if let Some(n) = self.worker_names.iter().find(|n| n.contains('\n')) {
            return Err(bad(format!("worker name {n:?} contains a newline")));
        }
        let mut mat = vec![0f32; d * k];
        for c in 0..k {
            let row = &self.centroids[c * d..(c + 1) * d];
            if row.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!("centroid {c} holds NaN or infinite values")));
            }
            let n = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            if n == 0.0 {
                return Err(bad(format!("centroid {c} is all zero")));
            }
            for j in 0..d {
                mat[j * k + c] = (row[j] as f64 / n) as f32;
            }
        }
        let names = self.worker_names.join("\n");
        let mut out = vec![0u8; HEADER_LEN];
        let place = |out: &mut Vec<u8>, bytes: &[u8], align: usize| -> u64 {
            while out.len() % align != 0 {
                out.push(0);
            }
            let off = out.len() as u64;
            out.extend_from_slice(bytes);
            off
        };
        let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let names_off = place(&mut out, names.as_bytes(), 1);
        let prov_off = place(&mut out, self.provenance.as_bytes(), 1);
        let w_off = place(&mut out, &le(self.layer_weights), 4);
        let idf_off = place(&mut out, &le(self.idf), 4);
        let mat_off = place(&mut out, &le(&mat), MATRIX_ALIGN);
        let file_len = (out.len() + TRAILER_LEN) as u64;
        let h = &mut out[..HEADER_LEN];
        h[..8].copy_from_slice(MAGIC);
        let u32s = [(8, FORMAT_VERSION), (12, 0), (16, k as u32), (20, spec.num_layers() as u32), (24, spec.num_experts() as u32), (28, spec.selected_layers().len() as u32)];
        for (at, v) in u32s {
            h[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        h[32..36].copy_from_slice(&self.tau.to_le_bytes());
        let u64s = [(40, names_off), (48, names.len() as u64), (56, prov_off), (64, self.provenance.len() as u64), (72, w_off), (80, idf_off), (88, mat_off), (96, file_len)];
        for (at, v) in u64s {
            h[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(END_MAGIC);
        Ok(out)
    }

    /// Write atomically (see [`write_atomic`]): readers (and a hot-reloading router) see
    /// either the old file or the complete new one.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), CentroidFileError> {
        write_atomic(path.as_ref(), &self.to_bytes()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample(k: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        // L=3 (layer 0 masked), E=4 -> D=8
        let weights = vec![0.0, 1.0, 0.5];
        let idf = (0..12).map(|i| 0.5 + (i % 5) as f32 * 0.25).collect();
        let cents = (0..k * 8).map(|i| ((i * 7 + 3) % 11) as f32 + 0.1).collect();
        (cents, weights, idf)
    }

    fn writer<'a>(c: &'a [f32], w: &'a [f32], idf: &'a [f32], k: usize) -> CentroidWriter<'a> {
        CentroidWriter { centroids: c, k, layer_weights: w, idf, tau: 0.1, worker_names: (0..k).map(|i| format!("w{i}")).collect(), provenance: "{\"x\":1}" }
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.eldr");
        let (c, w, idf) = sample(3);
        writer(&c, &w, &idf, 3).write(&p).unwrap();
        let s = CentroidSet::open(&p).unwrap();
        assert_eq!((s.num_workers(), s.num_layers(), s.num_experts(), s.dim()), (3, 3, 4, 8));
        assert_eq!(s.worker_names(), &["w0", "w1", "w2"]);
        assert_eq!(s.provenance(), "{\"x\":1}");
        assert_eq!(s.spec().idf(), &idf[..]);
        assert_eq!(s.centroids_t().as_ptr() as usize % 64, 0);
        let rows = s.centroids();
        for r in 0..3 {
            let n: f64 = (0..8).map(|j| (rows[r * 8 + j] as f64).powi(2)).sum();
            assert!((n - 1.0).abs() < 1e-6);
            // direction preserved
            let orig = &c[r * 8..r * 8 + 8];
            let on = orig.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            for j in 0..8 {
                assert!((rows[r * 8 + j] as f64 - orig[j] as f64 / on).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.eldr");
        let (c, w, idf) = sample(2);
        let good = writer(&c, &w, &idf, 2).to_bytes().unwrap();
        let check = |bytes: &[u8], want: &str| {
            std::fs::write(&p, bytes).unwrap();
            let e = CentroidSet::open(&p).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        };
        check(&good[..good.len() - 9], "truncated");
        check(&good[..50], "truncated");
        let mut flip = good.clone();
        flip[HEADER_LEN + 3] ^= 0x40;
        check(&flip, "checksum mismatch");
        let mut ver = good.clone();
        ver[8] = 2;
        check(&ver, "unsupported format version 2");
        let mut mag = good.clone();
        mag[0] = b'X';
        check(&mag, "bad magic");
    }

    /// Open on another thread so a blocking open fails the test instead of hanging it.
    fn open_within(p: &Path, secs: u64) -> Result<CentroidSet, CentroidFileError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = p.to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(CentroidSet::open(&p));
        });
        rx.recv_timeout(std::time::Duration::from_secs(secs)).expect("CentroidSet::open blocked")
    }

    #[cfg(unix)]
    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.eldr");
        let ok = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(ok.success());
        let e = open_within(&fifo, 20).unwrap_err();
        assert!(matches!(e, CentroidFileError::NotRegular { kind: "a FIFO", .. }), "{e}");
        assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
        let e = open_within(dir.path(), 20).unwrap_err();
        assert!(matches!(e, CentroidFileError::NotRegular { kind: "a directory", .. }), "{e}");
        let e = open_within(Path::new("/dev/zero"), 20).unwrap_err();
        assert!(matches!(e, CentroidFileError::NotRegular { kind: "a character device", .. }), "{e}");
        // A symlink to a regular file is followed (a common way to deploy a file).
        let real = dir.path().join("real.eldr");
        let (c, w, idf) = sample(2);
        writer(&c, &w, &idf, 2).write(&real).unwrap();
        let link = dir.path().join("link.eldr");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(open_within(&link, 20).unwrap().num_workers(), 2);
        // A symlink to a FIFO is refused like the FIFO.
        let link2 = dir.path().join("link2.eldr");
        std::os::unix::fs::symlink(&fifo, &link2).unwrap();
        assert!(matches!(open_within(&link2, 20).unwrap_err(), CentroidFileError::NotRegular { .. }));
    }

    #[cfg(unix)]
    #[test]
    fn writer_never_replaces_what_is_not_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let (c, w, idf) = sample(2);
        let wr = writer(&c, &w, &idf, 2);
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let target = dir.path().join("target");
        std::fs::write(&target, b"keep me").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        for (p, kind) in [(&fifo, "a FIFO"), (&link, "a symlink"), (&sub, "a directory")] {
            let e = wr.write(p).unwrap_err();
            assert!(matches!(e, CentroidFileError::WontReplace { kind: k, .. } if k == kind), "{e}");
        }
        let e = wr.write("/dev/null").unwrap_err();
        assert!(e.to_string().contains("refusing to write over a character device"), "{e}");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
        // A regular file is replaced; a failed write (missing directory) leaves nothing behind.
        wr.write(&target).unwrap();
        assert_eq!(CentroidSet::open(&target).unwrap().num_workers(), 2);
        assert!(wr.write(dir.path().join("nodir/c.eldr")).is_err());
        let mut names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["fifo", "link", "sub", "target"]);
    }

    #[test]
    fn header_length_is_checked_first() {
        let (c, w, idf) = sample(2);
        let good = writer(&c, &w, &idf, 2).to_bytes().unwrap();
        let mut long = good.clone();
        long.extend_from_slice(&[0u8; 64]);
        assert!(check_header("x", &long[..HEADER_LEN], long.len() as u64).unwrap_err().to_string().contains("trailing data"));
        let mut huge = good.clone();
        huge[96..104].copy_from_slice(&(MAX_FILE_LEN + 8).to_le_bytes());
        let e = check_header("x", &huge[..HEADER_LEN], MAX_FILE_LEN + 8).unwrap_err();
        assert!(matches!(e, CentroidFileError::TooLarge { .. }), "{e}");
        let mut tiny = good.clone();
        tiny[96..104].copy_from_slice(&(HEADER_LEN as u64).to_le_bytes());
        assert!(check_header("x", &tiny[..HEADER_LEN], HEADER_LEN as u64).unwrap_err().to_string().contains("too short"));
        assert!(check_header("x", &good[..HEADER_LEN], good.len() as u64).is_ok());
    }

    #[test]
    fn writer_rejects_bad_input() {
        let (c, w, idf) = sample(2);
        assert!(writer(&c[..15], &w, &idf, 2).to_bytes().unwrap_err().to_string().contains("K=2 x D=8"));
        let mut nan = c.clone();
        nan[3] = f32::NAN;
        assert!(writer(&nan, &w, &idf, 2).to_bytes().is_err());
        let zero = vec![0f32; 16];
        assert!(writer(&zero, &w, &idf, 2).to_bytes().unwrap_err().to_string().contains("all zero"));
    }
}
