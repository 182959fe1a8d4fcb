"""Online re-clustering: refit the centroids from a reservoir of recent signatures.

- `remap_to_workers(old, new)`: which new centroid each worker gets, so as to disturb the
  least -- a maximum-weight assignment (scipy `linear_sum_assignment`) on the cosine
  similarity of old and new centroids. Unchanged centroids keep their workers; a permuted
  set is put back in order.
- `refit_centroids(S, parent, ...)`: balanced spherical K-means (the offline fit's own
  `spherical_kmeans`) on the reservoir signatures, remapped to the parent's workers.
- `refit_file(parent_path, signatures, out_path, ...)`: the whole refit as one picklable
  function (it runs in a worker process): open the parent centroid file, keep its
  SignatureSpec (layer weights and IDF -- the signatures the router computes keep meaning
  the same, and the reservoir's signatures were computed under it), fit, remap, compute the
  new drift baseline, and write the new file atomically with `_core.write_centroids`
  (temporary file + rename), keeping the file it replaces as `out_path + ".prev"`. A Router
  watching `out_path` hot-reloads it.
- `RefitController`: feeds the monitor and the reservoir, triggers a refit on drift, on a
  schedule or on demand (with a cooldown), runs it in a background process, and reports a
  status dict.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from eldr_sglang.drift.monitor import DriftMonitor
from eldr_sglang.drift.reservoir import SignatureReservoir

# A refit needs at least this many signatures per worker (and never fewer than MIN_TOTAL).
MIN_PER_WORKER = 32
MIN_TOTAL = 64
LINEAGE_MAX = 16


class RefitError(ValueError):
    """A refit could not run (too few signatures, wrong dimension, unreadable parent)."""


def remap_to_workers(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """perm[k] = index of the new centroid that worker k gets, maximizing the total cosine
    similarity between each worker's old and new centroid. Returns (perm, similarity[k]).

    With another number of new centroids than old ones (the decode workers changed, issue 31):
    the best-matched pairs keep the old centroids' order; fewer new ones drop the old ones left
    unmatched, more new ones put the unmatched new ones last (the workers without a centroid).
    `similarity` then covers the matched workers only."""
    from scipy.optimize import linear_sum_assignment

    old = np.asarray(old, dtype=np.float64)
    new = np.asarray(new, dtype=np.float64)
    if old.ndim != 2 or new.ndim != 2 or old.shape[1] != new.shape[1]:
        raise RefitError(f"cannot map {new.shape} new centroids onto {old.shape} old ones")
    on = old / np.maximum(np.linalg.norm(old, axis=1, keepdims=True), 1e-30)
    nn = new / np.maximum(np.linalg.norm(new, axis=1, keepdims=True), 1e-30)
    sim = on @ nn.T  # [K old, K new]
    rows, cols = linear_sum_assignment(sim, maximize=True)  # rows ascending
    extra = [c for c in range(new.shape[0]) if c not in set(cols.tolist())]
    perm = np.asarray(list(cols) + extra, dtype=np.int64)
    return perm, sim[rows, cols]


@dataclass
class RefitResult:
    centroids: np.ndarray  # [K, D] float32, already in worker order
    perm: np.ndarray  # [K] new-cluster index given to each worker
    similarity: np.ndarray  # [K] cos(old centroid of worker k, its new centroid)
    sizes: np.ndarray  # [K] signatures per worker (balanced)
    objective: float
    baseline: dict
    n: int
    seconds: float
    kmeans: dict = field(default_factory=dict)


def _check_signatures(S, dim: int, K: int) -> np.ndarray:
    S = np.asarray(S, dtype=np.float32)
    if S.ndim != 2 or S.shape[1] != dim:
        raise RefitError(f"signatures must be [n, {dim}], got {list(S.shape)}")
    norms = np.linalg.norm(S, axis=1)
    keep = np.isfinite(norms) & (norms > 0)
    S = S[keep]
    need = max(MIN_TOTAL, MIN_PER_WORKER * K)
    if S.shape[0] < need:
        raise RefitError(f"only {S.shape[0]} usable signatures; a refit for {K} workers needs at least {need}")
    return S / np.linalg.norm(S, axis=1, keepdims=True)


def refit_centroids(S, old_centroids: np.ndarray, tau: float, *, seed: int = 0, n_init: int = 2, max_iter: int = 30,
                    k: int | None = None) -> RefitResult:
    """Balanced spherical K-means on S (`k` clusters; default: the old K), mapped onto the
    old centroids' workers."""
    from eldr_sglang.offline.balanced_kmeans import spherical_kmeans
    from eldr_sglang.offline.report import baseline_stats

    t0 = time.perf_counter()
    old = np.asarray(old_centroids, dtype=np.float32)
    K, D = old.shape
    K = int(k or K)
    S = _check_signatures(S, D, K)
    km = spherical_kmeans(S, K, seed=seed, n_init=n_init, max_iter=max_iter, balanced=True)
    perm, sim = remap_to_workers(old, km.centroids)
    C = np.ascontiguousarray(np.asarray(km.centroids, dtype=np.float32)[perm])
    sizes = np.bincount(km.assignment, minlength=K)[perm]
    return RefitResult(
        centroids=C, perm=perm, similarity=sim, sizes=sizes, objective=float(km.objective),
        baseline=baseline_stats(S, C, tau), n=int(S.shape[0]), seconds=time.perf_counter() - t0,
        kmeans={"iterations": int(km.iterations), "optimal_assignment": bool(km.optimal_assignment), "n_init": int(n_init)},
    )


