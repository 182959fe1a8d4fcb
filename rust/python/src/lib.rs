//! PyO3 bindings: the `eldr_sglang._core` extension module. A thin layer over eldr-core:
//! numpy arrays are read in place (any of the common integer/float dtypes, no copy when
//! C-contiguous), errors become typed Python exceptions, and batch work releases the GIL.

use std::path::PathBuf;
use std::sync::Arc;

use eldr_core::experts::{self, ExpertId};
use eldr_core::router::Routed;
use eldr_core::distance::{self, Counts};
use eldr_core::limits;
use eldr_core::payload::{self, DecodeLimits, DecodedCounts, Payload};
use eldr_core::policies::UnknownPolicy;
use eldr_core::router::ParamError;
use eldr_core::signature::SpecError;
use eldr_core::{BuildError, CentroidSet, CentroidWriter, CountValue, ExpertGuard, ExpertProfile, LoadGuard, NoSignature, RouteError, SignatureSpec, SizeError, SparseIndex, SparseSignature};
use numpy::{Element, IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

mod dataplane;

// ---------------------------------------------------------------- errors
//
// Every eldr-core error type maps onto one Python class, with one match arm per variant: a
// new variant does not compile until it is given its class here, and nothing reads a
// message to choose one. Argument and parameter errors are ValueError (Python's idiom).

create_exception!(_core, CentroidFileError, PyValueError, "A centroid file is truncated, corrupt, of another version or mismatched.");
create_exception!(_core, NoSignatureError, PyValueError, "No usable signature; `reason` says why.");
create_exception!(_core, NoHealthyWorker, PyRuntimeError, "Every decode worker is marked unhealthy.");
create_exception!(_core, PayloadError, PyValueError, "A counts payload (the `eldr_signature` field) is malformed; the message says what is wrong.");
create_exception!(_core, ProfileError, PyValueError, "An expert profile cannot be built from these cells, or counted on this worker (e.g. it predates a change of layer selection).");

/// An eldr-core error as the Python exception it maps onto.
trait ToPyErr: std::fmt::Display + Sized {
    fn to_py(self) -> PyErr;
}

impl ToPyErr for NoSignature {
    fn to_py(self) -> PyErr {
        use NoSignature::*;
        match self {
            Missing | Timeout | Malformed | PrefillNone | PrefillNoSignature | Empty | NonFinite | Negative | OutOfRange | Shape => Python::attach(|py| {
                let err = NoSignatureError::new_err(format!("no usable signature: {self}"));
                let _ = err.value(py).setattr("reason", self.as_str());
                err
            }),
        }
    }
}

impl ToPyErr for eldr_core::CentroidFileError {
    fn to_py(self) -> PyErr {
        use eldr_core::CentroidFileError::*;
        match &self {
            Io { .. } | NotRegular { .. } | WontReplace { .. } | TooLarge { .. } | Truncated { .. } | BadMagic { .. } | Version { .. }
            | Checksum { .. } | Field { .. } | Mismatch { .. } | Invalid(_) => CentroidFileError::new_err(self.to_string()),
        }
    }
}

impl ToPyErr for eldr_core::PayloadError {
    fn to_py(self) -> PyErr {
        use eldr_core::PayloadError::*;
        match &self {
            TooLarge { .. } | NotJson(_) | NotObject(_) | Version(_) | Field { .. } | RepeatedLayer | TooManyEntries { .. } | Encoding(_)
            | Base64(_) | DataLength { .. } | SparseLength { .. } | SparseIndex | LogBits | Experts { .. } | Layers { .. } => {
                PayloadError::new_err(self.to_string())
            }
        }
    }
}

impl ToPyErr for RouteError {
    fn to_py(self) -> PyErr {
        match self {
            RouteError::NoHealthyWorker => NoHealthyWorker::new_err(self.to_string()),
        }
    }
}

impl ToPyErr for eldr_core::policies::ProfileError {
    fn to_py(self) -> PyErr {
        use eldr_core::policies::ProfileError::*;
        match &self {
            Dims { .. } | Lengths { .. } | NoTokens | IndexOutOfRange { .. } | BadCount(_) | WorkerOutOfRange { .. } | OtherSelection { .. }
            | Stale => ProfileError::new_err(self.to_string()),
        }
    }
}

impl ToPyErr for BuildError {
    fn to_py(self) -> PyErr {
        match self {
            BuildError::Centroids(e) => e.to_py(),
            BuildError::Size(e) => e.to_py(),
            BuildError::Policy(e) => e.to_py(),
            BuildError::Param(e) => e.to_py(),
            BuildError::NoWorkerCount => PyValueError::new_err(self.to_string()),
        }
    }
}

/// The argument errors: ValueError, each variant named so a new one is a compile error here.
macro_rules! value_errors {
    ($($t:ty => |$e:ident| $arms:pat),* $(,)?) => {$(
        impl ToPyErr for $t {
            fn to_py(self) -> PyErr {
                let $e = &self;
                match $e {
                    $arms => PyValueError::new_err(self.to_string()),
                }
            }
        }
    )*};
}
value_errors! {
    SizeError => |e| SizeError::OutOfRange { .. } | SizeError::TooLarge { .. } | SizeError::Alloc { .. },
    ParamError => |e| ParamError::Tau(_) | ParamError::LoadFactor(_),
    SpecError => |e| SpecError::NoLayers | SpecError::IdfShape { .. } | SpecError::BadWeight { .. } | SpecError::BadIdf { .. } | SpecError::NoneSelected,
    UnknownPolicy => |e| UnknownPolicy { .. },
    experts::OutOfRange => |e| experts::OutOfRange { .. },
}

fn py_err<E: ToPyErr>(e: E) -> PyErr {
    e.to_py()
}

/// A contiguous view of a numpy array (copied only when the input is not C-contiguous).
struct View<'py, T: Element> {
    arr: PyReadonlyArrayDyn<'py, T>,
    owned: Option<Vec<T>>,
}

impl<'py, T: Element + Copy> View<'py, T> {
    fn new(arr: PyReadonlyArrayDyn<'py, T>) -> Self {
        let owned = if arr.as_slice().is_ok() { None } else { Some(arr.as_array().iter().copied().collect()) };
        View { arr, owned }
    }
    fn slice(&self) -> &[T] {
        match &self.owned {
            Some(v) => v,
            None => self.arr.as_slice().unwrap(),
        }
    }
    fn shape(&self) -> &[usize] {
        self.arr.shape()
    }
}

