"""Drift hook end to end: the router subprocess (eldr policy) in front of an emulated PD
cluster on loopback. Every routed request reaches the drift monitor and the reservoir, the
gauges are on /metrics, and POST /eldr/refit answers. No absolute-time asserts."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import free_port, get_json, metric, post, start_cluster, start_router  # noqa: E402


N_TRACE = 120
TOKEN = "drift-e2e-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.traces.synth import generate
    from eldr_sglang.traces import save_trace

    d = tmp_path_factory.mktemp("drift-e2e")
    trace = generate(model="gpt-oss-20b", requests=N_TRACE, seed=5, prompt_len=(16, 48), output_len=8)
    tpath, cpath = d / "trace.npz", d / "c.eldr"
    save_trace(trace, tpath)
    fit_trace(trace, workers=4, tau=0.1, seed=0).write(cpath)
    cproc, urls = start_cluster(tpath, d, time_scale=0.02)
    yield d, cpath, urls
    cproc.stop()


@pytest.fixture(scope="module")
def setup(cluster):
    d, cpath, urls = cluster
    rproc, base = start_router(urls, d, ["--disagg-router", "eldr", "--eldr-centroids", str(cpath),
                                         "--eldr-signature-timeout-secs", "2", "--health-check-interval-secs", "0.5",
                                         "--admin-token", TOKEN])
    yield base
    rproc.stop()



def _generate_limited(s, base: str, tag: str, sem: asyncio.Semaphore):
    """`one(i)`: a short /generate of the emulator's trace request i through session `s`, at most
    `sem`'s count at once; its HTTP status."""

    async def one(i: int) -> int:
        async with sem:
            body = {"text": f"{tag}{i}", "sampling_params": {"max_new_tokens": 2},
                    "emulator": {"trace_request": i % N_TRACE}}
            async with s.post(base + "/generate", json=body) as r:
                await r.read()
                return r.status

    return one

def test_router_feeds_the_drift_monitor_and_answers_refit(setup):
    base = setup
    n = 40
    for i in range(n):
        status, headers, body = post(base + "/generate", {"text": f"p{i}", "sampling_params": {"max_new_tokens": 3},
                                                          "emulator": {"trace_request": i}})
        assert status == 200, body
    st = get_json(base + "/eldr/drift")
    bands = st["monitor"]["observations"]
    assert bands + st["monitor"]["no_signature"] == n and bands > 0
    assert st["reservoir"]["total_seen"] == bands and st["signature_errors"] == 0
    status, _, body = post(base + "/eldr/refit", {"reason": "e2e"}, headers=AUTH)
    assert status == 422 and "needs" in json.loads(body)["message"]  # 40 signatures are too few to refit
    status, _, body = post(base + "/eldr/refit", b"[1, 2]", headers=AUTH)
    assert status == 400
    status, _, body = post(base + "/eldr/refit", {"reason": "e2e"})  # a control endpoint: no token, no refit
    assert status == 401
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert metric(text, "eldr_drift_observations_total") == bands
    assert "eldr_drift_share_js" in text and "eldr_refit_running 0.0" in text


def test_refit_under_load_in_the_router_app(cluster):
    """The router in this process (app.running, so the hook can be given a small reservoir) in front of
    the emulated cluster: 160 requests fill the reservoir, then 240 more run 16 at a time while
    POST /eldr/refit starts a refit in the background process. Every request succeeds, the refit
    finishes, the router's reload loop swaps the new file in, and routing goes on with it."""
    import asyncio
    import shutil

    import aiohttp
    from eldr_sglang import _core
    from eldr_sglang.router.app import PD_KEY, running
    from eldr_sglang.router.config import build_parser, config_from_args

    d, cpath, urls = cluster
    mine = d / "refit-under-load.eldr"
    shutil.copyfile(cpath, mine)
    args = ["--pd-disaggregation", "--port", str(free_port()), "--disagg-router", "eldr", "--eldr-centroids", str(mine),
            "--eldr-signature-timeout-secs", "2", "--health-check-interval-secs", "0", "--eldr-reload-interval-ms", "50",
            "--admin-token", TOKEN]
    for url, bport in urls["prefill"]:
        args += ["--prefill", url, str(bport)]
    for url in urls["decode"]:
        args += ["--decode", url]
    cfg = config_from_args(build_parser().parse_args(args))
    cfg.drift = dict(executor="process", cooldown_s=0, window=64, refit_on_drift=False, check_interval_s=0.05,
                     reservoir_capacity=256, reservoir_horizon=256)

    async def main():
        async with running(cfg) as (app, base):
            pd = app[PD_KEY]
            assert pd.drift is not None and pd.drift.ctl.reservoir.capacity == 256
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                one = _generate_limited(s, base, "q", asyncio.Semaphore(16))

                assert await asyncio.gather(*(one(i) for i in range(160))) == [200] * 160
                gen0 = pd.router.centroid_generation
                load = [asyncio.ensure_future(one(i)) for i in range(160, 400)]
                await asyncio.sleep(0)
                async with s.post(base + "/eldr/refit", json={"force": True, "reason": "under load"}, headers=AUTH) as r:
                    assert r.status == 202, await r.text()
                statuses = await asyncio.gather(*load)
                assert statuses == [200] * len(statuses)
                st = None
                for _ in range(600):  # bounded: the spawned process imports numpy/scipy first
                    async with s.get(base + "/eldr/drift") as r:
                        st = await r.json()
                    if not st["running"] and st["refits"] + st["failures"] and pd.router.centroid_generation > gen0:
                        break
                    await asyncio.sleep(0.1)
                assert st["last_ok"] and st["refits"] == 1, st
                assert pd.router.centroid_generation == gen0 + 1 and pd.router.last_reload_error is None
                assert await asyncio.gather(*(one(i) for i in range(400, 440))) == [200] * 40
                async with s.get(base + "/eldr/drift") as r:
                    assert (await r.json())["monitor"]["generation"] == gen0 + 1

    asyncio.run(main())
    assert json.loads(_core.CentroidSet.open(str(mine)).provenance_json)["refit"]["reason"] == "under load"
    # the refit kept the file it replaced
    assert _core.CentroidSet.open(str(mine) + ".prev").checksum == _core.CentroidSet.open(str(cpath)).checksum


