"""The router's latency metrics (eldr_router_ttft/tpot/itl/e2e/prefill_seconds) against the
client's own figures on the same run: streamed requests through a router in front of
emulated workers on loopback, timed by the client as `sglang.benchmark.serving` times them
(TTFT: request sent to first chunk; TPOT: (last chunk - first chunk) / (tokens - 1)).

The router's clock starts when the request arrives and stops when a chunk leaves for the
client, so on loopback its figures sit within the client's network and parsing overhead of
the client's: never above them by more than clock noise, never far below."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import make_trace_files, metric, start_cluster, start_router  # noqa: E402

N, TOKENS = 24, 12


async def _client(base: str) -> list[dict]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int):
            body = {"text": f"prompt {i} " * 8, "sampling_params": {"max_new_tokens": TOKENS}, "stream": True}
            t0 = time.perf_counter()
            stamps = []
            async with s.post(base + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        stamps.append(time.perf_counter())
            tokens = len(stamps)
            out.append({"ttft": stamps[0] - t0, "e2e": time.perf_counter() - t0, "tokens": tokens,
                        "tpot": (stamps[-1] - stamps[0]) / (tokens - 1)})

        # a few at a time, so that batches form but the client's own loop is not the bottleneck
        for k in range(0, N, 4):
            await asyncio.gather(*(one(i) for i in range(k, k + 4)))
    return out


def _hist(text: str, name: str, **labels) -> tuple[float, float]:
    return metric(text, name + "_sum", **labels), metric(text, name + "_count", **labels)


@pytest.mark.parametrize("policy", ["eldr", "round_robin"])
def test_router_latency_metrics_agree_with_the_client(tmp_path, policy):
    _, tpath, cpath = make_trace_files(tmp_path, requests=40, seed=2, workers=2)
    cluster, urls = start_cluster(tpath, tmp_path, prefill=1, decode=2, time_scale=0.5)
    args = ["--disagg-router", policy] + (["--eldr-centroids", str(cpath)] if policy == "eldr" else [])
    router, base = start_router(urls, tmp_path, args)
    try:
        client = asyncio.run(_client(base))
        # one non-streamed request: end to end and tokens only
        req = urllib.request.Request(base + "/generate", data=json.dumps(
            {"text": "plain", "sampling_params": {"max_new_tokens": TOKENS}}).encode(), headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        time.sleep(0.5)  # the prefill legs' ends trail the answers
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        router.stop()
        cluster.stop()
    assert all(c["tokens"] == TOKENS for c in client)
    lab = dict(policy=policy, endpoint="generate")
    ttft_sum, ttft_n = _hist(text, "eldr_router_ttft_seconds", **lab)
    tpot_sum, tpot_n = _hist(text, "eldr_router_tpot_seconds", **lab)
    itl_sum, itl_n = _hist(text, "eldr_router_itl_seconds", **lab)
    e2e_sum, e2e_n = _hist(text, "eldr_router_e2e_seconds", **lab)
    pre_sum, pre_n = _hist(text, "eldr_router_prefill_seconds", **lab)
    assert (ttft_n, tpot_n, e2e_n, pre_n) == (N, N, N + 1, N + 1)
    assert itl_n == N * (TOKENS - 1)
    assert metric(text, "eldr_router_output_tokens_total", **lab) == (N + 1) * TOKENS
    # every series names a decode worker the router has, and only those
    workers = set(re.findall(r'eldr_router_ttft_seconds_count\{[^}]*worker="(\d+)"', text))
    assert workers and workers <= {"0", "1"}

    mean = lambda k: sum(c[k] for c in client) / N  # noqa: E731
    c_ttft, c_tpot, c_e2e = mean("ttft"), mean("tpot"), mean("e2e")
    r_ttft, r_tpot = ttft_sum / N, tpot_sum / N
    r_e2e_stream = (e2e_sum - 0) / (N + 1)  # includes the non-streamed one: compared loosely below
    print(f"{policy}: TTFT client {c_ttft * 1e3:.2f} router {r_ttft * 1e3:.2f} ms; TPOT client {c_tpot * 1e3:.3f} "
          f"router {r_tpot * 1e3:.3f} ms; ITL mean {itl_sum / itl_n * 1e3:.3f} ms; E2E client {c_e2e * 1e3:.1f} router "
          f"{r_e2e_stream * 1e3:.1f} ms; prefill leg {pre_sum / pre_n * 1e3:.1f} ms")
    # the router's TTFT is the client's less its network overhead: below it, by a few ms at most on loopback
    assert r_ttft <= c_ttft + 0.001 and c_ttft - r_ttft < 0.020, (r_ttft, c_ttft)
    # TPOT: the same tokens timed at both ends of a loopback socket
    assert abs(r_tpot - c_tpot) <= max(0.1 * c_tpot, 0.0005), (r_tpot, c_tpot)
    # ITL sums to (last - first) per request: its mean is TPOT's
    assert abs(itl_sum - tpot_sum * (TOKENS - 1)) <= 1e-6 * max(1.0, itl_sum) + 1e-3
    assert 0 < pre_sum / pre_n < c_e2e
