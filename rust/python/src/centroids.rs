//! The centroid file: `CentroidSet` (read) and `write_centroids`.

use std::path::PathBuf;
use std::sync::Arc;

use eldr_core::{CentroidSet, CentroidWriter};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArrayDyn};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::View;
use crate::errors::py_err;
use crate::signatures::PySignatureSpec;

/// A validated centroid file, read into a private read-only copy (not mapped: an in-place
/// overwrite of a mapped file would crash the router with SIGBUS).
#[pyclass(name = "CentroidSet", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyCentroidSet {
    pub(crate) set: Arc<CentroidSet>,
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
pub(crate) fn write_centroids(
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
