"""The locality balancer behind the router service, over its HTTP surface (issue 11).

A router subprocess with `--disagg-router locality` in front of emulated workers on loopback:
requests succeed, each decision equals the offline Rust router's for the same state (the
profiles of the requests in flight, built from the same counts the emulated prefill sends),
queue slots and expert state return to 0 on every exit path, and failover still works.
Load polling is off so the router's state is exactly what its own requests put there.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang import _core  # noqa: E402
from eldr_sglang.router.config import ConfigError, parse_config  # noqa: E402
from eldr_sglang.sim.replay import TraceReplay  # noqa: E402
from eldr_sglang.testing.pd_cluster import free_port, get_json, metric, post, start_router  # noqa: E402
from test_router_faults import FAST, run_requests, set_fault, wait_idle  # noqa: E402

TIME_SCALE = 0.05
# the emulated cluster and trace of this suite (tests/conftest.py starts them)
TRACE = dict(requests=120, seed=11, workers=3)
CLUSTER = dict(prefill=2, decode=3)
LOAD_FACTOR = 0.5  # loose enough that the cap leaves a choice among 3 workers with a few in flight


def locality_router(urls, trace_files, workdir, extra=()):
    _, _, cpath = trace_files
    return start_router(urls, workdir, ["--disagg-router", "locality", "--eldr-centroids", str(cpath),
                                        "--eldr-load-factor", str(LOAD_FACTOR), "--eldr-signature-timeout-secs", "5",
                                        "--load-monitor-interval", "0", "--health-check-interval-secs", "0.3", *extra])


def counts_of(trace, r: int):
    """What the emulated prefill sends for trace request r: its prompt's [L, E] counts and length."""
    ids = np.ascontiguousarray(TraceReplay(trace).prefill_ids(r))
    return _core.count_topk(ids, trace.num_experts), len(ids)


