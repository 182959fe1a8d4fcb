"""The router's own switchback experiment (`--experiment`), end to end on emulated PD workers
on loopback: the clock and the admin call switch arms, requests in flight through a switch
finish whole, a request that starts while the previous arm's are still in flight is flagged
warm-up, and GET /eldr/experiment, `eldr experiment report --url` and the clients' own
timings agree block by block."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.cli import main as eldr  # noqa: E402
from eldr_sglang.testing.pd_cluster import get_json, make_trace_files, metric, post, start_cluster, start_router  # noqa: E402

TOKEN = "experiment-admin-token-0123"
ARMS = ("locality/0.05", "round_robin")
TOKENS = 16


async def _stream(s, base: str, i: int, tokens: int = TOKENS) -> dict:
    body = {"text": f"prompt {i} " * 8, "sampling_params": {"max_new_tokens": tokens}, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with s.post(base + "/generate", json=body) as r:
        status, h = r.status, r.headers
        async for line in r.content:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.perf_counter())
    rec = {"status": status, "tokens": len(stamps), "want": tokens, "t0": t0, "t1": time.perf_counter(),
           "block": int(h.get("x-eldr-experiment-block", -1)), "arm": h.get("x-eldr-experiment-arm"),
           "warmup": h.get("x-eldr-experiment-warmup") == "1"}
    if len(stamps) >= 2:
        rec["tpot_s"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return rec


async def _load(base: str, seconds: float, clients: int) -> list[dict]:
    """Closed-loop streaming clients for `seconds`."""
    out: list[dict] = []
    t_end = time.perf_counter() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def client(c: int):
            k = 0
            while time.perf_counter() < t_end:
                out.append(await _stream(s, base, c * 1000 + k))
                k += 1

        await asyncio.gather(*(client(c) for c in range(clients)))
    return out


async def _switch_under_load(base: str) -> tuple[list[dict], list[dict], int]:
    """Requests in flight when an admin call switches the arm, and requests started right
    after it; (in flight, after, the new block)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        # long answers, so that they are still decoding when the next block starts
        first = [asyncio.ensure_future(_stream(s, base, 90_000 + i, 8 * TOKENS)) for i in range(4)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30  # the router holds all four before the switch (a fixed sleep flaked under load)
        while loop.time() < deadline:
            st = await loop.run_in_executor(None, get_json, base + "/eldr/status")
            if sum(st["experiment"]["inflight_by_arm"]) >= 4:
                break
            await asyncio.sleep(0.02)
        status, _, body = await loop.run_in_executor(None, lambda: post(
            base + "/eldr/experiment/switch", {}, headers={"Authorization": f"Bearer {TOKEN}"}))
        assert status == 200, body
        block = json.loads(body)["block"]
        after = [asyncio.ensure_future(_stream(s, base, 91_000 + i)) for i in range(2)]
        return list(await asyncio.gather(*first)), list(await asyncio.gather(*after)), block


def test_the_router_runs_the_switchback_and_its_blocks_agree_with_the_clients(tmp_path, capsys):
    _, tpath, cpath = make_trace_files(tmp_path, requests=40, seed=4, workers=2)
    cluster, urls = start_cluster(tpath, tmp_path, prefill=1, decode=2, time_scale=0.5)
    args = ["--experiment", ",".join(ARMS), "--switch-every", "60s", "--experiment-seed", "3",
            "--eldr-centroids", str(cpath), "--admin-token", TOKEN]
    router, base = start_router(urls, tmp_path, args)
    try:
        st = get_json(base + "/eldr/status")["experiment"]
        assert st["arms"] == list(ARMS) and st["block"] == 0 and st["arm"] in ARMS and st["switch_every_s"] == 60.0

        # the admin switch is a control endpoint: off without the token
        assert post(base + "/eldr/experiment/switch", {})[0] == 401
        assert post(base + "/eldr/experiment/switch", {"arm": "fastest"},
                    headers={"Authorization": f"Bearer {TOKEN}"})[0] == 400

        # a switch with requests in flight: they finish whole, on the arm they started on;
        # the next block's first requests start while those are in flight: warm-up
        old_arm, recs = st["arm"], []
        while True:
            inflight, after, block = asyncio.run(_switch_under_load(base))
            recs += inflight + after
            new_arm = get_json(base + "/eldr/status")["experiment"]["arm"]
            if new_arm != old_arm:
                break
            old_arm = new_arm  # the schedule may run an arm twice across a round's edge
        assert all(r["status"] == 200 and r["tokens"] == r["want"] for r in recs), recs
        assert {(r["block"], r["arm"]) for r in inflight} == {(block - 1, old_arm)}
        assert {r["block"] for r in after} == {block} and {r["arm"] for r in after} == {new_arm}
        assert all(r["warmup"] for r in after)
        # once those have drained, a request is not warm-up
        (late,) = asyncio.run(_load_one(base))
        assert late["block"] == block and not late["warmup"]

        # blocks by admin calls under steady load (a short --switch-every would do the same on
        # the clock; tests/ of the schedule's clock are in rust/dataplane/src/experiment.rs)
        recs.append(late)
        for _ in range(6):
            recs += asyncio.run(_load(base, 1.2, 4))
            assert post(base + "/eldr/experiment/switch", {}, headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        time.sleep(0.3)
        snap = get_json(base + "/eldr/experiment")
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = tmp_path / "report.json"
        assert eldr(["experiment", "report", "--url", base, "--arms", ",".join(ARMS), "--min-requests", "3",
                     "--json", str(out)]) == 0
        res = json.loads(out.read_text())
    finally:
        router.stop()
        cluster.stop()
    capsys.readouterr()

    assert all(r["status"] == 200 and r["tokens"] == r["want"] for r in recs)
    blocks = {b["block"]: b for b in snap["blocks"]}
    cur = snap["experiment"]["block"]
    assert set(blocks) == set(range(cur + 1)) and all(blocks[b]["complete"] for b in range(cur))
    # block by block, the router's figures are the clients': the same requests, arms and
    # warm-up flags, and TPOTs within the clients' own read overhead (loopback, a few %)
    for b in range(cur):
        mine = [r for r in recs if r["block"] == b]
        rb = blocks[b]
        assert rb["requests"] == len(mine)
        assert {r["arm"] for r in mine} <= {rb["arm"]}
        assert rb["warmup_n"] == sum(r["warmup"] for r in mine)
        kept = [r["tpot_s"] for r in mine if not r["warmup"]]
        assert rb["n"] == len(kept)
        if kept:
            assert rb["tpot_p50_s"] == pytest.approx(statistics.median(kept), rel=0.15)
            assert rb["tpot_mean_s"] == pytest.approx(statistics.fmean(kept), rel=0.15)
    # the report reads the same blocks: its per-block figures are /eldr/experiment's
    reported = {k["block"]: k for k in res["per_block"]}
    for b, k in reported.items():
        assert (k["arm"], k["n"], k["p50"], k["mean"], k["dropped"]) == (
            blocks[b]["arm"], blocks[b]["n"], blocks[b]["tpot_p50_s"], blocks[b]["tpot_mean_s"], blocks[b]["warmup_n"])
    assert cur in res["blocks_left_out"]  # the current block is still running
    # /metrics: the current arm, one series per arm; latency split by arm
    now = snap["experiment"]["arm"]
    assert metric(text, "eldr_router_experiment_arm", arm=now) == 1.0
    assert sum(metric(text, "eldr_router_experiment_arm", arm=a) for a in ARMS) == 1.0
    for a in ARMS:
        assert metric(text, "eldr_router_tpot_seconds_count", policy=a) == sum(
            1 for r in recs if r["arm"] == a and "tpot_s" in r)


async def _load_one(base: str) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        return [await _stream(s, base, 99_999)]


def test_bad_experiment_flags_are_one_line_errors(tmp_path):
    from eldr_sglang.router.config import ConfigError, parse_config

    base = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--decode", "http://127.0.0.1:3", "--eldr-centroids", str(tmp_path / "c.eldr")]
    for extra, msg in (
        (["--experiment", "round_robin"], "2 to 16 arms"),
        (["--experiment", "round_robin,round_robin"], "given twice"),
        (["--experiment", "round_robin,fastest"], "unknown policy 'fastest'"),
        (["--experiment", "round_robin/0.1,random"], "applies to eldr and locality only"),
        (["--experiment", "locality/x,random"], "expected a number"),
        (["--experiment", "eldr@0.2,random"], "tau is the router's"),
        (["--experiment", "locality,random", "--switch-every", "10 parsecs"], "expected a duration like 10m"),
        (["--experiment", "locality,random", "--switch-every", "0s"], "between 0.1 s and 7 days"),
        (["--switch-every", "10m"], "--switch-every needs --experiment"),
        (["--experiment", "locality,random", "--disagg-router", "eldr"], "replaces --disagg-router"),
    ):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
            parse_config(base + extra)
    cfg = parse_config(base + ["--experiment", "locality/0.05,round_robin,eldr/none", "--switch-every", "1.5m",
                               "--experiment-seed", "9"])
    x = cfg.experiment
    assert [(a.label, a.policy, a.load_factor) for a in x.arms] == [
        ("locality/0.05", "locality", 0.05), ("round_robin", "round_robin", None), ("eldr/none", "eldr", None)]
    assert (x.switch_every_s, x.seed, cfg.policy, cfg.load_factor, cfg.late_binding) == (90.0, 9, "locality", 0.05, True)
    assert cfg.drift == {"enabled": False}  # the centroid file stays fixed through a run
    no_centroids = [a for a in base if a != "--eldr-centroids" and not a.endswith("c.eldr")]
    with pytest.raises(ConfigError, match="arm locality/0.05 needs --eldr-centroids"):
        parse_config(no_centroids + ["--experiment", "round_robin,locality/0.05"])
