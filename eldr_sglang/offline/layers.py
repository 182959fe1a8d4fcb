"""Layer weights of the signature: ``middle``, ``all``, an explicit LIST, or ``auto``.

``auto`` is the paper's greedy selection: keep adding the layer that most raises the
Spearman correlation between signature distance (1 - cos) and decode-time expert-overlap
distance of request pairs. Layers are chosen on pairs from one half of the requests and
the reached rho is reported on pairs from the other, held-out half.

The decode expert-overlap distance of requests a, b is
``1 - mean_l sum_e min(u_a[l, e], u_b[l, e])``, where ``u_r[l]`` is request r's decode
expert-usage distribution at layer l (histogram intersection: the expected share of
expert picks the two requests have in common), over ALL MoE layers.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import scipy.sparse as sp
from scipy.stats import rankdata


def middle_band(num_layers: int) -> np.ndarray:
    """Weight 1 on the middle half of the layers [L//4, L - L//4), 0 elsewhere."""
    w = np.zeros(num_layers, dtype=np.float32)
    lo = num_layers // 4
    hi = num_layers - lo
    if hi <= lo:
        lo, hi = 0, num_layers
    w[lo:hi] = 1.0
    return w


def parse_layers(spec: str, num_layers: int) -> np.ndarray:
    """``middle``, ``all`` or a LIST such as ``4-12,15`` or ``6:0.5,7-10,11:2`` -> weights [L].

    (``auto`` needs data and is handled by :func:`select_layers_auto`.)"""
    if not isinstance(spec, str):
        w = np.asarray(spec, dtype=np.float32)
        return _check_weights(w, num_layers)
    s = spec.strip().lower()
    if s == "middle":
        return middle_band(num_layers)
    if s == "all":
        return np.ones(num_layers, dtype=np.float32)
    w = np.zeros(num_layers, dtype=np.float32)
    if not s:
        raise ValueError("--layers is empty; use middle, all, auto or a list like 4-12,15")
    for item in s.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?(?::([0-9.eE+-]+))?", item)
        if not m:
            raise ValueError(
                f"--layers: cannot read {item!r}; use middle, all, auto or a list like 4-12,15 or 6:0.5"
            )
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) else a
        try:
            weight = float(m.group(3)) if m.group(3) else 1.0
        except ValueError:
            raise ValueError(f"--layers: bad weight in {item!r}") from None
        if b < a:
            raise ValueError(f"--layers: range {item!r} runs backwards")
        if b >= num_layers:
            raise ValueError(f"--layers: layer {b} out of range, the trace has {num_layers} MoE layers (0..{num_layers - 1})")
        w[a : b + 1] = weight
    return _check_weights(w, num_layers)


def _check_weights(w: np.ndarray, num_layers: int) -> np.ndarray:
    if w.shape != (num_layers,):
        raise ValueError(f"layer weights have shape {w.shape}, the trace has {num_layers} MoE layers")
    if not np.all(np.isfinite(w)):
        raise ValueError("layer weights hold NaN or infinite values")
    if np.any(w < 0):
        raise ValueError("layer weights must be >= 0")
    if not np.any(w > 0):
        raise ValueError("layer weights select no layer")
    return w.astype(np.float32)


def _dense(m) -> np.ndarray:
    return np.asarray(m.toarray() if sp.issparse(m) else m, dtype=np.float64)


