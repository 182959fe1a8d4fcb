"""Exact balanced assignment that scales (the assignment step of balanced K-means).

The paper's assignment step runs the Hungarian algorithm on the K centroids, each
replicated N/K times: O(N^3). The same optimum is the solution of a transportation
problem with K sinks, which has only K dual prices. We solve it in two stages:

1. **Prices** (fast, not trusted for optimality). Gauss-Seidel dual coordinate ascent:
   for each cluster k in turn, set its price p_k so that exactly n_k points have k as
   their cheapest reduced cost ``c_ik - p_k``. When every cluster hits its size at once,
   the argmin assignment is optimal for those sizes (complementary slackness).
2. **Exact finish** (the certificate; `cycle_cancel`). From any feasible balanced
   assignment, cancel negative cycles on the (K+1)-node cluster graph: edge a->b has weight
   ``min_{i in a} c_ib - c_ia`` (moving the best point of a to b), and a slack node S
   with 0-weight edges b->S (b holds floor(N/K) and may grow) and S->a (a holds
   ceil(N/K) and may shrink) expresses the freedom of which clusters take the extra
   points. Bellman-Ford on K+1 nodes finds cycles (stopped as soon as its predecessor graph
   holds one; the cycles it holds are disjoint and all cancelled); cancelling keeps the sizes
   feasible and lowers the cost. "No negative cycle" is the optimality condition of the
   min-cost flow, so the loop ends with a proof of optimality (up to a float tolerance).

3. **Screening** (warm starts, large N). Between Lloyd steps the prices move little: a point
   whose cheapest reduced cost beats its second by a wide gap stays put. Only the other
   points are solved for (stages 1-2, sizes less the fixed points); every fixed point is then
   checked against the sub-problem's dual prices, and any that would rather move is freed
   and the sub-problem solved again. The final assignment's certificate is checked on all
   N x K reduced costs (``certify_balanced``), screened or not.

Cost convention: ``C[i, k] = -<s_i, mu_k>``; with unit vectors ``||s_i - mu_k||^2 =
2 + 2 C[i, k]``, so minimising sum C minimises the K-means objective.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from eldr_sglang.offline.cycle_cancel import cancel_cycles


def balanced_sizes(n: int, k: int) -> tuple[int, int]:
    """(q, r): every cluster holds q or q+1 points and exactly r clusters hold q+1."""
    if k < 1:
        raise ValueError(f"the number of clusters must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} points into {k} non-empty balanced clusters (K > N)")
    return n // k, n % k


def is_balanced(assign: np.ndarray, k: int) -> bool:
    sizes = np.bincount(assign, minlength=k)
    q, r = balanced_sizes(len(assign), k)
    return bool(sizes.min() >= q and sizes.max() <= q + (1 if r else 0) and sizes.sum() == len(assign))


@dataclasses.dataclass
class AssignInfo:
    objective: float  # sum of C[i, assign[i]]
    sweeps: int  # price sweeps
    price_converged: bool  # prices alone reached the target sizes
    repaired: int  # points moved by the greedy repair
    cycles: int  # negative cycles cancelled
    optimal: bool  # no negative cycle left (optimality certificate)
    seconds: float
    screened: int = 0  # points left free by the screening (0: the whole problem was solved)
    screen_tries: int = 0  # sub-problems solved before every fixed point checked out
    screen_margin: float = float("nan")  # largest warm-start margin of a point that moved (a hint)


# ---------------------------------------------------------------------------
# Stage 1: prices by Gauss-Seidel coordinate ascent on the dual
# ---------------------------------------------------------------------------


def _top2(CT: np.ndarray, p: np.ndarray, cols: np.ndarray | None = None):
    """Best and second-best reduced cost (C - p) per point; CT is [K, N]."""
    V = CT if cols is None else CT[:, cols]
    V = V - p[:, None]
    j1 = np.argmin(V, axis=0)
    ar = np.arange(V.shape[1])
    m1 = V[j1, ar]
    V[j1, ar] = np.inf
    j2 = np.argmin(V, axis=0)
    m2 = V[j2, ar]
    return j1, m1, j2, m2


def _gauss_seidel_prices(CT, target, p, max_sweeps, deadline):
    K, N = CT.shape
    j1, m1, j2, m2 = _top2(CT, p)
    sizes = np.bincount(j1, minlength=K)
    sweeps = 0
    err = int(np.abs(sizes - target).sum())
    while sweeps < max_sweeps and err:
        if deadline is not None and time.perf_counter() > deadline:
            break
        sweeps += 1
        for k in range(K):
            if sizes[k] == target[k]:
                continue
            ck = CT[k]
            is1 = j1 == k
            other = np.where(is1, m2, m1)  # min over j != k of c_ij - p_j
            t = ck - other  # point i prefers k iff p_k > t_i
            n = int(target[k])
            if n == 0:
                newp = float(t.min()) - 1.0
            elif n >= N:
                newp = float(t.max()) + 1.0
            else:
                part = np.partition(t, (n - 1, n))
                lo, hi = float(part[n - 1]), float(part[n])
                if not hi > lo:  # exact tie: no price separates them; leave for the finish
                    continue
                newp = 0.5 * (lo + hi)
            p[k] = newp
            vk = ck - newp
            # update the top-2 structure for column k. Only points that had k first or second,
            # or now rank k above their second, can change: work on those alone
            cand = np.flatnonzero(is1 | (j2 == k) | (vk < m2))
            J1, M1, J2, M2, Vk = j1[cand], m1[cand], j2[cand], m2[cand], vk[cand]
            sizes -= np.bincount(J1, minlength=K)
            was1 = J1 == k
            was2 = J2 == k
            recompute = (was1 | was2) & (Vk > M2)
            keep1 = was1 & ~recompute
            M1[keep1] = Vk[keep1]
            w2 = was2 & ~recompute
            # k was second: it may now be best
            up = w2 & (Vk < M1)
            J2[up], M2[up] = J1[up], M1[up]
            J1[up], M1[up] = k, Vk[up]
            stay2 = w2 & ~up
            M2[stay2] = Vk[stay2]
            other_pts = ~(was1 | was2)
            b1 = other_pts & (Vk < M1)
            J2[b1], M2[b1] = J1[b1], M1[b1]
            J1[b1], M1[b1] = k, Vk[b1]
            b2 = other_pts & ~b1 & (Vk < M2)
            J2[b2], M2[b2] = k, Vk[b2]
            if recompute.any():
                idx = cand[recompute]
                J1[recompute], M1[recompute], J2[recompute], M2[recompute] = _top2(CT, p, idx)
            j1[cand], m1[cand], j2[cand], m2[cand] = J1, M1, J2, M2
            sizes += np.bincount(J1, minlength=K)
        new_err = int(np.abs(sizes - target).sum())
        # the tail of coordinate ascent crawls (near-ties between clusters); once a sweep
        # removes less than a quarter of the imbalance, the repair + exact finish is cheaper
        stalled = new_err > 0.75 * err
        err = new_err
        if stalled:
            break
    return j1, p, sweeps, bool(np.array_equal(sizes, target))


def _greedy_repair(CT, assign, target):
    """Move points from over-full to under-full clusters, cheapest moves first."""
    K = CT.shape[0]
    sizes = np.bincount(assign, minlength=K)
    moved = 0
    while True:
        excess = sizes - target
        if not np.any(excess > 0):
            return assign, moved
        over = np.flatnonzero(excess > 0)
        under = np.flatnonzero(excess < 0)
        pts = np.flatnonzero(np.isin(assign, over))
        cur = CT[assign[pts], pts]
        sub = CT[np.ix_(under, pts)] - cur[None, :]
        bi = np.argmin(sub, axis=0)
        delta = sub[bi, np.arange(pts.size)]
        order = np.argsort(delta, kind="stable")
        need = {int(a): int(excess[a]) for a in over}
        room = {int(b): int(-excess[b]) for b in under}
        for o in order:
            i = int(pts[o])
            a = int(assign[i])
            b = int(under[bi[o]])
            if need[a] > 0 and room[b] > 0:
                assign[i] = b
                need[a] -= 1
                room[b] -= 1
                sizes[a] -= 1
                sizes[b] += 1
                moved += 1
                if room[b] == 0:
                    break  # best targets change: recompute with the remaining under-full clusters
            if not any(need.values()):
                break


# ---------------------------------------------------------------------------
# Screening, the certificate and the public solve
# ---------------------------------------------------------------------------


SCREEN_MIN_N = 5_000  # screen (with warm prices) from this many points on
SCREEN_FIRST_SHARE = 0.25  # no hint: the first try leaves this share of the points free
SCREEN_SAFETY = 1.25  # the hint (last call's largest margin of a point that moved) times this
SCREEN_MAX_SHARE = 0.7  # more free points than this share: solve the whole problem instead
_BLOCK = 1 << 15  # points per block of the O(K N) passes (cache-sized temporaries)


def _best_and_margin(CT: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per point: the cluster of least reduced cost C - p, and the gap to the next least."""
    K, N = CT.shape
    j1 = np.empty(N, dtype=np.int64)
    gap = np.empty(N)
    for a in range(0, N, _BLOCK):
        b = min(N, a + _BLOCK)
        V = CT[:, a:b] - p[:, None]
        j = np.argmin(V, axis=0)
        ar = np.arange(b - a)
        m1 = V[j, ar]
        V[j, ar] = np.inf
        gap[a:b] = V.min(axis=0) - m1
        j1[a:b] = j
    return j1, gap