/// Call `$f::<T>(View<T>, args...)` for the dtype in the list that `$obj` has. The dtype is
/// compared first, so a mismatch costs no failed extraction (and no Python exception).
macro_rules! dispatch {
    ($obj:expr, $what:expr, $f:ident, [$($t:ty),*] $(, $arg:expr)*) => {{
        let obj = $obj;
        let names = stringify!($($t),*);
        match obj.cast::<numpy::PyUntypedArray>() {
            Ok(arr) => {
                let dt = arr.dtype();
                dispatch!(@try obj, dt, $what, names, $f, [$($t),*], ($($arg),*))
            }
            Err(_) => Err(PyTypeError::new_err(format!(
                "{}: expected a numpy array of one of: {}, got {}", $what, names, obj.get_type()
            ))),
        }
    }};
    (@try $obj:ident, $dt:ident, $what:expr, $names:ident, $f:ident, [$t0:ty $(, $t:ty)*], $args:tt) => {
        if $dt.is_equiv_to(&numpy::dtype::<$t0>($obj.py())) {
            let a = $obj.extract::<PyReadonlyArrayDyn<$t0>>()?;
            dispatch!(@call $f, $t0, a, $args)
        } else {
            dispatch!(@try $obj, $dt, $what, $names, $f, [$($t),*], $args)
        }
    };
    (@try $obj:ident, $dt:ident, $what:expr, $names:ident, $f:ident, [], $args:tt) => {
        Err(PyTypeError::new_err(format!("{}: unsupported input {}; pass a numpy array of one of: {}", $what, $dt, $names)))
    };
    (@call $f:ident, $t:ty, $a:ident, ($($arg:expr),*)) => {
        $f::<$t>(View::new($a) $(, $arg)*)
    };
}

// ---------------------------------------------------------------- signatures

fn dense_sig<T: Element + CountValue>(v: View<'_, T>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    if v.shape().len() != 2 && v.shape().len() != 1 {
        return Ok(Err(NoSignature::Shape));
    }
    Ok(spec.from_dense(v.slice()))
}

fn topk_sig<T: Element + ExpertId>(v: View<'_, T>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    let sh = v.shape();
    if sh.len() != 3 || sh[1] != spec.num_layers() {
        return Ok(Err(NoSignature::Shape));
    }
    Ok(spec.from_topk(v.slice(), sh[2]))
}

fn sparse_vals<I: Element + SparseIndex>(idx: View<'_, I>, counts: &Bound<'_, PyAny>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    dispatch!(counts, "counts", sparse_sig, [f32, u32, u16, i64, i32, f64], &idx, spec)
}

fn sparse_sig<T: Element + CountValue>(counts: View<'_, T>, idx: &View<'_, impl Element + SparseIndex>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    Ok(spec.from_sparse(idx.slice(), counts.slice()))
}

fn sparse_sig_any(index: &Bound<'_, PyAny>, counts: &Bound<'_, PyAny>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    dispatch!(index, "index", sparse_vals, [i64, i32, u32, u16], counts, spec)
}

fn dense_sig_any(counts: &Bound<'_, PyAny>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    dispatch!(counts, "counts", dense_sig, [u16, u32, f32, i64, i32, f64, u8], spec)
}

fn topk_sig_any(ids: &Bound<'_, PyAny>, spec: &SignatureSpec) -> PyResult<Result<SparseSignature, NoSignature>> {
    dispatch!(ids, "ids", topk_sig, [u8, i16, i32, i64, u16, u32], spec)
}

/// Layer weights and IDF: turns raw expert counts into a unit signature.
#[pyclass(name = "SignatureSpec", module = "eldr_sglang._core", frozen)]
struct PySignatureSpec {
    spec: SignatureSpec,
}

impl PySignatureSpec {
    fn out(&self, py: Python<'_>, r: Result<SparseSignature, NoSignature>) -> PyResult<Py<PyArray1<f32>>> {
        let sig = r.map_err(py_err)?;
        Ok(sig.to_dense(self.spec.dim()).into_pyarray(py).unbind())
    }
}

#[pymethods]
impl PySignatureSpec {
    #[new]
    fn new(layer_weights: PyReadonlyArrayDyn<'_, f32>, idf: PyReadonlyArrayDyn<'_, f32>) -> PyResult<Self> {
        let w = View::new(layer_weights);
        let i = View::new(idf);
        if w.shape().len() != 1 {
            return Err(PyValueError::new_err(format!("layer_weights must be 1-D [L], got shape {:?}", w.shape())));
        }
        if i.shape().len() != 2 || i.shape()[0] != w.shape()[0] {
            return Err(PyValueError::new_err(format!("idf must be [L, E] with L={}, got shape {:?}", w.shape()[0], i.shape())));
        }
        Ok(PySignatureSpec { spec: SignatureSpec::new(w.slice(), i.slice()).map_err(py_err)? })
    }
    #[getter]
    fn num_layers(&self) -> usize {
        self.spec.num_layers()
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.spec.num_experts()
    }
    #[getter]
    fn dim(&self) -> usize {
        self.spec.dim()
    }
    #[getter]
    fn selected_layers(&self) -> Vec<usize> {
        self.spec.selected_layers().to_vec()
    }
    fn from_dense(&self, py: Python<'_>, counts: &Bound<'_, PyAny>) -> PyResult<Py<PyArray1<f32>>> {
        let r = dense_sig_any(counts, &self.spec)?;
        self.out(py, r)
    }
    fn from_sparse(&self, py: Python<'_>, index: &Bound<'_, PyAny>, counts: &Bound<'_, PyAny>) -> PyResult<Py<PyArray1<f32>>> {
        let r = sparse_sig_any(index, counts, &self.spec)?;
        self.out(py, r)
    }
    fn from_topk(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<Py<PyArray1<f32>>> {
        let r = topk_sig_any(ids, &self.spec)?;
        self.out(py, r)
    }
    /// Signatures of many requests from one `[T, L, k]` id array (GIL released).
    #[pyo3(signature = (ids, offsets, prefix_len=None))]
    fn batch_from_topk<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        offsets: PyReadonlyArrayDyn<'py, i64>,
        prefix_len: Option<PyReadonlyArrayDyn<'py, i64>>,
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<bool>>)> {
        let off = View::new(offsets);
        let pre = prefix_len.map(View::new);
        dispatch!(ids, "ids", batch_topk, [u8, i16, i32, i64, u16, u32], py, &self.spec, off.slice(), pre.as_ref().map(|p| p.slice()))
    }
    /// Signatures of a CSR batch of count rows (GIL released); see the "batched sparse
    /// signatures" block below.
    #[pyo3(signature = (indptr, index, counts, out=None))]
    fn from_sparse_batch<'py>(
        &self,
        py: Python<'py>,
        indptr: PyReadonlyArrayDyn<'py, i64>,
        index: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        out: Option<Bound<'py, PyArray2<f32>>>,
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<bool>>)> {
        sparse_batch(py, &self.spec, indptr, index, counts, out)
    }
}

