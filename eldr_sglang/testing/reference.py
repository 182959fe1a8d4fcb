"""Plain-numpy reference of the signature and the band rule.

Exists only so tests can check the Rust hot path against an obviously-correct version of
the paper's formulas (arXiv:2607.00466; README, "The ELDR rule"); nothing in the product calls it.
"""

from __future__ import annotations

import numpy as np


def signature(counts: np.ndarray, layer_weights: np.ndarray, idf: np.ndarray) -> np.ndarray | None:
    """s = normalize_L2(idf * concat_l(w_l * c[l])) over layers with w_l > 0; None if unusable."""
    c = np.asarray(counts, dtype=np.float64)
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        return None
    w = np.asarray(layer_weights, dtype=np.float64)
    x = (c * w[:, None] * np.asarray(idf, dtype=np.float64))[w > 0].ravel()
    n = np.linalg.norm(x)
    if n == 0:
        return None
    return (x / n).astype(np.float32)


def distances(sig: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """d_k = 1 - cos(s, mu_k)."""
    s = np.asarray(sig, dtype=np.float64)
    m = np.asarray(centroids, dtype=np.float64)
    return 1.0 - (m @ s) / (np.linalg.norm(m, axis=1) * np.linalg.norm(s))


def band_route(sig, centroids, loads, healthy, tau: float):
    """(worker, band, d): shortest queue within {k : d_k <= d* + tau}, ties to smaller d_k.

    Without a usable signature: the healthy worker with the shortest queue (lowest index)."""
    loads = np.asarray(loads)
    healthy = np.asarray(healthy, dtype=bool)
    if sig is None:
        cand = np.flatnonzero(healthy)
        return int(cand[np.argmin(loads[cand])]), None, None
    d = distances(sig, centroids)
    d_star = d[healthy].min()
    band = [k for k in range(len(d)) if healthy[k] and d[k] <= d_star + tau]
    worker = min(band, key=lambda k: (loads[k], d[k], k))
    return worker, band, d


def _unpack(data: bytes, n: int, bits: int) -> np.ndarray:
    if len(data) != (n * bits + 7) // 8:
        raise ValueError("packed data length")
    if bits in (8, 16, 32):
        return np.frombuffer(data, dtype={8: "<u1", 16: "<u2", 32: "<u4"}[bits]).astype(np.uint32)
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n * bits, bitorder="little")
    weights = (np.uint32(1) << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    return flat.reshape(n, bits).astype(np.uint32) @ weights


def decode_counts(payload: dict) -> np.ndarray:
    """A well-formed counts payload (eldr_sglang.sglang_ext.payload) -> dense float32
    [len(layers), E] in numpy: the router's decoder before it moved to Rust, kept to check the
    Rust one and to time the path it replaced (benchmarks/bench_router.py). No validation."""
    import base64

    L, E, bits = len(payload["layers"]), payload["E"], payload["bits"]
    raw = base64.b64decode(payload["d"], validate=True)
    size = L * E
    if payload["enc"] == "dense":
        flat = _unpack(raw, size, bits).astype(np.float32)
    elif payload["enc"] == "sparse":
        nnz = payload["nnz"]
        idx_dtype = np.dtype("<u2" if size <= 1 << 16 else "<u4")
        ib = nnz * idx_dtype.itemsize
        flat = np.zeros(size, dtype=np.float32)
        flat[np.frombuffer(raw[:ib], dtype=idx_dtype).astype(np.int64)] = _unpack(raw[ib:], nnz, bits)
    else:  # log
        codes = _unpack(raw, size, bits).reshape(L, E)
        scale = np.log1p(np.asarray(payload["q"], dtype=np.float64))[:, None] / ((1 << bits) - 1)
        flat = np.expm1(codes * scale).astype(np.float32).reshape(-1)
    return flat.reshape(L, E)
