"""Drift hook end to end: the router subprocess (eldr policy) in front of an emulated PD
cluster on loopback. Every routed request reaches the drift monitor and the reservoir, the
gauges are on /metrics, and POST /eldr/refit answers. Skipped while the router app does not
install the drift hook (GET /eldr/drift is then unknown). No absolute-time asserts."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from pd_cluster import get_json, metric, post, start_cluster, start_router  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.synth import generate
    from eldr_sglang.traces import save_trace

    d = tmp_path_factory.mktemp("drift-e2e")
    trace = generate(model="gpt-oss-20b", requests=120, seed=5, prompt_len=(16, 48), output_len=8)
    tpath, cpath = d / "trace.npz", d / "c.eldr"
    save_trace(trace, tpath)
    fit_trace(trace, workers=4, tau=0.1, seed=0).write(cpath)
    cproc, urls = start_cluster(tpath, d, time_scale=0.02)
    try:
        rproc, base = start_router(urls, d, ["--disagg-router", "eldr", "--eldr-centroids", str(cpath),
                                             "--eldr-signature-timeout-secs", "2", "--health-check-interval-secs", "0.5"])
    except Exception:
        cproc.stop()
        raise
    yield base
    rproc.stop()
    cproc.stop()


def test_router_feeds_the_drift_monitor_and_answers_refit(setup):
    base = setup
    try:
        get_json(base + "/eldr/drift")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            pytest.skip("the router app does not install the drift hook yet (eldr_sglang.drift.router_hook.install)")
        raise
    n = 40
    for i in range(n):
        status, headers, body = post(base + "/generate", {"text": f"p{i}", "sampling_params": {"max_new_tokens": 3},
                                                          "emulator": {"trace_request": i}})
        assert status == 200, body
    st = get_json(base + "/eldr/drift")
    bands = st["monitor"]["observations"]
    assert bands + st["monitor"]["no_signature"] == n and bands > 0
    assert st["reservoir"]["total_seen"] == bands and st["signature_errors"] == 0
    status, _, body = post(base + "/eldr/refit", {"reason": "e2e"})
    assert status == 422 and "needs" in json.loads(body)["message"]  # 40 signatures are too few to refit
    status, _, body = post(base + "/eldr/refit", b"[1, 2]")
    assert status == 400
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert metric(text, "eldr_drift_observations_total") == bands
    assert "eldr_drift_share_js" in text and "eldr_refit_running 0.0" in text
