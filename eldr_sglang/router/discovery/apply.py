"""Live membership: each desired membership (MembershipHook) applied to the running data plane.

`MembershipApplier.request()` is the hook's `apply_cb`: it only wakes the applier's task, which
reconciles the data plane's members with the hook's latest `desired` (level-triggered: several
changes in a burst are applied once, and a change that came before the task started is not
lost). One reconcile, per role:
1. adds the workers the data plane lacks (prefill ones with their bootstrap port), and starts
   each one's health and load loops; a late-binding router probes a new prefill's signatures;
2. then removes the ones no longer desired: their loops are cancelled first (none reports into
   the slot afterwards), then the data plane drains them (no new request; those in flight end);
3. a prefill worker whose bootstrap port changed is removed, then added again.
Adds come first, so a role never runs empty. The data plane's calls run in a thread (off the
event loop). A call the data plane refuses (a full role, ...) is logged and shown in
/eldr/status (`last_apply_error`); `applied` is always what the data plane serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from eldr_sglang.router.discovery.membership import Membership, PrefillSpec, worker_key

logger = logging.getLogger("eldr.router.discovery")


class MembershipApplier:
    def __init__(self, hook, pd):
        self.hook = hook
        self.pd = pd
        self._wake = asyncio.Event()
        self._done = asyncio.Event()  # set after each reconcile
        self._task: asyncio.Task | None = None
        self.applies = 0
        # each prefill member's bootstrap port, as added (worker_key -> port)
        self.ports = {worker_key(w.url): w.bootstrap_port for w in (hook.applied or Membership()).prefill}

    def request(self, _m: Membership | None = None) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        self._wake.set()  # a change made before start

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.reconcile()
            except Exception as exc:  # never let the applier die; the status says what failed
                self.hook.last_apply_error = f"{exc.__class__.__name__}: {exc}"
                logger.error("membership: applying the change failed: %s", exc)
            if not self._wake.is_set():
                self._done.set()

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until the latest requested change has been reconciled."""
        self._done.clear()
        self._wake.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._done.wait(), timeout_s)

    def served(self) -> Membership:
        """What the data plane serves now, as a Membership (prefill workers with the bootstrap
        port they were added with)."""
        return Membership(tuple(PrefillSpec(u, self.ports.get(worker_key(u))) for _, u in self.pd.members("prefill")),
                          tuple(u for _, u in self.pd.members("decode")))

    async def reconcile(self) -> None:
        want = self.hook.desired
        if want is None:
            return
        errors: list[str] = []
        changed = []
        for role, wanted in (("prefill", [(w.url, w.bootstrap_port) for w in want.prefill]),
                             ("decode", [(u, None) for u in want.decode])):
            members = {worker_key(u): (slot, u) for slot, u in self.pd.members(role)}
            wanted_keys = {worker_key(u): (u, port) for u, port in wanted}
            moved = [k for k in wanted_keys if k in members and role == "prefill"
                     and self.ports.get(k) != wanted_keys[k][1]]
            for k, (url, port) in wanted_keys.items():
                if k not in members:
                    changed.append(await self._add(role, url, port, errors))
            for k, (slot, url) in members.items():
                if k not in wanted_keys or k in moved:
                    changed.append(await self._remove(role, slot, url, errors))
            for k in moved:
                url, port = wanted_keys[k]
                changed.append(await self._add(role, url, port, errors))
        self.hook.applied = self.served()
        self.hook.last_apply_error = "; ".join(errors) or None
        if any(changed):
            self.applies += 1
            logger.info("membership applied: %d prefill, %d decode workers serving", len(self.hook.applied.prefill),
                        len(self.hook.applied.decode))

    async def _add(self, role: str, url: str, port: int | None, errors: list[str]) -> bool:
        try:
            slot = await asyncio.to_thread(self.pd.dataplane.add_worker, role, url, port)
        except ValueError as exc:
            errors.append(f"add {role} {url}: {exc}")
            logger.warning("membership: cannot add %s worker %s: %s", role, url, exc)
            return False
        self.pd.forget(role, slot)  # a reused slot starts fresh here too
        if role == "prefill":
            self.ports[worker_key(url)] = port
        logger.info("membership: %s worker %s added (slot %d)", role, url, slot)
        if self.pd.pollers is not None:
            self.pd.pollers.start(role, slot, url)
        return True

    async def _remove(self, role: str, slot: int, url: str, errors: list[str]) -> bool:
        if self.pd.pollers is not None:
            await self.pd.pollers.stop(role, slot)
        try:
            await asyncio.to_thread(self.pd.dataplane.remove_worker, role, url)
        except ValueError as exc:
            errors.append(f"remove {role} {url}: {exc}")
            logger.warning("membership: cannot remove %s worker %s: %s", role, url, exc)
            if self.pd.pollers is not None:  # still a member: keep checking it
                self.pd.pollers.start(role, slot, url)
            return False
        self.pd.forget(role, slot)
        logger.info("membership: %s worker %s removed (slot %d drains its requests in flight)", role, url, slot)
        return True
