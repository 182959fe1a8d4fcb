"""The simulator split into event loop, prefill scheduler and decode replicas reproduces the
runs recorded before the split (same seeds, earliest-free prefill placement as then)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _sim_golden import FIELDS_INT, run_scenarios

pytest.importorskip("eldr_sglang._core")
GOLDEN = Path(__file__).resolve().parent / "data" / "sim_golden.npz"


def test_split_simulator_reproduces_the_recorded_runs(tmp_path):
    want = np.load(GOLDEN)
    got = run_scenarios(tmp_path, {"prefill_policy": "earliest_free"})
    assert sorted(got) == sorted(want.files)
    for key in want.files:
        if key.rsplit("/", 1)[1] in FIELDS_INT + ("offload_misses",):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:  # bit-identical on the recording machine; other CPUs' exp/log may differ in the last ulp
            np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=0, err_msg=key)


def test_the_default_prefill_placement_is_the_services():
    from eldr_sglang.router.config import PREFILL_POLICIES, RouterConfig
    from eldr_sglang.sim.cluster import ClusterConfig
    from eldr_sglang.sim.prefill import PREFILL_POLICIES as SIM_PREFILL_POLICIES

    assert ClusterConfig().prefill_policy == RouterConfig.__dataclass_fields__["prefill_policy"].default
    assert set(PREFILL_POLICIES) <= set(SIM_PREFILL_POLICIES)