def test_locality_router_feeds_the_drift_monitor_too(cluster):
    """The default policy keeps drift handling: the monitor reads the band rule's decision on
    the same counts, and the reservoir keeps the route's signatures."""
    d, cpath, urls = cluster
    rproc, base = start_router(urls, d, ["--disagg-router", "locality", "--eldr-centroids", str(cpath),
                                         "--eldr-signature-timeout-secs", "2", "--health-check-interval-secs", "0.5",
                                         "--admin-token", TOKEN])
    try:
        n = 24
        reasons = set()
        for i in range(n):
            status, headers, body = post(base + "/generate", {"text": f"q{i}", "sampling_params": {"max_new_tokens": 3},
                                                              "emulator": {"trace_request": i}})
            assert status == 200, body
            reasons.add(headers.get("X-ELDR-Reason"))
        assert "profile" in reasons  # the locality balancer routed them, not the band rule
        st = get_json(base + "/eldr/drift")
        bands = st["monitor"]["observations"]
        assert bands + st["monitor"]["no_signature"] == n and bands > 0
        assert st["reservoir"]["total_seen"] == bands and st["signature_errors"] == 0
    finally:
        rproc.stop()


def test_membership_change_then_refit_fits_the_decode_members(cluster):
    """Live membership under the eldr policy: a router started on 3 decode workers with a K=3
    file gets a 4th by POST /eldr/workers (it has no centroid: the file's K stays 3); a forced
    refit fits K = 4, the members, names them in the file, and the router reloads it."""
    import asyncio

    import aiohttp
    from eldr_sglang import _core
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.router.app import PD_KEY, running
    from eldr_sglang.router.config import build_parser, config_from_args
    from eldr_sglang.traces import load_trace

    d, _, urls = cluster
    mine = d / "members.eldr"
    fit_trace(load_trace(d / "trace.npz"), workers=3, tau=0.1, seed=0).write(mine)
    args = ["--pd-disaggregation", "--port", str(free_port()), "--disagg-router", "eldr", "--eldr-centroids", str(mine),
            "--eldr-signature-timeout-secs", "2", "--health-check-interval-secs", "0", "--eldr-reload-interval-ms", "50",
            "--admin-token", TOKEN]
    for url, bport in urls["prefill"]:
        args += ["--prefill", url, str(bport)]
    for url in urls["decode"][:3]:
        args += ["--decode", url]
    cfg = config_from_args(build_parser().parse_args(args))
    cfg.drift = dict(executor="process", cooldown_s=0, refit_on_drift=False, check_interval_s=0.05,
                     reservoir_capacity=256, reservoir_horizon=256)

    async def main():
        async with running(cfg) as (app, base):
            pd = app[PD_KEY]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async with s.post(base + "/eldr/workers", json={"role": "decode", "url": urls["decode"][3]},
                                  headers=AUTH) as r:
                    assert r.status == 200, await r.text()
                assert [u for _, u in pd.members("decode")] == urls["decode"]
                assert pd.router.centroid_set().num_workers == 3
                one = _generate_limited(s, base, "m", asyncio.Semaphore(16))

                assert await asyncio.gather(*(one(i) for i in range(200))) == [200] * 200
                gen0 = pd.router.centroid_generation
                async with s.post(base + "/eldr/refit", json={"force": True, "reason": "members"}, headers=AUTH) as r:
                    assert r.status == 202, await r.text()
                for _ in range(600):  # bounded: the spawned process imports numpy/scipy first
                    async with s.get(base + "/eldr/drift") as r:
                        st = await r.json()
                    if not st["running"] and st["refits"] + st["failures"] and pd.router.centroid_generation > gen0:
                        break
                    await asyncio.sleep(0.1)
                assert st["last_ok"] and st["refits"] == 1, st
                assert pd.router.centroid_generation == gen0 + 1 and pd.router.last_reload_error is None
                assert pd.router.centroid_set().num_workers == 4
                assert await asyncio.gather(*(one(i) for i in range(200, 240))) == [200] * 40

    asyncio.run(main())
    new = _core.CentroidSet.open(str(mine))
    assert new.num_workers == 4 and list(new.worker_names) == urls["decode"]
    assert json.loads(new.provenance_json)["refit"]["workers_before"] == 3
