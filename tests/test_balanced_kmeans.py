"""Exact balanced assignment against the paper's Hungarian step, and balanced K-means."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from eldr_sglang.offline.balanced_assignment import (
    balanced_assign,
    balanced_sizes,
    hungarian_balanced,
    is_balanced,
)
from eldr_sglang.offline.balanced_kmeans import spherical_kmeans


def _unit_rows(rng, n, d, k_latent=4, sparse_pow=3.0):
    Z = rng.random((k_latent, d)) ** sparse_pow
    X = Z[rng.integers(k_latent, size=n)] + 0.5 * rng.random((n, d)) ** sparse_pow
    return (X / np.linalg.norm(X, axis=1, keepdims=True)).astype(np.float32)


def _cost(rng, kind, n, k):
    if kind == "uniform":
        return rng.random((n, k))
    if kind == "ties":  # many exact ties: the price stage cannot separate them
        return np.round(rng.random((n, k)) * 3) / 3
    X = _unit_rows(rng, n, 24)
    M = X[rng.choice(n, k, replace=False)]
    return -(X.astype(np.float64) @ M.T.astype(np.float64))


@pytest.mark.parametrize("kind", ["uniform", "ties", "cosine"])
def test_matches_hungarian_on_random_instances(kind):
    checked = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 400))
        k = int(rng.integers(1, min(n, 16) + 1))
        C = _cost(rng, kind, n, k)
        assign, _, info = balanced_assign(C)
        _, h_obj = hungarian_balanced(C)
        assert is_balanced(assign, k), (seed, np.bincount(assign, minlength=k))
        assert info.optimal
        assert abs(info.objective - h_obj) <= 1e-9 * max(1.0, abs(h_obj)), (seed, n, k, info.objective, h_obj)
        assert abs(C[np.arange(n), assign].sum() - info.objective) <= 1e-9 * max(1.0, abs(h_obj))
        checked += 1
    assert checked == 40


def test_matches_hungarian_at_2000_points_not_divisible():
    rng = np.random.default_rng(7)
    n, k = 2000, 7  # 2000 = 7 * 285 + 5
    C = _cost(rng, "cosine", n, k)
    assign, _, info = balanced_assign(C)
    _, h_obj = hungarian_balanced(C)
    sizes = np.bincount(assign, minlength=k)
    assert sorted(sizes.tolist()) == [285] * 2 + [286] * 5
    assert abs(info.objective - h_obj) <= 1e-9 * abs(h_obj)


def test_hungarian_reference_itself_is_balanced():
    # guards the reference: replicated columns alone (ceil copies) would allow a floor-1 cluster
    rng = np.random.default_rng(3)
    C = rng.random((10, 3))
    C[:, 2] += 10.0  # everyone hates cluster 2; it must still get 3 points
    a, _ = hungarian_balanced(C)
    assert sorted(np.bincount(a, minlength=3).tolist()) == [3, 3, 4]


def test_extra_points_go_where_they_are_cheapest():
    # N = 5, K = 2: one cluster takes 3 points. All points prefer cluster 1 by a lot.
    C = np.array([[1.0, 0.0]] * 5)
    a, _, info = balanced_assign(C)
    assert np.bincount(a, minlength=2).tolist() == [2, 3]
    assert info.objective == pytest.approx(2.0)


def test_warm_start_prices_give_same_optimum():
    rng = np.random.default_rng(11)
    C = _cost(rng, "cosine", 900, 9)
    a0, p, info0 = balanced_assign(C)
    C2 = C + 1e-3 * rng.random(C.shape)
    _, _, warm = balanced_assign(C2, p)
    _, _, cold = balanced_assign(C2)
    assert warm.objective == pytest.approx(cold.objective, rel=1e-12, abs=1e-12)


def test_sizes_and_bad_inputs():
    assert balanced_sizes(10, 3) == (3, 1)
    assert balanced_sizes(9, 3) == (3, 0)
    with pytest.raises(ValueError, match="K > N"):
        balanced_sizes(3, 4)
    with pytest.raises(ValueError, match="NaN"):
        balanced_assign(np.array([[0.0, np.nan], [1.0, 0.0]]))


def test_kmeans_is_balanced_and_deterministic():
    rng = np.random.default_rng(5)
    X = _unit_rows(rng, 1003, 40, k_latent=3)
    r1 = spherical_kmeans(X, 6, seed=1, n_init=2)
    r2 = spherical_kmeans(X, 6, seed=1, n_init=2)
    assert np.array_equal(r1.assignment, r2.assignment)
    assert np.array_equal(r1.centroids, r2.centroids)
    sizes = np.bincount(r1.assignment, minlength=6)
    assert sizes.min() == 167 and sizes.max() == 168
    assert np.allclose(np.linalg.norm(r1.centroids, axis=1), 1.0, atol=1e-5)
    # objective is what it claims: sum ||s - mu||^2
    d = X - r1.centroids[r1.assignment]
    assert r1.objective == pytest.approx(float((d.astype(np.float64) ** 2).sum()), rel=1e-5)
    assert r1.optimal_assignment
    # another seed is another (deterministic) run
    r3 = spherical_kmeans(X, 6, seed=2, n_init=2)
    assert r3.restart_objectives != r1.restart_objectives


def test_kmeans_sparse_equals_dense():
    rng = np.random.default_rng(9)
    X = _unit_rows(rng, 300, 64, sparse_pow=8.0)
    X[X < 0.05] = 0
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    a = spherical_kmeans(X, 4, seed=3, n_init=1)
    b = spherical_kmeans(sp.csr_matrix(X), 4, seed=3, n_init=1)
    assert np.array_equal(a.assignment, b.assignment)
    assert a.objective == pytest.approx(b.objective, rel=1e-5)


def test_threaded_row_blocks_match_direct_products():
    from eldr_sglang.offline.balanced_kmeans import _Data

    rng = np.random.default_rng(2)
    X = sp.random(25_000, 40, density=0.2, format="csr", random_state=2, dtype=np.float32)
    M = rng.random((5, 40)).astype(np.float32)
    assign = rng.integers(0, 5, size=25_000)
    data = _Data(X)
    assert len(data.blocks) > 1
    np.testing.assert_allclose(data.dots(M), (X @ M.T).T, rtol=1e-6)
    direct = np.stack([np.asarray(X[assign == k].sum(axis=0)).ravel() for k in range(5)])
    np.testing.assert_allclose(data.sums(assign, 5), direct, rtol=1e-5)


def test_restarts_on_subsample_are_deterministic():
    rng = np.random.default_rng(4)
    X = _unit_rows(rng, 3000, 16, k_latent=5)
    a = spherical_kmeans(X, 5, seed=0, n_init=3, restart_sample=500)
    b = spherical_kmeans(X, 5, seed=0, n_init=3, restart_sample=500)
    assert a.restarts_on_subsample == 500
    assert np.array_equal(a.assignment, b.assignment)
    assert sorted(np.bincount(a.assignment).tolist()) == [600] * 5


def test_matches_transportation_lp_beyond_hungarian_sizes():
    """At N=4000 (too slow for replicated-column Hungarian in a unit test) the transportation
    LP solved by HiGHS gives the same optimum; the LP is integral, so this is the optimum."""
    from scipy.optimize import linprog

    rng = np.random.default_rng(21)
    n, k = 4001, 6
    C = _cost(rng, "cosine", n, k)
    _, _, info = balanced_assign(C)
    q, r = balanced_sizes(n, k)
    a_eq = sp.kron(sp.eye(n), np.ones((1, k))).tocsr()
    col = sp.kron(np.ones((1, n)), sp.eye(k))
    a_ub = sp.vstack([col, -col]).tocsr()
    b_ub = np.concatenate([np.full(k, q + 1), -np.full(k, q)])
    lp = linprog(C.ravel(), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(n), bounds=(0, 1), method="highs")
    assert lp.status == 0
    assert info.optimal
    assert abs(info.objective - lp.fun) <= 1e-9 * abs(lp.fun)


@pytest.mark.parametrize("kind", ["uniform", "ties", "cosine"])
@pytest.mark.parametrize("hint", [None, 1e-9, 0.01])
def test_screened_solve_matches_hungarian(kind, hint):
    """The screened path (warm prices; only points near a boundary solved for, the rest
    checked against the sub-problem's prices) reaches the same optimum as the paper's step.
    hint=1e-9 leaves almost nothing free at first, so the freeing and re-solving is exercised."""
    from eldr_sglang.offline.balanced_assignment import certify_balanced

    tries = screened = 0
    for seed in range(25):
        rng = np.random.default_rng(100 + seed)
        n = int(rng.integers(60, 400))
        k = int(rng.integers(2, min(n, 12) + 1))
        C0 = _cost(rng, kind, n, k)
        _, p, _ = balanced_assign(C0)
        C = C0 + 0.05 * rng.random(C0.shape)  # the next Lloyd step: costs moved a little
        assign, p2, info = balanced_assign(C, p, screen=True, margin_hint=hint)
        _, h_obj = hungarian_balanced(C)
        screened += info.screened > 0  # else it fell back to the whole solve (too few points fixed)
        assert is_balanced(assign, k), seed
        assert info.optimal and certify_balanced(C.T.copy(), assign, p2, 1e-12 * max(1.0, np.abs(C).max()))
        assert abs(info.objective - h_obj) <= 1e-9 * max(1.0, abs(h_obj)), (seed, n, k, info.objective, h_obj)
        tries = max(tries, info.screen_tries)
    assert screened >= 5
    if hint == 1e-9:
        assert tries > 1  # some instance needed fixed points freed


def test_certificate_rejects_what_is_not_optimal():
    from eldr_sglang.offline.balanced_assignment import certify_balanced

    rng = np.random.default_rng(8)
    C = _cost(rng, "cosine", 301, 5)  # 301 = 5 * 60 + 1: one cluster holds 61
    a, p, info = balanced_assign(C)
    CT, tol = C.T.copy(), 1e-12
    assert info.optimal and certify_balanced(CT, a, p, tol)
    # a swap of two points of different clusters keeps the sizes but breaks the optimality
    i = 0
    j = int(np.flatnonzero(a != a[i])[0])
    b = a.copy()
    b[i], b[j] = a[j], a[i]
    assert C[[i, j], [b[i], b[j]]].sum() > C[[i, j], [a[i], a[j]]].sum()
    assert not certify_balanced(CT, b, p, tol)
    # wrong sizes
    c = a.copy()
    c[np.flatnonzero(a == 0)[:2]] = 1
    assert not certify_balanced(CT, c, p, tol)
    # the cluster with the extra point must not be priced above a cluster without one
    big = int(np.flatnonzero(np.bincount(a, minlength=5) == 61)[0])
    p_bad = p.copy()
    p_bad[big] = p.max() + 1.0
    assert not certify_balanced(CT, a, p_bad, tol)


def test_kmeans_with_screening_equals_the_whole_solve(monkeypatch):
    """At N >= SCREEN_MIN_N Lloyd's steps use the screened solve; the run (assignments,
    centroids, restart objectives) is bit-identical to the one that solves every step whole."""
    from eldr_sglang.offline import balanced_assignment as bk

    rng = np.random.default_rng(6)
    X = _unit_rows(rng, 12_003, 24, k_latent=6, sparse_pow=2.0)
    a = spherical_kmeans(X, 16, seed=0, n_init=2, max_iter=8, restart_sample=6_000)
    assert max(h.get("screened", 0) for h in a.history) > 0
    monkeypatch.setattr(bk, "SCREEN_MIN_N", 10**12)
    b = spherical_kmeans(X, 16, seed=0, n_init=2, max_iter=8, restart_sample=6_000)
    assert all(h.get("screened", 0) == 0 for h in b.history)
    assert np.array_equal(a.assignment, b.assignment)
    assert np.array_equal(a.centroids, b.centroids)
    assert a.restart_objectives == b.restart_objectives
    assert a.optimal_assignment and b.optimal_assignment


def test_change_tol_stops_at_the_first_quiet_iteration():
    """change_tol: a run stops at its first iteration in which at most that share of the
    points changed cluster (rtol off), every assignment still the certified exact optimum."""
    rng = np.random.default_rng(8)
    X = _unit_rows(rng, 4000, 24, k_latent=6, sparse_pow=2.0)
    full = spherical_kmeans(X, 8, seed=0, n_init=1, max_iter=60, rtol=0.0)
    changed = [h["changed"] for h in full.history]
    tol = 0.01
    quiet = next(i for i, c in enumerate(changed) if c <= tol * 4000)
    assert 0 < quiet < len(changed) - 1  # the rule fires, and earlier than the plain run stops
    cut = spherical_kmeans(X, 8, seed=0, n_init=1, max_iter=60, rtol=0.0, change_tol=tol)
    assert cut.iterations == quiet + 1 and [h["changed"] for h in cut.history] == changed[: quiet + 1]
    assert all(h["optimal"] for h in cut.history) and cut.optimal_assignment
    assert sorted(set(np.bincount(cut.assignment).tolist())) == [500]
    assert cut.objective >= full.objective - 1e-9 * abs(full.objective)
    with pytest.raises(ValueError, match="change_tol"):
        spherical_kmeans(X, 8, change_tol=1.5)


def test_sample_growth_refines_on_nested_samples_then_all_points():
    """sample_growth: after the restarts, the winner is refined on samples growing by that
    factor, then on all points; deterministic, balanced and certified at every step."""
    rng = np.random.default_rng(3)
    X = _unit_rows(rng, 9000, 16, k_latent=5)
    a = spherical_kmeans(X, 6, seed=0, n_init=2, restart_sample=500, sample_growth=4.0, change_tol=1e-3)
    b = spherical_kmeans(X, 6, seed=0, n_init=2, restart_sample=500, sample_growth=4.0, change_tol=1e-3)
    runs = list(dict.fromkeys(h["run"] for h in a.history))
    assert runs == ["restart 1/2", "restart 2/2", "refine (2000 points)", "refine (8000 points)", "final (all points)"]
    assert np.array_equal(a.assignment, b.assignment) and np.array_equal(a.centroids, b.centroids)
    assert sorted(set(np.bincount(a.assignment).tolist())) == [1500]
    assert all(h["optimal"] for h in a.history) and a.optimal_assignment
    d = X - a.centroids[a.assignment]
    assert a.objective == pytest.approx(float((d.astype(np.float64) ** 2).sum()), rel=1e-5)
    with pytest.raises(ValueError, match="sample_growth"):
        spherical_kmeans(X, 6, sample_growth=1.01)
