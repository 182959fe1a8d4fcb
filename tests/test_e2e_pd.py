"""End to end on loopback: the router with 2 prefill and 4 decode emulated workers.

Every process listens on 127.0.0.1 only and is stopped by its fixture; every wait is bounded.
Times are scaled down (--time-scale) so the suite stays fast; no test asserts absolute time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang import _core  # noqa: E402
from eldr_sglang.sim.replay import TraceReplay  # noqa: E402
from eldr_sglang.testing.reference import band_route  # noqa: E402
from eldr_sglang.testing.pd_cluster import get_json, metric, post, start_cluster, start_router  # noqa: E402

TIME_SCALE = 0.05
# the emulated cluster and trace of this suite (tests/conftest.py starts them)
TRACE = dict(requests=160, seed=3, workers=4)
CLUSTER = dict(prefill=2, decode=4)
SIG_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def router(cluster, trace_files, workdir):
    _, _, cpath = trace_files
    proc, base = start_router(cluster, workdir, [
        "--disagg-router", "eldr", "--no-eldr-drift", "--eldr-centroids", str(cpath),
        "--eldr-signature-timeout-secs", str(SIG_TIMEOUT), "--load-monitor-interval", "0.2",
        "--health-check-interval-secs", "0.5",
    ])
    yield base
    proc.stop()


def reference(cpath, trace, r: int, loads=None):
    """What the band rule (the numpy reference) says for trace request r: (worker, band, distances, tau).

    The signature comes from the centroid file's own spec (Rust), so only the rule is checked here."""
    cs = _core.CentroidSet.open(str(cpath))
    sig = cs.spec().from_topk(np.ascontiguousarray(TraceReplay(trace).prefill_ids(r)))
    centroids = cs.centroids()
    loads = loads or [0] * len(centroids)
    worker, band, d = band_route(sig, centroids, loads, [True] * len(centroids), cs.tau)
    return worker, band, d, cs.tau


def _log(url):
    return get_json(url + "/emulator/log")


def test_signature_arrives_before_decode_is_chosen_and_both_legs_share_the_room(router, cluster):
    rooms = {}
    for i in range(12):
        status, headers, body = post(router + "/generate", {
            "text": f"prompt {i}", "sampling_params": {"max_new_tokens": 4}, "emulator": {"trace_request": i}})
        assert status == 200, body
        assert json.loads(body)["meta_info"]["completion_tokens"] == 4
        assert headers["X-ELDR-Reason"] == "band"
        rooms[int(headers["X-ELDR-Bootstrap-Room"])] = (int(headers["X-ELDR-Prefill-Worker"]), int(headers["X-ELDR-Decode-Worker"]))
    plogs = [_log(u) for u, _ in cluster["prefill"]]
    dlogs = [_log(u) for u in cluster["decode"]]
    for room, (p, d) in rooms.items():
        sent = [e["t"] for e in plogs[p] if e["event"] == "signature_sent" and e["room"] == room]
        recv = [e["t"] for e in dlogs[d] if e["event"] == "decode_recv" and e["room"] == room]
        assert len(sent) == 1 and len(recv) == 1, (room, sent, recv)
        assert sent[0] < recv[0]  # late binding: the decode leg starts after the signature
        # the room reached exactly the chosen prefill and decode workers, nobody else
        assert sum(e["room"] == room for lg in plogs for e in lg if e["event"] == "prefill_recv") == 1
        assert sum(e["room"] == room for lg in dlogs for e in lg if e["event"] == "decode_recv") == 1
        fetched = [e for e in plogs[p] if e["event"] == "kv_fetched" and e["room"] == room]
        assert len(fetched) == 1


def test_band_choice_matches_the_band_rule(router, trace_files, cluster):
    trace, _, cpath = trace_files
    seen_bands = set()
    for r in range(0, 40, 3):
        want, band, d, tau = reference(cpath, trace, r)
        if any(abs(x - (d.min() + tau)) < 1e-4 for x in d):
            continue  # on the band edge f32 and f64 may disagree; not a routing question
        _settle(router, cluster)  # all queues empty: the band member with the smallest d wins
        status, headers, _ = post(router + "/generate", {"text": f"r{r}", "sampling_params": {"max_new_tokens": 2},
                                                         "emulator": {"trace_request": r}})
        assert status == 200
        assert [int(x) for x in headers["X-ELDR-Band"].split(",")] == band
        assert int(headers["X-ELDR-Decode-Worker"]) == want
        seen_bands.add(len(band))
    assert seen_bands  # at least one request was checked


