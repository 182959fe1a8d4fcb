"""The router past its capacity (issue 12): admission control, and overload that must not
empty the worker pool.

Black-box, over the router's HTTP surface: a router subprocess in front of emulated workers on
loopback. A request holds its admission slot while the prefill delays its signature event
(the emulator's `signature: delay:S` control), which makes "more requests than slots" exact
without timing anything. Every wait is bounded; no test asserts how fast anything is beyond
comparing answers with each other and generous timeouts.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import (  # noqa: E402
    get_json, make_trace_files, metric, post, start_cluster, start_router,
)

TIME_SCALE = 0.05
N_TRACE = 60
CLIENT_TIMEOUT = 60.0
HOLD_S = 3.0  # how long a slow request holds its slot (the prefill's signature delay)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("overload-rust")


@pytest.fixture(scope="module")
def trace_files(workdir):
    return make_trace_files(workdir, requests=N_TRACE, seed=21, workers=3)


@pytest.fixture(scope="module")
def cluster(trace_files, workdir):
    _, tpath, _ = trace_files
    proc, urls = start_cluster(tpath, workdir, prefill=1, decode=3, time_scale=TIME_SCALE)
    yield urls
    proc.stop()


@pytest.fixture
def faults(cluster):
    """Set worker faults for one test; every worker is healthy again afterwards."""
    touched = []

    def setter(url: str, mode: str):
        status, _, body = post(url + "/emulator/fault", {"mode": mode}, timeout=10)
        assert status == 200, body
        touched.append(url)

    yield setter
    for url in touched:
        post(url + "/emulator/fault", {"mode": "none"}, timeout=10)


def rust_router(urls, trace_files, workdir, extra):
    _, _, cpath = trace_files
    return start_router(urls, workdir, ["--disagg-router", "eldr", "--no-eldr-drift",
                                        "--eldr-centroids", str(cpath), "--load-monitor-interval", "0.2",
                                        "--health-check-interval-secs", "0.3", *extra])


def body(i: int, hold_s: float = 0.0, stream: bool = False) -> dict:
    ctl = {"trace_request": i % N_TRACE}
    if hold_s:
        ctl["signature"] = f"delay:{hold_s}"
    return {"text": f"ov{i}", "stream": stream, "sampling_params": {"max_new_tokens": 4}, "emulator": ctl}


async def _one(s, base: str, b: dict) -> dict:
    t0 = time.monotonic()
    async with s.post(base + "/generate", json=b) as r:
        data = await r.read()
        return {"status": r.status, "body": data, "retry_after": r.headers.get("Retry-After"),
                "ctype": r.headers.get("Content-Type", ""), "t_end": time.monotonic(), "t0": t0}


def burst(base: str, bodies: list[dict]) -> list[dict]:
    """Send every body at once (one connection each) and wait for all answers."""
    async def go():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as s:
            return await asyncio.gather(*(_one(s, base, b) for b in bodies))

    return asyncio.run(go())


def metrics(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def wait_for(base: str, pred, timeout: float = 20.0) -> dict:
    """Poll /eldr/status until pred(status) holds (or the timeout: the status is returned anyway)."""
    deadline = time.monotonic() + timeout
    while True:
        st = get_json(base + "/eldr/status")
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def idle(st: dict) -> bool:
    adm = st.get("admission") or {}
    return (not any(st["decode_inflight"]) and not any(st["prefill_inflight"])
            and adm.get("in_flight") == 0 and adm.get("waiting") == 0)


def overloaded_error(r: dict) -> dict:
    assert r["ctype"].startswith("application/json"), r
    err = json.loads(r["body"])["error"]
    assert err["type"] == "overloaded" and "overloaded" in err["message"], err
    assert r["retry_after"] is not None and int(r["retry_after"]) >= 1, r
    return err


# ------------------------------------------------------------------ admission control
def test_overload_past_the_bound_is_refused_at_once_and_the_admitted_succeed(cluster, trace_files, workdir):
    """4 slots, a queue of 4, 24 slow requests at once: 8 are served (4 at once, 4 after
    waiting), 16 are refused with 429 + Retry-After + a JSON error, each answered before any
    admitted request ends (nothing waits for a slot it cannot get). Afterwards no slot, queue
    place or in-flight count stays held, and every worker is routable."""
    router, base = rust_router(cluster, trace_files, workdir, ["--max-concurrent-requests", "4", "--queue-size", "4"])
    try:
        results = burst(base, [body(i, hold_s=HOLD_S) for i in range(24)])
        ok = [r for r in results if r["status"] == 200]
        refused = [r for r in results if r["status"] == 429]
        assert len(ok) == 8 and len(refused) == 16, sorted(r["status"] for r in results)
        for r in refused:
            assert "queue" in overloaded_error(r)["message"]
        assert max(r["t_end"] for r in refused) < min(r["t_end"] for r in ok), "a refusal waited for a slot"
        st = wait_for(base, idle)
        assert idle(st), st
        assert st["admission"]["limit"] == 4 and st["admission"]["queue_size"] == 4
        assert all(st["decode_healthy"]) and all(st["prefill_healthy"]), st
        text = metrics(base)
        assert metric(text, "eldr_router_admission_admitted_total") == 8
        assert metric(text, "eldr_router_admission_admitted_total", how="queued") == 4
        assert metric(text, "eldr_router_admission_queued_total") == 4
        assert metric(text, "eldr_router_admission_rejected_total", reason="queue_full") == 16
        assert metric(text, "eldr_router_admission_in_flight") == 0
        # the router serves normally again
        after = burst(base, [body(100 + i) for i in range(6)])
        assert [r["status"] for r in after] == [200] * 6
    finally:
        router.stop()


def test_a_wait_past_the_queue_timeout_is_a_503_with_retry_after(cluster, trace_files, workdir):
    """One slot held by a slow request: the next waits in the queue and gets 503 +
    Retry-After when the queue timeout ends, while the slot's holder still runs."""
    router, base = rust_router(cluster, trace_files, workdir, ["--max-concurrent-requests", "1", "--queue-size", "2",
                                                               "--queue-timeout-secs", "0.5"])
    try:
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as s:
                slow = asyncio.ensure_future(_one(s, base, body(1, hold_s=HOLD_S)))
                await asyncio.sleep(0.3)
                waiter = await _one(s, base, body(2))
                return await slow, waiter

        slow, waiter = asyncio.run(go())
        assert slow["status"] == 200, slow
        assert waiter["status"] == 503, waiter
        assert "queue timeout" in overloaded_error(waiter)["message"]
        assert waiter["t_end"] < slow["t_end"]
        assert metric(metrics(base), "eldr_router_admission_rejected_total", reason="queue_timeout") == 1
        assert idle(wait_for(base, idle))
    finally:
        router.stop()


