//! `SignatureSpec`: unit signatures from dense, sparse or top-k counts, one request or a batch.

use eldr_core::experts::ExpertId;
use eldr_core::limits;
use eldr_core::{CountValue, NoSignature, SignatureSpec, SparseIndex, SparseSignature};
use numpy::{Element, IntoPyArray, PyArray1, PyArray2, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::View;
use crate::errors::{py_err, NoSignatureError};

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
pub(crate) struct PySignatureSpec {
    pub(crate) spec: SignatureSpec,
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
