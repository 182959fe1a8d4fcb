"""Router reliability over its HTTP surface (issue 11, found in the issue-9/10 runs).

- A busy worker whose /health and /v1/loads take seconds is neither ejected nor dropped from
  load reports: the poll timeout is its own flag (--worker-poll-timeout-secs), not
  min(interval, 5 s).
- A non-streamed request to a decode that hangs moves on after the first-byte timeout (the
  decode never took the KV) instead of waiting the whole request timeout.
"""

from __future__ import annotations

import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from pd_cluster import get_json, make_trace_files, metric, start_cluster  # noqa: E402
from test_router_faults import FAST, eldr_router, metrics, run_requests, set_fault, wait_idle  # noqa: E402

TIME_SCALE = 0.05


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def trace_files(workdir):
    return make_trace_files(workdir, requests=60, seed=5, workers=3)


@pytest.fixture(scope="module")
def cluster(trace_files, workdir):
    _, tpath, _ = trace_files
    proc, urls = start_cluster(tpath, workdir, prefill=1, decode=3, time_scale=TIME_SCALE)
    yield urls
    proc.stop()


def test_slow_status_answers_are_waited_for_not_ejected(cluster, trace_files, workdir):
    """/health and /v1/loads of decode 1 answer after 0.8 s, while the router polls health
    every 0.3 s (2 misses eject) and loads every 0.2 s: with the default poll timeout the worker
    stays healthy and its load reports arrive; the other workers' polls are not held up."""
    set_fault(cluster["decode"][1], "status_delay:0.8")
    router, base = eldr_router(cluster, trace_files, workdir, ["--health-failure-threshold", "2"])
    try:
        time.sleep(4.0)  # >= 10 health periods and 20 load periods
        st = get_json(base + "/eldr/status")
        assert st["decode_healthy"] == [True, True, True], st["decode_healthy"]
        text = metrics(base)
        assert metric(text, "eldr_router_load_reports_dropped_total", worker="1") == 0
        assert st["decode_reported"][1] is not None
    finally:
        set_fault(cluster["decode"][1], "none")
        router.stop()
    # an explicit short timeout still treats the slow worker as down (the flag is honoured)
    set_fault(cluster["decode"][1], "status_delay:0.8")
    router, base = eldr_router(cluster, trace_files, workdir, ["--health-failure-threshold", "2",
                                                                "--worker-poll-timeout-secs", "0.2"])
    try:
        deadline = time.monotonic() + 10
        while get_json(base + "/eldr/status")["decode_healthy"][1] and time.monotonic() < deadline:
            time.sleep(0.1)
        st = get_json(base + "/eldr/status")
        assert st["decode_healthy"] == [True, False, True]
        assert metric(metrics(base), "eldr_router_load_reports_dropped_total", worker="1", cause="timeout") >= 1
    finally:
        set_fault(cluster["decode"][1], "none")
        router.stop()


def test_non_streamed_request_to_a_hung_decode_fails_over(cluster, trace_files, workdir):
    """Decode 1 accepts and never answers (nor takes the KV). Non-streamed requests routed
    there move on once the first-byte timeout passes without the KV taken, instead of waiting
    the request timeout (60 s, above the client's 40 s limit); the worker is ejected."""
    set_fault(cluster["decode"][1], "hang")
    router, base = eldr_router(cluster, trace_files, workdir, [*FAST, "--request-timeout-secs", "60"])
    try:
        results = run_requests(base, 24, concurrency=6, seed=4, stream_share=0.0)
        bad = [r for r in results if not (r["status"] == 200 and r["complete"])]
        assert not bad, [(r["status"], r["body"][:200]) for r in bad[:5]]
        assert all(r["worker"] in (0, 2) for r in results)
        text = metrics(base)
        assert metric(text, "eldr_router_retries_total", role="decode") >= 1
        assert metric(text, "eldr_router_ejections_total", role="decode", worker="1") == 1
        st = wait_idle(base)
        assert st["decode_inflight"] == [0, 0, 0] and st["prefill_inflight"] == [0]
    finally:
        set_fault(cluster["decode"][1], "none")
        router.stop()
