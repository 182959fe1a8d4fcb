"""benchmarks/sim_vs_engine.py: the step fit recovers a known line and shared host from tagged
steps, and its held-out split keeps the training blocks out; ExecutionModel.request_cost_ratio
reads b / (c L) back (sim/host.py's own tests: tests/test_sim_host.py)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sim_vs_engine as sve  # noqa: E402


def _steps(rng, n=400, arm="round_robin"):
    out = []
    for i in range(n):
        b = int(rng.integers(1, 8))
        d = float(rng.integers(4 * b, 4 * min(32, 4 * b) + 1))
        r = float(rng.uniform(0, 25))
        y = (0.015 + 0.003 * b + 0.0008 * d) / (1 - 0.004 * r)
        out.append({"arm": arm, "block": i // 20, "server": 0, "batch": b, "sum_distinct": d, "mean_distinct": d / 4,
                    "other_rate": r, "interval_s": y})
    return out


def test_fit_recovers_terms_and_errors_are_zero_on_the_line():
    steps = _steps(np.random.default_rng(0))
    fit, host, _ = sve.fit_step(steps)
    assert fit["fixed_s"] == pytest.approx(0.015, rel=1e-4)
    assert fit["per_request_s"] == pytest.approx(0.003, rel=1e-4)
    assert fit["per_expert_s"] == pytest.approx(0.0008, rel=1e-4)
    assert host.steal_s == pytest.approx(0.004, rel=1e-4)
    assert sve.step_errors(fit, host, steps)["median_abs_error"] < 1e-4
    noisy = [dict(s, interval_s=s["interval_s"] * 1.2) for s in steps]
    assert sve.step_errors(fit, host, noisy)["median_abs_error"] == pytest.approx(1 / 6, rel=1e-3)
    # without the host the same line misses by the other server's share
    assert sve.step_errors(fit, None, steps)["median_abs_error"] > 0.01


def test_split_keeps_training_blocks_out_of_the_held_out_set():
    steps = _steps(np.random.default_rng(1)) + _steps(np.random.default_rng(2), arm="eldr/none")
    train, held = sve.split_train(steps)
    assert {s["block"] for s in train}.isdisjoint({s["block"] for s in held})
    rr_blocks = sorted({s["block"] for s in steps if s["arm"] == "round_robin"})
    assert {s["block"] for s in train} == set(rr_blocks[0::2])
    assert any(s["arm"] == "eldr/none" for s in held)


def test_matched_distinct_weights_by_engine_steps():
    sim = {1: (4.0, 100), 2: (8.0, 100), 9: (30.0, 5)}
    eng = {1: (4.0, 30), 2: (7.0, 10)}
    s, e = sve.matched_distinct(sim, eng)
    assert s == pytest.approx((4 * 30 + 8 * 10) / 40) and e == pytest.approx((4 * 30 + 7 * 10) / 40)


def test_request_cost_ratio_reads_b_over_cL_from_a_calibration():
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.profiles import get_hardware

    m = get_model("qwen3-30b-a3b")
    L = m.num_moe_layers
    cal = {b: (0.0, 0.0008, 0.015 + 0.003 * b) for b in range(1, 65)}
    em = ExecutionModel(m, get_hardware("cpu"), tp=1, calibration=cal)
    assert em.request_cost_ratio(batch=4, context=64) == pytest.approx(0.003 / (0.0008 * L), rel=1e-9)
