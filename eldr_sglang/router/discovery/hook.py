"""The discovery sources together: their union with the command line's workers, the membership
the router starts with, and each later change handed to an `apply(membership)` callback.

The union is taken in a fixed order: --prefill/--decode, then --workers-file, then Kubernetes.
A worker that two sources list (same host, port and path) is kept once, with the first
source's entry: its role and its bootstrap port; each such conflict is logged once. A union
without a prefill or a decode worker is refused (one log line) and the last good one stays.

A fourth layer, the admin overlay, is the operator's (POST/DELETE /eldr/workers, `admin_add`
and `admin_remove`): a worker it adds joins the union; one it removes is left out of the union
even while another source lists it, until it is POSTed again.

The first membership is the one the data plane is built with (`applied`). A later change
becomes `desired` and goes to `apply_cb`, which the router binds to `membership.apply`
(`MembershipApplier`): it adds and removes workers in the running data plane and sets `applied`
to the members it serves; /eldr/status shows `{"desired", "applied", "pending"}`.
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
from eldr_sglang.router.discovery.membership import (
    Membership,
    MembershipError,
    PrefillSpec,
    check_bootstrap_port,
    check_url,
    diff,
    same_workers,
    worker_key,
)

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
        self.last_apply_error: str | None = None  # set by the applier
        self._conflicts: tuple = ()
        # the admin overlay: workers POSTed (kept in a Membership) and the (role, worker_key) DELETEd
        self.admin_added = Membership()
        self.admin_removed: set[tuple[str, tuple]] = set()
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

    def _union(self) -> Membership:
        """The sources' union with the admin overlay, checked (MembershipError: refused)."""
        conflicts: list[str] = []
        union = self.static
        for src in self.sources:
            if src.name in self.reported:
                union = union.union(self.reported[src.name], conflicts)
        union = self._overlay(union.union(self.admin_added, conflicts))
        if tuple(conflicts) != self._conflicts and conflicts:
            logger.warning("discovery: %d worker(s) listed by two sources, the first source's entry kept "
                           "(--prefill/--decode, then --workers-file, then Kubernetes, then POST /eldr/workers): %s",
                           len(conflicts), "; ".join(conflicts))
        self._conflicts = tuple(conflicts)
        return union.check("discovered workers")

    def _recompute(self) -> None:
        try:
            union = self._union()
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

    def _overlay(self, m: Membership) -> Membership:
        """`m` without the workers the admin overlay removed."""
        if not self.admin_removed:
            return m
        return Membership(tuple(w for w in m.prefill if ("prefill", worker_key(w.url)) not in self.admin_removed),
                          tuple(u for u in m.decode if ("decode", worker_key(u)) not in self.admin_removed))

    # ------------------------------------------------------------------ the admin overlay
    def admin_add(self, role: str, url: str, bootstrap_port: int | None = None) -> Membership:
        """POST /eldr/workers: `url` joins `role` (MembershipError: bad input, or a worker the
        union already holds in the other role). Returns the new desired membership."""
        if role not in ("prefill", "decode"):
            raise MembershipError(f"role must be \"prefill\" or \"decode\", got {role!r}")
        where = f"POST /eldr/workers {role}"
        url = check_url(url, where)
        if role == "decode" and bootstrap_port is not None:
            raise MembershipError(f"{where}: a decode worker takes no bootstrap_port")
        port = check_bootstrap_port(bootstrap_port, f"{where} {url}")
        key = worker_key(url)
        other = "decode" if role == "prefill" else "prefill"
        if self.desired is not None and any(worker_key(u) == key for u in _urls(self.desired, other)):
            raise MembershipError(f"{where}: {url!r} is already a {other} worker")
        keep = Membership(tuple(w for w in self.admin_added.prefill if worker_key(w.url) != key),
                          tuple(u for u in self.admin_added.decode if worker_key(u) != key))
        if role == "prefill":
            keep = Membership(keep.prefill + (PrefillSpec(url, port),), keep.decode)
        else:
            keep = Membership(keep.prefill, keep.decode + (url,))
        return self._admin_change(keep, self.admin_removed - {(role, key)})

    def admin_remove(self, role: str, url: str) -> Membership:
        """DELETE /eldr/workers: `url` leaves `role`, whatever source lists it, until POSTed
        again. MembershipError for bad input or a worker that is not a member (LookupError) or
        the role's last one (LastWorkerError)."""
        if role not in ("prefill", "decode"):
            raise MembershipError(f"role must be \"prefill\" or \"decode\", got {role!r}")
        url = check_url(url, f"DELETE /eldr/workers {role}")
        key = worker_key(url)
        if self.desired is None or not any(worker_key(u) == key for u in _urls(self.desired, role)):
            raise NotAMemberError(f"{url} is not a {role} worker of this router")
        if len(_urls(self.desired, role)) == 1:
            raise LastWorkerError(f"{url} is the last {role} worker: the router needs at least one")
        keep = Membership(tuple(w for w in self.admin_added.prefill if worker_key(w.url) != key),
                          tuple(u for u in self.admin_added.decode if worker_key(u) != key))
        return self._admin_change(keep, self.admin_removed | {(role, key)})

    def _admin_change(self, added: Membership, removed: set) -> Membership:
        old = (self.admin_added, self.admin_removed)
        self.admin_added, self.admin_removed = added, removed
        try:
            self._union()
        except MembershipError:
            self.admin_added, self.admin_removed = old
            raise
        self._recompute()
        assert self.desired is not None
        return self.desired

    def overlay_json(self) -> dict:
        return {"added": self.admin_added.to_json(),
                "removed": sorted(f"{role} {_key_url(k)}" for role, k in self.admin_removed)}

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
            "live_apply": True,
            "changes": self.changes,
            "last_refused": self.last_refused,
            "last_apply_error": self.last_apply_error,
            "admin": self.overlay_json(),
            "sources": {s.name: s.state() for s in self.sources},
        }


class NotAMemberError(MembershipError):
    """DELETE of a worker the router does not have (404)."""


class LastWorkerError(MembershipError):
    """DELETE of a role's last worker (409)."""


def _urls(m: Membership, role: str) -> list[str]:
    return [w.url for w in m.prefill] if role == "prefill" else list(m.decode)


def _key_url(key: tuple) -> str:
    scheme, host, port, path = key
    return f"{scheme}://{host}:{port}{path}"


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


@contextlib.asynccontextmanager
async def discovered(cfg: RouterConfig) -> AsyncIterator[tuple[RouterConfig, MembershipHook | None]]:
    """Runs the discovery sources `cfg` asks for around the router: yields the config to build
    the router with (its workers: the first membership) and the hook (None without discovery),
    whose `apply_cb` the caller sets to what applies a later membership. Without a discovery
    source the hook holds the command line's workers and the admin overlay alone."""
    hook = MembershipHook(static_membership(cfg), cfg.discovery or DiscoverySettings())
    await hook.start()
    try:
        t0 = time.monotonic()
        m = await hook.first(timeout_s=cfg.worker_startup_timeout_s)
        logger.info("discovery: starting with %d prefill and %d decode workers (after %.1f s)", len(m.prefill),
                    len(m.decode), time.monotonic() - t0)
        yield with_workers(cfg, m), hook
    finally:
        await hook.stop()
