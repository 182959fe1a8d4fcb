//! PyO3 bindings: the `eldr_sglang._core` extension module. A thin layer over eldr-core:
//! numpy arrays are read in place (any of the common integer/float dtypes, no copy when
//! C-contiguous), errors become typed Python exceptions, and batch work releases the GIL.

#[macro_use]
mod arrays;
mod centroids;
mod counting;
mod dataplane;
mod errors;
mod reservoir;
mod router;
mod signatures;
mod spec;
mod wire;

use eldr_core::payload;
use pyo3::prelude::*;

pub(crate) use router::PyRouter;

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
    m.add("DEFAULT_REQUEST_COST", eldr_core::DEFAULT_REQUEST_COST)?;
    // the routing flags' bounds (rust/core/src/policies/spec.rs) and the experts-per-layer bound
    m.add("MAX_TAU", eldr_core::policies::MAX_TAU)?;
    m.add("MAX_LOAD_FACTOR", eldr_core::policies::MAX_LOAD_FACTOR)?;
    m.add("MAX_REQUEST_COST", eldr_core::policies::MAX_REQUEST_COST)?;
    m.add("MAX_EXPERTS", eldr_core::limits::MAX_EXPERTS)?;
    m.add("FALLBACK_REASONS", pyo3::types::PyTuple::new(py, eldr_core::fallback_reasons())?)?;
    m.add("CentroidFileError", py.get_type::<errors::CentroidFileError>())?;
    m.add("NoSignature", py.get_type::<errors::NoSignatureError>())?;
    m.add("NoHealthyWorker", py.get_type::<errors::NoHealthyWorker>())?;
    m.add("PayloadError", py.get_type::<errors::PayloadError>())?;
    m.add("ProfileError", py.get_type::<errors::ProfileError>())?;
    m.add("PAYLOAD_KEY", payload::META_KEY)?;
    m.add("PAYLOAD_MAX_ENTRIES", payload::MAX_ENTRIES)?;
    m.add("PAYLOAD_MAX_LAYERS", payload::MAX_LAYERS)?;
    m.add("PAYLOAD_MAX_COUNT", payload::MAX_COUNT)?;
    m.add_class::<signatures::PySignatureSpec>()?;
    m.add_class::<centroids::PyCentroidSet>()?;
    m.add_class::<router::PyDecision>()?;
    m.add_class::<router::PyLease>()?;
    m.add_class::<router::PyExpertProfile>()?;
    m.add_class::<router::PyOccupancySnapshot>()?;
    m.add_class::<router::PyRouter>()?;
    m.add_class::<spec::PyRouterSpec>()?;
    m.add_class::<wire::PyDecodedCounts>()?;
    m.add_class::<dataplane::PyDataPlane>()?;
    m.add_class::<reservoir::PyReservoirSampler>()?;
    m.add_function(wrap_pyfunction!(wire::decode_payload, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_event, m)?)?;
    m.add_function(wrap_pyfunction!(counting::count_topk, m)?)?;
    m.add_function(wrap_pyfunction!(counting::band_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(counting::distinct_per_layer, m)?)?;
    m.add_function(wrap_pyfunction!(centroids::write_centroids, m)?)?;
    m.add_function(wrap_pyfunction!(spec::parse_arms, m)?)?;
    m.add_function(wrap_pyfunction!(spec::parse_policy_label, m)?)?;
    Ok(())
}
