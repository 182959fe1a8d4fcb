"""The control plane's background loops (`pd`: the ControlPlane): decode /v1/loads polling
(reported into the core Router's queue tracker), health checks (reported into the data
plane's worker pools), the prefill signature probe, centroid hot reload. Each reports through
the control plane's typed calls, by the worker's slot; what the routes read lives in Rust.
The per-worker loops follow membership (WorkerPollers)."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import aiohttp

from eldr_sglang.router.logsafe import RateLimitedLog, safe
from eldr_sglang.router.occupancy import OccupancyDropped, occupancy_from_loads, query

logger = logging.getLogger("eldr.router")


# A /v1/loads count above this is not a real queue (SGLang caps running requests in the
# thousands): it is a bad answer, and 10**30 would overflow the i64 load tracker.
MAX_REPORTED = 10_000_000
MAX_LOADS_BYTES = 1 << 20


def _count(rank: dict, key: str) -> int:
    v = rank.get(key, 0)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} is {type(v).__name__}, not a number")
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise ValueError(f"{key} = {v!r} is not a whole number")
    if not 0 <= v <= MAX_REPORTED:
        raise ValueError(f"{key} = {v!r} is out of range [0, {MAX_REPORTED}]")
    return int(v)


def running_from_loads(body: object) -> int:
    """The running requests of a SGLang 0.5.23 /v1/loads answer, summed over DP ranks.

    Running counts every request the decode worker holds: running, waiting, and those still
    in its PD pre-allocation / KV-transfer queues. Any other shape or value (negative,
    non-finite, huge, not a number) raises ValueError."""
    if not isinstance(body, dict):
        raise ValueError("the answer is not a JSON object")
    loads = body.get("loads")
    if not isinstance(loads, list):
        raise ValueError("no 'loads' list")
    if len(loads) > 4096:
        raise ValueError(f"{len(loads)} DP ranks")
    running = 0
    for rank in loads:
        if not isinstance(rank, dict):
            raise ValueError("a 'loads' entry is not an object")
        running += _count(rank, "num_running_reqs") + _count(rank, "num_waiting_reqs")
        d = rank.get("disaggregation")
        if isinstance(d, dict):
            running += _count(d, "decode_prealloc_queue_reqs") + _count(d, "decode_transfer_queue_reqs")
    return running


async def _read_loads(pd, url: str, timeout: aiohttp.ClientTimeout, layers: list[int] | None) -> tuple[int, object]:
    async with pd.session.get(f"{url}/v1/loads?{query(layers)}", timeout=timeout) as r:
        if r.status != 200:
            raise _Dropped("http", f"HTTP {r.status}")
        raw = b""
        while len(raw) <= MAX_LOADS_BYTES:
            chunk = await r.content.read(MAX_LOADS_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    if len(raw) > MAX_LOADS_BYTES:
        raise _Dropped("too_large", f"answer over {MAX_LOADS_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _Dropped("not_json", f"not JSON ({exc.__class__.__name__})") from None
    try:
        return running_from_loads(body), body
    except ValueError as exc:
        raise _Dropped("bad_value", str(exc)) from None


class _Dropped(Exception):
    def __init__(self, cause: str, msg: str):
        super().__init__(msg)
        self.cause = cause


async def _load_once(pd, slot: int, url: str, timeout: aiohttp.ClientTimeout, log: RateLimitedLog) -> None:
    ours = pd.inflight(slot)  # this router's share of what the answer will count
    occ = pd.occupancy_poll(slot)  # (layers, experts, our expert sums now) or None
    try:
        running, body = await _read_loads(pd, url, timeout, occ[0] if occ else None)
    except _Dropped as exc:
        cause, msg = exc.cause, str(exc)
    except asyncio.TimeoutError:
        cause, msg = "timeout", f"no answer in {timeout.total:g} s"
    except aiohttp.ClientError as exc:
        cause, msg = "connect", exc.__class__.__name__
    except Exception as exc:  # anything else a worker can provoke: drop it, keep polling
        cause, msg = "error", f"{exc.__class__.__name__}: {exc}"
    else:
        pd.report_load(slot, running, ours)
        _apply_occupancy(pd, slot, body, occ, log)
        return
    pd.clear_occupancy(slot)  # no fresh picture of the worker's batch: route on our own view
    pd.metrics.loads_dropped.labels(str(slot), cause).inc()
    if cause != "connect":  # a worker that is down is the health check's news
        log.warning(("loads", slot, cause), "decode %d /v1/loads answer dropped (%s): %s", slot, cause, safe(msg))


def _apply_occupancy(pd, slot: int, body: object, occ, log: RateLimitedLog) -> None:
    """Blend the answer's occupancy report into the locality state, or forget the last one
    (none asked, none given, or one that cannot be used: counted and logged)."""
    if occ is None:
        pd.clear_occupancy(slot)
        return
    layers, experts, snapshot = occ
    try:
        idle = occupancy_from_loads(body, layers, experts)
        if idle is not None:
            pd.report_occupancy(slot, snapshot, idle)
            return
    except OccupancyDropped as exc:
        cause, msg = exc.cause, str(exc)
    except ValueError as exc:  # the core refused it (the balancer's state changed meanwhile)
        cause, msg = "changed", str(exc)
    else:
        pd.clear_occupancy(slot)  # an unpatched worker, or its flag off
        return
    pd.clear_occupancy(slot)
    pd.metrics.occupancy_dropped.labels(str(slot), cause).inc()
    log.warning(("occupancy", slot, cause), "decode %d occupancy report dropped (%s): %s", slot, cause, safe(msg))


async def poll_loads_of(pd, slot: int, url: str, interval: float, log: RateLimitedLog) -> None:
    """Every `interval` seconds, read decode worker `slot`'s /v1/loads and report it, each
    call bounded by --worker-poll-timeout-secs (a slow worker delays only its own next poll);
    an answer that cannot be used is counted (eldr_router_load_reports_dropped) and logged
    (rate-limited), and never stops the loop. One such loop runs per decode member
    (WorkerPollers), cancelled when the worker leaves."""
    timeout = aiohttp.ClientTimeout(total=pd.cfg.poll_timeout_s)
    while True:
        try:
            await _load_once(pd, slot, url, timeout, log)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let one worker's loop die
            log.warning(("loads-loop", slot), "decode %d /v1/loads poll failed: %s", slot, safe(str(exc)))
        await asyncio.sleep(interval)


def prefill_signature_state(info: dict) -> tuple[bool, str | None]:
    """(streams signatures?, why not) from a prefill's /server_info.

    A patched prefill reports `eldr_signature`: "on", or "off (reason)" when its parallel layout
    cannot be attributed (the reason names the flag). An older patched prefill has only the flag
    `enable_eldr_signature`; an unpatched one has neither."""
    sig = info.get("eldr_signature")
    if isinstance(sig, str):
        if sig == "on":
            return True, None
        reason = sig[5:-1] if sig.startswith("off (") and sig.endswith(")") else sig
        return False, (reason or "off")[:200]
    if info.get("enable_eldr_signature", False):
        return True, None
    return False, "unpatched, or without --enable-eldr-signature"


async def probe_prefill_signature(pd, i: int, url: str) -> None:
    """Does prefill slot i (at `url`) stream signatures (prefill_signature_state of its
    /server_info)? If not, the router binds decode at once for that worker instead of waiting
    for a signature that never comes, and says why once (a warning, /eldr/status, a metric)."""
    try:
        async with pd.session.get(f"{url}/server_info", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return
            info = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return  # unknown: keep waiting for signatures (bounded by the timeout)
    if isinstance(info, dict):
        signs, reason = prefill_signature_state(info)
        if not signs and (pd.prefill_signs.get(i) is not signs or pd.prefill_signature_off.get(i) != reason):
            logger.warning("prefill worker %d (%s) does not stream ELDR signatures (%s): its requests are routed "
                           "without one", i, url, safe(reason))
        pd.set_prefill_signs(i, signs, reason)


async def check_health_of(pd, role: str, slot: int, url: str, interval: float, threshold: int) -> None:
    """Mark worker `slot` of `role` unhealthy after `threshold` failed /health calls in a row,
    healthy on success. A passing health check does not end an outlier ejection: a hung
    worker's /health may answer. Each call is bounded by --worker-poll-timeout-secs (not by the
    interval: a busy CPU SGLang answers in seconds). The failures in a row are counted by the
    data plane's worker set (rust/core/src/workers.rs), which the routes read; this loop keeps
    only when to re-probe a prefill's signatures. One loop per member (WorkerPollers)."""
    timeout = aiohttp.ClientTimeout(total=pd.cfg.poll_timeout_s)
    reprobe = False  # a prefill whose last check failed: probe again when it answers (it may have restarted)
    while True:
        try:
            try:
                async with pd.session.get(f"{url}/health", timeout=timeout) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            if role == "prefill" and ok and (reprobe or pd.prefill_signs.get(slot) is None):
                await probe_prefill_signature(pd, slot, url)
                reprobe = False
            if role == "prefill" and not ok:
                reprobe = True
            pd.health_check(role, slot, ok, threshold)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let one worker's loop die
            logger.error("%s %d health check failed: %s", role, slot, safe(str(exc)))
        await asyncio.sleep(interval)


