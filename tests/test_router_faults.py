"""The router against workers that fail in ways other than refusing connections (issue 10).

Everything goes through the router's HTTP surface (a router subprocess in front of emulated
workers on loopback), so these tests keep holding when the data plane moves. The emulator's
faults (`POST /emulator/fault`) are the ones real workers show: accept and never answer, go
silent mid-stream, 500 to everything while /health stays green, bad /v1/loads answers. A
prefill that is down is a port nothing listens on. Every wait is bounded; no test asserts
how fast anything is, only that nothing waits past the timeouts the router was given.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import shutil
import socket
import threading
import time
import urllib.request

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import free_port, get_json, metric, post, start_router  # noqa: E402
from eldr_sglang import _core  # noqa: E402

TIME_SCALE = 0.05
N_TRACE = 120
# the emulated cluster and trace of this suite (tests/conftest.py starts them)
TRACE = dict(requests=N_TRACE, seed=11, workers=3)
CLUSTER = dict(prefill=2, decode=3)
# Short timeouts so a test sees many of them; the client's own limit is far above them.
FAST = ["--first-byte-timeout-secs", "1.5", "--stall-timeout-secs", "1.5", "--request-timeout-secs", "20",
        "--eject-after-failures", "2", "--eject-base-secs", "60", "--upstream-connect-timeout-secs", "2"]
CLIENT_TIMEOUT = 40.0


def set_fault(url: str, mode: str) -> None:
    status, _, body = post(url + "/emulator/fault", {"mode": mode}, timeout=10)
    assert status == 200, body


@pytest.fixture
def faults(cluster):
    """Set worker faults for one test; every worker is healthy again afterwards."""
    touched = []

    def setter(url: str, mode: str):
        set_fault(url, mode)
        touched.append(url)

    yield setter
    for url in touched:
        set_fault(url, "none")


def eldr_router(urls, trace_files, workdir, extra, policy: str = "eldr"):
    """The router under `policy`: a counts policy (late binding), a baseline (early binding),
    or EXPERIMENT: a switchback between both kinds, switching every second."""
    from eldr_sglang._core import COUNTS_POLICIES

    _, _, cpath = trace_files
    counts = ["--eldr-centroids", str(cpath), "--eldr-signature-timeout-secs", "2"]
    if policy == EXPERIMENT:
        choice = ["--experiment", "locality/0.05,round_robin", "--switch-every", "1s", *counts]
    else:
        choice = ["--disagg-router", policy, *(["--no-eldr-drift", *counts] if policy in COUNTS_POLICIES else [])]
    return start_router(urls, workdir, [*choice, "--load-monitor-interval", "0.2", "--health-check-interval-secs", "0.3",
                                        *extra])


# every policy fails over: eldr and locality bind late, the baselines early (re-sent on a
# fresh pair); and a switchback experiment alternating the two kinds every second
EXPERIMENT = "experiment"
POLICIES = [*_core.POLICIES, EXPERIMENT]


async def _request(s, base: str, i: int, stream: bool, rng: random.Random, extra_ctl=None):
    body = {"text": f"q{i}", "stream": stream, "sampling_params": {"max_new_tokens": rng.randint(3, 8)},
            "emulator": {"trace_request": rng.randrange(N_TRACE), **(extra_ctl or {})}}
    t0 = time.monotonic()
    async with s.post(base + "/generate", json=body) as r:
        data = await r.read()
        return {"status": r.status, "worker": int(r.headers.get("X-ELDR-Decode-Worker", -1)),
                "prefill": int(r.headers.get("X-ELDR-Prefill-Worker", -1)), "body": data,
                "seconds": time.monotonic() - t0, "stream": stream,
                "complete": (b"data: [DONE]" in data and b'"error"' not in data) if stream else r.status == 200}


def run_requests(base: str, n: int, concurrency: int, seed: int, stream_share: float = 1.0, extra_ctl=None):
    rng = random.Random(seed)

    async def go():
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as s:
            async def one(i):
                async with sem:
                    try:
                        return await _request(s, base, i, rng.random() < stream_share, rng, extra_ctl)
                    except asyncio.TimeoutError:
                        return {"status": "client_timeout", "worker": -1, "prefill": -1, "body": b"", "complete": False,
                                "seconds": CLIENT_TIMEOUT, "stream": None}

            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(go())


def metrics(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def wait_idle(base: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = get_json(base + "/eldr/status")
        if (not any(st["decode_inflight"]) and not any(st["prefill_inflight"])) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def decode_recv(url: str) -> int:
    return sum(e["event"] == "decode_recv" for e in get_json(url + "/emulator/log"))


# ------------------------------------------------------------------ decode faults
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fault", ["hang", "error500"])
def test_faulty_decode_is_ejected_and_its_requests_fail_over(cluster, trace_files, workdir, faults, fault, policy):
    """A decode worker that accepts and never answers, or answers 500 to everything (its
    /health stays green): every request still completes on another worker, within the
    timeouts; the worker is ejected and gets no more traffic. Under every policy: before,
    round_robin and shortest_queue failed about half the requests against a 500-ing decode."""
    faults(cluster["decode"][1], fault)
    router, base = eldr_router(cluster, trace_files, workdir, FAST, policy)
    try:
        results = run_requests(base, 60, concurrency=8, seed=1, stream_share=0.7 if fault == "error500" else 1.0)
        bad = [r for r in results if not (r["status"] == 200 and r["complete"])]
        assert not bad, [(r["status"], r["body"][:200]) for r in bad[:5]]
        assert all(r["worker"] in (0, 2) for r in results), "no answer came from the faulty worker"
        # nobody waited for the faulty worker longer than the first-byte timeout allows
        assert max(r["seconds"] for r in results) < 20
        st = get_json(base + "/eldr/status")
        assert st["decode_workers"][1]["circuit"] == "open" and st["decode_healthy"] == [True, False, True], st
        text = metrics(base)
        assert metric(text, "eldr_router_ejections_total", role="decode", worker="1") == 1
        assert metric(text, "eldr_router_retries_total", role="decode") >= 1
        # ejected: the next requests never reach it, though its /health answers
        seen = decode_recv(cluster["decode"][1])
        after = run_requests(base, 30, concurrency=8, seed=2)
        assert all(r["status"] == 200 and r["complete"] for r in after)
        assert decode_recv(cluster["decode"][1]) == seen
        st = wait_idle(base)
        assert st["decode_inflight"] == [0, 0, 0] and st["prefill_inflight"] == [0, 0]
    finally:
        router.stop()


@pytest.mark.parametrize("policy", ["round_robin", "eldr"])
def test_a_hung_decode_costs_no_request_under_the_default_timeouts(cluster, trace_files, workdir, faults, policy):
    """Issue 33 red team: under round robin, a decode that accepts and never answers (its
    /health still green) lost 7 of 16 sequential requests with a 12 s client limit: the 60 s
    first-byte timeout outlasted the clients, the worker was ejected only after clients had
    left, and each probation trial cost one more request. Now a decode stream must send its
    response head (SGLang sends it before running anything) within
    --decode-progress-timeout-secs (default 5), so a request that meets the hung decode fails
    over and completes, under the default timeouts; its ejection ends after 1 s here, so
    probation trials happen too, and cost no request either."""
    faults(cluster["decode"][1], "hang")
    router, base = eldr_router(cluster, trace_files, workdir, ["--eject-after-failures", "2", "--eject-base-secs", "1"],
                               policy)
    global CLIENT_TIMEOUT
    saved, CLIENT_TIMEOUT = CLIENT_TIMEOUT, 12.0
    try:
        results = run_requests(base, 16, concurrency=1, seed=12)
        bad = [r for r in results if not (r["status"] == 200 and r["complete"])]
        assert not bad, [(r["status"], r["body"][:200]) for r in bad]
        assert all(r["worker"] in (0, 2) for r in results)
        text = metrics(base)
        if policy == "round_robin":  # eldr's band may never choose worker 1
            assert metric(text, "eldr_router_upstream_timeouts_total", role="decode", worker="1", phase="progress") >= 2
            assert metric(text, "eldr_router_ejections_total", role="decode", worker="1") >= 1
    finally:
        CLIENT_TIMEOUT = saved
        router.stop()


@pytest.mark.parametrize("policy", POLICIES)
def test_dead_decode_is_marked_down_and_its_requests_fail_over(cluster, trace_files, workdir, policy):
    """A decode worker with nothing listening: refused connections mark it down at once, and
    every request is re-sent to a live one."""
    dead = f"http://127.0.0.1:{free_port()}"
    urls = {"prefill": cluster["prefill"], "decode": [cluster["decode"][0], dead, cluster["decode"][2]]}
    router, base = eldr_router(urls, trace_files, workdir, FAST, policy)
    try:
        results = run_requests(base, 40, concurrency=8, seed=11, stream_share=0.5)
        bad = [r for r in results if not (r["status"] == 200 and r["complete"])]
        assert not bad, [(r["status"], r["body"][:200]) for r in bad[:5]]
        assert all(r["worker"] in (0, 2) for r in results)
        assert get_json(base + "/eldr/status")["decode_healthy"][1] is False
        st = wait_idle(base)
        assert st["decode_inflight"] == [0, 0, 0] and st["prefill_inflight"] == [0, 0]
    finally:
        router.stop()


def test_ejected_decode_is_readmitted_after_probation(cluster, trace_files, workdir, faults):
    """Ejection ends with one trial request; a worker that recovered is back in rotation,
    one that still fails is ejected again for longer."""
    faults(cluster["decode"][2], "error500")
    router, base = eldr_router(cluster, trace_files, workdir, [*FAST[:-4], "--eject-base-secs", "1",
                                                               "--upstream-connect-timeout-secs", "2"])
    try:
        run_requests(base, 30, concurrency=6, seed=3, stream_share=0.5)
        st = get_json(base + "/eldr/status")
        assert st["decode_workers"][2]["ejections"] >= 1
        # still failing: the trial fails and the ejection gets longer (2 s, then 4 s, ...)
        deadline = time.monotonic() + 20
        while get_json(base + "/eldr/status")["decode_workers"][2]["ejections"] < 2 and time.monotonic() < deadline:
            run_requests(base, 6, concurrency=3, seed=4)
        assert get_json(base + "/eldr/status")["decode_workers"][2]["ejections"] >= 2
        set_fault(cluster["decode"][2], "none")  # recovered
        deadline = time.monotonic() + 30
        served = False
        while not served and time.monotonic() < deadline:
            out = run_requests(base, 12, concurrency=4, seed=5)
            assert all(r["status"] == 200 for r in out)
            served = any(r["worker"] == 2 for r in out)
            time.sleep(0.2)
        assert served, "the recovered worker gets traffic again"
        assert get_json(base + "/eldr/status")["decode_workers"][2]["circuit"] == "closed"
        text = metrics(base)
        assert metric(text, "eldr_router_probation_trials_total", role="decode", worker="2") >= 2
    finally:
        router.stop()


def test_decode_that_stalls_mid_stream_is_cut_and_frees_its_slot(cluster, trace_files, workdir, faults):
    """Bytes already reached the client, so the request cannot move: the stall timeout ends
    the stream with an error event, the slot comes back, the worker is charged."""
    faults(cluster["decode"][0], "hang_midstream")
    one = {"prefill": cluster["prefill"], "decode": cluster["decode"][:1]}
    router, base = start_router(one, workdir, ["--disagg-router", "shortest_queue", "--eldr-bind", "late",
                                               "--load-monitor-interval", "0", *FAST])
    try:
        results = run_requests(base, 4, concurrency=4, seed=6, extra_ctl=None)
        for r in results:
            assert r["status"] == 200 and not r["complete"], r
            assert b"no next chunk" in r["body"] and b"decode worker 0" in r["body"]
            assert r["seconds"] < 20
        st = wait_idle(base)
        assert st["decode_inflight"] == [0] and st["prefill_inflight"] == [0, 0]
        assert metric(metrics(base), "eldr_router_upstream_timeouts_total", role="decode", phase="stall") == 4
    finally:
        router.stop()


# ------------------------------------------------------------------ prefill faults
@pytest.mark.parametrize("policy", POLICIES)
def test_prefill_down_at_start_or_failing_is_ejected_and_failed_over(cluster, trace_files, workdir, faults, policy):
    """Prefill 0 has nothing listening, prefill 2 answers 500 to everything: every request
    still succeeds (re-sent to a working prefill with a new room) and both are taken out."""
    dead = [f"http://127.0.0.1:{free_port()}", free_port()]
    faults(cluster["prefill"][1][0], "error500")
    urls = {"prefill": [dead, cluster["prefill"][0], cluster["prefill"][1]], "decode": cluster["decode"]}
    router, base = eldr_router(urls, trace_files, workdir, FAST, policy)
    try:
        results = run_requests(base, 60, concurrency=8, seed=7, stream_share=0.5)
        bad = [r for r in results if not (r["status"] == 200 and r["complete"])]
        assert not bad, [(r["status"], r["body"][:200]) for r in bad[:5]]
        assert all(r["prefill"] == 1 for r in results)
        st = get_json(base + "/eldr/status")
        assert st["prefill_healthy"] == [False, True, False], st
        text = metrics(base)
        assert metric(text, "eldr_router_ejections_total", role="prefill", worker="2") == 1
        assert metric(text, "eldr_router_retries_total", role="prefill") >= 2
        st = wait_idle(base)
        assert st["prefill_inflight"] == [0, 0, 0]
    finally:
        router.stop()


# ------------------------------------------------------------------ /v1/loads
def test_bad_v1_loads_answers_never_stop_load_polling(cluster, workdir, faults):
    """Decode 0 answers /v1/loads with Infinity, 1e30, -5, HTML, a list, then not at all;
    the poller drops each, counts it, and keeps reporting decode 1's real load."""
    urls = {"prefill": cluster["prefill"][:1], "decode": cluster["decode"][:2]}
    router, base = start_router(urls, workdir, ["--disagg-router", "round_robin", "--load-monitor-interval", "0.1",
                                                "--health-check-interval-secs", "0", "--eldr-load-report-ttl-ms", "60000",
                                                "--worker-poll-timeout-secs", "0.3"])
    try:
        for mode in ("loads:inf", "loads:1e30", "loads:negative", "loads:nonjson", "loads:shape", "loads:hang"):
            faults(cluster["decode"][0], mode)
            time.sleep(0.5)
        text = metrics(base)
        for cause in ("bad_value", "not_json", "timeout"):
            assert metric(text, "eldr_router_load_reports_dropped_total", worker="0", cause=cause) >= 1, cause
        assert metric(text, "eldr_router_load_reports_dropped_total", worker="1") == 0

        async def hold_two_streams():  # round robin: one long stream on each decode worker
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as s:
                body = {"text": "long", "stream": True, "sampling_params": {"max_new_tokens": 100000}}
                async with s.post(base + "/generate", json=body) as a, s.post(base + "/generate", json=body) as b:
                    assert {a.headers["X-ELDR-Decode-Worker"], b.headers["X-ELDR-Decode-Worker"]} == {"0", "1"}
                    await a.content.readline()
                    await b.content.readline()
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        st = get_json(base + "/eldr/status")
                        if (st["decode_reported"][1] or 0) >= 1:
                            return st
                        await asyncio.sleep(0.1)
                    return get_json(base + "/eldr/status")

        st = asyncio.run(hold_two_streams())
        assert st["decode_reported"][1] >= 1, st  # polling is alive: decode 1's load is seen
        assert "Traceback" not in router.tail()
        wait_idle(base)
    finally:
        router.stop()