def sample_pairs(n: int, n_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Distinct unordered pairs (i < j) of range(n); all of them when there are few."""
    total = n * (n - 1) // 2
    if total <= n_pairs:
        a, b = np.triu_indices(n, 1)
        return a.astype(np.int64), b.astype(np.int64)
    a = rng.integers(0, n, size=n_pairs * 2)
    b = rng.integers(0, n, size=n_pairs * 2)
    keep = a != b
    a, b = np.minimum(a, b)[keep], np.maximum(a, b)[keep]
    key = np.unique(a * n + b)[:n_pairs]
    rng.shuffle(key)
    return key // n, key % n


def overlap_distance(profiles: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """1 - mean_l sum_e min(u_a, u_b) for decode usage profiles [R, L, E]."""
    out = np.empty(len(a), dtype=np.float64)
    step = 4096
    for s in range(0, len(a), step):
        pa, pb = profiles[a[s : s + step]], profiles[b[s : s + step]]
        out[s : s + step] = 1.0 - np.minimum(pa, pb).sum(axis=2).mean(axis=1)
    return out


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3:
        return float("nan")
    rx, ry = rankdata(x), rankdata(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


class PairScorer:
    """Spearman rho of a layer weighting on fixed pairs, without recomputing signatures.

    ``raw`` are count-proportional rows over all L*E columns (weights 1, IDF 1). For
    weights w and IDF, cos(x_a, x_b) = sum_l w_l^2 G_l(a, b) / sqrt(sum_l w_l^2 G_l(a, a)
    * sum_l w_l^2 G_l(b, b)) with G_l(a, b) = sum_e idf_le^2 raw_a,le raw_b,le; the row
    scale of raw cancels, so scoring a weighting costs O(pairs * L)."""

    def __init__(self, raw: sp.csr_matrix, idf: np.ndarray, a, b, target_dist: np.ndarray):
        L, E = idf.shape
        X = sp.csr_matrix(raw.multiply(idf.astype(np.float64).ravel()[None, :]))
        ind = sp.csr_matrix((np.ones(L * E), (np.arange(L * E), np.repeat(np.arange(L), E))), shape=(L * E, L))
        self.G = _dense(sp.csr_matrix(X[a].multiply(X[b])) @ ind)  # [P, L]
        self_n = _dense(sp.csr_matrix(X.multiply(X)) @ ind)  # [R, L]
        self.Na, self.Nb = self_n[a], self_n[b]
        self.target_rank = rankdata(target_dist)
        self.L = L

    def distances(self, w: np.ndarray) -> np.ndarray:
        w2 = np.asarray(w, dtype=np.float64) ** 2
        den = np.sqrt((self.Na @ w2) * (self.Nb @ w2))
        cos = np.divide(self.G @ w2, den, out=np.zeros(len(den)), where=den > 0)
        return 1.0 - cos

    def rho(self, w: np.ndarray) -> float:
        w2 = np.asarray(w, dtype=np.float64) ** 2
        den = np.sqrt((self.Na @ w2) * (self.Nb @ w2))
        ok = den > 0
        if ok.sum() < 3:
            return float("nan")
        d = 1.0 - (self.G[ok] @ w2) / den[ok]
        return spearman(d, self.target_rank[ok])


@dataclasses.dataclass
class AutoSelection:
    weights: np.ndarray  # [L] 0/1
    order: list[int]  # layers in the order they were added
    selection_rho: float  # on the selection half
    heldout_rho: float  # on the held-out half
    history: list[dict]
    n_pairs_selection: int
    n_pairs_heldout: int
    middle_heldout_rho: float  # the middle band on the same held-out pairs, for reference
    all_heldout_rho: float


def select_layers_auto(
    raw: sp.csr_matrix,
    idf: np.ndarray,
    profiles: np.ndarray,
    rng: np.random.Generator,
    n_pairs: int = 20000,
    min_gain: float = 1e-3,
) -> AutoSelection:
    """Greedy forward selection of layers maximizing Spearman rho.

    raw [R, L*E] and profiles [R, L, E] cover the same R requests, all with a usable
    prefill signature and at least one decode token."""
    R = raw.shape[0]
    L = idf.shape[0]
    if R < 8:
        raise ValueError(f"--layers auto needs at least 8 requests with prefill and decode tokens, got {R}")
    perm = rng.permutation(R)
    A, B = np.sort(perm[: R // 2]), np.sort(perm[R // 2 :])
    pa, pb = sample_pairs(len(A), n_pairs, rng)
    ha, hb = sample_pairs(len(B), n_pairs, rng)
    sel = PairScorer(raw, idf, A[pa], A[pb], overlap_distance(profiles, A[pa], A[pb]))
    held = PairScorer(raw, idf, B[ha], B[hb], overlap_distance(profiles, B[ha], B[hb]))
    chosen: list[int] = []
    best = -np.inf
    history = []
    w = np.zeros(L)
    while len(chosen) < L:
        cands = [l for l in range(L) if l not in chosen]
        scores = []
        for l in cands:
            w[l] = 1.0
            scores.append(sel.rho(w))
            w[l] = 0.0
        scores_arr = np.nan_to_num(np.array(scores), nan=-np.inf)
        j = int(np.argmax(scores_arr))
        if chosen and not scores_arr[j] > best + min_gain:
            break
        chosen.append(cands[j])
        best = float(scores_arr[j])
        w[cands[j]] = 1.0
        history.append({"layer": cands[j], "selection_rho": best, "heldout_rho": held.rho(w)})
    weights = np.zeros(L, dtype=np.float32)
    weights[chosen] = 1.0
    return AutoSelection(
        weights=weights,
        order=chosen,
        selection_rho=best,
        heldout_rho=held.rho(weights),
        history=history,
        n_pairs_selection=len(pa),
        n_pairs_heldout=len(ha),
        middle_heldout_rho=held.rho(middle_band(L)),
        all_heldout_rho=held.rho(np.ones(L)),
    )