def _violations(CT: np.ndarray, assign: np.ndarray, p: np.ndarray, tol: float) -> np.ndarray:
    """Mask of the points whose own reduced cost C - p exceeds their least by more than tol."""
    K, N = CT.shape
    bad = np.empty(N, dtype=bool)
    for a in range(0, N, _BLOCK):
        b = min(N, a + _BLOCK)
        V = CT[:, a:b] - p[:, None]
        own = V[assign[a:b], np.arange(b - a)]
        bad[a:b] = own > V.min(axis=0) + tol
    return bad


def certify_balanced(CT: np.ndarray, assign: np.ndarray, p: np.ndarray, tol: float) -> bool:
    """The optimality certificate of a balanced assignment, checked on every point and cluster.

    (assign, p) is optimal (within tol) when (1) the sizes are q or q+1 with exactly r = N mod K
    at q+1, (2) every point sits at a cluster of least reduced cost C[k, i] - p[k], and (3) no
    cluster at q+1 has a higher price than a cluster at q (by more than 2 tol). These are the
    complementary slackness conditions of the transportation LP, which is integral; they say
    that p is a feasible potential of the residual cluster graph with its slack node, i.e. that
    the graph has no negative cycle. CT is [K, N]."""
    K, N = CT.shape
    q, r = balanced_sizes(N, K)
    sizes = np.bincount(assign, minlength=K)
    big = sizes == q + 1
    if not (np.all((sizes == q) | big) and int(big.sum()) == r):
        return False
    if 0 < r < K and float(p[big].max()) > float(p[~big].min()) + 2 * tol:
        return False
    return not bool(_violations(CT, assign, p, tol).any())