# ------------------------------------------------------------------ centroid file
def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_fifo_and_huge_file_at_the_centroid_path_never_stop_traffic(cluster, trace_files, workdir):
    _, _, cpath = trace_files
    live = workdir / "live-faults.eldr"
    shutil.copy(cpath, live)
    router, base = start_router(cluster, workdir, ["--disagg-router", "eldr", "--no-eldr-drift", "--eldr-centroids", str(live),
                                                   "--eldr-reload-interval-ms", "50", "--load-monitor-interval", "0",
                                                   *FAST])
    stop = threading.Event()
    results: list = []

    def traffic():
        seed = 100
        while not stop.is_set():
            results.extend(run_requests(base, 16, concurrency=8, seed=seed))
            seed += 1

    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(0.5)
        fifo = workdir / "fifo.tmp"
        os.mkfifo(fifo)
        os.replace(fifo, live)
        deadline = time.monotonic() + 20
        while "FIFO" not in str(get_json(base + "/eldr/status")["last_reload_error"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        st = get_json(base + "/eldr/status")
        assert "FIFO" in st["last_reload_error"] and st["centroid_file"]["ok"] is False, st
        n_fifo = len(results)
        time.sleep(1.0)
        assert len(results) > n_fifo, "traffic kept flowing with a FIFO at the centroid path"
        rss0 = _rss_kib(router.p.pid)
        huge = workdir / "huge.tmp"
        with open(huge, "wb") as f:
            f.truncate(3 << 30)  # sparse: 3 GiB that cost no disk
        os.replace(huge, live)
        deadline = time.monotonic() + 20
        while "magic" not in str(get_json(base + "/eldr/status")["last_reload_error"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        st = get_json(base + "/eldr/status")
        assert "bad magic" in st["last_reload_error"], st  # refused from its header, not read whole
        assert _rss_kib(router.p.pid) - rss0 < 256 * 1024, "the huge file was not read"
        gen = st["centroid_generation"]
        tmp = workdir / "good.tmp"
        shutil.copy(cpath, tmp)
        os.replace(tmp, live)  # a good file again: swapped in
        deadline = time.monotonic() + 20
        while get_json(base + "/eldr/status")["centroid_generation"] == gen and time.monotonic() < deadline:
            time.sleep(0.1)
        st = get_json(base + "/eldr/status")
        assert st["centroid_generation"] == gen + 1 and st["centroid_file"]["ok"], st
        assert metric(metrics(base), "eldr_router_centroid_files_rejected_total") == 2
    finally:
        stop.set()
        t.join(timeout=120)
        router.stop()
    assert results and all(r["status"] == 200 and r["complete"] for r in results), \
        [r["status"] for r in results if r["status"] != 200][:5]


def test_router_start_with_a_fifo_centroid_path_fails_fast(cluster, workdir):
    import subprocess
    import sys

    fifo = workdir / "start.fifo"
    os.mkfifo(fifo)
    argv = [sys.executable, "-m", "eldr_sglang.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
            "--port", str(free_port()), "--prefill", cluster["prefill"][0][0], str(cluster["prefill"][0][1])]
    for u in cluster["decode"]:
        argv += ["--decode", u]
    try:
        p = subprocess.run(argv + ["--eldr-centroids", str(fifo)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        pytest.fail("the router hung on a FIFO centroid path")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "FIFO" in p.stderr and "not a regular file" in p.stderr, p.stderr


# ------------------------------------------------------------------ signature payloads
@pytest.mark.parametrize("signature,why", [
    ({"raw": {"v": 1, "layers": [0, 1], "E": 32, "n": 5, "enc": "log", "bits": 4, "q": [10 ** 400, 3],
              "d": base64.b64encode(bytes(32)).decode()}}, "huge quantization scale"),
    ({"raw": {"v": 1, "layers": list(range(4096)), "E": 65536, "n": 1, "enc": "sparse", "bits": 1, "nnz": 0, "d": ""}},
     "a sparse payload claiming 4096 x 65536 counts"),
    ("deep:100000", "a payload nested 100,000 deep"),
    ("pad:20000000", "a 20 MB stream line"),
    ('text:{"v": 1, "layers": [0], "E": 4, "n": NaN, "enc": "dense", "bits": 8, "d": "AAAA"}',
     "a payload that is not JSON (n: NaN; issue 33)"),
])
def test_hostile_signature_payloads_fall_back_to_shortest_queue(cluster, trace_files, workdir, signature, why):
    router, base = eldr_router(cluster, trace_files, workdir, [])
    try:
        m0 = metrics(base)
        status, headers, body = post(base + "/generate", {"text": why, "sampling_params": {"max_new_tokens": 3},
                                                          "emulator": {"trace_request": 1, "signature": signature}}, timeout=60)
        assert status == 200, body[:300]
        assert headers["X-ELDR-Reason"].startswith("no_signature"), headers
        m1 = metrics(base)
        assert metric(m1, "eldr_router_fallbacks_total", reason="malformed") == metric(m0, "eldr_router_fallbacks_total",
                                                                                       reason="malformed") + 1
        assert metric(m1, "eldr_router_malformed_signatures_total") == metric(m0, "eldr_router_malformed_signatures_total") + 1
        status, headers, _ = post(base + "/generate", {"text": "after", "sampling_params": {"max_new_tokens": 2},
                                                       "emulator": {"trace_request": 1}})
        assert status == 200 and headers["X-ELDR-Reason"] == "band"
    finally:
        router.stop()


def test_signature_decoding_is_bounded_before_it_allocates():
    """The crafted sparse payload that stalled the loop for seconds: refused before any
    array is made (peak allocation stays small), with and without the centroid layout."""
    import tracemalloc

    from eldr_sglang.sglang_ext.payload import PayloadError, decode_payload

    crafted = {"v": 1, "layers": list(range(4096)), "E": 65536, "n": 1, "enc": "sparse", "bits": 1, "nnz": 0, "d": ""}
    for layout in (None, (24, 32)):
        tracemalloc.start()
        try:
            with pytest.raises(PayloadError):
                decode_payload(crafted, layout=layout)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, peak


# ------------------------------------------------------------------ client bodies
@pytest.fixture(scope="module")
def default_router(cluster, trace_files, workdir):
    proc, base = eldr_router(cluster, trace_files, workdir, [])
    yield base
    proc.stop()


@pytest.fixture(scope="module")
def plain_router(cluster, trace_files, workdir):
    proc, base = eldr_router(cluster, trace_files, workdir, ["--client-header-timeout-secs", "1",
                                                             "--client-body-timeout-secs", "1"])
    yield base
    proc.stop()


def test_deep_or_oversized_client_bodies_get_4xx(default_router):
    status, _, body = post(default_router + "/generate", b"[" * 50_000 + b"]" * 50_000)
    assert status == 400 and b"nested too deeply" in body
    big = json.dumps({"text": "a" * (9 << 20)}).encode()  # above the 8 MiB default
    status, _, body = post(default_router + "/generate", big)
    assert status == 413 and b"--max-payload-size" in body
    status, _, _ = post(default_router + "/generate", {"text": "fine", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200


def _closed_within(sock: socket.socket, send, limit: float) -> bool:
    """Feed the socket with `send()` every 0.2 s until the server closes it or `limit` passes."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096)
            if not data or b"HTTP/1.1 408" in data:
                return True
        except socket.timeout:
            pass
        except OSError:
            return True
        try:
            send()
        except OSError:
            return True
    return False


def test_slowloris_sockets_are_dropped(plain_router):
    host, port = plain_router.split("//")[1].split(":")
    # a request head that trickles in, one byte at a time
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(s, lambda: s.sendall(b"X"), limit=10), "a trickling request head held the socket"
    # a complete head whose body trickles in
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        assert _closed_within(s, lambda: s.sendall(b" "), limit=10), "a trickling body held the socket"
    status, _, _ = post(plain_router + "/generate", {"text": "still fine", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200


# ------------------------------------------------------------------ control endpoints
def test_control_endpoints_are_off_without_a_token(default_router):
    for path, body in (("/eldr/refit", {"force": True}), ("/flush_cache", {})):
        status, _, out = post(default_router + path, body)
        assert status in (403, 404), (path, status)  # 404: drift handling is off in this router
        if path == "/flush_cache":
            assert status == 403 and b"--admin-token" in out


def test_control_endpoints_need_the_token_and_escape_what_they_log(cluster, trace_files, workdir):
    token = "faults-admin-token-0123456789abcdef"
    _, _, cpath = trace_files
    router, base = start_router(cluster, workdir, ["--disagg-router", "eldr", "--eldr-centroids", str(cpath),
                                                   "--load-monitor-interval", "0", "--admin-token", token])
    try:
        for path in ("/eldr/refit", "/flush_cache"):
            assert post(base + path, {"force": True})[0] == 401
            assert post(base + path, {"force": True}, headers={"Authorization": "Bearer wrong-token-of-some-length"})[0] == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert post(base + "/flush_cache", {}, headers=auth)[0] == 200
        forged = "x\n2026-01-01 00:00:00 INFO eldr.router: FORGED admin login"
        status, _, out = post(base + "/eldr/refit", {"force": True, "reason": forged}, headers=auth)
        assert status == 422, out  # authorized, but too few signatures yet
        assert "\n" not in json.loads(out)["reason"] and "FORGED" in json.loads(out)["reason"]
        assert not any(line.startswith("2026-01-01") for line in router.tail().splitlines())
    finally:
        router.stop()