fn batch_topk<'py, T: Element + ExpertId>(
    v: View<'_, T>,
    py: Python<'py>,
    spec: &SignatureSpec,
    offsets: &[i64],
    prefix: Option<&[i64]>,
) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<bool>>)> {
    let sh = v.shape().to_vec();
    if sh.len() != 3 || sh[1] != spec.num_layers() {
        return Err(PyValueError::new_err(format!("ids must be [T, L={}, k], got shape {sh:?}", spec.num_layers())));
    }
    if offsets.is_empty() {
        return Err(PyValueError::new_err("offsets must hold R+1 values"));
    }
    let r = offsets.len() - 1;
    if let Some(p) = prefix {
        if p.len() != r {
            return Err(PyValueError::new_err(format!("prefix_len has {} values for {r} requests", p.len())));
        }
    }
    let (t, row) = (sh[0] as i64, sh[1] * sh[2]);
    for i in 0..r {
        let (a, b) = (offsets[i], offsets[i + 1]);
        if a < 0 || b < a || b > t {
            return Err(PyValueError::new_err(format!("offsets[{i}..{}] = {a}..{b} is not a valid range of {t} tokens", i + 1)));
        }
        if let Some(p) = prefix {
            if p[i] < 0 || p[i] > b - a {
                return Err(PyValueError::new_err(format!("prefix_len[{i}] = {} is outside 0..={}", p[i], b - a)));
            }
        }
    }
    let d = spec.dim();
    let ids = v.slice();
    let k = sh[2];
    let mut sigs: Vec<f32> = limits::zeroed("signatures (requests x D)", r, d).map_err(py_err)?;
    let mut valid = vec![false; r];
    py.detach(|| {
        for i in 0..r {
            let a = offsets[i] as usize;
            let b = prefix.map_or(offsets[i + 1] as usize, |p| a + p[i] as usize);
            if let Ok(sig) = spec.from_topk(&ids[a * row..b * row], k) {
                valid[i] = true;
                let out = &mut sigs[i * d..(i + 1) * d];
                for (&j, &x) in sig.index.iter().zip(&sig.value) {
                    out[j as usize] = (x as f64 / sig.norm) as f32;
                }
            }
        }
    });
    let arr = numpy::ndarray::Array2::from_shape_vec((r, d), sigs).expect("shape");
    Ok((arr.into_pyarray(py), valid.into_pyarray(py)))
}

// ---------------------------------------------------------------- batched sparse signatures
// (scale branch, issue 13: `eldr fit` from a trace v2 chunk in one call.) Each row goes through
// eldr-core's `SignatureSpec::fill_sparse_batch`, i.e. the single-request `fill_sparse`.

type SigBatch<'py> = (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<bool>>);

fn sparse_batch<'py>(
    py: Python<'py>,
    spec: &SignatureSpec,
    indptr: PyReadonlyArrayDyn<'py, i64>,
    index: &Bound<'py, PyAny>,
    counts: &Bound<'py, PyAny>,
    out: Option<Bound<'py, PyArray2<f32>>>,
) -> PyResult<SigBatch<'py>> {
    let indptr = View::new(indptr);
    if indptr.shape().len() != 1 {
        return Err(PyValueError::new_err(format!("indptr must be 1-D [n+1], got shape {:?}", indptr.shape())));
    }
    dispatch!(index, "index", sparse_batch_index, [u16, u32, i32, i64], py, spec, indptr.slice(), counts, out)
}

fn sparse_batch_index<'py, I: Element + SparseIndex>(
    index: View<'_, I>,
    py: Python<'py>,
    spec: &SignatureSpec,
    indptr: &[i64],
    counts: &Bound<'py, PyAny>,
    out: Option<Bound<'py, PyArray2<f32>>>,
) -> PyResult<SigBatch<'py>> {
    dispatch!(counts, "counts", sparse_batch_rows, [u16, u32, f32, i64, i32, f64], &index, py, spec, indptr, out)
}

fn sparse_batch_rows<'py, T: Element + CountValue>(
    counts: View<'_, T>,
    index: &View<'_, impl Element + SparseIndex>,
    py: Python<'py>,
    spec: &SignatureSpec,
    indptr: &[i64],
    out: Option<Bound<'py, PyArray2<f32>>>,
) -> PyResult<SigBatch<'py>> {
    let (rows, d) = (indptr.len().saturating_sub(1), spec.dim());
    let (index, counts) = (index.slice(), counts.slice());
    let mut valid = vec![false; rows];
    let run = |sigs: &mut [f32], valid: &mut [bool]| {
        py.detach(|| spec.fill_sparse_batch(indptr, index, counts, sigs, valid)).map_err(|e| match e {
            eldr_core::BatchError::Row { row, why } => {
                let err = NoSignatureError::new_err(format!("row {row}: no usable signature: {why}"));
                let _ = err.value(py).setattr("reason", why.as_str());
                err
            }
            other => PyValueError::new_err(other.to_string()),
        })
    };
    let sigs = match out {
        Some(arr) => {
            if arr.shape() != [rows, d] {
                return Err(PyValueError::new_err(format!("out must be [{rows}, {d}] float32, got shape {:?}", arr.shape())));
            }
            if !arr.is_c_contiguous() {  // as_slice_mut accepts Fortran order too, which would scramble rows
                return Err(PyValueError::new_err("out must be C-contiguous"));
            }
            {
                let mut rw = numpy::PyArrayMethods::try_readwrite(&arr).map_err(|e| PyValueError::new_err(format!("out is not writable: {e}")))?;
                let slice = rw.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
                run(slice, &mut valid)?;
            }
            arr
        }
        None => {
            let mut sigs: Vec<f32> = limits::zeroed("signatures (requests x D)", rows, d).map_err(py_err)?;
            run(&mut sigs, &mut valid)?;
            numpy::ndarray::Array2::from_shape_vec((rows, d), sigs).expect("shape").into_pyarray(py)
        }
    };
    Ok((sigs, valid.into_pyarray(py)))
}
// ---------------------------------------------------------------- end of batched sparse signatures

