"""Stage 2 of the exact balanced assignment: the exact finish by negative-cycle cancelling.

From any feasible balanced assignment, cancel negative cycles on the (K+1)-node cluster graph
(K clusters and a slack node for the freedom of which clusters hold ceil(N/K) points) until
none is left: the min-cost flow's optimality condition. The method is set out in
`balanced_assignment`'s docstring.
"""

from __future__ import annotations

import numpy as np

BULK_CAP = 4096  # candidates per edge considered by one bulk cycle cancel


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


def cancel_cycles(CT, assign, base, r, tol, max_cycles):
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
