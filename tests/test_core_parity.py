"""Rust hot path against the numpy reference: signatures and band decisions."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang import NoSignature, Router, SignatureSpec, count_topk, write_centroids
from eldr_sglang.testing import reference as ref


def rel_close(a, b, rtol=1e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) <= rtol * max(np.max(np.abs(b)), 1e-30)


def random_spec(rng, L, E, masked=3):
    w = rng.uniform(0.2, 2.0, L).astype(np.float32)
    w[rng.choice(L, masked, replace=False)] = 0.0
    idf = rng.uniform(0.0, 3.0, (L, E)).astype(np.float32)
    return w, idf


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.float32, np.int64])
@pytest.mark.parametrize("shape", [(32, 8), (24, 32), (58, 256)])
def test_dense_signature_matches_reference(dtype, shape):
    rng = np.random.default_rng(hash((shape, np.dtype(dtype).name)) % 2**32)
    L, E = shape
    w, idf = random_spec(rng, L, E)
    spec = SignatureSpec(w, idf)
    for _ in range(20):
        counts = (rng.poisson(2.0, (L, E)) * (rng.random((L, E)) < 0.3)).astype(dtype)
        want = ref.signature(counts, w, idf)
        if want is None:
            with pytest.raises(NoSignature):
                spec.from_dense(counts)
            continue
        got = spec.from_dense(counts)
        assert got.dtype == np.float32 and got.shape == want.shape == (spec.dim,)
        assert rel_close(got, want)
        assert abs(np.linalg.norm(got.astype(np.float64)) - 1.0) < 1e-6


def test_sparse_and_topk_agree_with_dense():
    rng = np.random.default_rng(7)
    L, E, k = 24, 32, 4
    w, idf = random_spec(rng, L, E)
    spec = SignatureSpec(w, idf)
    ids = np.stack([rng.choice(E, (L, k), replace=True) for _ in range(200)]).astype(np.int16)
    # top-k picks are distinct per (token, layer) in real routing; dedupe is not the
    # normalizer's job, so the counts below count repeats the same way in both paths.
    counts = count_topk(ids, E)
    assert counts.shape == (L, E) and counts.sum() == ids.size
    np.testing.assert_array_equal(counts, np.apply_along_axis(lambda r: np.bincount(r, minlength=E), 1, ids.transpose(1, 0, 2).reshape(L, -1)))
    dense = spec.from_dense(counts)
    nz = np.flatnonzero(counts)
    perm = rng.permutation(nz.size)  # unsorted sparse input must work too
    sparse = spec.from_sparse(nz[perm].astype(np.int64), counts.ravel()[nz][perm].astype(np.float32))
    topk = spec.from_topk(ids)
    assert rel_close(sparse, dense) and rel_close(topk, dense)
    assert rel_close(dense, ref.signature(counts, w, idf))


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda c: c * 0, "empty"),
        (lambda c: np.where(np.arange(c.size).reshape(c.shape) == 5, np.nan, c), "non_finite"),
        (lambda c: np.where(np.arange(c.size).reshape(c.shape) == 5, -1.0, c), "negative"),
        (lambda c: c[:, :-1], "shape"),
    ],
)
def test_unusable_counts_raise_typed_reason(bad, reason):
    rng = np.random.default_rng(1)
    w, idf = random_spec(rng, 8, 4, masked=1)
    spec = SignatureSpec(w, idf)
    counts = bad(rng.integers(1, 5, (8, 4)).astype(np.float32))
    with pytest.raises(NoSignature) as exc:
        spec.from_dense(np.ascontiguousarray(counts))
    assert exc.value.reason == reason


def test_signature_on_real_trace_matches_reference(gptoss_trace):
    t = gptoss_trace
    rng = np.random.default_rng(0)
    w = np.zeros(t.num_layers, np.float32)
    w[6:18] = 1.0
    df = np.zeros((t.num_layers, t.num_experts))
    for r in range(t.num_requests):
        df += count_topk(t.prefill_ids(r), t.num_experts) > 0
    idf = np.log((t.num_requests + 1) / (df + 1)).astype(np.float32) + 1.0
    spec = SignatureSpec(w, idf)
    sigs, valid = spec.batch_from_topk(t.expert_ids, t.req_offsets, t.prefill_len.astype(np.int64))
    assert sigs.shape == (t.num_requests, spec.dim)
    checked = 0
    for r in rng.choice(t.num_requests, 100, replace=False):
        want = ref.signature(count_topk(t.prefill_ids(r), t.num_experts), w, idf)
        assert valid[r] == (want is not None)
        if want is not None:
            assert rel_close(sigs[r], want)
            assert rel_close(spec.from_topk(t.prefill_ids(r)), want)
            checked += 1
    assert checked > 50


def _centroid_file(tmp_path, rng, K, L, E):
    w, idf = random_spec(rng, L, E, masked=1)
    D = int((w > 0).sum()) * E
    cents = rng.random((K, D)).astype(np.float32) ** 4  # peaky, like real cluster profiles
    path = tmp_path / "c.eldr"
    write_centroids(str(path), cents, w, idf, tau=0.1)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    return path, w, idf, cents


@pytest.mark.parametrize("tau", [0.0, 0.02, 0.1, 2.0])  # 2: the widest (cosine distances lie in [0, 2])
def test_band_decisions_match_reference(tmp_path, tau):
    rng = np.random.default_rng(int(tau * 100) + 3)
    K, L, E = 8, 12, 16
    path, w, idf, cents = _centroid_file(tmp_path, rng, K, L, E)
    router = Router("eldr", centroids=str(path), tau=tau)
    leases = []
    for i in range(300):
        counts = (rng.poisson(1.5, (L, E)) * (rng.random((L, E)) < 0.4)).astype(np.uint32)
        sig = ref.signature(counts, w, idf)
        healthy = router.healthy()
        want, band, d = ref.band_route(sig, cents, router.loads(), healthy, tau)
        got = router.route_dense(counts, explain=True)
        assert got.worker == want
        if sig is not None:
            assert got.reason == "band" and got.band == band
            np.testing.assert_allclose(got.distances, d, atol=1e-6)
        else:
            assert got.reason.startswith("no_signature")
        leases.append(router.acquire(got.worker))
        if i % 3 == 0:  # let queues go up and down
            leases.pop(rng.integers(len(leases))).release()
        if i == 150:
            router.set_healthy(int(np.argmin(d)) if d is not None else 0, False)
    for lease in leases:
        lease.release()
    assert router.loads() == [0] * K


def test_band_sizes_match_the_reference_band():
    from eldr_sglang import _core

    rng = np.random.default_rng(5)
    d = rng.uniform(0.0, 1.0, size=(300, 8))
    d[:40, 1] = d[:40, 0] + 0.1  # exactly on the bound for some rows: inclusive
    for tau in (0.0, 0.05, 0.2):
        got = _core.band_sizes(d, tau)
        want = [int((row <= row.min() + tau).sum()) for row in d]  # the band of testing.reference.band_route, all healthy
        assert got.tolist() == want
    assert _core.band_sizes(np.asfortranarray(d), 0.1).tolist() == _core.band_sizes(d, 0.1).tolist()
    with pytest.raises(ValueError, match="tau"):
        _core.band_sizes(d, -1.0)
