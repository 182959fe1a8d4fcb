"""The split between the Rust data plane and the Python control plane, over HTTP, against the
emulated PD cluster.

The request path runs in the extension's tokio/hyper server; Python keeps the control plane
on an internal port, to which the Rust server forwards every path it does not serve. These
tests drive both through the public port only: forwarding, metrics read from the Rust
counters, the drift feed, and the start-up refusal of workers it cannot speak to. The other
HTTP-surface suites (test_e2e_pd, test_router_faults, ...) check request validation, 413s,
client disconnects, failover and the rest of the request path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.router.dataplane import DriftView  # noqa: E402
from eldr_sglang.testing.pd_cluster import REPO, free_port, get_json, metric, post, start_router  # noqa: E402

TIME_SCALE = 0.05
# the emulated cluster and trace of this suite (tests/conftest.py starts them)
TRACE = dict(requests=40, seed=21, workers=3)
CLUSTER = dict(prefill=2, decode=3)


@pytest.fixture(scope="module")
def router(cluster, trace_files, workdir):
    _, _, cpath = trace_files
    proc, base = start_router(cluster, workdir, ["--disagg-router", "eldr", "--no-eldr-drift",
                                                 "--eldr-centroids", str(cpath), "--eldr-signature-timeout-secs", "2",
                                                 "--load-monitor-interval", "0.2", "--health-check-interval-secs", "0.5"])
    yield base
    proc.stop()


def _metrics(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def _wait_idle(base: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = get_json(base + "/eldr/status")
        if (not any(st["decode_inflight"]) and not any(st["prefill_inflight"])) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_control_plane_paths_are_forwarded(router):
    with __import__("urllib.request").request.urlopen(router + "/health", timeout=10) as r:
        assert r.status == 200 and r.read() == b"ok"
    st = get_json(router + "/eldr/status")
    assert st["data_plane"] == "rust" and st["policy"] == "eldr"
    assert [w["circuit"] for w in st["decode_workers"]] == ["closed"] * 3
    assert get_json(router + "/v1/models")["data"]
    status, _, _ = post(router + "/no/such/path", {})
    assert status == 404  # the control plane's answer, passed on


def test_late_binding_non_streamed_and_streamed(router, cluster):
    rooms = {}
    for i, stream in enumerate([False, True, False, True]):
        status, headers, body = post(router + "/generate", {"text": f"p{i}", "stream": stream,
                                                            "sampling_params": {"max_new_tokens": 3},
                                                            "emulator": {"trace_request": i}})
        assert status == 200, body
        assert headers["X-ELDR-Reason"] == "band"
        if stream:
            assert headers["Content-Type"].startswith("text/event-stream")
            assert body.rstrip().endswith(b"data: [DONE]")
        else:
            assert json.loads(body)["meta_info"]["completion_tokens"] == 3
        rooms[int(headers["X-ELDR-Bootstrap-Room"])] = (int(headers["X-ELDR-Prefill-Worker"]), int(headers["X-ELDR-Decode-Worker"]))
    plogs = [get_json(u + "/emulator/log") for u, _ in cluster["prefill"]]
    dlogs = [get_json(u + "/emulator/log") for u in cluster["decode"]]
    for room, (p, d) in rooms.items():
        sent = [e["t"] for e in plogs[p] if e["event"] == "signature_sent" and e["room"] == room]
        recv = [e["t"] for e in dlogs[d] if e["event"] == "decode_recv" and e["room"] == room]
        assert len(sent) == 1 and len(recv) == 1 and sent[0] < recv[0]  # decode bound after the signature
    st = _wait_idle(router)
    assert st["decode_inflight"] == [0, 0, 0] and st["prefill_inflight"] == [0, 0]


def test_metrics_come_from_the_rust_counters(router):
    before = _metrics(router)
    n0 = metric(before, "eldr_router_requests_total", endpoint="generate", status="200")
    for i in range(3):
        assert post(router + "/generate", {"text": f"m{i}", "sampling_params": {"max_new_tokens": 2},
                                           "emulator": {"trace_request": i}})[0] == 200
    text = _metrics(router)
    assert metric(text, "eldr_router_requests_total", endpoint="generate", status="200") == n0 + 3
    assert metric(text, "eldr_router_decode_routes_total", reason="band") >= 3
    assert metric(text, "eldr_router_band_size_count") >= 3
    assert metric(text, "eldr_router_signature_wait_seconds_count") >= 3
    assert "eldr_router_queue_depth" in text and "eldr_router_worker_healthy" in text


def test_drift_monitor_is_fed_from_the_rust_plane(cluster, trace_files, workdir):
    """Drift handling on (the default for eldr): the monitor sees every routed request with
    its distances, and the refit reservoir gets unit signatures, drained off the request path."""
    _, _, cpath = trace_files
    proc, base = start_router(cluster, workdir, ["--disagg-router", "eldr", "--eldr-centroids", str(cpath),
                                                 "--load-monitor-interval", "0"])
    try:
        for i in range(6):
            assert post(base + "/generate", {"text": f"d{i}", "sampling_params": {"max_new_tokens": 2},
                                             "emulator": {"trace_request": i}})[0] == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = _metrics(base)
            if metric(text, "eldr_drift_observations_total") >= 6:
                break
            time.sleep(0.1)
        assert metric(text, "eldr_drift_observations_total") == 6
        assert metric(text, "eldr_reservoir_signatures") == 6
        assert metric(text, "eldr_drift_hook_signature_errors") == 0
    finally:
        proc.stop()


def test_once_the_reservoir_is_full_most_decisions_cross_without_a_signature(cluster, trace_files):
    """The data plane draws the refit reservoir's keep/slot decision before it routes, so a
    decision carries its signature only when the reservoir stores it, while every decision
    still carries its distances for the drift monitor. A reservoir of 32 signatures over a
    horizon of 2048 (1 per bucket of 64 offers) stores about H_64 ~ 4.7 of each 64; before
    this, every one of the 192 decisions below brought its signature into Python."""
    from concurrent.futures import ThreadPoolExecutor

    from eldr_sglang.drift.reservoir import SignatureReservoir
    from eldr_sglang.router.config import parse_config
    from eldr_sglang.router.control import ControlPlane

    _, _, cpath = trace_files
    argv = ["--pd-disaggregation", "--host", "127.0.0.1", "--port", str(free_port()), "--disagg-router", "eldr",
            "--eldr-centroids", str(cpath)]
    for url, bport in cluster["prefill"]:
        argv += ["--prefill", url, str(bport)]
    for url in cluster["decode"]:
        argv += ["--decode", url]
    cfg = parse_config(argv)
    cfg.drift = {"reservoir_capacity": 32, "reservoir_horizon": 2048}
    pd = ControlPlane(cfg)
    assert pd.dataplane.reservoir_shape == (1, 64)
    port = pd.dataplane.start()
    n = 192
    try:
        def one(i):
            return post(f"http://127.0.0.1:{port}/generate", {"text": f"k{i}", "sampling_params": {"max_new_tokens": 1},
                                                              "emulator": {"trace_request": i % TRACE["requests"]}})[0]

        with ThreadPoolExecutor(8) as ex:  # concurrent routes draw concurrently
            assert list(ex.map(one, range(n))) == [200] * n
        got = pd.dataplane.take_drift(10 * n)
    finally:
        pd.dataplane.stop()
    assert len(got) == n and all(reason == "band" for _, reason, _, _, _ in got)
    assert all(d is not None and len(d) == len(cluster["decode"]) for _, _, d, _, _ in got)  # the monitor's distances
    offers = [offer for *_, offer in got]
    assert sorted(i for i, _ in offers) == list(range(n))  # every decision an offer, no index skipped or repeated
    with_sig = [sig is not None for _, _, _, sig, _ in got]
    assert with_sig == [slot is not None for _, slot in offers]  # a signature exactly when the draw stores it
    assert 3 <= sum(with_sig) <= n // 4, sum(with_sig)  # expected ~14 of 192
    r = SignatureReservoir(pd.router.centroid_set().dim, capacity=32, horizon=2048)
    for gen, reason, d, sig, offer in got:
        view = DriftView(gen, reason, d, sig, r.dim, offer)
        r.offer(offer[0], offer[1], view.unit_signature)
    assert r.stats()["stored"] == 3 and r.stats()["total_seen"] == n  # one slot in each of the 3 buckets


def test_a_worker_url_the_rust_plane_cannot_reach_is_refused_at_start(cluster):
    argv = [sys.executable, "-m", "eldr_sglang.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
            "--port", str(free_port()), "--prefill", "https://127.0.0.1:1", "--decode", cluster["decode"][0],
            "--disagg-router", "round_robin"]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "plain http://" in out.stderr and "Traceback" not in out.stderr