fn count_t<T: Element + ExpertId>(v: View<'_, T>, py: Python<'_>, num_experts: usize, distinct: bool) -> PyResult<Py<PyAny>> {
    let sh = v.shape().to_vec();
    if sh.len() != 3 {
        return Err(PyValueError::new_err(format!("ids must be [T, L, k], got shape {sh:?}")));
    }
    let (l, k) = (sh[1], sh[2]);
    limits::check_dim("num_experts", num_experts).map_err(py_err)?;
    let ids = v.slice();
    let res = if distinct {
        let mut scratch: Vec<bool> = limits::zeroed("layers x num_experts", l, num_experts).map_err(py_err)?;
        let mut out = vec![0u32; l];
        py.detach(|| experts::distinct_per_layer(ids, l, k, num_experts, &mut scratch, &mut out)).map(|_| out)
    } else {
        let mut out: Vec<u32> = limits::zeroed("layers x num_experts", l, num_experts).map_err(py_err)?;
        py.detach(|| experts::count_topk(ids, l, k, num_experts, &mut out)).map(|_| out)
    };
    let out = res.map_err(py_err)?;
    if distinct {
        Ok(out.into_pyarray(py).into_any().unbind())
    } else {
        let arr = numpy::ndarray::Array2::from_shape_vec((l, num_experts), out).expect("shape");
        Ok(arr.into_pyarray(py).into_any().unbind())
    }
}

/// Top-k ids `[T, L, k]` -> counts `[L, E]` (uint32).
#[pyfunction]
fn count_topk(py: Python<'_>, ids: &Bound<'_, PyAny>, num_experts: usize) -> PyResult<Py<PyAny>> {
    dispatch!(ids, "ids", count_t, [u8, i16, i32, i64, u16, u32], py, num_experts, false)
}

/// Top-k ids `[N, L, k]` of one decode step -> distinct experts per layer `[L]` (uint32).
#[pyfunction]
fn distinct_per_layer(py: Python<'_>, ids: &Bound<'_, PyAny>, num_experts: usize) -> PyResult<Py<PyAny>> {
    dispatch!(ids, "ids", count_t, [u8, i16, i32, i64, u16, u32], py, num_experts, true)
}

// ---------------------------------------------------------------- band statistics (lead, issue 14)

/// Band size of each row of `distances` `[n, K]` (d = 1 - cos) at `tau`, every worker eligible:
/// the calibration statistic the drift baseline keeps, by the router's own band bound.
#[pyfunction]
fn band_sizes<'py>(py: Python<'py>, distances: PyReadonlyArray2<'py, f64>, tau: f64) -> PyResult<Bound<'py, PyArray1<u32>>> {
    if !(tau.is_finite() && tau >= 0.0) {
        return Err(PyValueError::new_err(format!("tau must be finite and >= 0, got {tau}")));
    }
    let d = distances.as_array();
    let out: Vec<u32> = d.rows().into_iter().map(|r| match r.as_slice() {
        Some(s) => eldr_core::band_size(s, tau) as u32,
        None => eldr_core::band_size(&r.to_vec(), tau) as u32,
    }).collect();
    Ok(out.into_pyarray(py))
}

// ---------------------------------------------------------------- centroid file

/// A validated centroid file, read into a private read-only copy (not mapped: an in-place
/// overwrite of a mapped file would crash the router with SIGBUS).
#[pyclass(name = "CentroidSet", module = "eldr_sglang._core", frozen)]
struct PyCentroidSet {
    set: Arc<CentroidSet>,
}

#[pymethods]
impl PyCentroidSet {
    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        Ok(PyCentroidSet { set: Arc::new(CentroidSet::open(&path).map_err(py_err)?) })
    }
    #[getter]
    fn path(&self) -> String {
        self.set.path().display().to_string()
    }
    #[getter]
    fn version(&self) -> u32 {
        eldr_core::FORMAT_VERSION
    }
    #[getter]
    fn num_workers(&self) -> usize {
        self.set.num_workers()
    }
    #[getter]
    fn num_layers(&self) -> usize {
        self.set.num_layers()
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.set.num_experts()
    }
    #[getter]
    fn dim(&self) -> usize {
        self.set.dim()
    }
    #[getter]
    fn tau(&self) -> f32 {
        self.set.tau()
    }
    #[getter]
    fn worker_names(&self) -> Vec<String> {
        self.set.worker_names().to_vec()
    }
    #[getter]
    fn provenance_json(&self) -> String {
        self.set.provenance().to_owned()
    }
    #[getter]
    fn checksum(&self) -> u32 {
        self.set.checksum()
    }
    fn layer_weights<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        self.set.spec().layer_weights().to_vec().into_pyarray(py)
    }
    fn idf<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<f32>> {
        let (l, e) = (self.set.num_layers(), self.set.num_experts());
        numpy::ndarray::Array2::from_shape_vec((l, e), self.set.spec().idf().to_vec()).expect("shape").into_pyarray(py)
    }
    fn centroids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<f32>> {
        let (k, d) = (self.set.num_workers(), self.set.dim());
        numpy::ndarray::Array2::from_shape_vec((k, d), self.set.centroids()).expect("shape").into_pyarray(py)
    }
    fn spec(&self) -> PySignatureSpec {
        PySignatureSpec { spec: self.set.spec().clone() }
    }
    fn __repr__(&self) -> String {
        format!("CentroidSet(path={:?}, K={}, L={}, E={}, D={}, tau={})", self.path(), self.num_workers(), self.num_layers(), self.num_experts(), self.dim(), self.tau())
    }
}

/// Validate and write a centroid file atomically (temp file + rename).
#[pyfunction]
#[pyo3(signature = (path, centroids, layer_weights, idf, tau=0.1, worker_names=None, provenance_json="{}"))]
fn write_centroids(
    path: PathBuf,
    centroids: PyReadonlyArrayDyn<'_, f32>,
    layer_weights: PyReadonlyArrayDyn<'_, f32>,
    idf: PyReadonlyArrayDyn<'_, f32>,
    tau: f32,
    worker_names: Option<Vec<String>>,
    provenance_json: &str,
) -> PyResult<()> {
    let c = View::new(centroids);
    let w = View::new(layer_weights);
    let i = View::new(idf);
    if c.shape().len() != 2 {
        return Err(PyValueError::new_err(format!("centroids must be [K, D], got shape {:?}", c.shape())));
    }
    if w.shape().len() != 1 || i.shape().len() != 2 || i.shape()[0] != w.shape()[0] {
        return Err(PyValueError::new_err(format!("layer_weights [L] and idf [L, E] disagree: {:?} vs {:?}", w.shape(), i.shape())));
    }
    let k = c.shape()[0];
    let names = worker_names.unwrap_or_else(|| (0..k).map(|i| format!("decode-{i}")).collect());
    CentroidWriter { centroids: c.slice(), k, layer_weights: w.slice(), idf: i.slice(), tau, worker_names: names, provenance: provenance_json }
        .write(&path)
        .map_err(py_err)
}