def _raw_request(port: int, b: dict) -> socket.socket:
    """Send a request on a plain socket and leave it open (no answer read)."""
    data = json.dumps(b).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_a_queued_client_that_goes_away_frees_its_place(cluster, trace_files, workdir):
    """One slot (held by a slow request) and a queue of one: a queued client that hangs up
    gives its place back at once (not at the queue timeout), so the next request is queued
    and served instead of refused."""
    router, base = rust_router(cluster, trace_files, workdir, ["--max-concurrent-requests", "1", "--queue-size", "1",
                                                               "--queue-timeout-secs", "60"])
    port = int(base.rsplit(":", 1)[1])
    try:
        holder = _raw_request(port, body(1, hold_s=HOLD_S))
        st = wait_for(base, lambda s: s["admission"]["in_flight"] == 1)
        assert st["admission"]["in_flight"] == 1, st
        queued = _raw_request(port, body(2))
        st = wait_for(base, lambda s: s["admission"]["waiting"] == 1)
        assert st["admission"]["waiting"] == 1, st
        queued.close()  # the client goes away while it waits
        st = wait_for(base, lambda s: s["admission"]["waiting"] == 0, timeout=10)
        assert st["admission"]["waiting"] == 0, "the gone client still holds its queue place"
        # the place is free again: this one waits for the slot and is served
        status, _, data = post(base + "/generate", body(3), timeout=CLIENT_TIMEOUT)
        assert status == 200, data
        holder.settimeout(CLIENT_TIMEOUT)
        assert holder.recv(64).startswith(b"HTTP/1.1 200"), "the slot's holder was served"
        holder.close()
        assert idle(wait_for(base, idle))
        assert metric(metrics(base), "eldr_router_admission_rejected_total") == 0
    finally:
        router.stop()


# ------------------------------------------------------------------ overload vs faults
def test_every_decode_timing_out_under_load_is_not_ejected(cluster, trace_files, workdir, faults):
    """All decode workers stop answering while requests keep coming (what an overloaded
    cluster looks like from the router): requests end with timely 504s, never a 503 'no
    healthy decode worker', and since no worker is slower than the others none is ejected
    (at most one charged failure each). When they answer again, every one is routable at once
    (the eject time, 60 s, is far longer than the test)."""
    fast = ["--first-byte-timeout-secs", "1.0", "--stall-timeout-secs", "1.0", "--request-timeout-secs", "20",
            "--eject-after-failures", "2", "--eject-base-secs", "60", "--retries", "1"]
    router, base = rust_router(cluster, trace_files, workdir, fast)
    try:
        for url in cluster["decode"]:
            faults(url, "hang")
        results = burst(base, [body(i, stream=i % 2 == 0) for i in range(12)])
        statuses = [r["status"] for r in results]
        assert all(s == 504 for s in statuses), (statuses, [r["body"][:160] for r in results][:3])
        st = get_json(base + "/eldr/status")
        assert all(st["decode_healthy"]), [w["circuit"] for w in st["decode_workers"]]
        text = metrics(base)
        assert metric(text, "eldr_router_ejections_total", role="decode") == 0
        assert metric(text, "eldr_router_overload_timeouts_total", role="decode") >= 1
        for url in cluster["decode"]:
            faults(url, "none")
        assert idle(wait_for(base, idle))
        after = burst(base, [body(100 + i) for i in range(9)])
        assert [r["status"] for r in after] == [200] * 9
    finally:
        router.stop()