def _parent_lineage(parent) -> tuple[dict, list]:
    """The parent file's provenance (empty when unreadable: not carried over) and the lineage
    the refitted file carries (the parent's, capped, plus the parent itself)."""
    from eldr_sglang import json_fields

    try:
        prov_parent = json_fields.as_object(parent.provenance_json, "provenance")
    except ValueError:
        prov_parent = {}
    lineage = [e for e in prov_parent.get("lineage") or [] if isinstance(e, dict)] if isinstance(prov_parent.get("lineage"), list) else []
    lineage = lineage[-(LINEAGE_MAX - 1):] + [
        {"checksum": int(parent.checksum), "tool": prov_parent.get("tool"), "created_utc": prov_parent.get("created_utc")}
    ]
    return prov_parent, lineage


def refit_file(
    parent_path: str,
    signatures,
    out_path: str | None = None,
    *,
    reason: str = "manual",
    seed: int = 0,
    n_init: int = 2,
    max_iter: int = 30,
    extra: dict | None = None,
    workers: list[str] | None = None,
) -> dict:
    """Refit `parent_path`'s centroids from `signatures` and write `out_path` (default: the
    parent path itself, replaced atomically). Returns a JSON-able summary. Raises RefitError
    or `_core.CentroidFileError` with a message; never leaves a partial file. `workers`: the
    decode workers to fit for (K = their number; their names go in the file when K differs
    from the parent's); default: the parent's K and names."""
    from eldr_sglang import _core

    out_path = str(out_path or parent_path)
    try:
        parent = _core.CentroidSet.open(str(parent_path))
    except (OSError, ValueError) as exc:
        raise RefitError(f"cannot open the current centroid file {parent_path}: {exc}") from None
    old = np.asarray(parent.centroids())
    tau = float(parent.tau)
    res = refit_centroids(signatures, old, tau, seed=seed, n_init=n_init, max_iter=max_iter,
                          k=len(workers) if workers else None)
    prov_parent, lineage = _parent_lineage(parent)
    K = res.centroids.shape[0]
    names = list(parent.worker_names) if K == old.shape[0] else list(workers or [f"worker{i}" for i in range(K)])
    summary = {
        "reason": reason,
        "n_signatures": res.n,
        "parent_path": str(parent_path),
        "parent_checksum": int(parent.checksum),
        "mapping": res.perm.tolist(),
        "centroid_similarity": [round(float(x), 6) for x in res.similarity],
        "mean_centroid_similarity": float(np.mean(res.similarity)) if res.similarity.size else None,
        "workers_before": int(old.shape[0]),
        "objective": res.objective,
        "cluster_sizes": res.sizes.tolist(),
        "seconds": round(res.seconds, 3),
        "kmeans": res.kmeans,
        "seed": int(seed),
        **(extra or {}),
    }
    provenance = {
        "tool": "eldr refit",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trace_model": prov_parent.get("trace_model"),
        "trace_shape": prov_parent.get("trace_shape"),
        "params": {**(prov_parent.get("params") if isinstance(prov_parent.get("params"), dict) else {}), "workers": K, "tau": tau},
        "fit": {"n_fitted": res.n, "objective": res.objective, "cluster_sizes": res.sizes.tolist(),
                "cluster_shares": (res.sizes / max(res.n, 1)).round(6).tolist()},
        "baseline": res.baseline,
        "refit": summary,
        "lineage": lineage,
    }
    from eldr_sglang.io_safe import keep_previous

    # the operator's current file survives a refit (and back-to-back refits) as OUT.prev
    previous = keep_previous(out_path)
    _core.write_centroids(
        out_path,
        res.centroids,
        np.ascontiguousarray(parent.layer_weights(), dtype=np.float32),
        np.ascontiguousarray(parent.idf(), dtype=np.float32),
        tau,
        names,
        json.dumps(provenance, sort_keys=True),
    )
    written = _core.CentroidSet.open(out_path)
    summary["checksum"] = int(written.checksum)
    summary["out_path"] = out_path
    summary["previous_path"] = str(previous) if previous else None
    summary["baseline"] = res.baseline
    return summary


