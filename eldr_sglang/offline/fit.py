"""Fit: trace -> signatures -> balanced clusters -> centroid file, with a quality report.

    from eldr_sglang.offline.fit import fit_trace
    res = fit_trace(trace, workers=4, tau=0.1, layers="middle", seed=0)
    res.write("centroids.eldr")

Domain labels are never read to fit; the report uses them only to score.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from eldr_sglang import _core
from eldr_sglang.defaults import FIT_CHANGE_TOL, FIT_SAMPLE_GROWTH
from eldr_sglang.offline import report as rpt
from eldr_sglang.offline.balanced_assignment import balanced_sizes
from eldr_sglang.offline.balanced_kmeans import KMeansResult, spherical_kmeans
from eldr_sglang.offline.layers import parse_layers, select_layers_auto
from eldr_sglang.offline.signatures import DEFAULT_CHUNK_TOKENS, compute_idf, make_spec
from eldr_sglang.offline.sources import prefill_source
from eldr_sglang.progress import status_line
from eldr_sglang.traces import TraceSource

# Densify the signature matrix for K-means when it is at least this dense and fits in this
# many bytes (dense BLAS beats sparse products there).
DENSE_MIN_DENSITY = 0.25
DENSE_MAX_BYTES = 4 << 30
# Requests sampled for the decode-overlap statistics (Spearman rho, auto layer selection).
PROFILE_SAMPLE = 4000


@dataclasses.dataclass
class FitResult:
    centroids: np.ndarray  # [K, D] float32, unit rows; row k is worker k's expert profile
    layer_weights: np.ndarray  # [L] float32
    idf: np.ndarray  # [L, E] float32
    assignment: np.ndarray  # [N] int64 cluster of each calibration request, -1 without signature
    requests: np.ndarray  # [N] trace index of each calibration request
    report: dict
    tau: float
    worker_names: list[str]
    provenance: dict
    signatures: sp.csr_matrix | None = None  # [N, D] (rows of requests without signature are empty)
    valid: np.ndarray | None = None  # [N] bool

    @property
    def num_workers(self) -> int:
        return int(self.centroids.shape[0])

    def write(self, path: str | os.PathLike) -> None:
        """Write the centroid file (atomically, by the Rust writer) with provenance JSON."""
        from eldr_sglang import _core
        from eldr_sglang.io_safe import json_ready

        path = Path(path)
        if path.parent and not path.parent.exists():
            raise OSError(f"output directory does not exist: {path.parent}")
        _core.write_centroids(
            str(path),
            np.ascontiguousarray(self.centroids, dtype=np.float32),
            np.ascontiguousarray(self.layer_weights, dtype=np.float32),
            np.ascontiguousarray(self.idf, dtype=np.float32),
            float(self.tau),
            list(self.worker_names),
            json.dumps(json_ready(self.provenance), sort_keys=True, allow_nan=False),
        )


def _check_inputs(trace: TraceSource, workers, tau, requests):
    if not isinstance(trace, TraceSource):
        raise TypeError("fit_trace needs an eldr_sglang.traces.Trace (v1) or CountsTrace (v2)")
    trace.validate()  # TraceError (a ValueError) names layer/expert/top-k mismatch, out-of-range ids, empty trace
    try:
        K = int(workers)
    except (TypeError, ValueError):
        raise ValueError(f"--workers must be an integer, got {workers!r}") from None
    if K != workers or K < 1:
        raise ValueError(f"--workers must be a positive integer, got {workers!r}")
    tau = float(tau)
    if not np.isfinite(tau) or not 0 <= tau <= _core.MAX_TAU:  # the router's bound, so the file's tau routes
        raise ValueError(f"--tau must be a finite number in [0, {_core.MAX_TAU:g}], got {tau}")
    if requests is None:
        req = np.arange(trace.num_requests, dtype=np.int64)
    else:
        req = np.asarray(requests)
        if req.dtype == bool:
            if req.shape != (trace.num_requests,):
                raise ValueError("a boolean request mask must have one entry per trace request")
            req = np.flatnonzero(req)
        if not np.issubdtype(req.dtype, np.integer):
            raise ValueError("requests must be integer indices into the trace")
        req = req.astype(np.int64).ravel()
        if req.size == 0:
            raise ValueError("the calibration subset is empty")
        if req.min() < 0 or req.max() >= trace.num_requests:
            raise ValueError(f"request index out of range 0..{trace.num_requests - 1}")
        if len(np.unique(req)) != len(req):
            raise ValueError("the calibration subset lists a request twice")
    if K > len(req):
        raise ValueError(f"K > N: {K} workers but only {len(req)} calibration requests")
    return K, tau, req


def fit_trace(
    trace: TraceSource,
    workers: int,
    tau: float = 0.1,
    layers="middle",
    seed: int = 0,
    requests: np.ndarray | None = None,
    progress: bool = False,
    *,
    n_init: int = 4,
    max_iter: int = 50,
    rtol: float = 1e-5,
    change_tol: float = FIT_CHANGE_TOL,
    sample_growth: float = FIT_SAMPLE_GROWTH,
    idf_plus_one: bool = True,
    worker_names: list[str] | None = None,
    source_path: str | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_signatures: bool = False,
) -> FitResult:
    """Fit K balanced centroids to the prefill signatures of the calibration requests.

    trace: a v1 Trace, or a v2 CountsTrace (read chunk by chunk from disk; layer selection
    "auto" and the decode statistics of the report then use the requests that kept decode
    routing).

    layers: "middle", "all", "auto" (greedy Spearman selection, held-out rho reported),
    a list string like "4-12,15" / "6:0.5,7", or a weight array [L].
    requests: optional index array (or boolean mask) of the calibration subset; the
    result's ``assignment`` and ``requests`` follow its order.
    Raises ValueError (TraceError) with a clear message on bad input, before any output.
    """
    t0 = time.perf_counter()
    K, tau, req = _check_inputs(trace, workers, tau, requests)
    if worker_names is not None and len(worker_names) != K:
        raise ValueError(f"{len(worker_names)} worker names for {K} workers")
    names = list(worker_names) if worker_names is not None else [f"decode-{k}" for k in range(K)]
    rng = np.random.default_rng([int(seed), 0xE1D2])  # drawn from in step order: layers, then scoring

    src = prefill_source(trace, chunk_tokens)
    valid, df, idf = _document_frequencies(src, req, K, progress, idf_plus_one)
    t_after_raw = time.perf_counter()
    with status_line(desc="eldr fit", enabled=progress) as line:  # cleared at the step's end: no stray line
        weights, auto, mode = _layer_weights(layers, src, req, valid, idf, trace.num_layers, rng, line.status)
    t_layers = time.perf_counter()
    spec = make_spec(weights, idf)
    X, S, valid, density = _fit_signatures(src, spec, req, valid, df, weights, K, progress, keep_signatures)
    t_sig = time.perf_counter() - t0
    with status_line(desc="eldr fit", enabled=progress) as line:  # balanced spherical K-means
        km: KMeansResult = spherical_kmeans(
            X, K, seed=seed, n_init=n_init, max_iter=max_iter, rtol=rtol, change_tol=change_tol,
            sample_growth=sample_growth, balanced=True,
            progress=line.status if progress else None,
        )
    assignment = np.full(len(req), -1, dtype=np.int64)
    assignment[valid] = km.assignment
    with status_line(desc="eldr fit", enabled=progress) as line:
        rep = _report(trace, src, req, valid, X, km, K, tau, seed, spec, idf, idf_plus_one, weights, mode, auto,
                      density, rng, line.status)
    rep["seconds"] = {
        "signatures": t_sig - (t_layers - t_after_raw),
        "layer_selection": t_layers - t_after_raw,
        "kmeans": km.seconds,
        "total": time.perf_counter() - t0,
    }
    provenance = _provenance(trace, src, rep, km, K, tau, layers, seed, n_init, max_iter,
                             (rtol, change_tol, sample_growth), idf_plus_one, req, requests is not None, source_path)
    return FitResult(
        centroids=km.centroids,
        layer_weights=weights.astype(np.float32),
        idf=idf,
        assignment=assignment,
        requests=req,
        report=rep,
        tau=tau,
        worker_names=names,
        provenance=provenance,
        signatures=S,
        valid=valid,
    )


def _document_frequencies(src, req: np.ndarray, K: int, progress: bool, idf_plus_one: bool):
    """Step 1: one streaming pass over the prompt counts -> which requests have a signature,
    the document frequencies and the IDF."""
    valid, df = src.prefill_pass(req, progress)
    n_valid = int(valid.sum())
    if n_valid == 0:
        raise ValueError("no calibration request has a usable signature (no prefill tokens)")
    if K > n_valid:
        raise ValueError(f"K > N: {K} workers but only {n_valid} calibration requests with a usable signature")
    return valid, df, compute_idf(df, n_valid, plus_one=idf_plus_one)


def _layer_weights(layers, src, req: np.ndarray, valid: np.ndarray, idf: np.ndarray, num_layers: int, rng, say):
    """Step 2: the layer weights, parsed or (layers="auto") selected by greedy Spearman on
    the requests that kept decode routing. Returns (weights, auto selection or None, mode)."""
    if not (isinstance(layers, str) and layers.strip().lower() == "auto"):
        return parse_layers(layers, num_layers), None, (layers if isinstance(layers, str) else "weights")
    cand = np.flatnonzero(valid & src.has_decode(req))
    if len(cand) > PROFILE_SAMPLE:
        cand = np.sort(rng.choice(cand, PROFILE_SAMPLE, replace=False))
    if len(cand) < 3:
        raise ValueError("--layers auto needs decode routing of at least 3 calibration requests; "
                         "this trace keeps too little (use --layers middle, or keep decode routing)")
    profiles = src.decode_profiles(req[cand])
    say("selecting layers (greedy Spearman)")
    auto = select_layers_auto(src.raw_rows(req, cand), idf.astype(np.float64), profiles, rng)
    return auto.weights, auto, "auto"


def _fit_signatures(src, spec, req: np.ndarray, valid: np.ndarray, df: np.ndarray, weights: np.ndarray, K: int,
                    progress: bool, keep_signatures: bool):
    """Step 3: the final signatures through the Rust normalizer (the router's exact path).
    Returns (X: the fitted rows, S: all rows when kept else None, valid, density)."""
    # The density of the signatures is known before they are made: with IDF > 0 a signature
    # entry is non-zero exactly where its count is, so df over the selected layers counts
    # them. A matrix that K-means will densify is then built dense, never as CSR first.
    n_cells = max(1, int(valid.sum()) * spec.dim)
    predicted = float(df[weights > 0].sum()) / n_cells
    dense = predicted >= DENSE_MIN_DENSITY and len(req) * spec.dim * 4 <= DENSE_MAX_BYTES
    S, valid2 = src.signatures(spec, req, progress, dense=dense)
    valid = valid & valid2
    n_valid = int(valid.sum())
    if K > n_valid:
        raise ValueError(
            f"K > N: {K} workers but only {n_valid} calibration requests have a signature on the selected layers"
        )
    X = S if valid.all() else S[valid]  # no copy in the usual case: every request has a signature
    nnz = int(np.count_nonzero(X)) if dense else X.nnz
    density = nnz / max(1, X.shape[0] * X.shape[1])
    if not dense and density >= DENSE_MIN_DENSITY and X.shape[0] * X.shape[1] * 4 <= DENSE_MAX_BYTES:
        X = X.toarray()
    if keep_signatures:
        S = sp.csr_matrix(S) if dense else S
    else:
        S = None  # X holds the fitted rows; the full matrix is not needed again
    return X, S, valid, density


def _report(trace, src, req, valid, X, km, K, tau, seed, spec, idf, idf_plus_one, weights, mode, auto, density,
            rng, say) -> dict:
    """Step 5: the fit report: sizes and balance, the K-means run, the layer selection, and the
    scores (cosines, signature rho, decode locality, domain purity, the drift baseline)."""
    n_valid = int(valid.sum())
    sizes = np.bincount(km.assignment, minlength=K)
    q, r = balanced_sizes(n_valid, K)
    fitted = req[valid]
    rep: dict = {
        "model": trace.model,
        "workers": K,
        "tau": tau,
        "seed": int(seed),
        "n_requests": int(len(req)),
        "n_fitted": n_valid,
        "n_without_signature": int(len(req) - n_valid),
        "dim": int(spec.dim),
        "idf": {"plus_one": bool(idf_plus_one), "min": float(idf.min()), "max": float(idf.max())},
        "layers": {
            "mode": mode,
            "selected": [int(l) for l in np.flatnonzero(weights > 0)],
            "weights": [float(x) for x in weights],
        },
        "cluster_sizes": sizes.tolist(),
        "balanced": bool(sizes.min() >= q and sizes.max() <= q + (1 if r else 0)),
        "objective": float(km.objective),
        "kmeans": {
            "iterations": int(km.iterations),
            "restart": int(km.restart),
            "restart_objectives": [float(o) for o in km.restart_objectives],
            "restarts_on_subsample": int(km.restarts_on_subsample),
            "optimal_assignment": bool(km.optimal_assignment),
            "assign_seconds": float(km.assign_seconds),
            "signature_density": float(density),
        },
    }
    if auto is not None:
        rep["layers"]["auto"] = {
            "order": [int(l) for l in auto.order],
            "selection_rho": auto.selection_rho,
            "heldout_rho": auto.heldout_rho,
            "middle_heldout_rho": auto.middle_heldout_rho,
            "all_heldout_rho": auto.all_heldout_rho,
            "n_pairs_selection": auto.n_pairs_selection,
            "n_pairs_heldout": auto.n_pairs_heldout,
            "history": auto.history,
        }
    say("scoring")
    rep["cosine"] = rpt.cosine_stats(X, km.assignment, km.centroids)
    # Spearman rho of the final signature, on a sample of fitted requests with decode tokens
    cand = np.flatnonzero(src.has_decode(fitted))
    if len(cand) > PROFILE_SAMPLE:
        cand = np.sort(rng.choice(cand, PROFILE_SAMPLE, replace=False))
    if len(cand) >= 3:
        prof = src.decode_profiles(fitted[cand])
        rep["signature_rho"] = rpt.signature_rho(X[cand], prof, rng)
    else:
        rep["signature_rho"] = {"spearman_rho": float("nan"), "n_pairs": 0}
    rep["decode_locality"] = src.decode_locality(fitted, km.assignment, rng)
    if trace.domain is not None:
        rep["domain_purity"] = rpt.domain_purity(np.asarray(trace.domain)[fitted], km.assignment, rng)
    rep["baseline"] = rpt.baseline_stats(X, km.centroids, tau)
    return rep


def _provenance(trace, src, rep: dict, km, K, tau, layers, seed, n_init, max_iter, tols, idf_plus_one, req,
                subset: bool, source_path) -> dict:
    """What the centroid file records of how it was made (its provenance JSON)."""
    rtol, change_tol, sample_growth = tols
    n_valid = rep["n_fitted"]
    sizes = np.asarray(rep["cluster_sizes"])
    provenance = {
        "tool": "eldr fit",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trace_sha256": src.digest(),
        "trace_model": trace.model,
        "trace_shape": {"num_layers": trace.num_layers, "num_experts": trace.num_experts, "top_k": trace.top_k},
        "params": {
            "workers": K,
            "tau": tau,
            "layers": layers if isinstance(layers, str) else "weights",
            "seed": int(seed),
            "n_init": int(n_init),
            "max_iter": int(max_iter),
            "rtol": float(rtol),
            "change_tol": float(change_tol),
            "sample_growth": float(sample_growth),
            "idf_plus_one": bool(idf_plus_one),
            "calibration_requests": int(len(req)),
            "calibration_subset": subset,
        },
        "fit": {
            "n_fitted": n_valid,
            "objective": float(km.objective),
            "cluster_sizes": sizes.tolist(),
            "cluster_shares": (sizes / n_valid).round(6).tolist(),
        },
        "baseline": rep["baseline"],
    }
    if source_path is not None:
        provenance["trace_path"] = str(source_path)
        provenance["trace_file_sha256"] = src.file_digest(source_path)
    return provenance