def test_locality_needs_the_centroid_file():
    with pytest.raises(ConfigError, match="locality needs --eldr-centroids"):
        parse_config(["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                      "--disagg-router", "locality"])
    cfg = parse_config(["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                        "--decode-policy", "locality", "--eldr-centroids", "x.eldr"])
    assert cfg.policy == "locality" and cfg.late_binding


def test_decisions_equal_the_offline_router_and_state_returns_to_zero(cluster, trace_files, workdir):
    trace, _, cpath = trace_files
    router, base = locality_router(cluster, trace_files, workdir)
    offline = _core.Router("locality", centroids=str(cpath), load_factor=LOAD_FACTOR)
    held = []  # the offline twin's leases of the requests held open on the router
    order = [3, 17, 3, 40, 17, 8, 61, 3, 90]

    async def run():
        chosen = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            streams = []
            try:
                for r in order:
                    counts, tokens = counts_of(trace, r)
                    prof = offline.profile_dense(counts, tokens)
                    want = offline.route_profile(prof, explain=True)
                    body = {"text": f"r{r}", "stream": True, "sampling_params": {"max_new_tokens": 100000},
                            "emulator": {"trace_request": r}}
                    resp = await s.post(base + "/generate", json=body)
                    streams.append(resp)
                    assert resp.status == 200
                    await resp.content.readline()  # decoding started: its slot and profile are held
                    got = int(resp.headers["X-ELDR-Decode-Worker"])
                    assert resp.headers["X-ELDR-Reason"] == "profile"
                    chosen.append((r, got, want.worker))
                    held.append(offline.acquire(want.worker, 0, profile=prof))
                    st = get_json(base + "/eldr/status")
                    assert st["decode_inflight"] == list(offline.inflight())
                    np.testing.assert_allclose(st["decode_expert_distinct"], offline.expert_distinct(), atol=1e-6)
            finally:
                for resp in streams:  # a client disconnect mid-stream: the router must release both counts
                    resp.close()
        return chosen

    try:
        chosen = asyncio.run(asyncio.wait_for(run(), 120))
        print("decisions (trace request, router, offline):", chosen)
        assert [g for _, g, _ in chosen] == [w for _, _, w in chosen], chosen
        assert len({g for _, g, _ in chosen}) >= 2, "the test state never gave the balancer a choice"
        st = wait_idle(base)
        assert st["decode_inflight"] == [0, 0, 0]
        assert st["decode_expert_distinct"] == [0.0, 0.0, 0.0]
        # plain requests, streamed and not, on all three endpoints succeed
        for path, body in [("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 3}}),
                           ("/v1/completions", {"prompt": "a", "max_tokens": 3}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3})]:
            for stream in (False, True):
                status, headers, out = post(base + path, {**body, "stream": stream, "emulator": {"trace_request": 5}})
                assert status == 200, out[:300]
                assert headers["X-ELDR-Reason"] == "profile"
        st = wait_idle(base)
        assert st["decode_inflight"] == [0, 0, 0] and st["decode_expert_distinct"] == [0.0, 0.0, 0.0]
    finally:
        for lease in held:
            lease.release()
        router.stop()


def test_fallback_reasons_are_named_and_counted(cluster, trace_files, workdir):
    router, base = locality_router(cluster, trace_files, workdir)
    try:
        for mode, reason in (("none", "prefill_none"), ("malformed", "malformed")):
            status, headers, _ = post(base + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2},
                                                          "emulator": {"trace_request": 1, "signature": mode}})
            assert status == 200
            assert headers["X-ELDR-Reason"] == f"no_signature:{reason}"
            text = get_metrics(base)
            assert metric(text, "eldr_router_fallbacks_total", reason=reason) == 1
        assert wait_idle(base)["decode_expert_distinct"] == [0.0, 0.0, 0.0]
    finally:
        router.stop()


def get_metrics(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize("fault", ["hang", "error500"])
def test_failover_works_with_locality(cluster, trace_files, workdir, fault):
    """A decode worker that never answers or 500s: every request completes elsewhere, the
    worker is ejected, and neither queue slots nor expert counts leak on the failed attempts."""
    set_fault(cluster["decode"][1], fault)
    router, base = locality_router(cluster, trace_files, workdir, FAST)
    try:
        results = run_requests(base, 40, concurrency=6, seed=3, stream_share=1.0)
        bad = [r for r in results if not (r["status"] == 200 and r["complete"])]
        assert not bad, [(r["status"], r["body"][:200]) for r in bad[:5]]
        assert all(r["worker"] in (0, 2) for r in results)
        text = get_metrics(base)
        assert metric(text, "eldr_router_ejections_total", role="decode", worker="1") == 1
        assert metric(text, "eldr_router_retries_total", role="decode") >= 1
        st = wait_idle(base)
        assert st["decode_inflight"] == [0, 0, 0] and st["decode_expert_distinct"] == [0.0, 0.0, 0.0], json.dumps(st)[:500]
    finally:
        set_fault(cluster["decode"][1], "none")
        router.stop()


def test_drift_view_under_locality_carries_the_band_rules_distances(cluster, trace_files):
    """Under locality the data plane hands the drift monitor distances computed beside the
    balancer's decision; they must be the band rule's for the same counts. The router runs in
    this process (app.running) so the hook's input can be read."""
    from eldr_sglang.router.app import PD_KEY, running

    trace, _, cpath = trace_files
    band = _core.Router("eldr", centroids=str(cpath))
    spec = band.centroid_set().spec()
    argv = ["--pd-disaggregation", "--port", str(free_port()), "--disagg-router", "locality",
            "--eldr-centroids", str(cpath), "--eldr-load-factor", str(LOAD_FACTOR),
            "--load-monitor-interval", "0", "--health-check-interval-secs", "0"]
    for url, bport in cluster["prefill"]:
        argv += ["--prefill", url, str(bport)]
    for url in cluster["decode"]:
        argv += ["--decode", url]
    requests = (0, 5, 17)

    async def main():
        async with running(parse_config(argv)) as (app, base):
            pd = app[PD_KEY]
            assert pd.drift is not None
            seen = []
            pd.drift.on_route = lambda view, counts=None: seen.append(view)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                for r in requests:
                    body = {"text": f"v{r}", "sampling_params": {"max_new_tokens": 2}, "emulator": {"trace_request": r}}
                    async with s.post(base + "/generate", json=body) as resp:
                        assert resp.status == 200 and resp.headers["X-ELDR-Reason"] == "profile"
                        await resp.read()
            pd.sync_drift()
            return seen, int(pd.router.centroid_generation)

    seen, gen = asyncio.run(main())
    assert len(seen) == len(requests)
    for r, view in zip(requests, seen):
        counts, _ = counts_of(trace, r)
        ref = band.route_dense(counts, explain=True)
        assert view.reason == "band" and view.generation == gen
        np.testing.assert_allclose(view.distances, ref.distances, atol=1e-5)
        np.testing.assert_allclose(view.unit_signature(), spec.from_dense(counts), atol=1e-5)