// ---------------------------------------------------------------- wire payload

/// Validated counts from a prefill's payload, still packed: routing reads them in place
/// (`Router.route_counts`); `counts` and `to_layout` make dense arrays for tools and tests.
#[pyclass(name = "DecodedCounts", module = "eldr_sglang._core", frozen)]
struct PyDecodedCounts {
    inner: DecodedCounts,
}

#[pymethods]
impl PyDecodedCounts {
    /// Hidden-layer ids of the payload's rows.
    #[getter]
    fn layers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        pyo3::types::PyTuple::new(py, self.inner.layers())
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.num_tokens()
    }
    #[getter]
    fn exact(&self) -> bool {
        self.inner.exact()
    }
    #[getter]
    fn encoding(&self) -> &'static str {
        self.inner.encoding_name()
    }
    #[getter]
    fn bits(&self) -> u32 {
        self.inner.bits()
    }
    /// Length of the base64 data field.
    #[getter]
    fn data_bytes(&self) -> usize {
        self.inner.data_bytes()
    }
    /// Dense counts `[len(layers), E]` (float32), rows in payload order.
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<f32>> {
        let (l, e) = (self.inner.layers().len(), self.inner.num_experts());
        numpy::ndarray::Array2::from_shape_vec((l, e), self.inner.to_dense()).expect("shape").into_pyarray(py)
    }
    /// Dense counts in a centroid file's `[num_layers, E]` layout (rows in order when the file
    /// holds only the payload's layers, else placed at their ids). Raises PayloadError.
    fn to_layout<'py>(&self, py: Python<'py>, num_layers: usize, num_experts: usize) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let v = self.inner.to_layout(num_layers, num_experts).map_err(py_err)?;
        Ok(numpy::ndarray::Array2::from_shape_vec((num_layers, num_experts), v).expect("shape").into_pyarray(py))
    }
    fn __repr__(&self) -> String {
        format!("DecodedCounts(layers={}, E={}, n={}, encoding={:?}, bits={})", self.inner.layers().len(), self.inner.num_experts(), self.inner.num_tokens(), self.inner.encoding_name(), self.inner.bits())
    }
}

fn text_bytes<'a>(data: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    if let Ok(b) = data.cast::<pyo3::types::PyBytes>() {
        return Ok(b.as_bytes());
    }
    if let Ok(s) = data.cast::<pyo3::types::PyString>() {
        return Ok(s.to_str()?.as_bytes());
    }
    Err(PyTypeError::new_err(format!("expected bytes or str, got {}", data.get_type())))
}

fn limits_of(max_bytes: usize, layout: Option<(usize, usize)>) -> DecodeLimits {
    DecodeLimits { max_bytes, layout }
}

/// Decode a payload's JSON text (an object, a one-request list of one, or a JSON string of
/// one), with the GIL released. With `layout` = (num_layers, num_experts) of the centroid file
/// a payload that cannot fit it is refused unread. Raises PayloadError (also for a payload
/// that says the prefill sent no counts).
#[pyfunction]
#[pyo3(signature = (data, max_bytes=payload::DEFAULT_MAX_BYTES, layout=None))]
fn decode_payload(py: Python<'_>, data: &Bound<'_, PyAny>, max_bytes: usize, layout: Option<(usize, usize)>) -> PyResult<PyDecodedCounts> {
    let bytes = text_bytes(data)?;
    let lim = limits_of(max_bytes, layout);
    match py.detach(|| payload::decode(bytes, &lim)).map_err(py_err)? {
        Payload::Counts(inner) => Ok(PyDecodedCounts { inner }),
        Payload::NoCounts(why) => Err(PayloadError::new_err(format!("the payload carries no counts (the prefill says: {why})"))),
    }
}

/// Find and decode the payload in one stream event's JSON (`meta_info` or `sglext`), with the
/// GIL released: DecodedCounts; the prefill's reason (str) when it sent none; None when the
/// event is not a JSON object or has no payload. Raises PayloadError for a malformed payload.
#[pyfunction]
#[pyo3(signature = (data, max_bytes=payload::DEFAULT_MAX_BYTES, layout=None))]
fn decode_event(py: Python<'_>, data: &Bound<'_, PyAny>, max_bytes: usize, layout: Option<(usize, usize)>) -> PyResult<Py<PyAny>> {
    let bytes = text_bytes(data)?;
    let lim = limits_of(max_bytes, layout);
    Ok(match py.detach(|| payload::decode_event(bytes, &lim)).map_err(py_err)? {
        None => py.None(),
        Some(Payload::NoCounts(why)) => why.into_pyobject(py)?.into_any().unbind(),
        Some(Payload::Counts(inner)) => Py::new(py, PyDecodedCounts { inner })?.into_any(),
    })
}

// ---------------------------------------------------------------- router

/// A routing decision with its details.
#[pyclass(name = "Decision", module = "eldr_sglang._core", frozen)]
struct PyDecision {
    #[pyo3(get)]
    worker: usize,
    #[pyo3(get)]
    reason: String,
    #[pyo3(get)]
    distances: Option<Vec<f64>>,
    #[pyo3(get)]
    band: Option<Vec<usize>>,
    #[pyo3(get)]
    d_star: Option<f64>,
    #[pyo3(get)]
    tau: Option<f64>,
    #[pyo3(get)]
    loads: Vec<i64>,
    #[pyo3(get)]
    generation: u64,
    /// The signature the route computed, kept when asked (`route_counts(signature=True)`).
    signature: Option<(SparseSignature, usize)>,
}

#[pymethods]
impl PyDecision {
    /// The request's unit signature `[D]` (float32) as the route computed it, or None (not
    /// kept, or no usable signature).
    fn unit_signature<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<f32>>> {
        self.signature.as_ref().map(|(s, dim)| s.to_dense(*dim).into_pyarray(py))
    }
    fn __repr__(&self) -> String {
        format!("Decision(worker={}, reason={:?}, d_star={:?}, band={:?})", self.worker, self.reason, self.d_star, self.band)
    }
}