def test_band_prefers_the_shorter_queue(router, trace_files, cluster):
    trace, _, cpath = trace_files
    cand = None
    for r in range(trace.num_requests):
        want, band, d, tau = reference(cpath, trace, r)
        if len(band) >= 2 and not any(abs(x - (d.min() + tau)) < 1e-4 for x in d):
            cand = (r, want, band, d)
            break
    assert cand is not None, "the seeded trace must hold a request whose band has two or more workers"
    r, first, band, d = cand
    _settle(router, cluster)

    async def run():
        async with aiohttp.ClientSession() as s:
            long_body = {"text": "long", "stream": True, "sampling_params": {"max_new_tokens": 100000},
                         "emulator": {"trace_request": r}}
            async with s.post(router + "/generate", json=long_body) as resp:
                assert resp.headers["X-ELDR-Decode-Worker"] == str(first)
                await resp.content.readline()  # decoding has started: its slot is held
                async with s.post(router + "/generate", json={"text": "short", "sampling_params": {"max_new_tokens": 2},
                                                             "emulator": {"trace_request": r}}) as r2:
                    assert r2.status == 200
                    second = int(r2.headers["X-ELDR-Decode-Worker"])
                # closing the long stream here is a client disconnect: its slot must come back
        return second

    second = asyncio.run(asyncio.wait_for(run(), 60))
    others = [k for k in band if k != first]
    assert second == min(others, key=lambda k: d[k])
    _wait_idle(router, cluster)


@pytest.mark.parametrize("mode,reason,counter", [
    ("omit", "timeout", None),
    ("none", "prefill_none", None),
    ("malformed", "malformed", "eldr_router_malformed_signatures_total"),
])
def test_fallback_to_shortest_queue_without_a_usable_signature(router, cluster, mode, reason, counter):
    _settle(router, cluster)
    m0 = _metrics(router)

    async def run():
        async with aiohttp.ClientSession() as s:
            # occupy one decode worker with a long stream, then route without a signature
            long_body = {"text": "busy", "stream": True, "sampling_params": {"max_new_tokens": 100000},
                         "emulator": {"trace_request": 5}}
            async with s.post(router + "/generate", json=long_body) as busy:
                await busy.content.readline()
                busy_worker = int(busy.headers["X-ELDR-Decode-Worker"])
                body = {"text": f"fallback {mode}", "sampling_params": {"max_new_tokens": 3},
                        "emulator": {"trace_request": 5, "signature": mode}}
                async with s.post(router + "/generate", json=body) as r:
                    await r.read()
                    return busy_worker, r.status, r.headers.copy()  # names case-insensitive

    busy_worker, status, headers = asyncio.run(asyncio.wait_for(run(), 60))
    assert status == 200
    assert headers["X-ELDR-Reason"] == f"no_signature:{reason}"  # one vocabulary: decision and label agree
    assert int(headers["X-ELDR-Decode-Worker"]) != busy_worker  # the shortest queue, not the busy one
    m1 = _metrics(router)
    assert metric(m1, "eldr_router_fallbacks_total", reason=reason) == metric(m0, "eldr_router_fallbacks_total", reason=reason) + 1
    if counter:
        assert metric(m1, counter) == metric(m0, counter) + 1
    _wait_idle(router, cluster)


