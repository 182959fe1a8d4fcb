//! `DataPlane`: the Rust request path (eldr-dataplane), started from Python. It routes on
//! the same core Router instance the Python control plane holds; Python feeds it health
//! checks and reads its counters at scrape time, never per request.

use std::sync::{Arc, Mutex};

use eldr_dataplane::{Config, DataPlane, Role};
use pyo3::exceptions::{PyOSError, PyValueError};
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::PyRouter;

/// The Rust data plane: a tokio/hyper server on its own threads (the GIL is released while
/// it starts and stops; requests never touch Python).
#[pyclass(name = "DataPlane", module = "eldr_sglang._core", frozen)]
pub(crate) struct PyDataPlane {
    inner: Mutex<DataPlane>,
    plane: Arc<eldr_dataplane::Plane>,
}

impl PyDataPlane {
    fn lock(&self) -> std::sync::MutexGuard<'_, DataPlane> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn role(role: &str) -> PyResult<Role> {
        Role::parse(role).ok_or_else(|| PyValueError::new_err(format!("role must be 'prefill' or 'decode', got {role:?}")))
    }
    fn check(&self, role: Role, i: usize) -> PyResult<()> {
        let n = self.plane.pool(role).len();
        if i >= n {
            return Err(PyValueError::new_err(format!("{role} worker {i} out of range 0..{n}")));
        }
        Ok(())
    }
}

