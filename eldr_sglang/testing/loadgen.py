"""The measuring code of the router benchmarks (bench_router_overhead, bench_gateway): clients that
speak the PD protocol directly or through a router, an open-loop Poisson load phase, latency
statistics and a process tree's CPU time from /proc. Loopback only; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np


def request_body(i: int) -> dict:
    """The i-th request of a phase. No emulator controls in the body: sglang-router drops unknown
    fields, so every router's workers see the same requests (mapped to trace requests by hash)."""
    return {"text": f"bench request {i}", "sampling_params": {"max_new_tokens": 1}}


def _boot(bport: int) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": random.getrandbits(63)}


async def direct_late(s: aiohttp.ClientSession, prefill: str, bport: int, decode: str, body: dict) -> None:
    """Late binding without a router: the prefill streamed up to its signature event (parsed, as a
    router does), then the decode with the same bootstrap room, the prefill drained meanwhile."""
    boot = _boot(bport)
    presp = await s.post(prefill + "/generate", json={**body, **boot, "stream": True})
    try:
        if presp.status != 200:
            raise RuntimeError(f"prefill answered HTTP {presp.status}")
        async for line in presp.content:
            if b"eldr_signature" in line:
                json.loads(line[5:])
                break
        drain = asyncio.ensure_future(presp.read())
        async with s.post(decode + "/generate", json={**body, **boot}) as d:
            await d.read()
            if d.status != 200:
                raise RuntimeError(f"decode answered HTTP {d.status}")
        await drain
    finally:
        presp.release()


async def direct_early(s: aiohttp.ClientSession, prefill: str, bport: int, decode: str, body: dict) -> None:
    """Early binding without a router (SGLang's own PD flow): both legs at once, same room."""
    boot = _boot(bport)

    async def leg(url: str) -> None:
        async with s.post(url + "/generate", json={**body, **boot}) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url} answered HTTP {r.status}")

    await asyncio.gather(leg(prefill), leg(decode))


async def via_router(s: aiohttp.ClientSession, router: str, body: dict) -> None:
    async with s.post(router + "/generate", json=body) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"router answered HTTP {r.status}")


@dataclass
class Phase:
    """One load phase: the latencies of the requests that succeeded, the failures, and how fast the
    client really sent (an open-loop client on a busy machine can fall behind its schedule)."""

    rate: float  # requests/s offered; 0 = sequential
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    unsent: int = 0  # of the errors: sequential requests not sent before the phase timeout
    first_error: str | None = None
    send_s: float = 0.0  # from the first to the last send
    schedule_s: float = 0.0  # from the first to the last send as the Poisson schedule planned them
    wall_s: float = 0.0  # from the first send to the last answer

    @property
    def sent(self) -> int:
        return len(self.latencies_s) + self.errors

    @property
    def achieved_rate(self) -> float:
        """The offered rate, scaled by how far the client fell behind its own schedule. (A
        random Poisson schedule of a few hundred arrivals spans its nominal time only to within
        several percent, so (sent - 1) / send_s would also measure the draw, not the client.)"""
        if self.send_s <= 0 or self.sent <= 1:
            return 0.0
        if self.rate > 0 and self.schedule_s > 0:
            return self.rate * min(1.0, self.schedule_s / self.send_s)
        return (self.sent - 1) / self.send_s

    def stats(self) -> dict:
        return {**latency_stats(self.latencies_s), "errors": self.errors, "first_error": self.first_error,
                "rate_rps": self.rate, "achieved_rate_rps": self.achieved_rate, "wall_s": self.wall_s}


async def run_phase(send, n: int, rate: float, rng: random.Random, request_timeout_s: float = 30.0,
                    phase_timeout_s: float = 120.0) -> Phase:
    """n requests `await send(body)`: open-loop Poisson at `rate`, or one after another when rate
    is 0. A request slower than request_timeout_s, or still open (sequentially: not yet sent)
    phase_timeout_s after the phase began, counts as an error."""
    ph = Phase(rate=rate)
    t_begin = time.perf_counter()

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(send(request_body(i)), request_timeout_s)
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: BLE001 - every failure is counted
            ph.errors += 1
            if ph.first_error is None:
                ph.first_error = f"{exc.__class__.__name__}: {exc}"[:200]
            return
        ph.latencies_s.append(time.perf_counter() - t0)

    if rate <= 0:
        for i in range(n):
            if time.perf_counter() - t_begin > phase_timeout_s:  # the rest would not start in time
                ph.errors += n - i
                ph.unsent = n - i
                ph.first_error = ph.first_error or f"{n - i} requests not sent within {phase_timeout_s:g} s"
                break
            await one(i)
        ph.send_s = ph.wall_s = time.perf_counter() - t_begin
        return ph
    tasks = []
    t_next = t_begin
    for i in range(n):
        delay = t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        ph.schedule_s = t_next - t_begin
        t_next += rng.expovariate(rate)
    ph.send_s = time.perf_counter() - t_begin
    done, pending = await asyncio.wait(tasks, timeout=max(1.0, phase_timeout_s - ph.send_s))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
        ph.errors += len(pending)
        ph.first_error = ph.first_error or f"{len(pending)} requests still open after {phase_timeout_s:g} s"
    ph.wall_s = time.perf_counter() - t_begin
    return ph


def latency_stats(x: list[float]) -> dict:
    if not x:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "mean_ms": None}
    a = np.asarray(x) * 1e3
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean())}


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """pid and all its live descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _stat_fields(int(d))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants: every thread of each live one
    (utime, stime) plus the children they have already reaped (cutime, cstime)."""
    total = 0
    for p in process_tree(pid):
        f = _stat_fields(p)
        if f is not None:
            total += sum(int(x) for x in f[11:15])
    return total / os.sysconf("SC_CLK_TCK")
