"""Live membership without a cluster: the hook's admin overlay (POST/DELETE /eldr/workers) and
the applier's reconcile (adds first, then removes; each worker's loops started and cancelled;
a refused call reported) against a fake data plane that keeps the core's contract (slots,
drain-then-reuse, ValueError for a duplicate or the last member)."""

from __future__ import annotations

import asyncio

import pytest

from eldr_sglang.router.discovery.apply import MembershipApplier
from eldr_sglang.router.discovery.flags import DiscoverySettings
from eldr_sglang.router.discovery.hook import LastWorkerError, MembershipHook, NotAMemberError
from eldr_sglang.router.discovery.membership import Membership, MembershipError, PrefillSpec

P0, P1 = "http://p0:30000", "http://p1:30000"
D0, D1, D2 = "http://d0:30001", "http://d1:30001", "http://d2:30001"


class FakePlane:
    """The contract of `_core.DataPlane`'s membership calls; `calls` records them in order."""

    def __init__(self, prefill, decode, capacity=1024):
        self.slots = {"prefill": [[u, "serving", p] for u, p in prefill], "decode": [[u, "serving", None] for u in decode]}
        self.capacity = capacity
        self.calls: list[tuple] = []

    def members(self, role):
        return [(i, s[0]) for i, s in enumerate(self.slots[role]) if s[1] == "serving"]

    def add_worker(self, role, url, bootstrap_port=None):
        self.calls.append(("add", role, url, bootstrap_port))
        if any(u == url for _, u in self.members(role)):
            raise ValueError(f"{url} is already a {role} worker")
        for i, s in enumerate(self.slots[role]):
            if s[1] == "free":
                self.slots[role][i] = [url, "serving", bootstrap_port]
                return i
        if len(self.slots[role]) >= self.capacity:
            raise ValueError(f"the {role} role is full ({self.capacity} slots)")
        self.slots[role].append([url, "serving", bootstrap_port])
        return len(self.slots[role]) - 1

    def remove_worker(self, role, url):
        self.calls.append(("remove", role, url))
        mine = [i for i, u in self.members(role) if u == url]
        if not mine:
            raise ValueError(f"{url} is not a {role} worker")
        if len(self.members(role)) == 1:
            raise ValueError(f"{url} is the last {role} worker")
        self.slots[role][mine[0]][1] = "free"  # drained at once: nothing in flight here
        return mine[0]


class FakePollers:
    def __init__(self):
        self.running: dict[tuple[str, int], str] = {}
        self.log: list[tuple] = []

    def start(self, role, slot, url, probe=True):
        self.running[(role, slot)] = url
        self.log.append(("start", role, slot, url))

    async def stop(self, role, slot):
        self.running.pop((role, slot), None)
        self.log.append(("stop", role, slot))


class FakePD:
    def __init__(self, plane):
        self.dataplane = plane
        self.pollers = FakePollers()
        self.forgotten: list[tuple] = []

    def members(self, role):
        return self.dataplane.members(role)

    def forget(self, role, slot):
        self.forgotten.append((role, slot))


def setup(prefill=((P0, 8998),), decode=(D0,), capacity=1024):
    static = Membership(tuple(PrefillSpec(u, p) for u, p in prefill), tuple(decode))
    hook = MembershipHook(static, DiscoverySettings())
    hook.applied = hook.desired
    pd = FakePD(FakePlane(prefill, decode, capacity))
    for role in ("prefill", "decode"):
        for slot, url in pd.members(role):
            pd.pollers.start(role, slot, url)
    applier = MembershipApplier(hook, pd)
    hook.apply_cb = applier.request
    return hook, pd, applier


def test_membership_admin_overlay_adds_and_removes_over_the_sources():
    hook, pd, applier = setup(decode=(D0, D1))
    m = hook.admin_add("decode", D2 + "/")
    assert m.decode == (D0, D1, D2) and hook.changes == 1
    m = hook.admin_remove("decode", D0)  # listed by the command line: the overlay wins
    assert m.decode == (D1, D2)
    assert hook.status()["admin"] == {"added": {"prefill": [], "decode": [{"url": D2}]}, "removed": ["decode http://d0:30001"]}
    m = hook.admin_add("decode", D0)  # POSTed again: back
    assert set(m.decode) == {D0, D1, D2} and hook.admin_removed == set()
    m = hook.admin_add("prefill", P1, 9000)
    assert m.prefill == (PrefillSpec(P0, 8998), PrefillSpec(P1, 9000))