def test_openai_endpoints_stream_and_not(router):
    status, headers, body = post(router + "/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert status == 200 and headers["X-ELDR-Reason"] == "band"
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    status, headers, body = post(router + "/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": 4, "stream": True})
    assert status == 200 and headers["X-ELDR-Reason"] == "band"
    events = [ln for ln in body.decode().split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 5


@pytest.mark.parametrize("body,message", [
    (b"{not json", "not valid JSON"),
    ({"sampling_params": {}}, "needs 'text' or 'input_ids'"),
    ({"text": ["a", "b"]}, "batch"),
    ({"text": "a", "stream": "yes"}, "'stream'"),
    ({"text": "a", "n": 2}, "n > 1"),
    ([1, 2], "JSON object"),
])
def test_malformed_client_requests_get_400(router, body, message):
    status, _, out = post(router + "/generate", body)
    assert status == 400
    assert message in json.loads(out)["error"]["message"]


@pytest.mark.parametrize("path,body,message", [
    ("/generate", {"input_ids": [1, "x"]}, "integers"),
    ("/generate", {"input_ids": [[1, 2], [3]]}, "batch"),
    ("/generate", {"input_ids": []}, "non-empty list"),
    ("/generate", {"text": "a", "sampling_params": [1]}, "'sampling_params'"),
    ("/v1/completions", {"model": "x", "prompt": ["a", "b"]}, "batch"),
    ("/v1/completions", {"model": "x"}, "needs 'prompt'"),
    ("/v1/completions", {"model": "x", "prompt": 3}, "'prompt'"),
    ("/v1/chat/completions", {"model": "x", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "x", "messages": ["hi"]}, "messages"),
])
def test_malformed_requests_on_each_endpoint_get_400(router, path, body, message):
    status, _, out = post(router + path, body)
    assert status == 400
    assert message in json.loads(out)["error"]["message"]


def test_one_prompt_in_a_list_and_input_ids_are_served(router):
    status, _, body = post(router + "/v1/completions", {"model": "x", "prompt": ["only one"], "max_tokens": 2})
    assert status == 200, body
    status, _, body = post(router + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, body


def test_models_health_metrics(router):
    assert get_json(router + "/v1/models")["data"]
    from eldr_sglang.router.config import DEFAULT_LOAD_FACTOR

    assert get_json(router + "/eldr/status")["load_factor"] == DEFAULT_LOAD_FACTOR == 0.05  # bounded loads by default
    text = _metrics(router)
    for name in ("eldr_router_decode_routes_total", "eldr_router_band_size", "eldr_router_distance_best",
                 "eldr_router_queue_depth", "eldr_router_fallbacks_total", "eldr_router_signature_wait_seconds"):
        assert name in text


def _metrics(router) -> str:
    import urllib.request

    with urllib.request.urlopen(router + "/metrics", timeout=10) as r:
        return r.read().decode()


def _settle(router, cluster, timeout=20.0):
    """Idle workers, and no load left in the router's view (stale /v1/loads reports expire)."""
    _wait_idle(router, cluster)
    deadline = time.monotonic() + timeout
    while any(get_json(router + "/eldr/status")["decode_loads"]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_idle(router, cluster, timeout=30.0):
    """Bounded wait until the router holds no slot and every worker is idle; returns the state."""
    deadline = time.monotonic() + timeout
    while True:
        st = get_json(router + "/eldr/status")
        dec = [get_json(u + "/emulator/stats") for u in cluster["decode"]]
        pre = [get_json(u + "/emulator/stats") for u, _ in cluster["prefill"]]
        idle = (
            not any(st["decode_inflight"]) and not any(st["prefill_inflight"])
            and all(x["running"] == 0 and x["waiting"] == 0 and x["transferring"] == 0 for x in dec)
            and all(x["inflight"] == 0 for x in pre)
        )
        if idle or time.monotonic() > deadline:
            return st, dec, pre, idle
        time.sleep(0.1)


def test_no_queue_slot_leaks_after_1000_requests(router, cluster):
    rng = random.Random(7)
    counts = {"ok": 0, "decode_500": 0, "prefill_500": 0, "disconnect": 0, "early_disconnect": 0}

    async def one(s: aiohttp.ClientSession, i: int, kind: str):
        endpoint = rng.choice(["/generate", "/generate", "/v1/completions", "/v1/chat/completions"])
        stream = kind in ("disconnect",) or rng.random() < 0.5
        body = {"stream": stream, "emulator": {"trace_request": rng.randrange(160)}}
        if endpoint == "/generate":
            body.update(text=f"q{i}", sampling_params={"max_new_tokens": rng.randint(1, 6)})
        elif endpoint == "/v1/completions":
            body.update(model="x", prompt=f"q{i}", max_tokens=rng.randint(1, 6))
        else:
            body.update(model="x", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=rng.randint(1, 6))
        if kind == "decode_500":
            body["emulator"]["decode_status"] = 500
        if kind == "prefill_500":
            body["emulator"]["prefill_status"] = 500
        if kind == "disconnect":
            body.setdefault("sampling_params", {})["max_new_tokens"] = 10000
            body["max_tokens"] = 10000
        if kind == "early_disconnect":
            try:
                await asyncio.wait_for(s.post(router + endpoint, json=body), timeout=0.002)
            except asyncio.TimeoutError:
                pass
            return kind, None
        async with s.post(router + endpoint, json=body) as r:
            if kind == "disconnect":
                assert r.status == 200
                await r.content.readline()
                return kind, 200  # leaving the context closes the connection mid-stream
            await r.read()
            return kind, r.status

    async def run():
        kinds = (["ok"] * 750 + ["decode_500"] * 100 + ["prefill_500"] * 50 + ["disconnect"] * 60
                 + ["early_disconnect"] * 40)
        rng.shuffle(kinds)
        sem = asyncio.Semaphore(48)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def guarded(i, k):
                async with sem:
                    return await one(s, i, k)

            return await asyncio.gather(*(guarded(i, k) for i, k in enumerate(kinds)))

    results = asyncio.run(asyncio.wait_for(run(), 300))
    assert len(results) == 1000
    for kind, status in results:
        counts[kind] += 1
        if kind == "ok":
            assert status == 200
        elif kind in ("decode_500", "prefill_500"):
            assert status == 500
    st, dec, pre, idle = _wait_idle(router, cluster)
    assert idle, (st, dec, pre)
    assert st["decode_inflight"] == [0, 0, 0, 0] and st["prefill_inflight"] == [0, 0]
    text = _metrics(router)
    assert metric(text, "eldr_router_client_disconnects_total") >= 1
    assert metric(text, "eldr_router_worker_errors_total", role="decode", kind="http_500") >= 100


def test_baseline_policy_binds_early_with_the_same_room(cluster, workdir):
    proc, base = start_router(cluster, workdir, ["--disagg-router", "round_robin", "--load-monitor-interval", "0",
                                                 "--health-check-interval-secs", "0"])
    try:
        workers, rooms = [], []
        for i in range(8):
            status, headers, _ = post(base + "/generate", {"text": f"rr {i}", "sampling_params": {"max_new_tokens": 2},
                                                           "emulator": {"trace_request": i}})
            assert status == 200 and headers["X-ELDR-Reason"] == "policy"
            workers.append(int(headers["X-ELDR-Decode-Worker"]))
            rooms.append((int(headers["X-ELDR-Bootstrap-Room"]), int(headers["X-ELDR-Prefill-Worker"]), workers[-1]))
        assert workers == [0, 1, 2, 3, 0, 1, 2, 3]
        for room, p, d in rooms:
            assert any(e["event"] == "kv_fetched" and e["room"] == room for e in _log(cluster["prefill"][p][0]))
            assert any(e["event"] == "decode_start" and e["room"] == room for e in _log(cluster["decode"][d]))
        # a failed prefill leg ends the request instead of leaving decode waiting for its KV,
        # with its status: the client's stream starts only with the decode's first chunk,
        # which never comes without KV, so a streamed request gets the status too
        status, _, body = post(base + "/generate", {"text": "rr fail", "sampling_params": {"max_new_tokens": 2},
                                                    "emulator": {"prefill_status": 503}}, timeout=60)
        assert status == 503 and b"emulated prefill failure" in body
        status, _, body = post(base + "/generate", {"text": "rr fail", "sampling_params": {"max_new_tokens": 2},
                                                    "stream": True, "emulator": {"prefill_status": 503, "prefill_fail_delay": 0.3}},
                               timeout=60)
        assert status == 503 and b"emulated prefill failure" in body and b"tok" not in body
        st, dec, pre, idle = _wait_idle(base, cluster)
        assert idle and not any(st["decode_inflight"])
    finally:
        proc.stop()


def test_unpatched_prefill_is_detected_and_not_waited_for(trace_files, workdir):
    _, tpath, cpath = trace_files
    cproc, urls = start_cluster(tpath, workdir, prefill=1, decode=4, time_scale=TIME_SCALE, extra=["--no-signature"])
    try:
        # a long signature timeout: waiting for it would show up as reason 'timeout'
        rproc, base = start_router(urls, workdir, ["--disagg-router", "eldr", "--no-eldr-drift", "--eldr-centroids", str(cpath),
                                                   "--eldr-signature-timeout-secs", "120", "--load-monitor-interval", "0"])
    except BaseException:
        cproc.stop()
        raise
    try:
        assert get_json(base + "/eldr/status")["prefill_signatures"] == [False]
        status, headers, _ = post(base + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert status == 200 and headers["X-ELDR-Reason"].startswith("no_signature")
        text = _metrics(base)
        assert metric(text, "eldr_router_fallbacks_total", reason="prefill_no_signature") == 1
        assert metric(text, "eldr_router_fallbacks_total", reason="timeout") == 0
    finally:
        rproc.stop()
        cproc.stop()


def test_dp_attention_deepep_prefill_whose_layout_is_off_is_reported_with_its_reason(trace_files, workdir):
    # a patched prefill that cannot attribute its layout says so in /server_info (patch 0004);
    # the router shows the reason in /eldr/status, a gauge and its warning, and does not wait
    _, tpath, cpath = trace_files
    reason = "--enable-two-batch-overlap: each MoE layer's top-k ids arrive in two micro-batches"
    cproc, urls = start_cluster(tpath, workdir, prefill=1, decode=4, time_scale=TIME_SCALE,
                                extra=["--signature-off", reason])
    try:
        rproc, base = start_router(urls, workdir, ["--disagg-router", "eldr", "--no-eldr-drift", "--eldr-centroids", str(cpath),
                                                   "--eldr-signature-timeout-secs", "120", "--load-monitor-interval", "0"])
    except BaseException:
        cproc.stop()
        raise
    try:
        st = get_json(base + "/eldr/status")
        assert st["prefill_signatures"] == [False] and st["prefill_signature_off"] == [reason]
        status, headers, _ = post(base + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert status == 200 and headers["X-ELDR-Reason"].startswith("no_signature")
        text = _metrics(base)
        assert metric(text, "eldr_router_prefill_signature_off", worker="0", reason=reason) == 1
        assert metric(text, "eldr_router_fallbacks_total", reason="timeout") == 0
        assert f"does not stream ELDR signatures ({reason})" in rproc.tail()
    finally:
        rproc.stop()
        cproc.stop()


def test_centroid_file_hot_reload_changes_routes(cluster, trace_files, workdir):
    import shutil

    trace, _, cpath = trace_files
    live = workdir / "live.eldr"
    shutil.copy(cpath, live)
    proc, base = start_router(cluster, workdir, ["--disagg-router", "eldr", "--no-eldr-drift", "--eldr-centroids", str(live),
                                                 "--eldr-reload-interval-ms", "50", "--load-monitor-interval", "0"])
    try:
        r = 7
        want, _, _, _ = reference(cpath, trace, r)
        body = {"text": "reload", "sampling_params": {"max_new_tokens": 2}, "emulator": {"trace_request": r}}
        _, headers, _ = post(base + "/generate", body)
        assert int(headers["X-ELDR-Decode-Worker"]) == want
        # the same centroids, workers renamed: worker k's profile moves to (k + 1) % 4
        cs = _core.CentroidSet.open(str(cpath))
        tmp = workdir / "next.eldr"
        _core.write_centroids(str(tmp), np.roll(cs.centroids(), 1, axis=0), cs.layer_weights(), cs.idf(), tau=cs.tau)
        tmp.replace(live)
        deadline = time.monotonic() + 20
        while get_json(base + "/eldr/status")["centroid_generation"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get_json(base + "/eldr/status")["centroid_generation"] >= 2
        _, headers, _ = post(base + "/generate", body)
        assert int(headers["X-ELDR-Decode-Worker"]) == (want + 1) % 4
        # a broken file, written in place, is rejected and the previous centroids keep serving
        live.write_bytes(b"garbage")
        deadline = time.monotonic() + 20
        while "rejected" not in proc.tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rejected" in proc.tail()
        status, headers, _ = post(base + "/generate", body)
        assert status == 200 and int(headers["X-ELDR-Decode-Worker"]) == (want + 1) % 4
    finally:
        proc.stop()
