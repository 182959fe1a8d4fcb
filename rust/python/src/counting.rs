//! Array statistics: expert counts from top-k ids, and band sizes of distance rows.

use eldr_core::experts::{self, ExpertId};
use eldr_core::limits;
use numpy::{Element, IntoPyArray, PyArray1, PyReadonlyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::View;
use crate::errors::py_err;

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
pub(crate) fn count_topk(py: Python<'_>, ids: &Bound<'_, PyAny>, num_experts: usize) -> PyResult<Py<PyAny>> {
    dispatch!(ids, "ids", count_t, [u8, i16, i32, i64, u16, u32], py, num_experts, false)
}

/// Top-k ids `[N, L, k]` of one decode step -> distinct experts per layer `[L]` (uint32).
#[pyfunction]
pub(crate) fn distinct_per_layer(py: Python<'_>, ids: &Bound<'_, PyAny>, num_experts: usize) -> PyResult<Py<PyAny>> {
    dispatch!(ids, "ids", count_t, [u8, i16, i32, i64, u16, u32], py, num_experts, true)
}

// ---------------------------------------------------------------- band statistics (lead, issue 14)

/// Band size of each row of `distances` `[n, K]` (d = 1 - cos) at `tau`, every worker eligible:
/// the calibration statistic the drift baseline keeps, by the router's own band bound.
#[pyfunction]
pub(crate) fn band_sizes<'py>(py: Python<'py>, distances: PyReadonlyArray2<'py, f64>, tau: f64) -> PyResult<Bound<'py, PyArray1<u32>>> {
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
