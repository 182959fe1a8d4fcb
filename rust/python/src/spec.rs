//! `RouterSpec`: the router's typed spec (rust/core/src/policies/spec.rs), built and checked
//! once in the core. The router's config builds one from its flags; `Router.from_spec` builds
//! the router from it.

use eldr_core::limits::MAX_EXPERTS;
use eldr_core::policies::PAGED_EXPERTS_FLAG;
use eldr_core::{Bind, RouterSpec, RouterSpecError};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::errors::py_err;

/// A decode router's policy (with the locality costs), tau, load factor and binding, checked
/// with the command line's messages (ValueError); `needs_centroids` and `binds_late` are its
/// capabilities.
#[pyclass(name = "RouterSpec", module = "eldr_sglang._core", frozen)]
#[derive(Clone)]
pub(crate) struct PyRouterSpec {
    pub(crate) inner: RouterSpec,
}

/// `--eldr-paged-experts C` as the core takes it: a Python int (not a bool); one past the
/// 64-bit range is out of range like any other.
fn paged_experts(v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<i64>> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(None) };
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<pyo3::types::PyInt>() {
        return Err(PyValueError::new_err(format!("--eldr-paged-experts must be an integer, got {}", v.repr()?)));
    }
    match v.extract::<i64>() {
        Ok(c) => Ok(Some(c)),
        Err(_) => {
            let e = RouterSpecError::Range { flag: PAGED_EXPERTS_FLAG, lo: 1.0, hi: MAX_EXPERTS as f64, got: v.str()?.to_string() };
            Err(py_err(e))
        }
    }
}

pub(crate) fn parse_bind(bind: &str) -> PyResult<Bind> {
    Bind::parse(bind).ok_or_else(|| PyValueError::new_err(format!("unknown --eldr-bind {bind:?}; choose one of {}", Bind::NAMES.join(", "))))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn build_spec(
    policy: Option<&str>,
    tau: Option<f64>,
    load_factor: Option<f64>,
    paged: Option<&Bound<'_, PyAny>>,
    request_cost: Option<f64>,
    bind: &str,
    seed: u64,
) -> PyResult<RouterSpec> {
    let paged = paged_experts(paged)?;
    RouterSpec::new(policy, seed, tau, load_factor, paged, request_cost, parse_bind(bind)?).map_err(py_err)
}

#[pymethods]
impl PyRouterSpec {
    #[new]
    // `policy`: None is the core's DEFAULT_POLICY
    #[pyo3(signature = (policy=None, tau=None, load_factor=None, paged_experts=None, request_cost=None, bind="auto", seed=0))]
    fn new(policy: Option<&str>, tau: Option<f64>, load_factor: Option<f64>, paged_experts: Option<&Bound<'_, PyAny>>, request_cost: Option<f64>, bind: &str, seed: u64) -> PyResult<Self> {
        Ok(PyRouterSpec { inner: build_spec(policy, tau, load_factor, paged_experts, request_cost, bind, seed)? })
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.name()
    }
    #[getter]
    fn tau(&self) -> Option<f64> {
        self.inner.tau
    }
    #[getter]
    fn load_factor(&self) -> Option<f64> {
        self.inner.load_factor
    }
    #[getter]
    fn paged_experts(&self) -> Option<usize> {
        self.inner.policy.build().paged_experts()
    }
    /// The locality cost's per-request term (None: not a locality policy).
    #[getter]
    fn request_cost(&self) -> Option<f64> {
        self.inner.policy.build().request_cost()
    }
    #[getter]
    fn bind(&self) -> &'static str {
        self.inner.bind.as_str()
    }
    /// The policy routes on the prefill's counts: it needs a centroid file.
    #[getter]
    fn needs_centroids(&self) -> bool {
        self.inner.needs_centroids()
    }
    /// A request waits for the prefill's signature before its decode is chosen.
    #[getter]
    fn binds_late(&self) -> bool {
        self.inner.binds_late()
    }
    /// The command line's check that a policy needing a centroid file has one (`arm`: the
    /// experiment arm's label); ValueError with the flag's message.
    #[pyo3(signature = (has_centroids, arm=None))]
    fn check_centroids(&self, has_centroids: bool, arm: Option<&str>) -> PyResult<()> {
        self.inner.check_centroids(has_centroids, arm).map_err(py_err)
    }
    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!("RouterSpec(policy={:?}, tau={:?}, load_factor={:?}, bind={:?})", s.name(), s.tau, s.load_factor, s.bind.as_str())
    }
}

/// `"locality/0.05,round_robin"` -> the arms of a switchback experiment, each (label, policy,
/// load factor), parsed by the core (rust/core/src/policies/label.rs); a plain counts policy
/// takes `default_load_factor`. ValueError with the command line's message.
#[pyfunction]
#[pyo3(signature = (text, default_load_factor=None))]
pub(crate) fn parse_arms(text: &str, default_load_factor: Option<f64>) -> PyResult<Vec<(String, &'static str, Option<f64>)>> {
    let arms = eldr_core::policies::parse_arms(text, default_load_factor).map_err(PyValueError::new_err)?;
    Ok(arms.into_iter().map(|a| (a.label, a.policy, a.load_factor)).collect())
}

/// `"eldr@0.3/0.05"`, `"locality/0.05:rc=0.4"` -> (policy, tau, load factor given, load factor,
/// request cost): one policy label as the simulator writes it, parsed by the core with the
/// router's bounds (rust/core/src/policies/label.rs). ValueError with the message.
#[pyfunction]
pub(crate) fn parse_policy_label(label: &str) -> PyResult<(&'static str, Option<f64>, bool, Option<f64>, Option<f64>)> {
    let l = eldr_core::policies::parse_label(label).map_err(PyValueError::new_err)?;
    Ok((l.policy, l.tau, l.load_factor.is_some(), l.load_factor.flatten(), l.request_cost))
}
