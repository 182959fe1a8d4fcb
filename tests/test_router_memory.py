"""What a request body costs the router while it is in flight (issue 25): the prompt is held
once per request, shared by the prefill and decode bodies and every re-send. Before, the
parsed body, the prefill body and the decode body were each a full copy: about 3 MB of router
memory per MB of body under early binding, 4 under late binding.

Measured as the router process's RSS with 20 requests of 2 MB held open (every decode hung,
so each request keeps its bodies until its client gives up). RSS also holds what the
allocator keeps of freed parse buffers, so the bound is 2.5 MB per MB, not 1: it separates
one copy plus allocator slack (1.6 to 2 measured) from the three or four copies before."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")

from eldr_sglang.testing.pd_cluster import make_trace_files, start_cluster, start_router  # noqa: E402

N, MB = 20, 2


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _held_rss(base: str, pid: int) -> tuple[float, float, list]:
    body = json.dumps({"text": "x" * (MB << 20), "sampling_params": {"max_new_tokens": 4}, "stream": True})
    statuses: list = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one():
            try:
                async with s.post(base + "/generate", data=body, headers={"content-type": "application/json"}) as r:
                    statuses.append(r.status)
                    await r.read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                statuses.append(repr(exc))

        r0 = _rss_mb(pid)
        tasks = [asyncio.ensure_future(one()) for _ in range(N)]
        peak = r0
        for _ in range(24):  # 6 s: every body is in by then, and every decode is hung
            await asyncio.sleep(0.25)
            peak = max(peak, _rss_mb(pid))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return r0, peak, statuses


@pytest.mark.parametrize("policy", ["round_robin", "eldr"])
def test_a_request_body_is_held_once(tmp_path, policy):
    if not __import__("os").path.exists("/proc/self/status"):
        pytest.skip("needs /proc")
    _, tpath, cpath = make_trace_files(tmp_path, requests=20, seed=1, workers=2)
    cluster, urls = start_cluster(tpath, tmp_path, prefill=1, decode=2,
                                  extra=["--fault", "decode:0=hang", "--fault", "decode:1=hang"])
    args = ["--disagg-router", policy, "--health-check-interval-secs", "0", "--load-monitor-interval", "0",
            "--max-payload-size", str((MB + 1) << 20), "--first-byte-timeout-secs", "120",
            "--decode-progress-timeout-secs", "120"]
    if policy == "eldr":
        args += ["--eldr-centroids", str(cpath)]
    router, base = start_router(urls, tmp_path, args)
    try:
        r0, peak, statuses = asyncio.run(_held_rss(base, router.p.pid))
    finally:
        router.stop()
        cluster.stop()
    assert statuses == [], statuses  # every request was still held open when measured
    per_mb = (peak - r0) / (N * MB)
    assert per_mb >= 0.9, f"{per_mb:.2f} MB per MB: the bodies were not held (is every decode hung?)"
    assert per_mb <= 2.5, f"{policy}: {per_mb:.2f} MB of router memory per MB of request body in flight"
