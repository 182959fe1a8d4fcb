"""Hungarian-balanced spherical K-means that scales: k-means++ seeding, seeded restarts in
lockstep, and Lloyd's iterations whose balanced assignment step is the exact, certified
optimum (`balanced_assignment.balanced_assign`; ``balanced=False`` is plain spherical K-means).

Cost convention: ``C[i, k] = -<s_i, mu_k>``; with unit vectors ``||s_i - mu_k||^2 =
2 + 2 C[i, k]``, so minimising sum C minimises the K-means objective.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import scipy.sparse as sp

from eldr_sglang.offline.balanced_assignment import balanced_assign, balanced_sizes


def _normalize_rows(M: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(M, axis=1, keepdims=True)
    n[n == 0] = 1.0
    return (M / n).astype(np.float32)


# Sparse products run on fixed row blocks in a small thread pool (scipy's sparse kernels
# release the GIL). The block split depends only on N, so results do not depend on the
# number of threads; sums over blocks are added in block order (deterministic).
N_BLOCKS = 4
_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, min(N_BLOCKS, os.cpu_count() or 1)))
    return _POOL


def _row_blocks(X) -> list[tuple[int, int, object]]:
    N = X.shape[0]
    if N < 20_000:
        return [(0, N, X)]
    edges = np.linspace(0, N, N_BLOCKS + 1).astype(np.int64)
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        if sp.issparse(X):
            lo, hi = X.indptr[a], X.indptr[b]
            blk = sp.csr_matrix(
                (X.data[lo:hi], X.indices[lo:hi], X.indptr[a : b + 1] - lo), shape=(int(b - a), X.shape[1]), copy=False
            )
        else:
            blk = X[a:b]
        out.append((int(a), int(b), blk))
    return out


_T_BLOCK = 8192  # rows per block of the products' transpose


class _Data:
    """Unit rows X with the two products Lloyd's iterations need."""

    def __init__(self, X):
        self.X = X
        self.N = X.shape[0]
        self.sparse = sp.issparse(X)
        self.blocks = _row_blocks(X) if self.sparse else [(0, self.N, X)]

    def dots(self, M: np.ndarray) -> np.ndarray:
        """[K, N] float64 inner products <mu_k, s_i>."""
        if not self.sparse:
            # X @ M.T, not M @ X.T: with K rows in M, BLAS streams X at close to memory speed
            # in this orientation (about 1.6x faster measured at 20k x 7680, K = 8). The
            # [N, K] -> [K, N] float64 transpose goes by row blocks that stay in cache: done
            # whole it read X @ M.T column by column (2.4x slower at 200k x 64, measured)
            R = self.X @ np.asarray(M, dtype=self.X.dtype).T
            out = np.empty((R.shape[1], self.N), dtype=np.float64)
            for a in range(0, self.N, _T_BLOCK):
                out[:, a : a + _T_BLOCK] = R[a : a + _T_BLOCK].T
            return out
        out = np.empty((M.shape[0], self.N), dtype=np.float64)
        MT = np.ascontiguousarray(M.T, dtype=np.float32)

        def one(args):
            a, b, blk = args
            out[:, a:b] = (blk @ MT).T

        list(_pool().map(one, self.blocks)) if len(self.blocks) > 1 else one(self.blocks[0])
        return out

    def sums(self, assign: np.ndarray, K: int) -> np.ndarray:
        """[K, D] float64 sum of the rows of each cluster."""
        return self.sums_many([assign], K)[0]

    def sums_many(self, assigns: list[np.ndarray], K: int) -> list[np.ndarray]:
        """sums(a, K) of each assignment (of runs in lockstep). One sparse product each: for a
        dense X that is one streaming read, already at memory speed (cache-sized row blocks
        summed for every run in turn measured slower: per-block overhead)."""
        if len(assigns) > 1 and not self.sparse:
            return list(_pool().map(lambda a: self._sparse_sums(a, K), assigns))
        return [self._sparse_sums(a, K) for a in assigns]

    def _sparse_sums(self, assign: np.ndarray, K: int) -> np.ndarray:
        """A one-hot [K, N] sparse matrix times X, per row block (threads for a sparse X)."""

        def one(args):
            a, b, blk = args
            n = b - a
            oh = sp.csr_matrix((np.ones(n, dtype=np.float32), (assign[a:b], np.arange(n))), shape=(K, n))
            r = oh @ blk
            return np.asarray(r.toarray() if sp.issparse(r) else r, dtype=np.float64)

        if len(self.blocks) == 1:
            return one(self.blocks[0])
        parts = list(_pool().map(one, self.blocks))
        total = parts[0]
        for p_ in parts[1:]:
            total = total + p_
        return total