#[pymethods]
impl PyDataPlane {
    /// `config_json`: the data plane's settings (`eldr_sglang.router.config.plane_config`);
    /// `router`: the core Router the control plane holds (shared, not copied).
    #[new]
    fn new(config_json: &str, router: &PyRouter) -> PyResult<Self> {
        let cfg = Config::from_json(config_json, router.inner.policy_name()).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let dp = DataPlane::new(cfg, Arc::clone(&router.inner)).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let plane = Arc::clone(dp.plane());
        Ok(PyDataPlane { inner: Mutex::new(dp), plane })
    }
    /// Check the numeric settings of `config_json` as `DataPlane(config_json, router)` does,
    /// each named by its flag, building nothing: the router's config runs it so a bad flag
    /// is refused before anything starts.
    #[staticmethod]
    fn check_numbers(config_json: &str) -> PyResult<()> {
        Config::check_numbers(config_json).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    /// Bind and serve; the bound port. Idempotent.
    fn start(&self, py: Python<'_>) -> PyResult<u16> {
        py.detach(|| self.lock().start()).map_err(|e| PyOSError::new_err(format!("the data plane could not start: {e}")))
    }
    /// Stop serving; requests in flight end (their slots are released).
    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.lock().stop())
    }
    #[getter]
    fn running(&self) -> bool {
        self.lock().is_running()
    }
    /// A health check's verdict on a worker (role 'prefill' or 'decode').
    fn set_healthy(&self, role: &str, worker: usize, healthy: bool) -> PyResult<()> {
        let r = Self::role(role)?;
        self.check(r, worker)?;
        self.plane.pool(r).set_health(worker, healthy);
        Ok(())
    }
    /// One /health check's result on a worker: a pass marks it healthy, `threshold` failures
    /// in a row unhealthy (the worker set counts them: the one health tracker).
    fn health_check(&self, role: &str, worker: usize, ok: bool, threshold: u32) -> PyResult<()> {
        let r = Self::role(role)?;
        self.check(r, worker)?;
        self.plane.pool(r).health_check(worker, ok, threshold);
        Ok(())
    }
    /// Whether prefill `worker` streams signatures (None: not known yet). A prefill that
    /// does not is bound early (no wait for a signature that never comes).
    fn set_prefill_signature(&self, worker: usize, signs: Option<bool>) -> PyResult<()> {
        self.check(Role::Prefill, worker)?;
        self.plane.set_prefill_signs(worker, signs);
        Ok(())
    }
    /// A worker joins a role while the router serves: its slot (the index the other calls
    /// take). `bootstrap_port`: a prefill's (None: SGLang's default). ValueError: a bad URL,
    /// already a member, or no free slot.
    #[pyo3(signature = (role, url, bootstrap_port=None))]
    fn add_worker(&self, role: &str, url: &str, bootstrap_port: Option<u16>) -> PyResult<usize> {
        self.plane.add_worker(Self::role(role)?, url, bootstrap_port).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    /// A worker leaves: no new requests; those in flight finish (it drains). Its slot.
    /// ValueError: not a member, or the role's last one.
    fn remove_worker(&self, role: &str, url: &str) -> PyResult<usize> {
        self.plane.remove_worker(Self::role(role)?, url).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    /// The role's members: (slot, url) in slot order.
    fn members(&self, role: &str) -> PyResult<Vec<(usize, String)>> {
        Ok(self.plane.pool(Self::role(role)?).members())
    }
    /// Each slot of a role (members, removed ones draining, free ones): slot, url, state
    /// ('serving', 'draining', 'free'), member, health_ok, circuit, consecutive_failures,
    /// ejections, ejected_for_s, last_failure, inflight (the keys `/eldr/status` shows).
    fn workers<'py>(&self, py: Python<'py>, role: &str) -> PyResult<Bound<'py, PyList>> {
        let r = Self::role(role)?;
        let out = PyList::empty(py);
        for w in self.plane.pool(r).state() {
            let d = PyDict::new(py);
            d.set_item("slot", w.slot)?;
            d.set_item("url", w.url)?;
            d.set_item("state", serde_json_str(&w.state))?;
            d.set_item("member", w.state == eldr_core::SlotState::Serving)?;
            d.set_item("health_ok", w.health_ok)?;
            let circuit = serde_json_str(&w.circuit);
            d.set_item("circuit", circuit)?;
            d.set_item("consecutive_failures", w.consecutive_failures)?;
            d.set_item("ejections", w.ejections)?;
            d.set_item("ejected_for_s", w.ejected_for_s)?;
            d.set_item("last_failure", w.last_failure)?;
            d.set_item("inflight", w.inflight)?;
            out.append(d)?;
        }
        Ok(out)
    }
    /// Routable flags of a role's workers (health check passing, not ejected).
    fn routable(&self, role: &str) -> PyResult<Vec<bool>> {
        Ok(self.plane.pool(Self::role(role)?).routable_all())
    }
    /// A snapshot for the Prometheus collector: {"counters": {name: [(labels, value)]},
    /// "histograms": {name: (upper bounds, per-bucket counts with +Inf last, sum)},
    /// "labelled_histograms": [(name, label names, upper bounds, [(label values, counts, sum)])]}.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.plane.counters;
        let counters = PyDict::new(py);
        for (name, series) in c.snapshot() {
            let items = PyList::empty(py);
            for (labels, v) in series {
                items.append((PyTuple::new(py, labels)?, v))?;
            }
            counters.set_item(name, items)?;
        }
        let hists = PyDict::new(py);
        for (name, h) in c.histograms() {
            let (counts, sum) = h.snapshot();
            hists.set_item(name, (h.bounds.to_vec(), counts, sum))?;
        }
        let labelled = PyList::empty(py);
        for (name, label_names, bounds, series) in c.latency.snapshot() {
            let items = PyList::empty(py);
            for (values, counts, sum) in series {
                items.append((PyTuple::new(py, values)?, counts, sum))?;
            }
            labelled.append((name, PyTuple::new(py, label_names)?, bounds.to_vec(), items))?;
        }
        let out = PyDict::new(py);
        out.set_item("labelled_histograms", labelled)?;
        out.set_item("counters", counters)?;
        out.set_item("histograms", hists)?;
        Ok(out)
    }
    /// Up to `n` of the oldest decisions not taken yet, for the drift monitor: (centroid
    /// generation, reason, distances to all K centroids or None, signature or None as
    /// (index uint32[nnz], value float32[nnz], norm): value / norm is the unit signature,
    /// the refit reservoir's draw or None as (offer index, slot or None)). The signature
    /// comes only with a draw that stores it.
    fn take_drift<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let Some(feed) = &self.plane.drift else { return Ok(out) };
        for s in py.detach(|| feed.take(n)) {
            let sig = match s.signature {
                Some(sig) => Some((sig.index.into_pyarray(py), sig.value.into_pyarray(py), sig.norm).into_pyobject(py)?.into_any()),
                None => None,
            };
            out.append((s.generation, s.reason, s.distances, sig, s.offer.map(|d| (d.index, d.slot))))?;
        }
        Ok(out)
    }
    /// The refit reservoir's shape the data plane draws for, (per_bucket, span); None when
    /// the drift feed is off.
    #[getter]
    fn reservoir_shape(&self) -> Option<(u64, u64)> {
        self.plane.drift.as_ref().map(|f| (f.sampler.per_bucket(), f.sampler.span()))
    }
    /// Admission control now: {"limit", "queue_size", "queue_timeout_s", "in_flight",
    /// "waiting", "buffered_bytes", "buffer_limit"} (limit 0: no bound; the last two: the
    /// request-body bytes held now and their bound).
    fn admission<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let a = &self.plane.admission;
        let d = PyDict::new(py);
        d.set_item("limit", a.limit())?;
        d.set_item("queue_size", a.queue_size())?;
        d.set_item("queue_timeout_s", self.plane.cfg.queue_timeout_s)?;
        d.set_item("in_flight", a.in_flight())?;
        d.set_item("waiting", a.waiting())?;
        d.set_item("buffered_bytes", self.plane.bodies.used())?;
        d.set_item("buffer_limit", self.plane.bodies.limit())?;
        Ok(d)
    }
    /// The switchback experiment as JSON (None: no experiment): with `blocks`, GET
    /// /eldr/experiment's body (every block's statistics); without, /eldr/status's view.
    fn experiment(&self, blocks: bool) -> Option<String> {
        self.plane.experiment.as_ref().map(|x| if blocks { x.snapshot() } else { x.status() }.to_string())
    }
    /// End the experiment's block now and start the next, on `arm` (a label) or the
    /// schedule's; the new (block, arm label).
    fn experiment_switch(&self, arm: Option<&str>) -> PyResult<(u64, String)> {
        let Some(x) = &self.plane.experiment else { return Err(PyValueError::new_err("no experiment is running (start the router with --experiment)")) };
        let to = match arm {
            None => None,
            Some(a) => Some(x.arms.iter().position(|r| r.label == a).ok_or_else(|| {
                PyValueError::new_err(format!("no arm {a:?}; the arms are {}", x.arms.iter().map(|r| r.label).collect::<Vec<_>>().join(", ")))
            })?),
        };
        let (block, i) = x.switch(to);
        Ok((block, x.arms[i].label.to_owned()))
    }
    /// Decisions the drift queue dropped because the control plane did not drain it in time.
    #[getter]
    fn drift_dropped(&self) -> u64 {
        self.plane.drift.as_ref().map_or(0, |f| f.dropped.load(std::sync::atomic::Ordering::Relaxed))
    }
    fn __repr__(&self) -> String {
        let cfg = &self.plane.cfg;
        format!("DataPlane(policy={:?}, prefill={}, decode={}, running={})", cfg.policy, cfg.prefill.len(), cfg.decode.len(), self.running())
    }
}

fn serde_json_str<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}