def _solve(CT, base, r, p, tol, max_sweeps, max_cycles, deadline):
    """The exact solve (prices, repair, cycle cancelling) for sizes base[k] or base[k] + 1, with
    exactly r clusters at base + 1. Returns (assign, p, sweeps, converged, repaired, cycles,
    optimal, p_is_dual): p are the certificate's dual prices when p_is_dual."""
    K = CT.shape[0]
    # which clusters take the r extra points: the r most demanded at the current prices
    demand = np.bincount(np.argmin(CT - p[:, None], axis=0), minlength=K)
    target = base.copy()
    if r:
        target[np.argsort(base - demand, kind="stable")[:r]] += 1
    assign, p, sweeps, conv = _gauss_seidel_prices(CT, target, p, max_sweeps, deadline)
    assign = assign.astype(np.int64)
    repaired = 0
    if not conv:
        assign, repaired = _greedy_repair(CT, assign, target)
    assign, cycles, optimal, duals = cancel_cycles(CT, assign, base, r, tol, max_cycles)
    if duals is not None:
        # shortest-path potentials are exact dual prices of the optimum: the next call
        # (slightly moved centroids) starts from a nearly balanced argmin
        p = duals
    return assign, p, sweeps, conv, repaired, cycles, optimal, duals is not None


def _screened(CT, q, r, p0, tol, max_sweeps, max_cycles, deadline, hint):
    """Warm-started solve on the points near a boundary only (see balanced_assign).

    Returns (assign, p, sweeps, converged, repaired, cycles, free points, tries, margin of the
    movers), or None when the screening does not pay (then the whole problem is solved)."""
    K, N = CT.shape
    j1, gap = _best_and_margin(CT, p0)
    theta = SCREEN_SAFETY * hint if hint is not None and np.isfinite(hint) and hint > 0 else None
    if theta is None:
        theta = float(np.quantile(gap, SCREEN_FIRST_SHARE))
    free = gap <= theta
    p = p0
    sweeps = repaired = cycles = tries = 0
    conv = True
    while True:
        fixed_sizes = np.bincount(j1[~free], minlength=K)
        over = np.flatnonzero(fixed_sizes > q)
        if over.size:  # fixed points alone overfill these clusters: free all their points
            free |= np.isin(j1, over)
            continue
        idx = np.flatnonzero(free)
        if idx.size > SCREEN_MAX_SHARE * N:
            return None
        tries += 1
        sub = np.ascontiguousarray(CT[:, idx])
        a_sub, p, sw, cv, rep, cyc, opt, is_dual = _solve(sub, q - fixed_sizes, r, p, tol, max_sweeps, max_cycles,
                                                          deadline)
        sweeps, repaired, cycles, conv = sweeps + sw, repaired + rep, cycles + cyc, conv and cv
        if not (opt and is_dual):
            return None
        assign = j1.copy()
        assign[idx] = a_sub
        # the sub-problem's prices are a certificate for the free points; a fixed point is
        # fine where it is if it still has the least reduced cost under them
        bad = _violations(CT, assign, p, tol)
        if not bad.any():
            moved = assign != j1
            need = float(gap[moved].max()) if moved.any() else 0.0
            return assign, p, sweeps, conv, repaired, cycles, int(idx.size), tries, need
        free |= bad | (gap <= 2 * theta)
        theta *= 2


