"""The fit report's statistics against brute force: cosine statistics (computed in row blocks,
dense and sparse), distinct experts per decode step, and per-request decode profiles."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

pytest.importorskip("eldr_sglang._core", reason="the Rust extension is not built")

from eldr_sglang.offline import report as rpt  # noqa: E402
from eldr_sglang.offline.signatures import decode_profiles  # noqa: E402
from eldr_sglang.traces import synth  # noqa: E402


@pytest.mark.parametrize("sparse", [False, True])
def test_cosine_stats_equal_brute_force(sparse):
    rng = np.random.default_rng(3)
    N, D, K = rpt._BLOCK_ROWS + 905, 12, 5  # more than one row block
    S = rng.random((N, D)) * (rng.random((N, D)) < 0.6)
    S[S.sum(axis=1) == 0, 0] = 1.0
    S = (S / np.linalg.norm(S, axis=1, keepdims=True)).astype(np.float32)
    assign = rng.integers(0, K, N)
    C = rng.random((K, D))
    C = (C / np.linalg.norm(C, axis=1, keepdims=True)).astype(np.float32)
    got = rpt.cosine_stats(sp.csr_matrix(S) if sparse else S, assign, C)
    G = S.astype(np.float64) @ S.astype(np.float64).T
    same = assign[:, None] == assign[None, :]
    off = ~np.eye(N, dtype=bool)
    assert got["mean_intra_cluster_cosine"] == pytest.approx(G[same & off].mean(), rel=1e-9)
    assert got["mean_inter_cluster_cosine"] == pytest.approx(G[~same].mean(), rel=1e-9)
    own = (S.astype(np.float64) * C[assign].astype(np.float64)).sum(axis=1).mean()
    assert got["mean_point_centroid_cosine"] == pytest.approx(own, rel=1e-9)
    cc = C.astype(np.float64) @ C.astype(np.float64).T
    assert got["mean_centroid_centroid_cosine"] == pytest.approx(cc[~np.eye(K, dtype=bool)].mean(), rel=1e-12)


def test_distinct_per_step_equals_unique_counts():
    rng = np.random.default_rng(8)
    steps = rng.integers(0, 16, (7, 5, 3, 2))  # [S, B, L, k], repeats within a step and layer
    got = rpt._distinct_per_step(steps, 16)
    want = np.array([[len(np.unique(steps[s, :, l, :])) for l in range(3)] for s in range(7)])
    np.testing.assert_array_equal(got, want)


def test_decode_profiles_equal_numpy_counts():
    t = synth.generate("gpt-oss-20b", requests=40, seed=2, prompt_len=(3, 9), output_len=(0, 7))
    req = np.array([5, 0, 39, 12, 3])
    prof, has = decode_profiles(t, req, chunk_tokens=16)  # several chunks
    for j, r in enumerate(req):
        ids = t.decode_ids(r).astype(np.int64)
        assert has[j] == (len(ids) > 0)
        want = np.zeros((t.num_layers, t.num_experts))
        for l in range(t.num_layers):
            want[l] = np.bincount(ids[:, l, :].ravel(), minlength=t.num_experts) / max(1, len(ids) * t.top_k)
        np.testing.assert_array_equal(prof[j], want.astype(np.float32))