def test_panic_mode_serves_when_every_decode_fails_its_health_check(cluster, trace_files, workdir, faults):
    """Every decode worker's /health answers too slowly for the poll timeout (a busy worker),
    so the health checks mark all of them down, though they serve requests fine: the router
    routes across them anyway (panic mode) instead of answering 503 'no healthy decode
    worker', and counts it."""
    for url in cluster["decode"]:
        faults(url, "status_delay:2")
    router, base = rust_router(cluster, trace_files, workdir, ["--worker-poll-timeout-secs", "0.2",
                                                               "--health-failure-threshold", "1"])
    try:
        st = wait_for(base, lambda s: not any(s["decode_healthy"]))
        assert not any(st["decode_healthy"]), st["decode_healthy"]
        results = burst(base, [body(i) for i in range(6)])
        assert [r["status"] for r in results] == [200] * 6, [r["body"][:160] for r in results]
        assert metric(metrics(base), "eldr_router_panic_routes_total", role="decode") == 6
        assert idle(wait_for(base, idle))
    finally:
        router.stop()


# ------------------------------------------------------------------ request bodies (issue 33)
def _partial(port: int, body: bytes) -> socket.socket:
    """A connection that sent its request head and all of `body` but its last byte."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s.sendall(head + body[:-1])
    return s


def _answer(s: socket.socket) -> tuple[int, bytes]:
    """The status and first bytes of the answer on `s` (the socket's timeout bounds the wait)."""
    data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data[9:12]), data


def test_request_bodies_held_at_once_are_bounded(cluster, trace_files, workdir):
    """Issue 33 red team: 100 connections each holding a 7.9 MB body less its last byte took the
    router from 101 to 914 MB. Bodies were read whole before admission, with no bound on their
    sum. Now the bytes of request bodies the router holds at once are bounded
    (--max-buffered-bytes): a body that would pass the bound is refused with a 503 naming the
    flag at once, unread, and counted; the bytes held, which the router reports, never pass the
    bound; the held requests are served when their bodies complete."""
    limit, n = 4 << 20, 10
    router, base = rust_router(cluster, trace_files, workdir, ["--max-buffered-bytes", str(limit),
                                                             "--max-payload-size", str(2 << 20)])
    port = int(base.rsplit(":", 1)[1])
    payload = json.dumps(body(1) | {"text": "x" * (1 << 20)}).encode()  # 1 MiB and some: 3 fit in 4 MiB
    socks = []
    try:
        socks = [_partial(port, payload) for _ in range(n)]
        st = wait_for(base, lambda s: metric(metrics(base), "eldr_router_admission_rejected_total", reason="buffer_full") >= n - 3)
        refused = metric(metrics(base), "eldr_router_admission_rejected_total", reason="buffer_full")
        assert refused == n - 3, refused
        adm = get_json(base + "/eldr/status")["admission"]
        assert adm["buffer_limit"] == limit and 3 * len(payload) <= adm["buffered_bytes"] <= limit, adm
        answers = []
        for s in socks:
            s.settimeout(0.5)
            try:
                answers.append(_answer(s))
            except socket.timeout:
                answers.append((None, b""))  # held: its body is not complete yet
        over = [a for a in answers if a[0] == 503]
        assert len(over) == n - 3 and all(b"--max-buffered-bytes" in a[1] for a in over), [a[0] for a in answers]
        held = [s for s, a in zip(socks, answers) if a[0] is None]
        assert len(held) == 3
        for s in held:
            s.settimeout(30)
            s.sendall(payload[-1:])
        assert [_answer(s)[0] for s in held] == [200] * 3
        st = wait_for(base, idle)
        assert st["admission"]["buffered_bytes"] == 0, st["admission"]
    finally:
        for s in socks:
            s.close()
        router.stop()


def test_a_request_is_admitted_before_its_body_is_read(cluster, trace_files, workdir):
    """Issue 33: admission comes before the body is read, so a request past the bound is
    refused (429) while its body is still arriving, instead of being buffered whole first."""
    router, base = rust_router(cluster, trace_files, workdir, ["--max-concurrent-requests", "2", "--queue-size", "0"])
    port = int(base.rsplit(":", 1)[1])
    payload = json.dumps(body(2) | {"text": "y" * (256 << 10)}).encode()
    socks = []
    try:
        socks = [_partial(port, payload) for _ in range(2)]
        wait_for(base, lambda s: s["admission"]["in_flight"] == 2)
        third = _partial(port, payload)
        socks.append(third)
        status, data = _answer(third)  # within the socket's 20 s, its body still one byte short
        assert status == 429 and b"overloaded" in data, data[:300]
        assert get_json(base + "/eldr/status")["admission"]["buffered_bytes"] <= 2 * len(payload)
        for s in socks[:2]:
            s.sendall(payload[-1:])
        assert [_answer(s)[0] for s in socks[:2]] == [200, 200]
    finally:
        for s in socks:
            s.close()
        router.stop()
