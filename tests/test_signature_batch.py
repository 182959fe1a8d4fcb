"""`SignatureSpec.from_sparse_batch` (one call per trace v2 chunk) against `from_sparse`, the
single-request path: the same bits for every row, in every index/count dtype, with and
without `out`; empty and masked-only rows are invalid, bad rows and bad CSR arrays are errors."""

from __future__ import annotations

import numpy as np
import pytest

core = pytest.importorskip("eldr_sglang._core", reason="the Rust extension is not built")

L, E = 6, 16


def _spec():
    rng = np.random.default_rng(5)
    w = np.array([0.0, 0.5, 1.0, 1.0, 2.0, 0.0], dtype=np.float32)  # layers 0 and 5 masked
    idf = rng.uniform(0.2, 3.0, (L, E)).astype(np.float32)
    idf[2, 3] = 0.0  # an expert every request uses, under plain IDF
    return core.SignatureSpec(w, idf)


def _rows(rng, n=300):
    """CSR arrays of n rows: sorted rows, unsorted rows with repeats, empty rows, rows on
    masked layers only, and single entries."""
    index, count, indptr = [], [], [0]
    for r in range(n):
        kind = r % 5
        if kind == 0:
            idx = np.sort(rng.choice(L * E, rng.integers(1, 60), replace=False))
        elif kind == 1:
            idx = rng.integers(0, L * E, rng.integers(1, 40))  # unsorted, repeats add up
        elif kind == 2:
            idx = np.zeros(0, dtype=np.int64)
        elif kind == 3:
            idx = np.concatenate([rng.choice(E, 3, replace=False), 5 * E + rng.choice(E, 2, replace=False)])
        else:
            idx = rng.integers(0, L * E, 1)
        index.append(idx)
        count.append(rng.integers(1, 900, len(idx)))
        indptr.append(indptr[-1] + len(idx))
    return np.array(indptr, dtype=np.int64), np.concatenate(index), np.concatenate(count)


def _one_by_one(spec, indptr, index, count):
    out = np.zeros((len(indptr) - 1, spec.dim), dtype=np.float32)
    valid = np.zeros(len(indptr) - 1, dtype=bool)
    for r in range(len(indptr) - 1):
        a, b = indptr[r], indptr[r + 1]
        try:
            out[r] = spec.from_sparse(index[a:b], count[a:b])
            valid[r] = True
        except core.NoSignature as exc:
            assert exc.reason == "empty"
    return out, valid


@pytest.mark.parametrize("index_dtype,count_dtype", [(np.uint16, np.uint16), (np.uint32, np.uint32),
                                                     (np.int64, np.float32), (np.int32, np.uint16)])
def test_batch_rows_are_the_single_request_bits(index_dtype, count_dtype):
    spec = _spec()
    indptr, index, count = _rows(np.random.default_rng(11))
    index, count = index.astype(index_dtype), count.astype(count_dtype)
    want, want_valid = _one_by_one(spec, indptr, index.astype(np.int64), count.astype(np.uint32))
    got, valid = spec.from_sparse_batch(indptr, index, count)
    assert got.dtype == np.float32 and got.shape == (len(indptr) - 1, spec.dim)
    np.testing.assert_array_equal(valid, want_valid)
    assert not valid[2::5].any() and not valid[3::5].any() and valid[0::5].all()  # empty / masked-only / normal
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit
    # written in place into rows of a larger (dirty) array: every value is overwritten
    big = np.full((len(indptr) + 9, spec.dim), np.nan, dtype=np.float32)
    sigs, valid2 = spec.from_sparse_batch(indptr, index, count, out=big[4 : 4 + len(indptr) - 1])
    assert np.shares_memory(sigs, big)
    np.testing.assert_array_equal(big[4 : 4 + len(indptr) - 1].view(np.uint32), want.view(np.uint32))
    assert np.isnan(big[:4]).all() and np.isnan(big[4 + len(indptr) - 1 :]).all()
    np.testing.assert_array_equal(valid2, want_valid)


def test_batch_refuses_bad_input_with_clear_errors():
    spec = _spec()
    ok = (np.array([0, 1, 2], dtype=np.int64), np.array([20, 30], dtype=np.uint16), np.array([1, 1], dtype=np.uint16))
    with pytest.raises(core.NoSignature, match="row 1: no usable signature: out_of_range") as exc:
        spec.from_sparse_batch(ok[0], np.array([20, L * E], dtype=np.uint32), ok[2])
    assert exc.value.reason == "out_of_range"
    with pytest.raises(core.NoSignature, match="row 0: .*negative"):
        spec.from_sparse_batch(ok[0], ok[1], np.array([-1, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="indptr"):
        spec.from_sparse_batch(np.array([0, 2, 1], dtype=np.int64), *ok[1:])
    with pytest.raises(ValueError, match="indptr"):
        spec.from_sparse_batch(np.array([0, 1, 3], dtype=np.int64), *ok[1:])
    with pytest.raises(ValueError, match="index has 2 entries and counts 1"):
        spec.from_sparse_batch(ok[0], ok[1], ok[2][:1])
    with pytest.raises(ValueError, match=r"out must be \[2, 64\]"):
        spec.from_sparse_batch(*ok, out=np.zeros((3, spec.dim), dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        spec.from_sparse_batch(*ok, out=np.zeros((spec.dim, 2), dtype=np.float32).T)
    with pytest.raises(TypeError, match="counts"):
        spec.from_sparse_batch(ok[0], ok[1], np.array(["a", "b"]))
    sigs, valid = spec.from_sparse_batch(*ok)
    assert valid.all() and sigs.shape == (2, spec.dim)
