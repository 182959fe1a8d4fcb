"""The analysis in benchmarks/real_cpu_tpot.py that turns decode step logs and client results
into its figures: cutting the step logs into runs, equal-batch comparisons, the two-level
bootstrap. Pure functions on constructed steps; no server runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import real_cpu_tpot as rct  # noqa: E402
from eldr_sglang.testing.sglang_cpu.step_log import Step  # noqa: E402


def _run(t0: float, per_server: list[list[int]], dt: float = 0.05) -> list[list[Step]]:
    """One run: per server, steps of the given batch sizes, dt apart, starting at t0."""
    return [[Step(t0 + j * dt + i * dt / 2, b, (3, 3), 0.01) for j, b in enumerate(batches)]
            for i, batches in enumerate(per_server)]


def test_runs_are_cut_where_the_decode_token_count_completes_a_run():
    # each run: 12 decode tokens over both servers; run 2 has a 5 s stall inside it, longer
    # than the 2 s gaps between runs, which a cut at the longest gaps would have taken
    r1 = _run(0.0, [[2, 2, 2], [3, 3]])
    r2 = [[Step(2.6, 4, (1, 1), 0.01), Step(2.7, 4, (1, 1), 0.01)],
          [Step(2.5, 2, (1, 1), 0.01), Step(7.5, 2, (1, 1), 0.01)]]
    r3 = _run(10.0, [[6], [6]])
    logs = [r1[0] + r2[0] + r3[0], r1[1] + r2[1] + r3[1]]
    split = rct._split_runs(logs, 12)
    assert split is not None and len(split) == 3
    assert [sum(st.tokens for srv in run for st in srv) for run in split] == [12, 12, 12]
    assert split[1] == [r2[0], r2[1]] and split[2] == [r3[0], r3[1]]


def test_a_step_that_crosses_a_run_boundary_is_refused():
    logs = [[Step(0.0, 5, (1,), 0.01), Step(0.1, 5, (1,), 0.01)], [Step(0.05, 4, (1,), 0.01)]]  # 5, 9, 14: 12 skipped
    assert rct._split_runs(logs, 12) is None


def _runs_with_intervals(interval_ms: float, batch: int = 3, steps: int = 20) -> list[dict]:
    srv = [Step(j * interval_ms / 1e3, batch, (4, 4), 0.002) for j in range(steps)]
    return [{"by_batch": rct._by_batch([srv])}]


def test_equal_batch_step_interval_ratio():
    base = _runs_with_intervals(50.0)
    assert abs(rct.matched_ratio(_runs_with_intervals(45.0), base, "step") - 0.9) < 1e-9
    assert abs(rct.matched_ratio(base, base, "step") - 1.0) < 1e-12
    assert abs(rct.matched_ratio(base, base, "moe") - 1.0) < 1e-12
    # batch 1 is left out: a policy is compared on batches it shares with the baseline
    assert np.isnan(rct.matched_ratio(_runs_with_intervals(45.0, batch=1), _runs_with_intervals(50.0, batch=1), "step"))


def test_two_level_bootstrap_resamples_repeats_not_only_requests():
    rng = np.random.default_rng(0)
    # within each repeat every request has the same TPOT, so resampling requests alone would
    # give a point; the change differs between repeats (-20%, 0%, -10%), which the interval shows
    b = [np.full(30, 0.1)] * 3
    a = [np.full(30, 0.08), np.full(30, 0.10), np.full(30, 0.09)]
    v, lo, hi = rct.change_ci(a, b, rng, n_boot=400)
    assert abs(v + 0.1) < 1e-9
    assert lo <= -0.15 and hi >= -0.05
    # identical repeats: the interval collapses onto the point
    v2, lo2, hi2 = rct.change_ci([np.full(30, 0.09)] * 3, [np.full(30, 0.1)] * 3, rng, n_boot=200)
    assert abs(lo2 - v2) < 1e-9 and abs(hi2 - v2) < 1e-9


def test_router_figures_are_summed_over_label_sets():
    text = "\n".join([
        "# HELP eldr_router_tpot_seconds x",
        'eldr_router_tpot_seconds_sum{policy="a",worker="0"} 1.5',
        'eldr_router_tpot_seconds_sum{policy="a",worker="1"} 0.5',
        'eldr_router_tpot_seconds_count{policy="a",worker="0"} 30',
        'eldr_router_tpot_seconds_count{policy="a",worker="1"} 10',
        "eldr_router_ttft_seconds_sum 4",
        "eldr_router_ttft_seconds_count 40",
    ])
    out = rct.router_vs_client(text, {"mean_tpot_ms": 50.0, "mean_ttft_ms": 100.0})
    assert out["router_mean_tpot_ms"] == 50.0 and out["router_tpot_count"] == 40
    assert out["router_mean_ttft_ms"] == 100.0