@pytest.mark.parametrize("call, err, match", [
    (lambda h: h.admin_add("router", D2), MembershipError, "role must be"),
    (lambda h: h.admin_add("decode", "d2:30001"), MembershipError, "is not a URL like"),
    (lambda h: h.admin_add("prefill", P1, 70000), MembershipError, "bootstrap_port must be an integer"),
    (lambda h: h.admin_add("decode", D2, 8998), MembershipError, "a decode worker takes no bootstrap_port"),
    (lambda h: h.admin_add("decode", P0), MembershipError, "is already a prefill worker"),
    (lambda h: h.admin_remove("decode", D2), NotAMemberError, "is not a decode worker"),
    (lambda h: h.admin_remove("prefill", P0), LastWorkerError, "is the last prefill worker"),
])
def test_membership_admin_overlay_refuses_bad_input_and_changes_nothing(call, err, match):
    hook, _, _ = setup(decode=(D0, D1))
    before = (hook.desired, hook.admin_added, set(hook.admin_removed), hook.changes)
    with pytest.raises(err, match=match):
        call(hook)
    assert (hook.desired, hook.admin_added, hook.admin_removed, hook.changes) == before


def test_membership_applier_adds_first_then_removes_and_moves_the_loops():
    async def main():
        hook, pd, applier = setup(decode=(D0, D1))
        applier.start()
        hook.admin_add("decode", D2)
        hook.admin_remove("decode", D0)
        hook.admin_add("prefill", P1, 9000)
        await applier.settle(2.0)
        assert pd.dataplane.calls == [("add", "prefill", P1, 9000), ("add", "decode", D2, None),
                                      ("remove", "decode", D0)]
        assert pd.members("decode") == [(1, D1), (2, D2)]
        assert pd.pollers.running == {("prefill", 0): P0, ("prefill", 1): P1, ("decode", 1): D1, ("decode", 2): D2}
        st = hook.status()
        assert st["pending"] is False and st["applied"] == st["desired"] and st["last_apply_error"] is None
        assert st["applied"]["prefill"][1] == {"url": P1, "bootstrap_port": 9000}
        # re-added: gets the drained slot 0 back, with fresh notes and a fresh poll loop
        hook.admin_add("decode", D0)
        await applier.settle(2.0)
        assert pd.members("decode") == [(0, D0), (1, D1), (2, D2)] and ("decode", 0) in pd.forgotten[-1:]
        assert pd.pollers.log[-1] == ("start", "decode", 0, D0)
        await applier.close()

    asyncio.run(main())


def test_membership_applier_reports_a_refused_add_and_applied_stays_true():
    async def main():
        hook, pd, applier = setup(decode=(D0,), capacity=1)
        applier.start()
        hook.admin_add("decode", D1)
        await applier.settle(2.0)
        st = hook.status()
        assert st["pending"] is True and "the decode role is full (1 slots)" in st["last_apply_error"]
        assert st["applied"]["decode"] == [{"url": D0}] and pd.members("decode") == [(0, D0)]
        assert ("decode", 1) not in pd.pollers.running
        await applier.close()

    asyncio.run(main())


def test_membership_applier_re_adds_a_prefill_whose_bootstrap_port_changed():
    async def main():
        hook, pd, applier = setup(prefill=((P0, 8998), (P1, 8999)))
        applier.start()
        hook.static = Membership((PrefillSpec(P0, 8998), PrefillSpec(P1, 9100)), (D0,))
        hook._recompute()
        await applier.settle(2.0)
        assert pd.dataplane.calls == [("remove", "prefill", P1), ("add", "prefill", P1, 9100)]
        assert hook.status()["applied"]["prefill"][1] == {"url": P1, "bootstrap_port": 9100}
        assert hook.status()["pending"] is False
        await applier.close()

    asyncio.run(main())