/// One in-flight request on one worker; released exactly once (explicitly, on `with` exit,
/// or when garbage-collected).
#[pyclass(name = "Lease", module = "eldr_sglang._core", frozen)]
struct PyLease {
    guard: LoadGuard,
    /// The locality balancer's count of the request's experts, released with the lease.
    experts: Option<ExpertGuard>,
}

#[pymethods]
impl PyLease {
    #[getter]
    fn worker(&self) -> usize {
        self.guard.worker()
    }
    #[getter]
    fn tokens(&self) -> i64 {
        self.guard.tokens()
    }
    #[getter]
    fn released(&self) -> bool {
        self.guard.is_released()
    }
    fn release(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            if let Some(e) = &self.experts {
                e.release();
            }
            self.guard.release()
        })
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release(py);
        false
    }
    fn __repr__(&self) -> String {
        format!("Lease(worker={}, tokens={}, released={})", self.worker(), self.tokens(), self.released())
    }
}

/// A request's expected expert use per decode token, from its prompt's counts (the locality
/// balancer's input): `index` flat `l * num_experts + e`, `counts` prompt tokens that chose it.
#[pyclass(name = "ExpertProfile", module = "eldr_sglang._core", frozen)]
struct PyExpertProfile {
    inner: Arc<ExpertProfile>,
}

#[pymethods]
impl PyExpertProfile {
    #[new]
    fn new(num_layers: usize, num_experts: usize, index: PyReadonlyArray1<'_, i64>, counts: PyReadonlyArray1<'_, f64>, tokens: u64) -> PyResult<Self> {
        let idx: Vec<u64> = index.as_array().iter().map(|&i| if i < 0 { u64::MAX } else { i as u64 }).collect();
        let c = counts.as_array().to_vec();
        ExpertProfile::from_sparse(num_layers, num_experts, &idx, &c, tokens).map(|p| PyExpertProfile { inner: Arc::new(p) }).map_err(py_err)
    }
    /// MoE layers (rows of the prefill counts) the profile spans.
    #[getter]
    fn layer_ids(&self) -> Vec<u32> {
        self.inner.layer_ids().to_vec()
    }
    /// Nonzero (layer, expert) cells: the work of one acquire, release or route per worker.
    #[getter]
    fn nnz(&self) -> usize {
        self.inner.nnz()
    }
    #[getter]
    fn generation(&self) -> u64 {
        self.inner.generation()
    }
    fn __repr__(&self) -> String {
        format!("ExpertProfile(layers={}, experts={}, nnz={}, experts_per_layer={:.2})", self.inner.layers(), self.inner.experts(), self.inner.nnz(), self.inner.experts_per_layer())
    }
}

/// Band router + baseline policies + queue tracker + hot-reloadable centroids.
#[pyclass(name = "Router", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyRouter {
    /// Shared with the Rust data plane (`DataPlane`), which routes on the same instance.
    pub(crate) inner: Arc<eldr_core::Router>,
}

impl PyRouter {
    fn finish(&self, py: Python<'_>, r: Result<Routed, RouteError>, explain: bool) -> PyResult<Py<PyAny>> {
        let r = r.map_err(py_err)?;
        let worker = r.decision.worker.expect("route returns a worker or an error");
        if !explain {
            return Ok(worker.into_pyobject(py)?.into_any().unbind());
        }
        let uses_tau = r.decision.d_star.is_some();
        let d = PyDecision {
            worker,
            reason: r.decision.reason.label(),
            distances: r.distances,
            band: r.decision.band,
            d_star: r.decision.d_star,
            tau: uses_tau.then_some(r.tau),
            loads: r.loads,
            generation: r.generation,
            signature: r.signature.map(|s| (s, self.inner.store().map_or(0, |st| st.set().dim()))),
        };
        Ok(Py::new(py, d)?.into_any())
    }

    fn check_worker(&self, worker: usize) -> PyResult<()> {
        if worker >= self.inner.num_workers() {
            return Err(PyValueError::new_err(format!("worker {worker} out of range 0..{}", self.inner.num_workers())));
        }
        Ok(())
    }
}

fn route_dense_t<T: Element + CountValue>(v: View<'_, T>, r: &PyRouter, py: Python<'_>, explain: bool) -> PyResult<Py<PyAny>> {
    let c = v.slice();
    let routed = py.detach(|| r.inner.route(|set| distance::from_counts::<u32, T>(set, Counts::Dense(c)), explain));
    r.finish(py, routed, explain)
}

fn route_sparse_i<I: Element + SparseIndex>(idx: View<'_, I>, counts: &Bound<'_, PyAny>, r: &PyRouter, py: Python<'_>, explain: bool) -> PyResult<Py<PyAny>> {
    dispatch!(counts, "counts", route_sparse_it, [f32, u32, u16, i64, i32, f64], &idx, r, py, explain)
}

fn route_sparse_it<T: Element + CountValue>(c: View<'_, T>, idx: &View<'_, impl Element + SparseIndex>, r: &PyRouter, py: Python<'_>, explain: bool) -> PyResult<Py<PyAny>> {
    let (i, c) = (idx.slice(), c.slice());
    let routed = py.detach(|| r.inner.route(|set| distance::from_counts(set, Counts::Sparse(i, c)), explain));
    r.finish(py, routed, explain)
}

// ---- locality balancer: profiles from raw prefill counts (one block) ----

fn profile_out(r: Option<Result<ExpertProfile, NoSignature>>) -> PyResult<PyExpertProfile> {
    match r {
        None => Err(PyValueError::new_err("this router has no centroid file, whose layer selection a profile needs; build one with ExpertProfile(...) instead")),
        Some(Err(why)) => Err(why.to_py()),
        Some(Ok(p)) => Ok(PyExpertProfile { inner: Arc::new(p) }),
    }
}

fn profile_dense_t<T: Element + CountValue>(v: View<'_, T>, r: &PyRouter, py: Python<'_>, tokens: u64) -> PyResult<PyExpertProfile> {
    let c = v.slice();
    let p = py.detach(|| r.inner.profile::<u32, T>(Counts::Dense(c), tokens));
    profile_out(p)
}

