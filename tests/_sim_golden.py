"""Seeded simulator scenarios whose outputs were recorded before `sim/cluster.py` was split
(tests/data/sim_golden.npz, written by `python tests/_sim_golden.py OUT` on the old code).

The trace is built here from a seeded numpy generator (not by synth), so the recording does
not move when the synthetic generator does. Each scenario uses the earliest-free prefill
placement the simulator had then. `closed_offload` was re-recorded alone when the offload mode
became SGLang's paged experts (sim/paged_experts.py: warm start, its LRU order, waves); every
other scenario still reproduces the first recording."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

FIELDS_INT = ("worker", "completions", "step_worker", "step_batch")
FIELDS_FLOAT = ("arrival", "prefill_done", "first_token", "finish", "step_start", "step_dt", "step_distinct",
                "distinct_layer_sum", "step_null_distinct")


def skewed_trace(requests: int = 120, seed: int = 11):
    """GPT-OSS-20B shaped (24 layers, 32 experts, top-4): each request favours its domain's experts."""
    from _sim_helpers import make_trace

    rng = np.random.default_rng(seed)
    L, E, k, D = 24, 32, 4, 4
    favour = rng.random((D, L, E)) ** 4
    rows, req_lens, pre_lens, dom = [], [], [], []
    for _ in range(requests):
        d = int(rng.integers(D))
        p, n = int(rng.integers(8, 40)), int(rng.integers(6, 30))
        scores = rng.random((p + n, L, E)) + 2.0 * favour[d]
        rows.append(np.argsort(-scores, axis=-1)[..., :k].astype(np.uint8))
        req_lens.append(p + n)
        pre_lens.append(p)
        dom.append(d)
    return make_trace(np.concatenate(rows), req_lens, pre_lens, E)


# (name, policy, workload kwargs, ClusterConfig kwargs, ExecutionModel kwargs)
SCENARIOS = [
    ("closed_rr", "round_robin", dict(arrival="closed", concurrency=24), dict(num_decode=4, num_prefill=2), {}),
    ("closed_eldr", "eldr", dict(arrival="closed", concurrency=32), dict(num_decode=4, num_prefill=3), {}),
    ("poisson_sq", "shortest_queue", dict(arrival="poisson", rate=400.0, requests=200, output_len=40, seed=3),
     dict(num_decode=3, num_prefill=2), {}),
    ("bursty_p2c", "power_of_two", dict(arrival="bursty", rate=300.0, seed=5), dict(num_decode=4), {}),
    ("closed_perfect", "random", dict(arrival="closed", concurrency=16), dict(num_decode=2, num_prefill=1,
                                                                             perfect_overlap=True), {}),
    ("closed_offload", "round_robin", dict(arrival="closed", concurrency=16, output_len=20),
     dict(num_decode=2, num_prefill=2), dict(offload_cache_experts=8)),
    ("closed_ep2", "eldr", dict(arrival="closed", concurrency=16), dict(num_decode=2, num_prefill=2),
     dict(ep=2, tp=2)),
]


def run_scenarios(workdir: Path, config_extra: dict | None = None) -> dict[str, np.ndarray]:
    """{scenario/field: array} for every scenario (config_extra is added to each ClusterConfig)."""
    from _sim_helpers import quick_fit

    from eldr_sglang.sim.cluster import ClusterConfig, simulate
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.policies import make_policy
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.workload import replay_workload

    trace = skewed_trace()
    replay = TraceReplay(trace)
    out: dict[str, np.ndarray] = {}
    for name, pol, wk, ck, ek in SCENARIOS:
        K = ck["num_decode"]
        cpath = quick_fit(trace, K, workdir / f"{name}.eldr") if pol == "eldr" else None
        em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"), **ek)
        wl = replay_workload(replay, **wk)
        policy = make_policy(pol, K, replay=replay, centroids=cpath, seed=7)
        res = simulate(replay, wl, policy, em, ClusterConfig(**ck, **(config_extra or {})))
        for f in FIELDS_INT + FIELDS_FLOAT:
            out[f"{name}/{f}"] = np.asarray(getattr(res, f))
        out[f"{name}/offload_misses"] = np.asarray(res.offload_misses)
    return out


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with tempfile.TemporaryDirectory() as d:
        res = run_scenarios(Path(d))
    np.savez_compressed(sys.argv[1], **res)
    print(f"wrote {sys.argv[1]}: {len(res)} arrays")