def _lower_priority() -> None:  # pragma: no cover - runs in the worker process
    try:
        os.nice(10)
    except OSError:
        pass


def make_process_executor() -> cf.ProcessPoolExecutor:
    """One background process for refits: spawned (the router holds threads, and fork with
    threads is unsafe), niced so routing keeps its CPU."""
    return cf.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_lower_priority)


class RefitController:
    """Feeds a DriftMonitor and a SignatureReservoir from routed decisions and refits the
    centroid file in the background on drift, on a schedule or on demand.

    `executor`: "process" (default; a spawned ProcessPoolExecutor with one worker),
    "inline" (run the refit in the caller -- simulator and tests), or any
    concurrent.futures.Executor. The router picks the new file up by hot reload (or call
    `router.reload()`); `status()` says what happened.
    """

    def __init__(
        self,
        centroid_path: str,
        *,
        router=None,
        reservoir: SignatureReservoir | None = None,
        monitor: DriftMonitor | None = None,
        on_drift: bool = True,
        interval_s: float | None = None,
        cooldown_s: float = 60.0,
        min_signatures: int | None = None,
        drift_only_since_onset: bool = True,
        executor="process",
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        reservoir_kw: dict | None = None,
        monitor_kw: dict | None = None,
        workers: Callable[[], list[str]] | None = None,
    ):
        from eldr_sglang import _core

        self.path = str(centroid_path)
        cs = _core.CentroidSet.open(self.path)
        self.num_workers = int(cs.num_workers)
        self.dim = int(cs.dim)
        self.router = router
        self.reservoir = reservoir or SignatureReservoir(self.dim, seed=seed, **(reservoir_kw or {}))
        if self.reservoir.dim != self.dim:
            raise ValueError(f"reservoir holds {self.reservoir.dim}-dim signatures, the centroid file has {self.dim}")
        self.monitor = monitor or DriftMonitor(cs.provenance_json, baseline_loader=self._current_provenance,
                                               num_workers=self.num_workers, **(monitor_kw or {}))
        if self.monitor.baseline_loader is None:
            self.monitor.baseline_loader = self._current_provenance
        self.on_drift = bool(on_drift)
        self.interval_s = float(interval_s) if interval_s else None
        self.cooldown_s = float(cooldown_s)
        # the decode workers to fit for (their number is K); None: the file's K
        self.workers = workers
        self._min_signatures = int(min_signatures) if min_signatures else None
        self.drift_only_since_onset = drift_only_since_onset
        self.seed = int(seed)
        self.clock = clock
        self._own_executor = executor == "process"
        self._executor = make_process_executor() if executor == "process" else (None if executor == "inline" else executor)
        self._lock = threading.Lock()
        self._future: cf.Future | None = None
        self._started_at: float | None = None
        self._last_submit: float | None = None
        self._last_schedule = clock()
        self._drift_handled_gen: object = object()
        self.refits = 0
        self.failures = 0
        self.last: dict = {}  # last finished refit: time, reason, result or error
        self.running_reason: str | None = None
        self.waiting: str | None = None

    @property
    def min_signatures(self) -> int:
        """The signatures a refit needs: MIN_PER_WORKER per worker it fits for."""
        if self._min_signatures:
            return self._min_signatures
        k = len(self.workers()) if self.workers is not None else self.num_workers
        return max(MIN_TOTAL, MIN_PER_WORKER * k)

    def _current_provenance(self):
        if self.router is not None:
            cs = self.router.centroid_set()
            if cs is not None:
                return cs.provenance_json
        from eldr_sglang import _core

        return _core.CentroidSet.open(self.path).provenance_json

    # ------------------------------------------------------------------ feeding
    def observe(self, decision, signature=None) -> str | None:
        """One routed request: its Decision (explain=True) and its signature (None when it had
        none). Returns the trigger reason when this call started a refit."""
        self.monitor.observe_decision(decision)
        if signature is not None and getattr(decision, "distances", None):
            self.reservoir.add(signature)
        return self.maybe_trigger()

    def maybe_trigger(self) -> str | None:
        """Start a refit if drift was detected or the schedule is due (cooldown permitting)."""
        now = self.clock()
        if self.on_drift:
            d, why = self.monitor.drifted()
            if d and self._drift_handled_gen != self.monitor.generation:
                since = self.monitor.drift_since
                last = None
                if self.drift_only_since_onset and since is not None:
                    # refit on the traffic since the drift began only (the horizon before it is
                    # the old mix); wait until the reservoir holds enough of it
                    last = self.monitor.observations - since
                    if self.reservoir.expected_sample_size(last) < self.min_signatures:
                        self.waiting = f"drift detected; waiting for {self.min_signatures} signatures since its onset"
                        last = -1
                if last != -1:
                    self.waiting = None
                    r = self._submit(f"drift: {why}", now, last=last, drift=True)
                    if r["accepted"]:
                        return r["reason"]
        if self.interval_s is not None and now - self._last_schedule >= self.interval_s:
            r = self._submit("schedule", now)
            if r["accepted"] or r.get("why") != "cooldown":
                self._last_schedule = now
            if r["accepted"]:
                return r["reason"]
        return None

    def request(self, reason: str = "manual", force: bool = False) -> dict:
        """On-demand refit (POST /eldr/refit). force=True ignores the cooldown."""
        return self._submit(reason, self.clock(), force=force)

    def _submit(self, reason: str, now: float, *, last: int | None = None, force: bool = False, drift: bool = False) -> dict:
        with self._lock:
            self._collect_locked()
            if self._future is not None:
                return {"accepted": False, "why": "running", "reason": reason, "message": f"a refit ({self.running_reason}) is already running"}
            if not force and self._last_submit is not None and now - self._last_submit < self.cooldown_s:
                wait = self.cooldown_s - (now - self._last_submit)
                return {"accepted": False, "why": "cooldown", "reason": reason, "message": f"cooldown: next refit allowed in {wait:.1f} s"}
            S = self.reservoir.sample(last, seed=self.seed + self.refits)
            workers = list(self.workers()) if self.workers is not None else None
            need = self.min_signatures
            if S.shape[0] < need:
                return {"accepted": False, "why": "too_few", "reason": reason,
                        "message": f"reservoir holds {S.shape[0]} signatures, a refit needs {need}"}
            self._last_submit = now
            self._started_at = now
            if drift:  # one drift refit per centroid generation (retried after a failure)
                self._drift_handled_gen = self.monitor.generation
            self.running_reason = reason
            kw = dict(reason=reason, seed=self.seed + self.refits, workers=workers,
                      extra={"window_observations": last if last is not None else self.reservoir.horizon_len()})
            if self._executor is None:
                fut: cf.Future = cf.Future()
                try:
                    fut.set_result(refit_file(self.path, S, self.path, **kw))
                except Exception as exc:  # reported in status, never raised into routing
                    fut.set_exception(exc)
            else:
                fut = self._executor.submit(refit_file, self.path, S, self.path, **kw)
            self._future = fut
            if self._executor is None:
                self._collect_locked()
            return {"accepted": True, "reason": reason, "signatures": int(S.shape[0])}

    def _collect_locked(self) -> None:
        fut = self._future
        if fut is None or not fut.done():
            return
        self._future = None
        now = self.clock()
        entry = {"reason": self.running_reason, "started": self._started_at, "finished": now,
                 "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            res = fut.result()
            self.refits += 1
            entry.update(ok=True, result=res)
            if self.router is not None:
                try:  # pick the new file up now rather than at the next reload check
                    self.router.reload()
                except Exception as exc:  # the router keeps the old set; say why
                    entry.update(ok=False, error=f"router rejected the refitted file: {exc}")
                    self.failures += 1
        except Exception as exc:
            self.failures += 1
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        if not entry["ok"]:
            self._drift_handled_gen = object()  # a failed drift refit may be retried after the cooldown
        self.last = entry
        self.running_reason = None

    def poll(self) -> dict:
        """Collect a finished background refit (if any) and return the status."""
        with self._lock:
            self._collect_locked()
        return self.status()

    def wait(self, timeout: float | None = None) -> dict:
        fut = self._future
        if fut is not None:
            cf.wait([fut], timeout=timeout)
        return self.poll()

    def status(self) -> dict:
        with self._lock:
            last = dict(self.last)
            running = self._future is not None
            reason = self.running_reason
        res = last.get("result") or {}
        return {
            "running": running,
            "running_reason": reason if running else None,
            "refits": self.refits,
            "failures": self.failures,
            "last_reason": last.get("reason"),
            "last_ok": last.get("ok"),
            "last_error": last.get("error"),
            "last_finished_utc": last.get("finished_utc"),
            "last_seconds": res.get("seconds"),
            "last_signatures": res.get("n_signatures"),
            "last_checksum": res.get("checksum"),
            "last_mean_centroid_similarity": res.get("mean_centroid_similarity"),
            "waiting": self.waiting,
            "cooldown_s": self.cooldown_s,
            "interval_s": self.interval_s,
            "reservoir": self.reservoir.stats(),
            "monitor": self.monitor.snapshot(),
        }

    def close(self) -> None:
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
