"""--workers-file: the Membership value (checks, union, diff), the watched file (valid, garbage,
half-written, duplicate, empty decode list, a change picked up within the interval, a FIFO that
must not block), and the hook that unions the sources and starts the router."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest

from eldr_sglang.router.discovery.flags import DiscoverySettings
from eldr_sglang.router.discovery.hook import MembershipHook
from eldr_sglang.router.discovery.membership import (
    Membership,
    MembershipError,
    PrefillSpec,
    diff,
    from_json,
)
from eldr_sglang.router.discovery.workers_file import WorkersFile, WorkersFileError, parse

GOOD = {"prefill": [{"url": "http://p0:30000", "bootstrap_port": 8998}], "decode": [{"url": "http://d0:30001"}]}


def write(path, obj) -> None:
    """Write atomically (the way a deploy tool should): a temp file renamed over the old."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    os.replace(tmp, path)


# ---------------------------------------------------------------- the value
def test_membership_from_json_normalises_and_checks():
    m = from_json({"prefill": [{"url": "http://p0:30000/", "bootstrap_port": 8998}, {"url": "http://p1:30000"}],
                   "decode": [{"url": "http://d0:30001"}]}, "f")
    assert m.prefill == (PrefillSpec("http://p0:30000", 8998), PrefillSpec("http://p1:30000", None))
    assert m.decode == ("http://d0:30001",)
    assert m.to_json()["prefill"][1] == {"url": "http://p1:30000", "bootstrap_port": None}


