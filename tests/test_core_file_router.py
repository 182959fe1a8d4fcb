"""Centroid file round trip and corruption, hot reload, leases and the queue tracker."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from eldr_sglang import (
    CentroidFileError,
    CentroidSet,
    NoHealthyWorker,
    Router,
    SignatureSpec,
    count_topk,
    distinct_per_layer,
    write_centroids,
)


def make(path, K=4, L=6, E=8, seed=0, tau=0.1, sel=(1, 2, 3, 4)):
    rng = np.random.default_rng(seed)
    w = np.zeros(L, np.float32)
    w[list(sel)] = rng.uniform(0.5, 1.5, len(sel))
    idf = rng.uniform(0.1, 2.0, (L, E)).astype(np.float32)
    cents = rng.random((K, len(sel) * E)).astype(np.float32)
    names = [f"http://decode-{i}:30000" for i in range(K)]
    prov = json.dumps({"trace_sha256": "ab" * 32, "seed": seed})
    write_centroids(str(path), cents, w, idf, tau=tau, worker_names=names, provenance_json=prov)
    return w, idf, cents / np.linalg.norm(cents, axis=1, keepdims=True), names, prov


def test_round_trip(tmp_path):
    p = tmp_path / "c.eldr"
    w, idf, cents, names, prov = make(p, tau=0.25)
    s = CentroidSet.open(str(p))
    assert (s.num_workers, s.num_layers, s.num_experts, s.dim) == (4, 6, 8, 32)
    assert s.worker_names == names and s.provenance_json == prov
    assert s.tau == pytest.approx(0.25)
    np.testing.assert_array_equal(s.layer_weights(), w)
    np.testing.assert_array_equal(s.idf(), idf)
    np.testing.assert_allclose(s.centroids(), cents, atol=1e-7)
    assert s.spec().selected_layers == [1, 2, 3, 4]
    assert not list(tmp_path.glob(".*.tmp")), "atomic write leaves no temp file"


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:40], "truncated"),
        (lambda b: b[:200] + bytes([b[200] ^ 1]) + b[201:], "checksum mismatch"),
        (lambda b: b[:8] + (7).to_bytes(4, "little") + b[12:], "unsupported format version 7"),
        (lambda b: b"NOTELDR!" + b[8:], "not an ELDR centroid file"),
        (lambda b: b + b"\0" * 8, "trailing data"),
    ],
)
def test_corruption_named(tmp_path, corrupt, message):
    good = tmp_path / "good.eldr"
    make(good)
    bad = tmp_path / "bad.eldr"
    bad.write_bytes(corrupt(good.read_bytes()))
    with pytest.raises(CentroidFileError, match=message):
        CentroidSet.open(str(bad))


def test_missing_file_and_k_mismatch(tmp_path):
    with pytest.raises(CentroidFileError, match="cannot read"):
        CentroidSet.open(str(tmp_path / "nope.eldr"))
    p = tmp_path / "c.eldr"
    make(p, K=4)
    with pytest.raises(CentroidFileError, match="K mismatch"):
        Router("eldr", num_workers=5, centroids=str(p))


def test_writer_rejects_bad_input_and_writes_nothing(tmp_path):
    p = tmp_path / "c.eldr"
    w = np.ones(3, np.float32)
    idf = np.ones((3, 4), np.float32)
    with pytest.raises(CentroidFileError, match="D=12"):
        write_centroids(str(p), np.ones((2, 11), np.float32), w, idf)
    bad = np.ones((2, 12), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(CentroidFileError, match="NaN"):
        write_centroids(str(p), bad, w, idf)
    with pytest.raises(CentroidFileError, match="worker names"):
        write_centroids(str(p), np.ones((2, 12), np.float32), w, idf, worker_names=["a"])
    assert not any(tmp_path.iterdir())


def test_reload_on_request_rejects_bad_file_and_keeps_old(tmp_path):
    p = tmp_path / "c.eldr"
    make(p, seed=1)
    r = Router("eldr", centroids=str(p), reload_interval_ms=0)
    before = r.centroid_set().centroids()
    assert r.centroid_generation == 1
    make(p, seed=2)
    assert r.reload() is True and r.centroid_generation == 2
    after = r.centroid_set().centroids()
    assert not np.allclose(before, after)
    # a corrupt replacement is rejected, the old centroids keep serving
    tmp = tmp_path / "x"
    tmp.write_bytes(p.read_bytes()[:-3])
    os.replace(tmp, p)
    with pytest.raises(CentroidFileError, match="truncated"):
        r.reload()
    assert r.centroid_generation == 2 and "truncated" in r.last_reload_error
    np.testing.assert_array_equal(r.centroid_set().centroids(), after)
    counts = np.ones((6, 8), np.uint32)
    assert r.route_dense(counts, explain=True).reason == "band"
    # a file with other dimensions is refused too
    make(p, E=9, seed=3)
    with pytest.raises(CentroidFileError, match="E=9"):
        r.reload()
    make(p, seed=4)
    r.reload()
    assert r.centroid_generation == 3 and r.last_reload_error is None


def test_automatic_reload_when_file_replaced(tmp_path):
    p = tmp_path / "c.eldr"
    make(p, seed=1)
    r = Router("eldr", centroids=str(p), reload_interval_ms=50)
    counts = np.ones((6, 8), np.uint32)
    make(p, seed=5)
    deadline = time.monotonic() + 5
    while r.centroid_generation == 1 and time.monotonic() < deadline:
        r.route_dense(counts)  # routes drive the rate-limited file check
        time.sleep(0.01)
    assert r.centroid_generation == 2
    assert r.route_dense(counts, explain=True).generation == 2


def test_lease_releases_exactly_once():
    r = Router("shortest_queue", num_workers=3)
    a = r.acquire(1, tokens=100)
    assert r.loads() == [0, 1, 0] and r.tokens() == [0, 100, 0]
    assert a.release() is True and a.release() is False
    with r.acquire(2, 5) as b:
        assert r.loads() == [0, 0, 1]
        with pytest.raises(KeyError):
            with r.acquire(0) as c:
                raise KeyError("request failed")
    assert b.released and c.released and r.loads() == [0, 0, 0] and r.tokens() == [0, 0, 0]
    d = r.acquire(0)
    del d  # dropped without release: the guard releases it
    assert r.loads() == [0, 0, 0]
    with pytest.raises(ValueError, match="out of range"):
        r.acquire(3)


def test_queue_stress_8_threads_1m_pairs():
    """acquire/release release the GIL, so the 8 threads really contend on the counters. Each
    thread holds at most one lease, so a sampler must never see a negative count or more than
    8 in flight; a lost or doubled update would also leave the counts off zero at the end."""
    r = Router("shortest_queue", num_workers=8)
    n_threads, pairs = 8, 1_000_000 // 8
    errors, bad_samples = [], []
    done = threading.Event()

    def work(t):
        try:
            acquire = r.acquire
            for i in range(pairs):
                lease = acquire((t + i) % 8, 3)
                lease.release()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def sample():
        while not done.is_set():
            loads, tokens = r.loads(), r.tokens()
            if min(loads) < 0 or sum(loads) > n_threads or min(tokens) < 0 or sum(tokens) > 3 * n_threads:
                bad_samples.append((loads, tokens))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    sampler = threading.Thread(target=sample)
    sampler.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done.set()
    sampler.join()
    assert not errors
    assert not bad_samples, bad_samples[:3]
    assert r.loads() == [0] * 8 and r.tokens() == [0] * 8


def test_decision_generation_is_that_of_the_centroids_used(tmp_path):
    """Three threads route while the main thread swaps in 1,500 files cycling through 30
    distinguishable ones. Generation g is file (g - 1) % 30, and the distances in a decision
    tell which file it used: every decision's generation must match them, and its reason
    must be the band rule. A generation read apart from its snapshot fails this."""
    n_files, n_reloads = 30, 1500
    counts = (np.arange(48, dtype=np.uint32).reshape(6, 8) % 5) + 1
    staged, expect = [], []
    for i in range(n_files):
        f = tmp_path / f"s{i}.eldr"
        make(f, seed=100 + i)
        staged.append(f)
        expect.append(Router("eldr", centroids=str(f), reload_interval_ms=0).route_dense(counts, explain=True).distances)
    assert all(expect[i] != expect[i - 1] for i in range(1, n_files)) and expect[0] != expect[-1]
    p, tmp = tmp_path / "c.eldr", tmp_path / "next.eldr"
    os.link(staged[0], p)
    r = Router("eldr", centroids=str(p), reload_interval_ms=0)
    stop = threading.Event()
    errors, wrong, routed = [], [], [0] * 3

    def work(t):
        try:
            while not stop.is_set():
                d = r.route_dense(counts, explain=True)
                if d.reason != "band" or d.distances != expect[(d.generation - 1) % n_files]:
                    wrong.append((d.generation, d.reason))
                routed[t] += 1
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    try:
        for g in range(2, n_reloads + 1):
            os.link(staged[(g - 1) % n_files], tmp)
            os.replace(tmp, p)
            assert r.reload() is True
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[:3]
    assert r.centroid_generation == n_reloads and min(routed) > 0
    assert not wrong, f"{len(wrong)} of {sum(routed)} decisions disagree with their generation: {wrong[:5]}"


def test_sizes_beyond_the_limits_raise_value_error_not_abort():
    ids = np.zeros((2, 3, 2), np.int32)
    with pytest.raises(ValueError, match="num_experts = 1099511627776 is out of range"):
        count_topk(ids, 1 << 40)
    with pytest.raises(ValueError, match="num_experts = 1099511627776 is out of range"):
        distinct_per_layer(ids, 1 << 40)
    with pytest.raises(ValueError, match="num_experts = 0"):
        count_topk(ids, 0)
    # each dimension within bounds, the [L, E] table not: 2^20 layers x 2^20 experts
    wide = np.zeros((0, 1 << 20, 1), np.uint8)
    with pytest.raises(ValueError, match="elements exceed the limit"):
        count_topk(wide, 1 << 20)
    with pytest.raises(ValueError, match="num_workers = 1000000000000 is out of range"):
        Router("random", num_workers=10**12)
    with pytest.raises(ValueError, match="num_workers = 0"):
        Router("random", num_workers=0)
    # a batch of signatures larger than one buffer may hold: 1,000 requests x D = 2^20
    spec = SignatureSpec(np.ones(1, np.float32), np.ones((1, 1 << 20), np.float32))
    with pytest.raises(ValueError, match="elements exceed the limit"):
        spec.batch_from_topk(np.zeros((0, 1, 1), np.int32), np.zeros(1001, np.int64))


def test_non_regular_centroid_paths_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "c.eldr"
    os.mkfifo(fifo)
    # Opening a FIFO with no writer blocks forever: without the check this test hangs.
    with pytest.raises(CentroidFileError, match=r"not a regular file \(a FIFO\)"):
        CentroidSet.open(str(fifo))
    with pytest.raises(CentroidFileError, match="not a regular file"):
        Router("eldr", centroids=str(fifo))
    with pytest.raises(CentroidFileError, match=r"not a regular file \(a directory\)"):
        CentroidSet.open(str(tmp_path))
    # A router whose file is replaced by a FIFO keeps serving and reports it.
    good = tmp_path / "good.eldr"
    make(good)
    r = Router("eldr", centroids=str(good), reload_interval_ms=0)
    os.replace(fifo, good)
    with pytest.raises(CentroidFileError, match="FIFO"):
        r.reload()
    assert r.centroid_generation == 1 and "FIFO" in r.last_reload_error
    assert r.route_dense(np.ones((6, 8), np.uint32), explain=True).reason == "band"


def test_unhealthy_never_chosen_and_load_reports_blend():
    for policy in ("random", "round_robin", "shortest_queue", "power_of_two", "eldr"):
        r = Router(policy, num_workers=4, seed=3)
        r.set_healthy(0, False)
        r.set_healthy(2, False)
        picks = {r.route_signature(None) for _ in range(200)}
        assert picks <= {1, 3}, policy
        for w in range(4):
            r.set_healthy(w, False)
        with pytest.raises(NoHealthyWorker):
            r.route_signature(None)
    r = Router("shortest_queue", num_workers=2)
    r.report_load(0, running=7)  # another router replica's requests on worker 0
    assert r.loads() == [7, 0] and r.route_signature(None) == 1


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="unknown policy"):
        Router("fastest", num_workers=2)
    with pytest.raises(ValueError, match="num_workers"):
        Router("random")
    with pytest.raises(ValueError, match="tau"):
        Router("random", num_workers=2, tau=-1.0)



def test_unsupported_dtype_is_a_type_error(tmp_path):
    p = tmp_path / "c.eldr"
    make(p)
    with pytest.raises(TypeError, match="unsupported input complex64"):
        Router("eldr", centroids=str(p)).route_dense(np.ones((6, 8), np.complex64))


def test_bounded_loads_keep_bursts_off_one_worker(tmp_path):
    p = tmp_path / "c.eldr"
    make(p, K=4)
    counts = np.ones((6, 8), np.uint32)  # a burst: every request has the same signature
    plain = Router("eldr", centroids=str(p), tau=0.0)
    bounded = Router("eldr", centroids=str(p), tau=0.0, load_factor=0.25)
    assert bounded.load_factor == 0.25 and plain.load_factor is None
    held = {"plain": [], "bounded": []}
    for _ in range(40):
        held["plain"].append(plain.acquire(plain.route_dense(counts)))
        held["bounded"].append(bounded.acquire(bounded.route_dense(counts)))
    assert max(plain.loads()) == 40  # the paper's rule at tau=0: all on the nearest worker
    loads = bounded.loads()
    assert sum(loads) == 40 and max(loads) <= int(np.ceil(1.25 * 40 / 4))
    bounded.load_factor = None
    assert bounded.load_factor is None
    with pytest.raises(ValueError, match="load_factor"):
        bounded.load_factor = -1.0