#[pymethods]
impl PyRouter {
    #[new]
    // `policy`: None is the core's DEFAULT_POLICY (a literal default here would be a second copy).
    #[pyo3(signature = (policy=None, num_workers=None, centroids=None, tau=None, seed=0, reload_interval_ms=250, load_report_ttl_ms=2000, load_factor=None, paged_experts=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        policy: Option<&str>,
        num_workers: Option<usize>,
        centroids: Option<PathBuf>,
        tau: Option<f64>,
        seed: u64,
        reload_interval_ms: u64,
        load_report_ttl_ms: u64,
        load_factor: Option<f64>,
        paged_experts: Option<u32>,
    ) -> PyResult<Self> {
        let mut inner = py
            .detach(|| eldr_core::Router::new(policy.unwrap_or(eldr_core::DEFAULT_POLICY), num_workers, centroids.as_deref(), tau, seed, reload_interval_ms, load_report_ttl_ms))
            .map_err(py_err)?;
        inner.set_load_factor(load_factor).map_err(py_err)?;
        inner.set_paged_experts(paged_experts).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyRouter { inner: Arc::new(inner) })
    }
    #[getter]
    fn get_load_factor(&self) -> Option<f64> {
        self.inner.load_factor()
    }
    #[setter]
    fn set_load_factor(&self, value: Option<f64>) -> PyResult<()> {
        self.inner.set_load_factor(value).map_err(py_err)
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy_name()
    }
    #[getter]
    fn paged_experts(&self) -> Option<usize> {
        self.inner.paged_experts()
    }
    #[getter]
    fn num_workers(&self) -> usize {
        self.inner.num_workers()
    }
    #[getter]
    fn get_tau(&self) -> f64 {
        self.inner.tau()
    }
    #[setter]
    fn set_tau(&self, value: f64) -> PyResult<()> {
        self.inner.set_tau(value).map_err(py_err)
    }
    #[pyo3(signature = (counts, explain=false))]
    fn route_dense(&self, py: Python<'_>, counts: &Bound<'_, PyAny>, explain: bool) -> PyResult<Py<PyAny>> {
        dispatch!(counts, "counts", route_dense_t, [u16, u32, f32, i64, i32, f64, u8], self, py, explain)
    }
    #[pyo3(signature = (index, counts, explain=false))]
    fn route_sparse(&self, py: Python<'_>, index: &Bound<'_, PyAny>, counts: &Bound<'_, PyAny>, explain: bool) -> PyResult<Py<PyAny>> {
        dispatch!(index, "index", route_sparse_i, [i64, i32, u32, u16], counts, self, py, explain)
    }
    /// Route from a signature in the centroids' D-dim space; None = the signature is missing.
    #[pyo3(signature = (signature, explain=false))]
    fn route_signature(&self, py: Python<'_>, signature: Option<PyReadonlyArrayDyn<'_, f32>>, explain: bool) -> PyResult<Py<PyAny>> {
        let r = match signature {
            None => py.detach(|| self.inner.route(|_| Err(NoSignature::Missing), explain)),
            Some(a) => {
                let v = View::new(a);
                let ok_shape = v.shape().len() == 1;
                let s = v.slice();
                py.detach(|| self.inner.route(|set| if ok_shape { distance::from_dense_signature(set, s) } else { Err(NoSignature::Shape) }, explain))
            }
        };
        self.finish(py, r, explain)
    }
    /// Route from a decoded payload (`decode_event` / `decode_payload`), GIL released: the
    /// signature is read straight from the packed counts. With `signature`, the decision keeps
    /// it (`Decision.unit_signature()`), for the drift reservoir.
    #[pyo3(signature = (counts, explain=false, signature=false))]
    fn route_counts(&self, py: Python<'_>, counts: &PyDecodedCounts, explain: bool, signature: bool) -> PyResult<Py<PyAny>> {
        let c = &counts.inner;
        let r = py.detach(|| self.inner.route_counts(c, signature && explain, explain));
        self.finish(py, r, explain)
    }
    /// Route a request whose signature is known to be unusable (`reason` as in NoSignature).
    #[pyo3(signature = (reason, explain=false))]
    fn route_fallback(&self, py: Python<'_>, reason: &str, explain: bool) -> PyResult<Py<PyAny>> {
        let why = NoSignature::parse(reason).ok_or_else(|| PyValueError::new_err(format!("unknown no-signature reason {reason:?}")))?;
        let r = py.detach(|| self.inner.route(|_| Err(why), explain));
        self.finish(py, r, explain)
    }
    /// Route by the request's expert profile (the locality balancer; other policies ignore it
    /// and route as with no signature).
    #[pyo3(signature = (profile, explain=false))]
    fn route_profile(&self, py: Python<'_>, profile: &PyExpertProfile, explain: bool) -> PyResult<Py<PyAny>> {
        let inner = &profile.inner;
        let r = py.detach(|| self.inner.route_profiled(|_| Err(NoSignature::Missing), Some(inner), explain));
        self.finish(py, r, explain)
    }
    /// The locality balancer's profile of a request from its raw dense `[L, E]` prefill
    /// counts and prompt length, over the centroid file's selected layers. Bad counts raise
    /// NoSignature (its `reason` as for a signature); no centroid file raises ValueError.
    fn profile_dense(&self, py: Python<'_>, counts: &Bound<'_, PyAny>, tokens: u64) -> PyResult<PyExpertProfile> {
        dispatch!(counts, "counts", profile_dense_t, [u16, u32, f32, i64, i32, f64, u8], self, py, tokens)
    }
    /// The locality balancer's expected distinct experts per layer per step of each worker's
    /// in-flight requests (zeros before its first profile); None for other policies.
    fn expert_distinct(&self) -> Option<Vec<f64>> {
        let k = self.inner.num_workers();
        self.inner.policy().expert_distinct().map(|d| if d.len() == k { d } else { vec![0.0; k] })
    }
    /// Count one request on `worker` (GIL released: the counters are atomics, so threads
    /// really do acquire and release concurrently); with `profile`, the locality balancer also
    /// counts its experts there until the lease is released.
    #[pyo3(signature = (worker, tokens=0, profile=None))]
    fn acquire(&self, py: Python<'_>, worker: usize, tokens: i64, profile: Option<&PyExpertProfile>) -> PyResult<PyLease> {
        self.check_worker(worker)?;
        let experts = match profile {
            Some(p) => self.inner.policy().track(self.inner.num_workers(), worker, Arc::clone(&p.inner)).transpose().map_err(py_err)?,
            None => None,
        };
        let tracker = self.inner.tracker();
        Ok(PyLease { guard: py.detach(|| tracker.acquire(worker, tokens)), experts })
    }
    fn loads(&self) -> Vec<i64> {
        let mut v = Vec::new();
        self.inner.tracker().loads_into(&mut v);
        v
    }
    fn inflight(&self) -> Vec<i64> {
        (0..self.inner.num_workers()).map(|w| self.inner.tracker().inflight(w)).collect()
    }
    fn tokens(&self) -> Vec<i64> {
        (0..self.inner.num_workers()).map(|w| self.inner.tracker().tokens(w)).collect()
    }
    /// Each decode worker's last /v1/loads count, however old (None: never reported).
    fn reported(&self) -> Vec<Option<i64>> {
        (0..self.inner.num_workers()).map(|w| self.inner.tracker().reported(w)).collect()
    }
    /// A worker's own count of the requests it holds (its /v1/loads), kept for the report TTL.
    fn report_load(&self, worker: usize, running: i64) -> PyResult<()> {
        self.check_worker(worker)?;
        self.inner.tracker().report(worker, running);
        Ok(())
    }
    fn set_healthy(&self, worker: usize, healthy: bool) -> PyResult<()> {
        self.check_worker(worker)?;
        self.inner.tracker().set_healthy(worker, healthy);
        Ok(())
    }
    fn healthy(&self) -> Vec<bool> {
        let mut v = Vec::new();
        self.inner.tracker().healthy_into(&mut v);
        v
    }
    fn reload(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.reload()).map_err(py_err)
    }
    fn maybe_reload(&self, py: Python<'_>) -> PyResult<bool> {
        match self.inner.store() {
            None => Ok(false),
            Some(s) => py.detach(|| s.maybe_reload()).map_err(py_err),
        }
    }
    #[getter]
    fn centroid_generation(&self) -> u64 {
        self.inner.store().map_or(0, |s| s.generation())
    }
    /// Centroid files rejected so far (each bad replacement counts once).
    #[getter]
    fn reload_failures(&self) -> u64 {
        self.inner.store().map_or(0, |s| s.failures())
    }
    #[getter]
    fn last_reload_error(&self) -> Option<String> {
        self.inner.store().and_then(|s| s.last_error())
    }
    fn centroid_set(&self) -> Option<PyCentroidSet> {
        self.inner.store().map(|s| PyCentroidSet { set: s.set() })
    }
    fn __repr__(&self) -> String {
        format!("Router(policy={:?}, num_workers={}, tau={})", self.policy(), self.num_workers(), self.get_tau())
    }
}

