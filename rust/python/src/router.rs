//! `Router` and what it hands out: `Decision`, `Lease`, `ExpertProfile`.

use std::path::PathBuf;
use std::sync::Arc;

use eldr_core::distance::{self, Counts};
use eldr_core::router::Routed;
use eldr_core::policies::OwnAtPoll;
use eldr_core::{CountValue, ExpertGuard, ExpertProfile, LoadGuard, NoSignature, RouteError, SparseIndex, SparseSignature};
use numpy::{Element, IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArrayDyn};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::View;
use crate::centroids::PyCentroidSet;
use crate::errors::{py_err, ToPyErr};
use crate::spec::{build_spec, PyRouterSpec};
use crate::wire::PyDecodedCounts;

/// A routing decision with its details.
#[pyclass(name = "Decision", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyDecision {
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
pub(crate) struct PyLease {
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

/// This router's own expert sums on one decode worker when a load poll was sent
/// (`Router.occupancy_snapshot`), to blend that poll's occupancy report with.
#[pyclass(name = "OccupancySnapshot", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyOccupancySnapshot {
    inner: OwnAtPoll,
}

/// A request's expected expert use per decode token, from its prompt's counts (the locality
/// balancer's input): `index` flat `l * num_experts + e`, `counts` prompt tokens that chose it.
#[pyclass(name = "ExpertProfile", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyExpertProfile {
    pub(crate) inner: Arc<ExpertProfile>,
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
    /// The profile as the data plane sends it with a decode request (`eldr_profile`, JSON):
    /// what a worker sums for its occupancy report (eldr_sglang/sglang_ext/profile_occupancy.py).
    fn to_wire_json(&self) -> String {
        self.inner.to_wire_json().to_owned()
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

    fn build(py: Python<'_>, spec: eldr_core::RouterSpec, num_workers: Option<usize>, centroids: Option<PathBuf>, reload_interval_ms: u64, load_report_ttl_ms: u64) -> PyResult<Self> {
        let inner = py.detach(|| eldr_core::Router::new(spec, num_workers, centroids.as_deref(), reload_interval_ms, load_report_ttl_ms)).map_err(py_err)?;
        Ok(PyRouter { inner: Arc::new(inner) })
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
    // The routing arguments make a RouterSpec (checked in the core), as `from_spec` takes.
    #[pyo3(signature = (policy=None, num_workers=None, centroids=None, tau=None, seed=0, reload_interval_ms=250, load_report_ttl_ms=2000, load_factor=None, paged_experts=None, request_cost=None, bind="auto"))]
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
        paged_experts: Option<&Bound<'_, PyAny>>,
        request_cost: Option<f64>,
        bind: &str,
    ) -> PyResult<Self> {
        let spec = build_spec(policy, tau, load_factor, paged_experts, request_cost, bind, seed)?;
        Self::build(py, spec, num_workers, centroids, reload_interval_ms, load_report_ttl_ms)
    }
    /// A router made from a checked spec (`RouterSpec`): the control plane's.
    #[staticmethod]
    #[pyo3(signature = (spec, num_workers=None, centroids=None, reload_interval_ms=250, load_report_ttl_ms=2000))]
    fn from_spec(py: Python<'_>, spec: &PyRouterSpec, num_workers: Option<usize>, centroids: Option<PathBuf>, reload_interval_ms: u64, load_report_ttl_ms: u64) -> PyResult<Self> {
        Self::build(py, spec.inner, num_workers, centroids, reload_interval_ms, load_report_ttl_ms)
    }
    /// What the router was built from (its tau and load factor as at start).
    #[getter]
    fn spec(&self) -> PyRouterSpec {
        PyRouterSpec { inner: *self.inner.spec() }
    }
    #[getter]
    fn get_load_factor(&self) -> Option<f64> {
        self.inner.load_factor()
    }
    #[setter]
    fn set_load_factor(&self, value: Option<f64>) -> PyResult<()> {
        self.inner.set_load_factor(value).map_err(py_err)
    }
    /// Router replicas in front of these workers, this one among them (1: alone): each
    /// request sent to a worker also counts `replicas - 1` projected requests of the others
    /// there until that worker's next load report or the request's end
    /// (rust/core/src/queue.rs, `set_replicas`), and the locality balancer counts each
    /// request's experts `replicas` times (policies/locality.rs).
    #[getter]
    fn get_replicas(&self) -> u32 {
        self.inner.tracker().replicas()
    }
    #[setter]
    fn set_replicas(&self, value: u32) -> PyResult<()> {
        if !(1..=1024).contains(&value) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!("replicas must be between 1 and 1024, got {value}")));
        }
        self.inner.tracker().set_replicas(value);
        self.inner.policy().set_replicas(value);
        Ok(())
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy_name()
    }
    #[getter]
    fn paged_experts(&self) -> Option<usize> {
        self.inner.paged_experts()
    }
    /// The locality cost's per-request term r (None: not a locality policy).
    #[getter]
    fn request_cost(&self) -> Option<f64> {
        self.inner.request_cost()
    }
    /// Decode worker slots in use (members, removed ones draining, free ones; see
    /// `DataPlane.members`).
    #[getter]
    fn num_workers(&self) -> usize {
        self.inner.num_workers()
    }
    /// Per decode slot, the index of its centroid in the serving file (None: none, e.g. a
    /// worker that joined since the file was written, or no file).
    fn centroid_of_slots(&self) -> Vec<Option<usize>> {
        self.inner.centroid_of_slots()
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
    /// The MoE layer ids and experts per layer the locality balancer tracks (what a worker's
    /// occupancy report must cover); None for other policies and before its first profile.
    fn occupancy_layout(&self) -> Option<(Vec<u32>, usize)> {
        self.inner.policy().expert_load().map(|l| {
            let (layers, experts) = l.layout();
            (layers.to_vec(), experts)
        })
    }
    /// This router's own expert sums on `worker` now: take it when a load poll is sent; None
    /// without a locality state that holds the worker.
    fn occupancy_snapshot(&self, worker: usize) -> Option<PyOccupancySnapshot> {
        let load = self.inner.policy().expert_load()?;
        load.own_at_poll(worker).map(|inner| PyOccupancySnapshot { inner })
    }
    /// Blend `worker`'s occupancy report (`idle`: per cell, layer-major in
    /// `occupancy_layout()` order, the share of its recent decode steps in which no request
    /// selected the expert) into the locality state, against this router's own sums at the
    /// poll (`snapshot`). ValueError when it does not fit; the state is then unchanged.
    fn report_occupancy(&self, py: Python<'_>, snapshot: &PyOccupancySnapshot, idle: PyReadonlyArray1<'_, f64>) -> PyResult<()> {
        let idle = idle.as_slice().map_err(|_| PyValueError::new_err("idle must be a contiguous float64 array"))?;
        let load = snapshot.inner.load();
        let now = self.inner.policy().expert_load();
        if !now.is_some_and(|l| Arc::ptr_eq(&l, load)) {
            return Err(PyValueError::new_err("the balancer's expert state changed during the poll"));
        }
        py.detach(|| load.report_occupancy(&snapshot.inner, idle)).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    /// Forget `worker`'s occupancy report (its cells read this router's own requests again).
    fn clear_occupancy(&self, worker: usize) -> PyResult<()> {
        self.check_worker(worker)?;
        if let Some(l) = self.inner.policy().expert_load() {
            if worker < l.num_workers() {
                l.clear_occupancy(worker).map_err(|e| PyValueError::new_err(e.to_string()))?;
            }
        }
        Ok(())
    }
    /// Per worker, whether the locality state holds an occupancy report for it now.
    fn occupancy_reported(&self) -> Vec<bool> {
        let k = self.inner.num_workers();
        let load = self.inner.policy().expert_load();
        (0..k).map(|w| load.as_ref().is_some_and(|l| l.has_occupancy(w))).collect()
    }
    /// A worker's own count of the requests it holds (its /v1/loads), kept for the report TTL;
    /// `inflight_at_poll`: this router's in-flight count on it when the poll was sent.
    #[pyo3(signature = (worker, running, inflight_at_poll=None))]
    fn report_load(&self, worker: usize, running: i64, inflight_at_poll: Option<i64>) -> PyResult<()> {
        self.check_worker(worker)?;
        self.inner.tracker().report(worker, running, inflight_at_poll);
        Ok(())
    }
    /// Mark a worker of a router no data plane holds (tests, the simulator). A data plane's
    /// router takes health from the plane's worker set (`DataPlane.set_healthy`,
    /// `DataPlane.health_check`), which owns the routable bit: writing it here would be undone
    /// by the next check, so this refuses.
    fn set_healthy(&self, worker: usize, healthy: bool) -> PyResult<()> {
        self.check_worker(worker)?;
        if Arc::strong_count(&self.inner) > 1 {
            return Err(PyValueError::new_err("a data plane routes on this router: its worker set owns health (use DataPlane.set_healthy)"));
        }
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
