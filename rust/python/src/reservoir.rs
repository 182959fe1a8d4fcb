//! `ReservoirSampler`: the data plane's refit-reservoir draw, for Python.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The refit reservoir's keep/slot draw (bucketed Algorithm R, rust/dataplane/src/reservoir.rs),
/// for a reservoir fed without a data plane; the data plane draws with the same code per request.
#[pyclass(name = "ReservoirSampler", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyReservoirSampler {
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
