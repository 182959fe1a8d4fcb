"""Exact balanced assignment and Hungarian-balanced spherical K-means that scale.

The paper's assignment step runs the Hungarian algorithm on the K centroids, each
replicated N/K times: O(N^3). The same optimum is the solution of a transportation
problem with K sinks, which has only K dual prices. We solve it in two stages:

1. **Prices** (fast, not trusted for optimality). Gauss-Seidel dual coordinate ascent:
   for each cluster k in turn, set its price p_k so that exactly n_k points have k as
   their cheapest reduced cost ``c_ik - p_k``. When every cluster hits its size at once,
   the argmin assignment is optimal for those sizes (complementary slackness).
2. **Exact finish** (the certificate). From any feasible balanced assignment, cancel
   negative cycles on the (K+1)-node cluster graph: edge a->b has weight
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
from typing import Callable

import numpy as np
import scipy.sparse as sp

BULK_CAP = 4096  # candidates per edge considered by one bulk cycle cancel


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
# Stage 2: exact finish by negative-cycle cancelling on K+1 nodes
# ---------------------------------------------------------------------------


class _ClusterGraph:
    """Edge weights W[a, b] = min over points i of cluster a of C[i, b] - C[i, a].

    Recomputing a row from all of a's points costs O(|a| K); cycle cancelling changes a
    few points at a time, so each row keeps, per target b, the CAND cheapest points of a
    (sorted, from the last rebuild) plus the points that arrived since. The row minimum
    is the first listed point still in a, or a cheaper arrival; that is exact because
    every unlisted point costs at least as much as the last listed one. A row is rebuilt
    only when one of its lists runs dry or too many points arrived."""

    CAND = 64

    def __init__(self, CT: np.ndarray, assign: np.ndarray):
        self.CT = CT
        self.K = CT.shape[0]
        self.assign = assign
        order = np.argsort(assign, kind="stable")
        bounds = np.searchsorted(assign[order], np.arange(self.K + 1))
        self.members = [order[bounds[a] : bounds[a + 1]].copy() for a in range(self.K)]
        self.W = np.full((self.K, self.K), np.inf)
        self.Widx = np.full((self.K, self.K), -1, dtype=np.int64)
        self.cand_i: list[np.ndarray] = [None] * self.K  # type: ignore[list-item]
        self.cand_d: list[np.ndarray] = [None] * self.K  # type: ignore[list-item]
        self.arrived: list[list[np.ndarray]] = [[] for _ in range(self.K)]
        self.rebuilds = 0
        for a in range(self.K):
            self._rebuild(a)

    def _rebuild(self, a: int) -> None:
        self.rebuilds += 1
        m = self.members[a]
        self.arrived[a] = []
        if m.size == 0:
            self.cand_i[a] = np.zeros((self.K, 0), dtype=np.int64)
            self.cand_d[a] = np.zeros((self.K, 0))
            self.W[a] = np.inf
            self.Widx[a] = -1
            return
        D = self.CT[:, m] - self.CT[a, m][None, :]  # [K, |a|]
        c = min(self.CAND, m.size)
        if c < m.size:
            part = np.argpartition(D, c - 1, axis=1)[:, :c]
        else:
            part = np.broadcast_to(np.arange(m.size), (self.K, m.size))
        dsel = np.take_along_axis(D, part, axis=1)
        o = np.argsort(dsel, axis=1, kind="stable")
        self.cand_i[a] = m[np.take_along_axis(part, o, axis=1)]
        self.cand_d[a] = np.take_along_axis(dsel, o, axis=1)
        self._refresh(a)

    def _refresh(self, a: int) -> None:
        ci, cd = self.cand_i[a], self.cand_d[a]
        if ci.shape[1] == 0:
            self.W[a] = np.inf
            self.Widx[a] = -1
            self.W[a, a] = np.inf
            return
        valid = self.assign[ci] == a  # [K, c]
        has = valid.any(axis=1)
        has[a] = True  # the diagonal is never used
        if not has.all():
            self._rebuild(a)
            return
        first = np.argmax(valid, axis=1)
        rows = np.arange(self.K)
        w = cd[rows, first]
        wi = ci[rows, first]
        if self.arrived[a]:
            arr = np.unique(np.concatenate(self.arrived[a]))
            arr = arr[self.assign[arr] == a]
            self.arrived[a] = [arr]
            if arr.size > self.CAND:
                self._rebuild(a)
                return
            if arr.size:
                Da = self.CT[:, arr] - self.CT[a, arr][None, :]
                j = np.argmin(Da, axis=1)
                da = Da[rows, j]
                better = da < w
                w = np.where(better, da, w)
                wi = np.where(better, arr[j], wi)
        self.W[a] = w
        self.Widx[a] = wi
        self.W[a, a] = np.inf

    def move_many(self, pts: np.ndarray, a: int, b: int) -> None:
        self.assign[pts] = b
        ma = self.members[a]
        self.members[a] = ma[~np.isin(ma, pts)] if len(pts) > 1 else ma[ma != pts[0]]
        self.members[b] = np.concatenate([self.members[b], pts])
        self.arrived[b].append(np.asarray(pts, dtype=np.int64))

    def _row(self, a: int) -> None:
        self._refresh(a)


def _pred_cycles(pred: np.ndarray) -> list[list[int]]:
    """The cycles of a predecessor graph (each node has at most one predecessor, so they are
    vertex-disjoint), each listed in edge order: c[j] -> c[j + 1]."""
    pred_l = pred.tolist()
    state = [0] * len(pred_l)  # 0 unseen, 1 on the current walk, 2 done
    cycles = []
    for s in range(len(pred_l)):
        if state[s]:
            continue
        path = []
        v = s
        while v >= 0 and state[v] == 0:
            state[v] = 1
            path.append(v)
            v = pred_l[v]
        if v >= 0 and state[v] == 1:
            cycles.append(path[path.index(v):][::-1])
        for x in path:
            state[x] = 2
    return cycles


def _find_negative_cycles(Wfull: np.ndarray, tol: float) -> tuple[list[list[int]] | None, np.ndarray]:
    """Bellman-Ford from a virtual source on a small dense graph, stopped at the first round
    whose predecessor graph holds a cycle (with strict improvements every such cycle is
    negative; their weights are checked by the caller).

    Returns (cycles, dist): the vertex-disjoint cycles of the predecessor graph, or None and
    the shortest-path distances, which are then dual prices (W[a, b] >= dist[b] - dist[a] - tol);
    an empty list when only cycles of float noise (weight >= -tol) are left."""
    n = Wfull.shape[0]
    dist = np.zeros(n)
    pred = np.full(n, -1, dtype=np.int64)
    ar = np.arange(n)
    for _ in range(n + 1):
        cand = dist[:, None] + Wfull
        u = np.argmin(cand, axis=0)
        nd = cand[u, ar]
        imp = nd < dist - tol
        if not imp.any():
            return None, dist
        dist[imp] = nd[imp]
        pred[imp] = u[imp]
        cycles = [c for c in _pred_cycles(pred) if _cycle_weight(Wfull, c) < -tol]
        if cycles:
            return cycles, dist
    return [], dist  # improving for n + 1 rounds, yet no cycle below -tol: only float noise


def _cycle_weight(W: np.ndarray, cyc: list[int]) -> float:
    return float(sum(W[u, v] for u, v in zip(cyc, cyc[1:] + cyc[:1])))


def _cancel_cycles(CT, assign, base, r, tol, max_cycles):
    """Cancel negative cycles until none is left; sizes stay base[k] or base[k] + 1 with r
    clusters at base + 1 (base = q everywhere for the whole problem)."""
    K = CT.shape[0]
    g = _ClusterGraph(CT, assign)
    sizes = np.bincount(assign, minlength=K)
    cycles = 0
    rounds = 0
    S = K
    while rounds < max_cycles:
        Wf = np.full((K + 1, K + 1), np.inf)
        Wf[:K, :K] = g.W
        if r:
            Wf[np.flatnonzero(sizes == base), S] = 0.0  # may gain a point
            Wf[S, np.flatnonzero(sizes == base + 1)] = 0.0  # may lose a point
        cycs, dist = _find_negative_cycles(Wf, tol)
        if cycs is None:
            return assign, cycles, True, dist[:K].copy()
        moves = []
        for cyc in cycs:  # vertex-disjoint: each is cancelled on its own clusters
            edges = list(zip(cyc, cyc[1:] + cyc[:1]))
            real = [(u, v) for u, v in edges if u != S and v != S]
            if len(real) < len(edges):
                # through the slack node: the size freedom allows exactly one unit
                moves += [(u, v, np.array([g.Widx[u, v]])) for u, v in real]
                m = 1
            else:
                # Bulk cancel: the m-th best point of every edge, for every m whose cycle is
                # still negative. Each edge's list is sorted, so the per-m cycle sums rise
                # with m; every one of these cancellations is itself a negative cycle.
                cap = min(BULK_CAP, min(g.members[u].size for u, _ in real))
                lists = []
                for u, v in real:
                    mem = g.members[u]
                    d = CT[v, mem] - CT[u, mem]
                    if cap < d.size:
                        part = np.argpartition(d, cap - 1)[:cap]
                        order = part[np.argsort(d[part], kind="stable")]
                    else:
                        order = np.argsort(d, kind="stable")
                    lists.append((mem[order], d[order]))
                tot = np.sum([d for _, d in lists], axis=0)
                m = max(1, int(np.count_nonzero(tot < -tol)))
                moves += [(u, v, pts[:m]) for (u, v), (pts, _) in zip(real, lists)]
            cycles += m
        if not moves:
            return assign, cycles, True, None  # only float noise left
        for u, v, pts in moves:
            g.move_many(pts, u, v)
            sizes[u] -= len(pts)
            sizes[v] += len(pts)
        for a in {x for u, v, _ in moves for x in (u, v)}:
            g._row(a)
        rounds += 1
    return assign, cycles, False, None


# ---------------------------------------------------------------------------
# Public: exact balanced assignment
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
    assign, cycles, optimal, duals = _cancel_cycles(CT, assign, base, r, tol, max_cycles)
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


# ---------------------------------------------------------------------------
# Spherical K-means (balanced or plain) with k-means++ and seeded restarts
# ---------------------------------------------------------------------------


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


def _dots(X, M: np.ndarray) -> np.ndarray:
    """[K, N] float64 inner products <mu_k, s_i>."""
    return _Data(X).dots(M)


def _cluster_sums(X, assign: np.ndarray, K: int) -> np.ndarray:
    return _Data(X).sums(assign, K)


def kmeanspp(X, K: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding under cosine distance (d = 2 - 2 cos = squared distance)."""
    return _kmeanspp_many(_Data(X), K, [rng])[0]


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
    N = X.shape[0]
    balanced_sizes(N, K)
    if not 0.0 <= change_tol <= 1.0:
        raise ValueError(f"change_tol must lie in [0, 1], got {change_tol}")
    if not (sample_growth == 0 or 2 <= sample_growth < float("inf")):
        raise ValueError(f"sample_growth must be 0 (off) or at least 2, got {sample_growth}")
    if sp.issparse(X):
        X = X.tocsr().astype(np.float32)
    else:
        X = np.ascontiguousarray(X, dtype=np.float32)
    stats = {"assign_seconds": 0.0, "history": []}
    kw = dict(balanced=balanced, max_iter=max_iter, rtol=rtol, change_tol=change_tol, stats=stats, progress=progress)
    on_sub = n_init > 1 and N > restart_sample >= K
    Xr = X
    if on_sub:
        sub = np.sort(np.random.default_rng([int(seed), 0x5AB]).choice(N, restart_sample, replace=False))
        Xr = X[sub]
    objs: list[float] = []
    best = None
    # the restarts run in lockstep (one pass over Xr per step for all of them), each exactly
    # as it would alone: restart r seeds from the generator (seed, r)
    data = _Data(Xr)
    seeds = _kmeanspp_many(data, K, [np.random.default_rng([int(seed), rs]) for rs in range(n_init)])
    results = _lloyd_many(data, K, seeds, tags=[f"restart {rs + 1}/{n_init}" for rs in range(n_init)], **kw)
    for rs, (M, assign, obj, it, opt, prices) in enumerate(results):
        objs.append(obj)
        if best is None or obj < best[2] - 1e-12 * abs(obj):
            best = (M, assign, obj, it, opt, rs, prices)
    assert best is not None
    M, assign, obj, it, opt, rs, prices = best
    if on_sub:
        # the winner's dual prices on the subsample warm-start the first step of the next
        # sample (the first step's screening then applies; its assignment is the exact optimum
        # anyway). Samples grow by sample_growth: each is the previous one plus fresh points.
        stages = []
        n = restart_sample * sample_growth if sample_growth else N
        while n < N:
            stages.append(int(n))
            n *= sample_growth
        if stages:
            rest = np.setdiff1d(np.arange(N), sub)
            extra = np.random.default_rng([int(seed), 0x5AC]).permutation(rest)
        for n in stages:
            idx = np.sort(np.concatenate([sub, extra[: n - restart_sample]]))
            M, assign, obj, it, opt, prices = _lloyd(X[idx], K, M, tag=f"refine ({n} points)", prices=prices, **kw)
        M, assign, obj, it, opt, _ = _lloyd(X, K, M, tag="final (all points)", prices=prices, **kw)
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