class WorkerPollers:
    """The per-worker background loops: a health check per member of each role, a /v1/loads
    poll per decode member. `start` when a worker joins (at start-up, or a membership change),
    `stop` when it leaves: its loops are cancelled and awaited, so none reports into its slot
    afterwards (a slot is reused by a later worker once drained)."""

    def __init__(self, pd):
        self.pd = pd
        self.tasks: dict[tuple[str, int], list[asyncio.Task]] = {}
        self._log = RateLimitedLog(logger)

    def start(self, role: str, slot: int, url: str, probe: bool = True) -> None:
        cfg = self.pd.cfg
        if (role, slot) in self.tasks:
            return
        loops = []
        if cfg.health_check_interval_s > 0:
            loops.append(check_health_of(self.pd, role, slot, url, cfg.health_check_interval_s,
                                         cfg.health_failure_threshold))
        if role == "decode" and cfg.load_monitor_interval_s > 0:
            loops.append(poll_loads_of(self.pd, slot, url, cfg.load_monitor_interval_s, self._log))
        if role == "prefill" and cfg.late_binding and cfg.health_check_interval_s <= 0 and probe:
            loops.append(probe_prefill_signature(self.pd, slot, url))  # else the health loop probes it
        self.tasks[(role, slot)] = [asyncio.ensure_future(c) for c in loops]

    async def stop(self, role: str, slot: int) -> None:
        tasks = self.tasks.pop((role, slot), [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for role, slot in list(self.tasks):
            await self.stop(role, slot)


async def reload_centroids(pd, interval: float) -> None:
    """Hot reload, off the event loop: a changed file is checked and swapped in by a worker
    thread (pd.reload_centroids); a bad file keeps the old centroids serving."""
    while True:
        await asyncio.sleep(interval)
        try:
            await pd.reload_centroids()
        except Exception as exc:  # never let the loop die; the status says what failed
            logger.error("centroid reload check failed: %s", safe(str(exc)))


async def wait_for_workers(pd, timeout_s: float) -> None:
    """At startup: wait until every worker answers /health, or give up after timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    urls = [u for role in ("prefill", "decode") for _, u in pd.members(role)]
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