@pytest.mark.parametrize("doc,match", [
    ({"prefill": GOOD["prefill"], "decode": []}, "the decode list is empty"),
    ({"prefill": GOOD["prefill"]}, "no \"decode\" list"),
    ({"prefill": [], "decode": GOOD["decode"]}, "the prefill list is empty"),
    ({**GOOD, "decode": [{"url": "http://d0:30001"}, {"url": "http://D0:30001/"}]}, "decode lists 'http://d0:30001' and"),
    ({**GOOD, "decode": [{"url": "http://d0:30001"}, {"url": "http://d0:30001"}]}, "decode lists 'http://d0:30001' twice"),
    ({**GOOD, "decode": [{"url": "http://p0:30000"}]}, "both a prefill and a decode worker"),
    ({**GOOD, "decode": [{"url": "d0:30001"}]}, "not a URL like http://host:port"),
    ({**GOOD, "decode": [{"url": "https://d0:30001"}]}, "plain http://"),
    ({**GOOD, "decode": [{"url": "http://d0:99999"}]}, "port out of range"),
    ({**GOOD, "decode": [{"url": 5}]}, "non-empty string"),
    ({**GOOD, "prefill": [{"url": "http://p0:1", "bootstrap_port": 0}]}, "bootstrap_port must be an integer"),
    ({**GOOD, "prefill": [{"url": "http://p0:1", "bootstrap_port": "8998"}]}, "bootstrap_port must be an integer"),
    ({**GOOD, "prefill": [{"url": "http://p0:1", "bootstrap-port": 8998}]}, "unknown key 'bootstrap-port'"),
    ({**GOOD, "workers": []}, "unknown key 'workers'"),
    ({**GOOD, "decode": "http://d0:30001"}, "\"decode\" must be a list"),
    ([GOOD], "expected a JSON object"),
])
def test_membership_invalid_documents_are_one_line_errors(doc, match):
    with pytest.raises(MembershipError, match=match) as e:
        from_json(doc, "workers file w.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("workers file w.json: ")


def test_membership_diff_per_role():
    a = Membership((PrefillSpec("http://p0:1", 8998),), ("http://d0:1", "http://d1:1"))
    b = Membership((PrefillSpec("http://p0:1", 9000), PrefillSpec("http://p1:1")), ("http://d1:1/", "http://d2:1"))
    d = diff(a, b)
    assert [w.url for w in d.added_prefill] == ["http://p0:1", "http://p1:1"]
    assert [w.bootstrap_port for w in d.removed_prefill] == [8998]  # a changed bootstrap port: removed and added
    assert d.added_decode == ["http://d2:1"] and d.removed_decode == ["http://d0:1"]
    assert diff(a, a).empty and diff(a, Membership(a.prefill, tuple(reversed(a.decode)))).empty
    assert "+decode http://d2:1" in d.describe() and "-decode http://d0:1" in d.describe()


def test_membership_union_keeps_the_first_sources_entry():
    flags = Membership((PrefillSpec("http://p0:1", 8998),), ("http://d0:1",))
    file = Membership((PrefillSpec("http://P0:1/", 9999), PrefillSpec("http://p1:1", 7000)), ("http://d0:1", "http://d1:1"))
    conflicts: list[str] = []
    u = flags.union(file, conflicts)
    assert u.prefill == (PrefillSpec("http://p0:1", 8998), PrefillSpec("http://p1:1", 7000))
    assert u.decode == ("http://d0:1", "http://d1:1")
    assert len(conflicts) == 1 and "bootstrap port 8998" in conflicts[0]
    # a worker that is decode in one source and prefill in the other keeps the first role
    conflicts.clear()
    u = flags.union(Membership((PrefillSpec("http://d0:1"),), ()), conflicts)
    assert u.prefill == flags.prefill and u.decode == flags.decode and "already decode" in conflicts[0]


# ---------------------------------------------------------------- the file
@pytest.mark.parametrize("text,match", [
    ('{"prefill": [{"url": "http://p0:30000", "bootstr', "ends early"),
    ("", "ends early"),
    ("{'prefill': []}", "not valid JSON"),
    ("<html>", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    ("[" * 100000 + "]" * 100000, "nested too deeply|not valid JSON"),
])
def test_workers_file_unparsable_versions_are_refused(text, match):
    with pytest.raises(WorkersFileError, match=match):
        parse(text if isinstance(text, bytes) else text.encode(), "w.json")


def run_file(path, body, interval=0.05, need_prefill=True):
    changes: list[Membership] = []
    wf = WorkersFile(str(path), changes.append, interval, need_prefill=need_prefill)

    async def main():
        task = asyncio.ensure_future(wf.run())
        try:
            await body(wf, changes)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return wf, changes


async def until(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def test_workers_file_bad_versions_keep_the_last_good_with_one_line_each(tmp_path, caplog):
    path = tmp_path / "workers.json"
    write(path, GOOD)
    bad_versions = [
        '{"prefill": [{"url": "http://p0:30000", "bootstrap_port": 8998}], "decode": [{"url": "http://d0:3',  # half-written
        "garbage \x00",
        {**GOOD, "decode": [{"url": "http://d0:30001"}, {"url": "http://d0:30001"}]},  # duplicate
        {**GOOD, "decode": []},  # empty decode list
        {**GOOD, "decode": [{"url": "ftp://d0"}]},  # bad URL
    ]

    async def body(wf, changes):
        await until(lambda: len(changes) == 1, what="first version")
        good = changes[0]
        for i, bad in enumerate(bad_versions):
            write(path, bad)
            await until(lambda: wf.refused == i + 1, what=f"bad version {i} refused")
            await asyncio.sleep(0.2)  # four more polls of the same bad version
            assert wf.refused == i + 1 and wf.membership == good and len(changes) == 1
        path.unlink()  # a file that disappears keeps the last good too
        await until(lambda: wf.refused == len(bad_versions) + 1)
        assert "not found" in wf.last_error and wf.membership == good
        newer = {**GOOD, "decode": GOOD["decode"] + [{"url": "http://d1:30001"}]}
        write(path, newer)
        await until(lambda: len(changes) == 2, what="good version after the bad ones")
        assert changes[1].decode == ("http://d0:30001", "http://d1:30001") and wf.last_error is None

    with caplog.at_level(logging.WARNING, logger="eldr.router.discovery"):
        run_file(path, body)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(bad_versions) + 1  # one line per bad version, none per poll
    assert all("\n" not in m and "keeping the last good membership" in m for m in lines)
    assert "ends early" in lines[0] and "twice" in lines[2] and "decode list is empty" in lines[3]


def test_workers_file_change_applies_within_the_interval(tmp_path):
    path = tmp_path / "workers.json"
    write(path, GOOD)
    interval = 0.2
    delays = []

    async def body(wf, changes):
        await until(lambda: len(changes) == 1)
        for k in range(3):
            doc = {**GOOD, "decode": GOOD["decode"] + [{"url": f"http://d{k + 1}:30001"}]}
            t0 = time.monotonic()
            write(path, doc)
            await until(lambda: len(changes) == k + 2, timeout=5 * interval)
            delays.append(time.monotonic() - t0)
            assert changes[-1].decode[-1] == f"http://d{k + 1}:30001"

    run_file(path, body, interval=interval)
    assert max(delays) <= interval + 0.3, delays  # a poll every interval, plus a loaded machine's slack


def test_workers_file_same_size_rewrite_is_seen(tmp_path):
    """A rewrite with the same size (and, on a coarse clock, the same mtime) is still read."""
    path = tmp_path / "workers.json"
    write(path, GOOD)

    async def body(wf, changes):
        await until(lambda: len(changes) == 1)
        st = os.stat(path)
        with open(path, "w") as f:  # in place, same length: d0 -> d9
            f.write(json.dumps(GOOD).replace("d0", "d9"))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        await until(lambda: len(changes) == 2)
        assert changes[1].decode == ("http://d9:30001",)

    run_file(path, body)


def test_workers_file_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "workers.json"
    os.mkfifo(path)

    async def body(wf, changes):
        t0 = time.monotonic()
        await until(lambda: wf.refused == 1, timeout=2)
        assert time.monotonic() - t0 < 1 and "not a regular file" in wf.last_error and changes == []

    run_file(path, body)


def test_workers_file_beside_prefill_flags_may_list_decode_only(tmp_path):
    path = tmp_path / "workers.json"
    write(path, {"decode": [{"url": "http://d0:30001"}]})

    async def body(wf, changes):
        await until(lambda: len(changes) == 1)
        assert changes[0].prefill == () and changes[0].decode == ("http://d0:30001",)

    run_file(path, body, need_prefill=False)


# ---------------------------------------------------------------- the hook
def test_membership_hook_file_alone_starts_with_the_first_good_version(tmp_path):
    path = tmp_path / "workers.json"
    write(path, {**GOOD, "decode": []})  # invalid at start: start-up waits

    async def main():
        hook = MembershipHook(Membership(), DiscoverySettings(workers_file=str(path), file_interval_s=0.05))
        applied_cb = []
        hook.apply_cb = applied_cb.append
        await hook.start()
        try:
            with pytest.raises(ValueError, match="no workers from discovery in 0.3 s: .*decode list is empty"):
                await hook.first(timeout_s=0.3)
            write(path, GOOD)
            m = await asyncio.wait_for(hook.first(), 5)
            assert m.decode == ("http://d0:30001",) and hook.applied == m
            st = hook.status()
            assert st["pending"] is False and st["applied"] == st["desired"] == m.to_json()
            # a later change is desired and handed to apply_cb; pending until the applier sets `applied`
            write(path, {**GOOD, "decode": GOOD["decode"] + [{"url": "http://d1:30001"}]})
            await until(lambda: hook.changes == 1)
            assert [m.decode for m in applied_cb] == [("http://d0:30001", "http://d1:30001")]
            st = hook.status()
            assert st["pending"] is True and st["live_apply"] is True
            assert st["pending_change"]["added_decode"] == ["http://d1:30001"]
            assert st["applied"]["decode"] == [{"url": "http://d0:30001"}]
            assert st["sources"]["workers_file"]["ok"] is True
        finally:
            await hook.stop()

    asyncio.run(main())


def test_membership_hook_unions_flags_and_file_flags_win(tmp_path, caplog):
    path = tmp_path / "workers.json"
    write(path, {"prefill": [{"url": "http://p0:30000", "bootstrap_port": 1111}, {"url": "http://p1:30000"}],
                 "decode": [{"url": "http://d5:30001"}]})
    static = Membership((PrefillSpec("http://p0:30000", 8998),), ("http://d0:30001",))

    async def main():
        hook = MembershipHook(static, DiscoverySettings(workers_file=str(path), file_interval_s=0.05))
        await hook.start()
        try:
            m = await asyncio.wait_for(hook.first(), 5)
        finally:
            await hook.stop()
        return m

    with caplog.at_level(logging.WARNING, logger="eldr.router.discovery"):
        m = asyncio.run(main())
    assert m.prefill == (PrefillSpec("http://p0:30000", 8998), PrefillSpec("http://p1:30000", None))
    assert m.decode == ("http://d0:30001", "http://d5:30001")
    assert any("first source's entry kept" in r.getMessage() and "1111" in r.getMessage() for r in caplog.records)