def _kmeanspp_many(data: "_Data", K: int, rngs: list) -> list[np.ndarray]:
    """k-means++ seeds of several restarts at once, restart r drawing from rngs[r] exactly as
    a run of its own would; each seeding step reads X once for all of them."""
    X, N = data.X, data.N

    def rows_of(idx):
        r = X[idx]
        return np.asarray(r.toarray() if sp.issparse(r) else r, dtype=np.float32).reshape(len(idx), -1)

    rows = [[int(rng.integers(N))] for rng in rngs]
    d2 = np.maximum(2.0 - 2.0 * data.dots(rows_of([r[0] for r in rows])), 0.0)  # [R, N]
    for _ in range(1, K):
        nxt = []
        for j, rng in enumerate(rngs):
            tot = d2[j].sum()
            if tot <= 0:
                n = int(rng.integers(N))
            else:
                n = min(int(np.searchsorted(np.cumsum(d2[j]), rng.random() * tot, side="right")), N - 1)
            rows[j].append(n)
            nxt.append(n)
        d2 = np.minimum(d2, np.maximum(2.0 - 2.0 * data.dots(rows_of(nxt)), 0.0))
    return [_normalize_rows(rows_of(r).astype(np.float64)) for r in rows]


@dataclasses.dataclass
class KMeansResult:
    centroids: np.ndarray  # [K, D] float32 unit rows
    assignment: np.ndarray  # [N] int64
    objective: float  # sum ||s_i - mu_c(i)||^2 = sum (2 - 2 cos)
    iterations: int  # of the winning (final) run
    restart: int  # index of the winning restart
    restart_objectives: list[float]  # per restart (on the subsample when restarts_on_subsample)
    restarts_on_subsample: int  # 0, or the subsample size the restarts were compared on
    balanced: bool
    optimal_assignment: bool  # last balanced assignment carried an optimality certificate
    seconds: float
    assign_seconds: float
    history: list[dict]


def _lloyd(X, K, M, *, balanced, max_iter, rtol, change_tol, stats, tag, progress, prices=None):
    """Lloyd iterations from centroids M. Returns (M, assign, objective, iterations, optimal, prices)."""
    return _lloyd_many(X, K, [M], balanced=balanced, max_iter=max_iter, rtol=rtol, change_tol=change_tol, stats=stats,
                       tags=[tag], progress=progress, prices=[prices])[0]


