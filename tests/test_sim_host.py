"""sim/host.py: the shared host CPU fitted on engine-like steps recovers what was planted, its
clock slows a step by the other workers' step rate, and a cluster run with it conserves every
request, is deterministic per seed and slows its steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eldr_sglang.sim.host import HostClock, SharedHost, fit_shared_host, load_shared_host, predict


def _host(steal=0.005, scatter=(1.0, 1.0), hazard=(0.0,), excess=((0.0, 0.0),), edges=(0.0,)):
    return SharedHost(steal, 1.0, tuple(scatter), tuple(edges), tuple(hazard), tuple(excess))


def test_fit_recovers_the_line_the_steal_and_planted_stalls():
    rng = np.random.default_rng(0)
    n = 4000
    B = rng.integers(1, 8, n).astype(float)
    D = B * 4 + rng.integers(0, 8, n)
    R = rng.uniform(0, 30, n)
    y = (0.012 + 0.002 * B + 0.0009 * D) / (1 - 0.006 * R)
    stalled = rng.random(n) < 0.1
    y = y + np.where(stalled, 0.3, 0.0)  # every stall 300 ms: over twice any step here
    line, host, diag = fit_shared_host(B, D, R, y, bins=3)
    assert line["fixed_s"] == pytest.approx(0.012, rel=1e-3)
    assert line["per_request_s"] == pytest.approx(0.002, rel=1e-3)
    assert line["per_expert_s"] == pytest.approx(0.0009, rel=1e-3)
    assert host.steal_s == pytest.approx(0.006, rel=1e-3)
    assert diag["stall_share_of_steps"] == pytest.approx(stalled.mean(), abs=1e-9)
    assert all(q[50] == pytest.approx(0.3, rel=1e-3) for q in host.excess_s)
    # the hazard is stalls per second of modelled step: 10 % of steps over their mean length
    m = predict(line, host, B, D, R)
    assert np.average(host.hazard_per_s, weights=np.bincount(np.searchsorted(host.rate_edges, R, "right") - 1)) \
        == pytest.approx(stalled.sum() / m.sum(), rel=0.05)
    assert host.scatter[0] == pytest.approx(1.0, abs=1e-6) and host.scatter[-1] == pytest.approx(1.0, abs=1e-6)


def test_fit_refuses_too_few_steps():
    with pytest.raises(ValueError, match="at least 50"):
        fit_shared_host([1] * 10, [4] * 10, [0] * 10, [0.01] * 10)


def test_clock_divides_by_the_other_workers_free_share():
    clock = HostClock(_host(steal=0.01), workers=2)
    for i in range(20):  # worker 1: 20 steps in the last second
        clock.step(1, 0.05 * i, 0.05)
    assert clock.step(0, 0.999, 0.04) == pytest.approx(0.04 / (1 - 0.01 * 20))
    assert clock.other_rate(1, 0.999) == pytest.approx(1.0)  # worker 0's one step
    assert clock.step(0, 5.0, 0.04) == pytest.approx(0.04)  # worker 1's steps have left the window


def test_clock_stalls_at_the_hazard_rate():
    clock = HostClock(_host(steal=0.0, hazard=(2.0,), excess=((0.5, 0.5),)), workers=1, seed=1)
    dts = np.array([clock.step(0, float(i), 0.1) for i in range(20000)])
    assert set(np.round(dts, 9)) == {0.1, 0.6}
    assert (dts > 0.1).mean() == pytest.approx(-np.expm1(-0.2), abs=0.01)


def test_shared_host_checks_and_the_calibration_section(tmp_path):
    with pytest.raises(ValueError, match="rate_edges ascending"):
        _host(edges=(1.0,))
    with pytest.raises(ValueError, match="missing or malformed"):
        SharedHost.from_dict({"steal_s": 0.1})
    h = _host(hazard=(1.0, 2.0), excess=((0.1, 0.2), (0.3, 0.4)), edges=(0.0, 10.0))
    assert SharedHost.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"format": "eldr-moe-calibration/1", "entries": []}))
    assert load_shared_host(p) is None
    p.write_text(json.dumps({"format": "eldr-moe-calibration/1", "entries": [], "host": h.to_dict()}))
    assert load_shared_host(p) == h
    p.write_text(json.dumps({"host": {"steal_s": -1}}))
    with pytest.raises(ValueError, match="cal.json: shared host"):
        load_shared_host(p)


def test_cluster_with_a_shared_host_conserves_and_slows_steps(gptoss_trace):
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cluster import ClusterConfig, simulate
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.policies import make_policy
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.workload import replay_workload

    small = TraceReplay(gptoss_trace.subset(np.arange(0, 703, 7)))
    em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"))
    wl = replay_workload(small, arrival="closed", concurrency=16)
    host = _host(steal=0.004, scatter=(0.8, 1.2), hazard=(3.0,), excess=((0.01, 0.05),))
    runs = [simulate(small, wl, make_policy("round_robin", 2), em, ClusterConfig(num_decode=2, host=h, host_seed=s))
            for h, s in ((None, 0), (host, 0), (host, 0), (host, 1))]
    plain, a, b, c = runs
    for r in runs:
        assert np.all(r.completions == 1) and int(r.step_batch.sum()) == int((wl.output_len - 1).sum())
    assert np.array_equal(a.step_dt, b.step_dt)  # one seed, one run
    assert not np.array_equal(a.step_dt, c.step_dt)
    assert np.mean(a.step_dt) > np.mean(plain.step_dt)


def test_strict_protocol_refuses_a_calibration_with_a_shared_host(tmp_path):
    import argparse

    from eldr_sglang.cli.simulate import run_strict

    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"format": "eldr-moe-calibration/1", "entries": [], "host": _host().to_dict()}))
    args = argparse.Namespace(rate=None, arrival=None, order="trace", output_len=None, splits=1, calibration=str(p))
    with pytest.raises(ValueError, match="does not model a shared host"):
        run_strict(args, None, {})
