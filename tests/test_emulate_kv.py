"""The emulated workers' KV handoff moves a room's KV once, over HTTP (GET /kv/{room} on the
prefill's bootstrap port) and in-process (`emulate cluster --kv-in-process`) alike: two decodes
sent the same room get one 200 and one 409, and the prefill finishes."""

from __future__ import annotations

import asyncio
import random

import pytest

aiohttp = pytest.importorskip("aiohttp")

from eldr_sglang.testing.pd_cluster import make_trace_files, start_cluster  # noqa: E402


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv")
    _, tpath, _ = make_trace_files(d, requests=10, seed=3, workers=2)
    return d, tpath


async def _two_decodes_one_room(urls: dict) -> tuple[list[int], int]:
    (prefill, bport), decodes = urls["prefill"][0], urls["decode"]
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": random.getrandbits(62)}
    body = {"text": "one room", "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def leg(url: str) -> int:
            async with s.post(url + "/generate", json={**body, **boot}) as r:
                await r.read()
                return r.status

        pre = asyncio.ensure_future(leg(prefill))
        statuses = await asyncio.gather(leg(decodes[0]), leg(decodes[1]))
        return sorted(statuses), await pre


@pytest.mark.parametrize("extra", [[], ["--kv-in-process"]], ids=["http", "in-process"])
def test_a_room_is_transferred_once(trace, extra):
    d, tpath = trace
    cluster, urls = start_cluster(tpath, d, prefill=1, decode=2, time_scale=0.05, extra=extra)
    try:
        decodes, prefill = asyncio.run(_two_decodes_one_room(urls))
    finally:
        cluster.stop()
    assert decodes == [200, 409]
    assert prefill == 200
