//! The wire payload: `DecodedCounts`, `decode_payload` and `decode_event`.

use eldr_core::payload::{self, DecodeLimits, DecodedCounts, Payload};
use numpy::{IntoPyArray, PyArray2};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::{py_err, PayloadError};

/// Validated counts from a prefill's payload, still packed: routing reads them in place
/// (`Router.route_counts`); `counts` and `to_layout` make dense arrays for tools and tests.
#[pyclass(name = "DecodedCounts", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyDecodedCounts {
    pub(crate) inner: DecodedCounts,
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
pub(crate) fn decode_payload(py: Python<'_>, data: &Bound<'_, PyAny>, max_bytes: usize, layout: Option<(usize, usize)>) -> PyResult<PyDecodedCounts> {
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
pub(crate) fn decode_event(py: Python<'_>, data: &Bound<'_, PyAny>, max_bytes: usize, layout: Option<(usize, usize)>) -> PyResult<Py<PyAny>> {
    let bytes = text_bytes(data)?;
    let lim = limits_of(max_bytes, layout);
    Ok(match py.detach(|| payload::decode_event(bytes, &lim)).map_err(py_err)? {
        None => py.None(),
        Some(Payload::NoCounts(why)) => why.into_pyobject(py)?.into_any().unbind(),
        Some(Payload::Counts(inner)) => Py::new(py, PyDecodedCounts { inner })?.into_any(),
    })
}
