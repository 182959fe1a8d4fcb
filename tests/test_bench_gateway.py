"""benchmarks/bench_gateway.py: its measuring code in a quick run, with our random router standing in
for the gateway (no PyPI install in tests), and the figures of its JSON recomputed from the
measurements the same JSON holds."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gateway  # noqa: E402

from eldr_sglang.testing.pd_cluster import start_router  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_gateway.json"
    mp = pytest.MonkeyPatch()
    mp.setattr(bench_gateway, "ensure_gateway", lambda cache_dir: Path(sys.executable))
    # the stand-in peer: our router with its random policy, launched where the gateway would be
    mp.setattr(bench_gateway, "start_gateway",
               lambda py, urls, tmp, proxy_port, cpus=None: start_router(
                   urls, tmp, ["--disagg-router", "random", "--log-level", "warning"], cpus=cpus))
    try:
        assert bench_gateway.main(["--quick", "--policies", "random,eldr", "--json", str(out)]) == 0
    finally:
        mp.undo()
    return json.loads(out.read_text())


def _cpu_at(target: dict, level: int) -> float:
    return statistics.median(x["cpu_ms_per_request"] for x in target["phases"][str(level)] if "skipped" not in x)


def test_ratios_are_computed_from_the_measured_cpu(quick):
    rate = int(quick["config"]["cpu_rate_rps"])
    tg = quick["targets"]
    gw = tg[f"gateway {bench_gateway.GATEWAY_VERSION} random"]
    eldr, rnd = tg["ours eldr"], tg["ours random"]
    for t in (gw, eldr, rnd):
        assert t["cpu_ms_per_request"] == _cpu_at(t, rate)
        assert t["cpu_ms_per_request"] > 0  # a router that served requests used CPU (read from /proc)
    assert quick["cpu_ratio_eldr_vs_gateway"] == pytest.approx(eldr["cpu_ms_per_request"] / gw["cpu_ms_per_request"])
    assert quick["cpu_ratio_eldr_vs_our_random"] == pytest.approx(eldr["cpu_ms_per_request"] / rnd["cpu_ms_per_request"])
    assert quick["gateway"]["hub_downloads_refused"] == 0  # the stand-in tries no download


def test_added_latency_and_held_rate_follow_the_phases(quick):
    tg = quick["targets"]
    direct = {v["flow"]: v for v in tg.values() if v["kind"] == "direct"}
    for name, t in tg.items():
        seq = t["phases"]["0"]
        assert sum(x["n"] for x in seq) == t["sequential"]["n"] == quick["config"]["sequential_requests"]
        if t["kind"] != "direct":
            base = direct[t["flow"]]["sequential"]
            assert t["added_p50_ms"] == pytest.approx(t["sequential"]["p50_ms"] - base["p50_ms"])
            assert t["added_p99_ms"] == pytest.approx(t["sequential"]["p99_ms"] - base["p99_ms"])
        held = t["held_rate_rps"]
        levels = quick["config"]["levels_rps"]
        first_failed = next((x for x in levels if held is None or x > held), None)
        for lv in levels:
            runs = t["phases"][str(lv)]
            ok = [r.get("held", False) for r in runs]
            for r in runs:
                if "skipped" not in r:
                    assert r["held"] == (r["errors"] == 0 and r["p99_ms"] < bench_gateway.P99_LIMIT_MS and (
                        lv == 0 or r["achieved_rate_rps"] >= 0.9 * lv)), (name, lv, r)
            if held is not None and lv <= held:
                assert sum(ok) * 2 > len(ok), (name, lv)
            elif lv == first_failed:
                assert sum(ok) * 2 <= len(ok), (name, lv)
    assert quick["machine"]["loadavg_min"] <= quick["machine"]["loadavg_median"] <= quick["machine"]["loadavg_max"]


def test_a_failed_install_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    with pytest.raises(bench_gateway.GatewayUnavailable, match="failed"):
        bench_gateway.ensure_gateway(blocker)
    assert blocker.read_text().startswith("a file")  # nothing destroyed


def test_harness_cpu_and_pinning_are_recorded(quick):
    cfg = quick["config"]
    if cfg["router_cpus"] is not None:  # 2+ CPUs: routers on one, the client + workers on the rest
        assert set(cfg["router_cpus"]).isdisjoint(cfg["harness_cpus"])
    for name, t in quick["targets"].items():
        for lv, runs in t["phases"].items():
            for r in runs:
                if "skipped" not in r:
                    assert r["harness_cpu_ms_per_request"] > 0, (name, lv)  # the workers served them: CPU from /proc
        ok_runs = {lv: [sum(bool(r.get("held")) for r in runs), len(runs)] for lv, runs in t["phases"].items()}
        assert t["held_repeats_by_rate"] == ok_runs


def test_a_router_started_pinned_runs_on_its_cpus(tmp_path):
    import os

    from eldr_sglang.testing.pd_cluster import Proc

    cpu = max(os.sched_getaffinity(0))
    p = Proc(["-c", "import time; time.sleep(30)"], tmp_path / "p.log", cpus={cpu})
    try:
        assert os.sched_getaffinity(p.p.pid) == {cpu}
    finally:
        p.stop()


def test_the_held_goal_compares_the_two_held_rates(quick):
    tg = quick["targets"]
    e = tg["ours eldr"]["held_rate_rps"]
    g = tg[f"gateway {bench_gateway.GATEWAY_VERSION} random"]["held_rate_rps"]
    assert (quick["held_rate_eldr_rps"], quick["held_rate_gateway_rps"]) == (e, g)
    assert quick["eldr_holds_gateway_rate"] == (g is None or (e is not None and e >= g))


def test_a_sequential_phase_stops_at_its_phase_timeout():
    import asyncio
    import random

    from eldr_sglang.testing import loadgen

    async def slow(_body):  # a worker that never answers: every request runs into its timeout
        await asyncio.sleep(10)

    ph = asyncio.run(loadgen.run_phase(slow, 50, 0.0, random.Random(0), request_timeout_s=0.1, phase_timeout_s=0.35))
    assert ph.sent == 50 and ph.errors == 50 and not ph.latencies_s
    assert 0 < ph.unsent < 50  # some were sent and timed out; the rest, past the phase timeout, never were
