"""Router replicas in front of one emulated PD cluster (issue 32, part 3): two routers, each
with its own in-flight view, serve the same workers at once.

- Clients split over both replicas lose no request, every worker serves, and both replicas'
  in-flight counts return to zero.
- A replica killed mid-load (SIGKILL: no drain) costs none of the other replica's requests,
  and the workers finish or drop what it left, so nothing stays counted anywhere.
- A replica restarted after that serves at once, and reads the workers' loads from its
  first polls.

Counts only, never times. Routing quality with several replicas is measured, not asserted,
in benchmarks/replicas_study.py (simulated) and docs/operations.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import signal
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import get_json  # noqa: E402
from test_router_faults import _request, eldr_router, run_requests, wait_idle  # noqa: E402

TIME_SCALE = 0.05
# the emulated cluster and trace of this suite (tests/conftest.py starts them)
TRACE = dict(requests=60, seed=8, workers=3)
CLUSTER = dict(prefill=2, decode=3)
POLICY = "locality"  # the default's policy: it reads loads, so it is the one replicas can mislead


def _failed(results) -> list:
    return [r for r in results if not (r["status"] == 200 and r["complete"])]


def _running(cluster) -> list[int]:
    return [get_json(u + "/emulator/stats")["running"] for u in cluster["decode"]]


def _load_dying(base: str, n: int, concurrency: int, seed: int) -> list[dict]:
    """run_requests for a replica that dies under it: a broken connection is a failed request."""
    rng = random.Random(seed)

    async def go():
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as s:
            async def one(i):
                async with sem:
                    try:
                        return await _request(s, base, i, rng.random() < 0.5, rng)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        return {"status": type(exc).__name__, "complete": False, "worker": -1, "body": b""}
            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(go())


def _both(a: str, b: str, n: int, concurrency: int):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(run_requests, a, n, concurrency, 1, 0.5)
        fb = pool.submit(run_requests, b, n, concurrency, 2, 0.5)
        return fa.result(), fb.result()


def test_two_router_replicas_split_clients_and_lose_nothing(cluster, trace_files, workdir):
    ra, a = eldr_router(cluster, trace_files, workdir, [], POLICY)
    rb, b = eldr_router(cluster, trace_files, workdir, [], POLICY)
    try:
        res_a, res_b = _both(a, b, 40, 4)
        assert not _failed(res_a) and not _failed(res_b), [(r["status"], r["body"][:200]) for r in _failed(res_a) + _failed(res_b)][:5]
        used = {r["worker"] for r in res_a} | {r["worker"] for r in res_b}
        assert used == {0, 1, 2}, used
        sa, sb = wait_idle(a), wait_idle(b)
        assert sa["decode_inflight"] == [0, 0, 0] and sb["decode_inflight"] == [0, 0, 0]
    finally:
        ra.stop()
        rb.stop()


def test_a_killed_router_replica_costs_none_of_the_other_replicas_requests(cluster, trace_files, workdir):
    ra, a = eldr_router(cluster, trace_files, workdir, [], POLICY)
    rb, b = eldr_router(cluster, trace_files, workdir, [], POLICY)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            fa = pool.submit(_load_dying, a, 600, 6, 3)  # outlasts b's load
            fb = pool.submit(run_requests, b, 60, 6, 4, 0.5)
            deadline = time.monotonic() + 20
            while sum(get_json(b + "/eldr/status")["decode_inflight"]) == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            ra.p.send_signal(signal.SIGKILL)  # both replicas mid-load
            res_b = fb.result()
            res_a = fa.result()
        assert not _failed(res_b), [(r["status"], r["body"][:200]) for r in _failed(res_b)][:5]
        assert _failed(res_a), "the killed replica's own clients saw it go (else it died after its load)"
        # what the killed replica left on the workers ends; the live one's counts return to 0
        deadline = time.monotonic() + 30
        while any(_running(cluster)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(cluster) == [0, 0, 0]
        assert wait_idle(b)["decode_inflight"] == [0, 0, 0]

        # a replica restarted in its place serves at once and reads the workers' loads
        ra2, a2 = eldr_router(cluster, trace_files, workdir, [], POLICY)
        try:
            res = run_requests(a2, 12, 4, 5, 0.5)
            assert not _failed(res), [(r["status"], r["body"][:200]) for r in _failed(res)][:5]
            deadline = time.monotonic() + 10
            while None in get_json(a2 + "/eldr/status")["decode_reported"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert None not in get_json(a2 + "/eldr/status")["decode_reported"]
        finally:
            ra2.stop()
    finally:
        if ra.p.poll() is None:
            ra.stop()
        else:
            ra.fh.close()
        rb.stop()