def _lloyd_many(X, K, Ms, *, balanced, max_iter, rtol, change_tol, stats, tags, progress, prices=None):
    """Lloyd iterations of several runs in lockstep, from centroids Ms[r]: every step computes
    the products of all runs still going in one pass over X (their centroids stacked), then
    assigns and updates each run on its own, so each run goes exactly as it would alone.
    prices: optional warm-start dual prices per run (the assignments do not depend on them:
    each is the exact optimum; they only make the first steps cheaper).
    Returns [(M, assign, objective, iterations, optimal, prices)] per run."""
    data = X if isinstance(X, _Data) else _Data(X)
    X = data.X
    N = data.N
    ar = np.arange(N)
    prices = prices or [None] * len(Ms)
    runs = [{"M": M, "tag": tag, "prices": p0, "hint": None, "assign": None, "obj": np.inf, "opt": True, "it": 0,
             "done": False, "true_sums": None} for M, tag, p0 in zip(Ms, tags, prices)]
    for it in range(1, max_iter + 1):
        going = [r for r in runs if not r["done"]]
        if not going:
            break
        D = data.dots(np.vstack([r["M"] for r in going]))  # [len(going) * K, N]
        for j, run in enumerate(going):
            run["it"] = it
            CT = -D[j * K : (j + 1) * K]
            tag = run["tag"]
            if balanced:
                ta = time.perf_counter()
                new, run["prices"], info = balanced_assign(CT, run["prices"], transposed=True, margin_hint=run["hint"])
                run["hint"] = info.screen_margin
                stats["assign_seconds"] += time.perf_counter() - ta
                run["opt"] = info.optimal
                stats["history"].append({"run": tag, "iter": it, **dataclasses.asdict(info)})
            else:
                new = np.argmin(CT, axis=0).astype(np.int64)
            new_obj = float(2.0 * N + 2.0 * CT[new, ar].sum())
            n_changed = N if run["assign"] is None else int(np.count_nonzero(new != run["assign"]))
            if stats["history"] and balanced:
                stats["history"][-1]["changed"] = n_changed
                stats["history"][-1]["objective_before_update"] = new_obj
            run["assign"], run["CT"], run["new_obj"], run["changed"] = new, CT, new_obj, n_changed
        all_sums = data.sums_many([r["assign"] for r in going], K)
        for run, sums in zip(going, all_sums):
            run["true_sums"] = sums
            empty = ~np.any(sums != 0, axis=1)
            if empty.any():  # plain K-means only: reseed an empty cluster at the worst point
                far = np.argsort(run["CT"][run["assign"], ar])[::-1]
                sums = sums.copy()
                for j, k in enumerate(np.flatnonzero(empty)):
                    row = X[far[j]]
                    sums[k] = np.asarray(row.toarray() if sp.issparse(row) else row).ravel()
            run["M"] = _normalize_rows(sums)
            new_obj, obj = run["new_obj"], run["obj"]
            if progress:
                progress(f"k-means {run['tag']} iter {it} objective {new_obj:.6f} changed {run['changed']}")
            run["done"] = run["changed"] <= change_tol * N or (np.isfinite(obj) and obj - new_obj <= rtol * abs(new_obj))
            run["obj"] = new_obj
            run["CT"] = None
        del D
    # objective of the final assignment against the final (updated) centroids:
    # sum_i <s_i, mu_a(i)> = sum_k <sums_k, mu_k>
    return [(r["M"], r["assign"], float(2.0 * N - 2.0 * np.einsum("kd,kd->", r["true_sums"], r["M"].astype(np.float64))),
             r["it"], r["opt"], r["prices"]) for r in runs]


