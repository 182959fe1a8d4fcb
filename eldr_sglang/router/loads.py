"""Background loops: decode /v1/loads polling (blended into the Rust queue tracker), health
checks, centroid hot reload."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

logger = logging.getLogger("eldr.router")


def running_from_loads(body: dict) -> tuple[int, int]:
    """(running requests, used tokens) of a SGLang 0.5.23 /v1/loads answer, summed over DP ranks.

    Running counts every request the decode worker holds: running, waiting, and those still
    in its PD pre-allocation / KV-transfer queues."""
    loads = body.get("loads")
    if not isinstance(loads, list):
        raise ValueError("no 'loads' list")
    running = tokens = 0
    for rank in loads:
        if not isinstance(rank, dict):
            raise ValueError("a 'loads' entry is not an object")
        running += int(rank.get("num_running_reqs", 0)) + int(rank.get("num_waiting_reqs", 0))
        d = rank.get("disaggregation")
        if isinstance(d, dict):
            running += int(d.get("decode_prealloc_queue_reqs", 0)) + int(d.get("decode_transfer_queue_reqs", 0))
        tokens += int(rank.get("num_used_tokens", 0))
    return running, tokens


async def poll_loads(pd, interval: float) -> None:
    """Every `interval` seconds, read each decode worker's /v1/loads and report it."""
    timeout = aiohttp.ClientTimeout(total=max(0.05, min(interval, 5.0)))
    while True:
        async def one(i: int, url: str) -> None:
            try:
                async with pd.session.get(f"{url}/v1/loads?include=core,disagg", timeout=timeout) as r:
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}")
                    running, tokens = running_from_loads(await r.json(content_type=None))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError) as exc:
                pd.metrics.worker_errors.labels("decode", str(i), "loads").inc()
                logger.debug("decode %d /v1/loads: %s", i, exc)
                return
            pd.reported[i] = running
            pd.router.report_load(i, running, tokens)

        await asyncio.gather(*(one(i, u) for i, u in enumerate(pd.cfg.decode)))
        await asyncio.sleep(interval)


async def probe_prefill_signature(pd, i: int) -> None:
    """Does prefill i stream signatures? Its /server_info lists the patched flag
    `enable_eldr_signature`; absent (unpatched SGLang) or false means no, and the router then
    binds decode at once for that worker instead of waiting for a signature that never comes."""
    try:
        async with pd.session.get(f"{pd.cfg.prefill[i].url}/server_info", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return
            info = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return  # unknown: keep waiting for signatures (bounded by the timeout)
    if isinstance(info, dict):
        signs = bool(info.get("enable_eldr_signature", False))
        if pd.prefill_signs[i] is not signs and not signs:
            logger.warning("prefill worker %d (%s) does not stream ELDR signatures (unpatched, or without "
                           "--enable-eldr-signature): its requests are routed without one", i, pd.cfg.prefill[i].url)
        pd.prefill_signs[i] = signs


async def check_health(pd, interval: float, threshold: int) -> None:
    """Mark workers unhealthy after `threshold` failed /health calls in a row, healthy on success."""
    timeout = aiohttp.ClientTimeout(total=max(0.1, min(interval, 5.0)))
    fails = {("prefill", i): 0 for i in range(len(pd.cfg.prefill))}
    fails.update({("decode", i): 0 for i in range(len(pd.cfg.decode))})
    while True:
        async def one(role: str, i: int, url: str) -> None:
            try:
                async with pd.session.get(f"{url}/health", timeout=timeout) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            key = (role, i)
            fails[key] = 0 if ok else fails[key] + 1
            if role == "prefill" and ok and (fails.get(("probe", i)) or pd.prefill_signs[i] is None):
                await probe_prefill_signature(pd, i)
                fails[("probe", i)] = 0
            if not ok:
                fails[("probe", i)] = 1  # re-probe when it comes back (it may have been restarted)
            pd.set_healthy(role, i, fails[key] < threshold)

        await asyncio.gather(
            *(one("prefill", i, w.url) for i, w in enumerate(pd.cfg.prefill)),
            *(one("decode", i, u) for i, u in enumerate(pd.cfg.decode)),
        )
        await asyncio.sleep(interval)


async def reload_centroids(pd, interval: float) -> None:
    """Hot reload: the Rust router swaps in a changed centroid file (a bad file keeps the old)."""
    while True:
        await asyncio.sleep(interval)
        try:
            if pd.check_centroids():
                logger.info("centroids reloaded from %s (generation %d)", pd.cfg.centroids, pd.router.centroid_generation)
        except Exception as exc:  # CentroidFileError: keep serving with the old centroids
            logger.warning("centroid reload rejected, keeping the previous file: %s", exc)


async def wait_for_workers(pd, timeout_s: float) -> None:
    """At startup: wait until every worker answers /health, or give up after timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    urls = [w.url for w in pd.cfg.prefill] + list(pd.cfg.decode)
    pending = set(urls)
    while pending and loop.time() < deadline:
        for url in list(pending):
            try:
                async with pd.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        pending.discard(url)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
        if pending:
            await asyncio.sleep(0.5)
    if pending:
        logger.warning("workers not healthy after %.0fs: %s", timeout_s, ", ".join(sorted(pending)))
