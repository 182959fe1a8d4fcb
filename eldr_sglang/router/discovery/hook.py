"""The discovery sources together: their union with the command line's workers, the membership
the router starts with, and each later change handed to an `apply(membership)` callback.

The union is taken in a fixed order: --prefill/--decode, then --workers-file, then Kubernetes.
A worker that two sources list (same host, port and path) is kept once, with the first
source's entry: its role and its bootstrap port; each such conflict is logged once. A union
without a prefill or a decode worker is refused (one log line) and the last good one stays.

What `apply` can do today: the Rust core builds its worker sets once, so the first membership
is the one the data plane is built with (`applied`). A later change becomes `desired`; until
the core takes runtime membership (issue 31, part 1) the router keeps serving `applied`, logs
the difference and shows `{"desired", "applied", "pending": true}` in /eldr/status. Live apply
is not done.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable
from urllib.parse import urlparse

from eldr_sglang.router.config import PrefillWorker, RouterConfig
from eldr_sglang.router.discovery.flags import DiscoverySettings
from eldr_sglang.router.discovery.membership import Membership, MembershipError, PrefillSpec, diff, same_workers

logger = logging.getLogger("eldr.router.discovery")

STARTUP_GRACE_S = 15.0  # beside --prefill/--decode: how long start-up waits for each source's first answer
WAIT_LOG_S = 30.0


class MembershipHook:
    def __init__(self, static: Membership, settings: DiscoverySettings,
                 apply: Callable[[Membership], None] | None = None, *, kube_options: dict | None = None):
        self.static = static
        self.settings = settings
        self.apply_cb = apply
        self.sources: list = []
        self.reported: dict[str, Membership] = {}
        self.desired: Membership | None = None
        self.applied: Membership | None = None
        self.last_refused: str | None = None
        self.changes = 0  # desired memberships after the applied one
        self._conflicts: tuple = ()
        self._event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        if settings.workers_file is not None:
            from eldr_sglang.router.discovery.workers_file import WorkersFile

            need_prefill = not static.prefill and settings.kube is None
            self.sources.append(WorkersFile(settings.workers_file, self._reporter("workers_file"),
                                            settings.file_interval_s, need_prefill=need_prefill))
        if settings.kube is not None:
            from eldr_sglang.router.discovery.kube import KubeDiscovery

            self.sources.append(KubeDiscovery(settings.kube, self._reporter("kubernetes"), **(kube_options or {})))
        self._recompute()

    def _reporter(self, name: str) -> Callable[[Membership], None]:
        def report(m: Membership) -> None:
            self.reported[name] = m
            self._recompute()
        return report

    def _recompute(self) -> None:
        conflicts: list[str] = []
        union = self.static
        for src in self.sources:
            if src.name in self.reported:
                union = union.union(self.reported[src.name], conflicts)
        if tuple(conflicts) != self._conflicts and conflicts:
            logger.warning("discovery: %d worker(s) listed by two sources, the first source's entry kept "
                           "(--prefill/--decode, then --workers-file, then Kubernetes): %s", len(conflicts), "; ".join(conflicts))
        self._conflicts = tuple(conflicts)
        try:
            union = union.check("discovered workers")
        except MembershipError as exc:
            if self.desired is not None or self.reported:
                if str(exc) != self.last_refused:
                    logger.warning("%s; keeping the last good membership", exc)
                self.last_refused = str(exc)
            self._event.set()
            return
        self.last_refused = None
        if self.desired is not None and union == self.desired:
            return
        self.desired = union
        if self.applied is not None:
            self.changes += 1
            if self.apply_cb is not None:
                self.apply_cb(union)
        self._event.set()

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        self._tasks = [asyncio.ensure_future(src.run()) for src in self.sources]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for src in self.sources:
            close = getattr(src, "close", None)
            if close is not None:
                await close()

    def _all_reported(self) -> bool:
        return all(src.name in self.reported for src in self.sources)

    async def first(self, timeout_s: float = 0.0, grace_s: float = STARTUP_GRACE_S) -> Membership:
        """The membership to start with: the union once every source has answered once (beside
        --prefill/--decode: or after `grace_s`, with what has answered) and it holds a prefill and
        a decode worker. `timeout_s` > 0: ValueError when none is ready by then; 0: wait on."""
        loop = asyncio.get_running_loop()
        start = next_log = loop.time()
        has_static = bool(self.static.prefill or self.static.decode)
        while True:
            now = loop.time()
            if self.desired is not None and (self._all_reported() or (has_static and now - start >= grace_s)):
                if not self._all_reported():
                    logger.warning("discovery: starting without %s, which has not answered in %.0f s",
                                   ", ".join(s.name for s in self.sources if s.name not in self.reported), grace_s)
                self.applied = self.desired
                return self.desired
            if timeout_s > 0 and now - start >= timeout_s:
                raise ValueError(f"no workers from discovery in {timeout_s:g} s: {self._why()}")
            if now >= next_log + WAIT_LOG_S:
                next_log = now
                logger.info("discovery: waiting for workers (%s)", self._why())
            self._event.clear()
            limits = [next_log + WAIT_LOG_S - now] + ([start + timeout_s - now] if timeout_s > 0 else [])
            if has_static:
                limits.append(start + grace_s - now)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event.wait(), max(0.01, min(limits)))

    def _why(self) -> str:
        quiet = [s.name for s in self.sources if s.name not in self.reported]
        errs = [e for s in self.sources for e in _errors(s)]
        parts = ([f"no answer yet from {', '.join(quiet)}"] if quiet else []) + errs
        if self.last_refused:
            parts.append(self.last_refused)
        return "; ".join(parts) or "no prefill or no decode worker yet"

    # ------------------------------------------------------------------ /eldr/status
    def status(self) -> dict:
        pending = self.applied is not None and self.desired is not None and not same_workers(self.desired, self.applied)
        return {
            "desired": self.desired.to_json() if self.desired is not None else None,
            "applied": self.applied.to_json() if self.applied is not None else None,
            "pending": pending,
            "pending_change": diff(self.applied, self.desired).to_json() if pending else None,
            "live_apply": False,  # the core does not take runtime membership yet
            "changes": self.changes,
            "last_refused": self.last_refused,
            "sources": {s.name: s.state() for s in self.sources},
        }


def _errors(src) -> list[str]:
    st = src.state()
    if "last_error" in st and st["last_error"]:
        return [st["last_error"]]
    return [f"{r}: {v['last_error']}" for r, v in st.get("roles", {}).items() if v.get("last_error")]


def static_membership(cfg: RouterConfig) -> Membership:
    return Membership(tuple(PrefillSpec(w.url, w.bootstrap_port) for w in cfg.prefill), tuple(cfg.decode))


def with_workers(cfg: RouterConfig, m: Membership) -> RouterConfig:
    """`cfg` with the membership's workers (checked again, as the command line's are)."""
    prefill = [PrefillWorker(url=w.url, bootstrap_port=w.bootstrap_port, host=urlparse(w.url).hostname or "")
               for w in m.prefill]
    return dataclasses.replace(cfg, prefill=prefill, decode=list(m.decode))


def pending_apply(hook: MembershipHook, m: Membership) -> None:
    """Today's `apply` (the app binds it to its hook): the core cannot take the change while
    serving, so it is logged and left pending in /eldr/status."""
    if hook.applied is None:
        return
    d = diff(hook.applied, m)
    if d.empty:
        logger.info("discovery: membership is back to the applied one")
        return
    logger.warning("discovery: membership changed (%s) but is NOT applied: the router's core does not take workers "
                   "added or removed while it serves yet; it keeps serving the %d prefill and %d decode workers it "
                   "started with (a restart picks the change up)", d.describe(), len(hook.applied.prefill),
                   len(hook.applied.decode))


@contextlib.asynccontextmanager
async def discovered(cfg: RouterConfig) -> AsyncIterator[tuple[RouterConfig, MembershipHook | None]]:
    """Runs the discovery sources `cfg` asks for around the router: yields the config to build
    the router with (its workers: the first membership) and the hook (None without discovery),
    whose `apply_cb` the caller sets to what applies a later membership."""
    if cfg.discovery is None:
        yield cfg, None
        return
    hook = MembershipHook(static_membership(cfg), cfg.discovery)
    await hook.start()
    try:
        t0 = time.monotonic()
        m = await hook.first(timeout_s=cfg.worker_startup_timeout_s)
        logger.info("discovery: starting with %d prefill and %d decode workers (after %.1f s)", len(m.prefill),
                    len(m.decode), time.monotonic() - t0)
        yield with_workers(cfg, m), hook
    finally:
        await hook.stop()
