"""Helpers for the simulator tests: small traces built by hand and a quick centroid fit."""

from __future__ import annotations

import json

import numpy as np

from eldr_sglang.traces import Trace


def make_trace(expert_ids: np.ndarray, req_lens, prefill_lens, num_experts: int, domain=None, model="openai/gpt-oss-20b") -> Trace:
    ids = np.asarray(expert_ids)
    off = np.zeros(len(req_lens) + 1, dtype=np.int64)
    np.cumsum(req_lens, out=off[1:])
    meta = {"model": model, "num_layers": ids.shape[1], "num_experts": num_experts, "top_k": ids.shape[2]}
    t = Trace(ids, off, np.asarray(prefill_lens, dtype=np.int32), meta, domain=None if domain is None else np.asarray(domain))
    t.validate()
    return t


def quick_fit(trace: Trace, workers: int, path, requests=None, tau: float = 0.1, seed: int = 0) -> str:
    """Middle-band layers, smoothed IDF over the calibration requests, balanced spherical
    K-means: a small stand-in for eldr_sglang.offline.fit, used only by tests."""
    from eldr_sglang import _core
    from eldr_sglang.offline.balanced_kmeans import spherical_kmeans
    from eldr_sglang.offline.layers import middle_band

    reqs = np.arange(trace.num_requests) if requests is None else np.asarray(requests)
    sub = trace.subset(reqs)
    L, E = sub.num_layers, sub.num_experts
    df = np.zeros((L, E))
    for r in range(sub.num_requests):
        df += _core.count_topk(np.ascontiguousarray(sub.prefill_ids(r)), E) > 0
    idf = (np.log((len(reqs) + 1.0) / (df + 1.0)) + 1.0).astype(np.float32)
    w = middle_band(L)
    spec = _core.SignatureSpec(w, idf)
    sig, valid = spec.batch_from_topk(sub.expert_ids, sub.req_offsets, sub.prefill_len.astype(np.int64))
    km = spherical_kmeans(np.asarray(sig)[valid], workers, seed=seed, n_init=1, max_iter=20)
    _core.write_centroids(str(path), km.centroids, w, idf, tau=tau, provenance_json=json.dumps({"quick_fit": True}))
    return str(path)