/// The refit reservoir's keep/slot draw (bucketed Algorithm R, rust/dataplane/src/reservoir.rs),
/// for a reservoir fed without a data plane; the data plane draws with the same code per request.
#[pyclass(name = "ReservoirSampler", module = "eldr_sglang._core", frozen)]
struct PyReservoirSampler {
    inner: eldr_dataplane::reservoir::KeepSampler,
}

#[pymethods]
impl PyReservoirSampler {
    #[new]
    #[pyo3(signature = (per_bucket, span, seed=0))]
    fn new(per_bucket: u64, span: u64, seed: u64) -> PyResult<Self> {
        let inner = eldr_dataplane::reservoir::KeepSampler::new(per_bucket, span, seed).map_err(PyValueError::new_err)?;
        Ok(PyReservoirSampler { inner })
    }
    /// The next offer's (index, slot or None: not stored).
    fn draw(&self) -> (u64, Option<u32>) {
        let d = self.inner.draw();
        (d.index, d.slot)
    }
    /// Give back a draw that made no offer: the next `draw()` returns it.
    fn undo(&self, index: u64, slot: Option<u32>) {
        self.inner.undo(eldr_dataplane::reservoir::Draw { index, slot })
    }
    #[getter]
    fn per_bucket(&self) -> u64 {
        self.inner.per_bucket()
    }
    #[getter]
    fn span(&self) -> u64 {
        self.inner.span()
    }
    fn __repr__(&self) -> String {
        format!("ReservoirSampler(per_bucket={}, span={})", self.inner.per_bucket(), self.inner.span())
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", eldr_core::FORMAT_VERSION)?;
    // the one policy list and the one fallback vocabulary (config, CLI and simulator read them)
    m.add("POLICIES", pyo3::types::PyTuple::new(py, eldr_core::POLICY_NAMES)?)?;
    m.add("COUNTS_POLICIES", pyo3::types::PyTuple::new(py, eldr_core::counts_policies())?)?;
    m.add("PREFILL_POLICIES", pyo3::types::PyTuple::new(py, eldr_core::prefill_policies())?)?;
    m.add("DEFAULT_POLICY", eldr_core::DEFAULT_POLICY)?;
    m.add("DEFAULT_PREFILL_POLICY", eldr_core::DEFAULT_PREFILL_POLICY)?;
    m.add("DEFAULT_TAU", eldr_core::DEFAULT_TAU)?;
    m.add("DEFAULT_LOAD_FACTOR", eldr_core::DEFAULT_LOAD_FACTOR)?;
    m.add("FALLBACK_REASONS", pyo3::types::PyTuple::new(py, eldr_core::fallback_reasons())?)?;
    m.add("CentroidFileError", py.get_type::<CentroidFileError>())?;
    m.add("NoSignature", py.get_type::<NoSignatureError>())?;
    m.add("NoHealthyWorker", py.get_type::<NoHealthyWorker>())?;
    m.add("PayloadError", py.get_type::<PayloadError>())?;
    m.add("ProfileError", py.get_type::<ProfileError>())?;
    m.add("PAYLOAD_KEY", payload::META_KEY)?;
    m.add("PAYLOAD_MAX_ENTRIES", payload::MAX_ENTRIES)?;
    m.add("PAYLOAD_MAX_LAYERS", payload::MAX_LAYERS)?;
    m.add("PAYLOAD_MAX_COUNT", payload::MAX_COUNT)?;
    m.add_class::<PySignatureSpec>()?;
    m.add_class::<PyCentroidSet>()?;
    m.add_class::<PyDecision>()?;
    m.add_class::<PyLease>()?;
    m.add_class::<PyExpertProfile>()?;
    m.add_class::<PyRouter>()?;
    m.add_class::<PyDecodedCounts>()?;
    m.add_class::<dataplane::PyDataPlane>()?;
    m.add_class::<PyReservoirSampler>()?;
    m.add_function(wrap_pyfunction!(decode_payload, m)?)?;
    m.add_function(wrap_pyfunction!(decode_event, m)?)?;
    m.add_function(wrap_pyfunction!(count_topk, m)?)?;
    m.add_function(wrap_pyfunction!(band_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(distinct_per_layer, m)?)?;
    m.add_function(wrap_pyfunction!(write_centroids, m)?)?;
    Ok(())
}
