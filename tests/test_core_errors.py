"""Each eldr-core error type reaches Python as its own exception class (rust/python/src/lib.rs maps
them per variant; nothing reads a message to choose one). The class is checked exactly, so an
error that slid into another class, or into a bare ValueError, fails here."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang import _core


def _classes(exc: BaseException) -> type:
    return type(exc)


@pytest.fixture()
def cfile(tmp_path):
    p = tmp_path / "c.eldr"
    _core.write_centroids(str(p), np.eye(2, 8, dtype=np.float32), np.ones(2, np.float32), np.ones((2, 4), np.float32))
    return p


CASES = {
    # (what raises, exact class, message fragment)
    "centroid file": (lambda tmp: _core.CentroidSet.open(str(tmp / "missing.eldr")), _core.CentroidFileError, "cannot read"),
    "payload": (lambda tmp: _core.decode_payload(b"{not json"), _core.PayloadError, "not JSON"),
    "no signature": (lambda tmp: _core.SignatureSpec(np.ones(2, np.float32), np.ones((2, 4), np.float32)).from_dense(
        np.zeros((2, 4), np.uint32)), _core.NoSignature, "empty"),
    "profile": (lambda tmp: _core.ExpertProfile(1, 8, np.array([9]), np.array([1.0]), 1), _core.ProfileError, "out of range"),
    "unknown policy": (lambda tmp: _core.Router(policy="fastest", num_workers=2), ValueError, "fastest"),
    "no worker count": (lambda tmp: _core.Router(policy="random"), ValueError, "num_workers"),
    "size": (lambda tmp: _core.Router(policy="random", num_workers=1 << 21), ValueError, "out of range"),
    "param": (lambda tmp: _core.Router(policy="random", num_workers=2, tau=float("nan")), ValueError, "tau"),
    "spec": (lambda tmp: _core.SignatureSpec(np.zeros(2, np.float32), np.ones((2, 4), np.float32)), ValueError, "no layer"),
    "expert id": (lambda tmp: _core.count_topk(np.array([[[9]]], np.int32), 4), ValueError, "expert id 9 at layer 0"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_core_error_has_its_class(name, tmp_path):
    fn, cls, fragment = CASES[name]
    with pytest.raises(Exception) as info:
        fn(tmp_path)
    assert _classes(info.value) is cls, (name, type(info.value), info.value)
    assert fragment in str(info.value)


def test_no_signature_carries_its_reason_and_route_errors_are_no_healthy_worker(cfile):
    spec = _core.SignatureSpec(np.ones(2, np.float32), np.ones((2, 4), np.float32))
    with pytest.raises(_core.NoSignature) as info:
        spec.from_dense(np.full((2, 4), np.nan, np.float32))
    assert info.value.reason == "non_finite"
    r = _core.Router(policy="eldr", centroids=str(cfile))
    for w in range(r.num_workers):
        r.set_healthy(w, False)
    with pytest.raises(_core.NoHealthyWorker):
        r.route_fallback("missing")


def test_a_stale_profile_is_a_profile_error(cfile):
    r = _core.Router(policy="locality", centroids=str(cfile))
    lease = r.acquire(0, profile=r.profile_dense(np.ones((2, 4), np.uint32), 4))  # the file's layout
    other = _core.ExpertProfile(3, 4, np.array([0]), np.array([1.0]), 1)  # another layer selection
    with pytest.raises(_core.ProfileError, match="differs"):
        r.acquire(1, profile=other)
    assert r.inflight() == [1, 0]  # the refused one was not counted
    lease.release()


def test_the_classes_keep_their_bases():
    for cls in (_core.CentroidFileError, _core.NoSignature, _core.PayloadError, _core.ProfileError):
        assert issubclass(cls, ValueError)
    assert issubclass(_core.NoHealthyWorker, RuntimeError)