def spherical_kmeans(
    X,
    K: int,
    *,
    seed: int = 0,
    n_init: int = 3,
    max_iter: int = 50,
    balanced: bool = True,
    rtol: float = 1e-5,
    change_tol: float = 0.0,
    restart_sample: int = 20_000,
    sample_growth: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> KMeansResult:
    """Spherical K-means on unit rows X ([N, D] ndarray or scipy.sparse CSR).

    ``balanced=True`` uses the exact balanced assignment (sizes floor/ceil N/K);
    ``balanced=False`` is plain spherical K-means (for comparison). Restart r seeds its
    k-means++ with the generator (seed, r), so results are deterministic for a seed.
    When N > restart_sample, the n_init restarts are run and compared on one seeded
    subsample of restart_sample points, and only the winner is refined on all N points
    (the restarts then cost O(restart_sample) each instead of O(N)). With
    ``sample_growth`` g > 1 the winner is first refined on nested subsamples g, g^2, ...
    times restart_sample (each started from the last one's centroids and prices) before
    all N points: the cheap steps on a sample do most of the moving.
    Lloyd's iterations stop when at most ``change_tol`` (a share of the points; 0: none)
    changed cluster in an iteration, or the objective improves by at most ``rtol``
    (relative) in one, or after ``max_iter``. Every balanced assignment, the last
    included, is the exact (certified) optimum for its centroids, whatever stops the run.
    """
    t0 = time.perf_counter()
    X = _checked_rows(X, K, change_tol, sample_growth)
    N = X.shape[0]
    stats = {"assign_seconds": 0.0, "history": []}
    kw = dict(balanced=balanced, max_iter=max_iter, rtol=rtol, change_tol=change_tol, stats=stats, progress=progress)
    on_sub = n_init > 1 and N > restart_sample >= K
    sub = np.sort(np.random.default_rng([int(seed), 0x5AB]).choice(N, restart_sample, replace=False)) if on_sub else None
    objs, (M, assign, obj, it, opt, rs, prices) = _best_restart(X if sub is None else X[sub], K, seed, n_init, kw)
    if sub is not None:
        M, assign, obj, it, opt = _refine(X, K, M, prices, sub, seed, sample_growth, kw)
    return KMeansResult(
        centroids=M,
        assignment=assign,
        objective=obj,
        iterations=it,
        restart=rs,
        restart_objectives=objs,
        restarts_on_subsample=restart_sample if on_sub else 0,
        balanced=balanced,
        optimal_assignment=opt,
        seconds=time.perf_counter() - t0,
        assign_seconds=stats["assign_seconds"],
        history=stats["history"],
    )


def _checked_rows(X, K: int, change_tol: float, sample_growth: float):
    """X as float32 rows (CSR or C-contiguous), after the argument checks of spherical_kmeans."""
    balanced_sizes(X.shape[0], K)
    if not 0.0 <= change_tol <= 1.0:
        raise ValueError(f"change_tol must lie in [0, 1], got {change_tol}")
    if not (sample_growth == 0 or 2 <= sample_growth < float("inf")):
        raise ValueError(f"sample_growth must be 0 (off) or at least 2, got {sample_growth}")
    if sp.issparse(X):
        return X.tocsr().astype(np.float32)
    return np.ascontiguousarray(X, dtype=np.float32)


def _best_restart(Xr, K: int, seed: int, n_init: int, kw: dict):
    """The n_init restarts on Xr, in lockstep (one pass over Xr per step for all of them), each
    exactly as it would run alone: restart r seeds from the generator (seed, r). Returns (the
    restarts' objectives, (M, assign, objective, iterations, optimal, restart, prices) of the
    best)."""
    objs: list[float] = []
    best = None
    data = _Data(Xr)
    seeds = _kmeanspp_many(data, K, [np.random.default_rng([int(seed), rs]) for rs in range(n_init)])
    results = _lloyd_many(data, K, seeds, tags=[f"restart {rs + 1}/{n_init}" for rs in range(n_init)], **kw)
    for rs, (M, assign, obj, it, opt, prices) in enumerate(results):
        objs.append(obj)
        if best is None or obj < best[2] - 1e-12 * abs(obj):
            best = (M, assign, obj, it, opt, rs, prices)
    assert best is not None
    return objs, best


def _refine(X, K: int, M, prices, sub: np.ndarray, seed: int, sample_growth: float, kw: dict):
    """Refine the subsample's winner on all of X. Returns (M, assign, objective, iterations,
    optimal).

    The winner's dual prices on the subsample warm-start the first step of the next sample
    (the first step's screening then applies; its assignment is the exact optimum anyway).
    Samples grow by sample_growth: each is the previous one plus fresh points."""
    N, n_sub = X.shape[0], len(sub)
    stages = []
    n = n_sub * sample_growth if sample_growth else N
    while n < N:
        stages.append(int(n))
        n *= sample_growth
    if stages:
        rest = np.setdiff1d(np.arange(N), sub)
        extra = np.random.default_rng([int(seed), 0x5AC]).permutation(rest)
    for n in stages:
        idx = np.sort(np.concatenate([sub, extra[: n - n_sub]]))
        M, assign, obj, it, opt, prices = _lloyd(X[idx], K, M, tag=f"refine ({n} points)", prices=prices, **kw)
    M, assign, obj, it, opt, _ = _lloyd(X, K, M, tag="final (all points)", prices=prices, **kw)
    return M, assign, obj, it, opt