def balanced_assign(
    C: np.ndarray,
    prices: np.ndarray | None = None,
    *,
    transposed: bool = False,
    max_sweeps: int = 200,
    max_cycles: int = 1_000_000,
    tol: float | None = None,
    price_seconds: float | None = None,
    screen: bool | None = None,
    margin_hint: float | None = None,
) -> tuple[np.ndarray, np.ndarray, AssignInfo]:
    """Exact minimum-cost balanced assignment.

    C: [N, K] costs (or [K, N] with ``transposed=True``). Returns (assign [N] int64,
    prices [K] for warm starts, info). Every cluster gets floor(N/K) or ceil(N/K)
    points and sum C[i, assign[i]] is minimal (``info.optimal`` certifies it).

    Screening (default: with warm ``prices`` and N >= SCREEN_MIN_N; ``screen`` forces it on
    or off): a point whose least reduced cost under the warm prices beats its second least
    by a wide gap stays where it is, and only the other points are solved for, with the
    cluster sizes less the fixed points. The sub-problem's dual prices are then checked on
    every fixed point; one that would rather move is freed (with a wider gap) and the
    sub-problem solved again. So the result carries the same certificate as the whole
    solve, checked on the whole problem (``certify_balanced``). ``margin_hint``: the
    ``screen_margin`` of the previous call (the gap of its widest-gapped mover).
    """
    t0 = time.perf_counter()
    CT = np.ascontiguousarray(C if transposed else np.asarray(C).T, dtype=np.float64)
    K, N = CT.shape
    q, r = balanced_sizes(N, K)
    if not np.all(np.isfinite(CT)):
        raise ValueError("cost matrix holds NaN or infinite values")
    if tol is None:
        tol = 1e-12 * max(1.0, float(np.abs(CT).max()))
    p = np.zeros(K) if prices is None else np.array(prices, dtype=np.float64, copy=True)
    if K == 1:
        assign = np.zeros(N, dtype=np.int64)
        return assign, p, AssignInfo(float(CT.sum()), 0, True, 0, 0, True, time.perf_counter() - t0)
    deadline = None if price_seconds is None else t0 + price_seconds
    use_screen = (prices is not None and N >= SCREEN_MIN_N) if screen is None else bool(screen)
    got = _screened(CT, q, r, p, tol, max_sweeps, max_cycles, deadline, margin_hint) if use_screen else None
    if got is not None:
        assign, p, sweeps, conv, repaired, cycles, n_free, tries, need = got
        optimal = certify_balanced(CT, assign, p, tol)
        extra = dict(screened=n_free, screen_tries=tries, screen_margin=need)
    else:
        base = np.full(K, q, dtype=np.int64)
        assign, p, sweeps, conv, repaired, cycles, optimal, is_dual = _solve(CT, base, r, p, tol, max_sweeps,
                                                                             max_cycles, deadline)
        if is_dual:  # the whole problem's certificate, checked point by point
            optimal = optimal and certify_balanced(CT, assign, p, tol)
        extra = {}
    obj = float(CT[assign, np.arange(N)].sum())
    return assign, p, AssignInfo(obj, sweeps, conv, repaired, cycles, optimal, time.perf_counter() - t0, **extra)


def hungarian_balanced(C: np.ndarray) -> tuple[np.ndarray, float]:
    """Reference: the paper's Hungarian step on replicated centroid columns (O(N^3)).

    Handles N not divisible by K exactly: each cluster gets q mandatory columns and one
    optional column; K - r dummy rows (cost 0 on optional, forbidden on mandatory
    columns) use up the optional columns that must stay empty.
    """
    from scipy.optimize import linear_sum_assignment

    C = np.asarray(C, dtype=np.float64)
    N, K = C.shape
    q, r = balanced_sizes(N, K)
    big = 1e6 * (1.0 + np.abs(C).max())
    cols_mand = np.repeat(np.arange(K), q)
    cols = np.concatenate([cols_mand, np.arange(K)])  # [Kq + K]
    M = np.zeros((N + K - r, K * q + K))
    M[:N] = C[:, cols]
    M[N:, : K * q] = big
    rows, cidx = linear_sum_assignment(M)
    real = rows < N
    assign = np.empty(N, dtype=np.int64)
    assign[rows[real]] = cols[cidx[real]]
    return assign, float(C[np.arange(N), assign].sum())
