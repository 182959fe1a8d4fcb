"""Simulator: conservation, determinism, distinct-expert counting, batching limits."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.sim.cluster import ClusterConfig, simulate
from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.sim.metrics import compute_metrics
from eldr_sglang.sim.policies import make_policy
from eldr_sglang.models import get_model
from eldr_sglang.sim.profiles import get_hardware
from eldr_sglang.sim.replay import TraceReplay, distinct_per_layer_np
from eldr_sglang.workload import replay_workload

from _sim_helpers import make_trace

core = pytest.importorskip("eldr_sglang._core")


@pytest.fixture(scope="module")
def small(gptoss_trace):
    return TraceReplay(gptoss_trace.subset(np.arange(0, 703, 7)))  # 101 requests


def _em():
    return ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"))


def _check_conservation(res, wl):
    # every request completes exactly once
    assert np.all(res.completions == 1)
    assert np.all(np.isfinite(res.finish)) and np.all(res.worker >= 0)
    # every output token is counted: 1 from prefill + one per decode step it was in
    assert int(res.step_batch.sum()) == int((wl.output_len - 1).sum())
    m = compute_metrics(res)
    assert m["output_tokens"] == int(wl.output_len.sum())
    assert sum(w["tokens"] for w in m["per_worker"]) == int((wl.output_len - 1).sum())
    assert sum(w["requests"] for w in m["per_worker"]) == wl.num_requests
    # causality
    assert np.all(res.prefill_done >= res.arrival)
    assert np.all(res.first_token >= res.prefill_done)
    assert np.all(res.finish >= res.first_token)


@pytest.mark.parametrize("policy", ["random", "round_robin", "shortest_queue", "power_of_two"])
def test_conservation_closed_loop(small, policy):
    wl = replay_workload(small, arrival="closed", concurrency=24)
    res = simulate(small, wl, make_policy(policy, 4), _em(), ClusterConfig(num_decode=4))
    _check_conservation(res, wl)


@pytest.mark.parametrize("arrival", ["poisson", "bursty"])
def test_conservation_open_loop_with_cycling(small, arrival):
    # more output tokens than recorded: decode routing is replayed cyclically
    wl = replay_workload(small, requests=150, arrival=arrival, rate=200.0, output_len=400, seed=3)
    assert wl.cycled
    res = simulate(small, wl, make_policy("shortest_queue", 3), _em(), ClusterConfig(num_decode=3, num_prefill=2))
    _check_conservation(res, wl)
    assert np.all(res.arrival == wl.arrival_s)


def test_router_in_flight_returns_to_zero(small):
    pol = make_policy("shortest_queue", 4)
    wl = replay_workload(small, arrival="closed", concurrency=16)
    simulate(small, wl, pol, _em(), ClusterConfig(num_decode=4))
    assert pol.loads() == [0, 0, 0, 0]


def test_single_token_requests_finish_at_admission(small):
    wl = replay_workload(small, arrival="closed", concurrency=10, output_len=1)
    res = simulate(small, wl, make_policy("round_robin", 2), _em(), ClusterConfig(num_decode=2))
    _check_conservation(res, wl)
    assert len(res.step_dt) == 0
    assert np.array_equal(res.finish, res.first_token)


def test_model_trace_mismatch_is_a_clear_error():
    ids = np.zeros((6, 2, 1), np.int16)
    rp = TraceReplay(make_trace(ids, [3, 3], [2, 2], num_experts=2))
    wl = replay_workload(rp, arrival="closed", concurrency=2)
    with pytest.raises(ValueError, match="pass the matching --model"):
        simulate(rp, wl, make_policy("round_robin", 2), _em(), ClusterConfig(num_decode=2))


def test_determinism(small):
    wl = replay_workload(small, arrival="poisson", rate=300.0, seed=5)
    outs = []
    for _ in range(2):
        res = simulate(small, wl, make_policy("power_of_two", 4, seed=11), _em(), ClusterConfig(num_decode=4))
        outs.append(res)
    a, b = outs
    assert np.array_equal(a.worker, b.worker)
    assert np.array_equal(a.finish, b.finish)
    assert np.array_equal(a.step_dt, b.step_dt)
    assert compute_metrics(a)["tpot_ms"] == compute_metrics(b)["tpot_ms"]
    # another router seed changes the routing
    c = simulate(small, wl, make_policy("power_of_two", 4, seed=12), _em(), ClusterConfig(num_decode=4))
    assert not np.array_equal(a.worker, c.worker)


def test_workload_seed_changes_arrivals(small):
    a = replay_workload(small, arrival="poisson", rate=10.0, seed=1).arrival_s
    b = replay_workload(small, arrival="poisson", rate=10.0, seed=1).arrival_s
    c = replay_workload(small, arrival="poisson", rate=10.0, seed=2).arrival_s
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.all(np.diff(a) >= 0)


def test_rust_distinct_matches_numpy():
    rng = np.random.default_rng(0)
    for E, dtype in ((256, np.uint8), (32, np.int16), (128, np.int32)):
        ids = rng.integers(0, E, size=(37, 9, 4)).astype(dtype)
        assert np.array_equal(np.asarray(core.distinct_per_layer(ids, E)), distinct_per_layer_np(ids, E))
    # constructed: 3 tokens at one layer with experts {0,1}, {1,2}, {0,2} -> 3 distinct
    ids = np.array([[[0, 1]], [[1, 2]], [[0, 2]]], np.uint8)
    assert core.distinct_per_layer(ids, 4).tolist() == [3]


def test_max_running_and_kv_capacity_respected(small):
    wl = replay_workload(small, arrival="closed", concurrency=60)
    res = simulate(small, wl, make_policy("round_robin", 2), _em(), ClusterConfig(num_decode=2, max_running=5))
    assert res.step_batch.max() <= 5
    _check_conservation(res, wl)
    need = int((wl.prompt_len + wl.output_len).max())
    res2 = simulate(small, wl, make_policy("round_robin", 2), _em(),
                    ClusterConfig(num_decode=2, kv_capacity_tokens=need))
    assert max(res2.extra["peak_kv_reserved"]) <= need
    assert res.step_batch.mean() > res2.step_batch.mean()  # the KV limit binds
    _check_conservation(res2, wl)
    with pytest.raises(ValueError, match="KV tokens"):
        simulate(small, wl, make_policy("round_robin", 2), _em(), ClusterConfig(num_decode=2, kv_capacity_tokens=need - 1))


def test_step_distinct_comes_from_the_trace(small):
    """A recorded step's distinct count equals a recount of the batch's trace rows."""
    same = np.nonzero(small.prompt_len == small.prompt_len.max())[0][:8]
    assert len(same) == 8
    wl = replay_workload(small, arrival="closed", concurrency=8, requests=same)
    # equal prompts on 8 prefill workers: all 8 reach the single decode worker together
    res = simulate(small, wl, make_policy("round_robin", 1), _em(), ClusterConfig(num_decode=1, num_prefill=8))
    d = distinct_per_layer_np(small.expert_ids[small.dec_start[same]], small.num_experts)
    assert res.step_batch[0] == 8
    assert res.step_distinct[0] == pytest.approx(d.mean())
    d1 = distinct_per_layer_np(small.expert_ids[small.dec_start[same] + 1], small.num_experts)
    assert res.step_distinct[1] == pytest.approx(d1.mean())


def test_offload_mode_counts_misses(small):
    em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"), offload_cache_experts=8)
    wl = replay_workload(small, arrival="closed", concurrency=16, requests=np.arange(30))
    res = simulate(small, wl, make_policy("round_robin", 2), em, ClusterConfig(num_decode=2))
    _check_conservation(res, wl)
    assert res.offload_misses > 0
    base = simulate(small, wl, make_policy("round_robin", 2), _em(), ClusterConfig(num_decode=2))
    assert res.step_dt.sum() > base.step_dt.sum()


def test_random_mix_yardstick():
    from eldr_sglang.sim.cluster import random_mix_distinct

    # every token picks 2 of 4 experts, uniformly: p = 1/2 each
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(3)]) for _ in range(4000)]).astype(np.int16)
    rp = TraceReplay(make_trace(ids, [2000, 2000], [10, 10], num_experts=4))
    null = random_mix_distinct(rp, np.array([1, 2, 3]))
    assert null == pytest.approx([4 * (1 - 0.5**b) for b in (1, 2, 3)], rel=0.02)


def test_locality_near_one_without_locality(small):
    """Round robin over real requests: batches look like random mixes (locality ~ 1)."""
    wl = replay_workload(small, arrival="closed", concurrency=32, requests=np.random.default_rng(0).permutation(small.num_requests))
    m = compute_metrics(simulate(small, wl, make_policy("round_robin", 2), _em(), ClusterConfig(num_decode=2)))
    assert 0.93 < m["expert_locality"] < 1.02


def test_perfect_overlap_bound_and_expert_parallel_and_context(small):
    wl = replay_workload(small, requests=60, arrival="closed", concurrency=16, output_len=12)
    em = _em()
    pol = lambda: make_policy("round_robin", 4)
    base = simulate(small, wl, pol(), em, ClusterConfig(num_decode=4))
    bound = simulate(small, wl, pol(), em, ClusterConfig(num_decode=4, perfect_overlap=True))
    _check_conservation(bound, wl)
    # the bound touches exactly top_k experts per layer and is never slower
    assert np.allclose(bound.step_distinct, small.top_k)
    assert bound.step_dt.sum() < base.step_dt.sum()
    # EP over 2 ranks (tp=2): per-rank counts, same routing, same distinct totals
    ep = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"), tp=2, ep=2)
    res = simulate(small, wl, pol(), ep, ClusterConfig(num_decode=4))
    _check_conservation(res, wl)
    # step_distinct still counts all of a layer's distinct experts (summed over ranks)
    assert np.all(res.step_distinct >= small.top_k)
    assert np.all(res.step_distinct <= np.minimum(res.step_batch * small.top_k, small.num_experts))
    # a longer simulated context reads more KV: slower steps
    long = replay_workload(small, requests=60, arrival="closed", concurrency=16, output_len=12, context_len=4096)
    assert (long.prompt_len == 4096).all()
    rl = simulate(small, long, pol(), em, ClusterConfig(num_decode=4))
    assert rl.step_dt.sum() > base.step_dt.sum()
    with pytest.raises(ValueError, match="context length"):
        replay_workload(small, requests=4, arrival="closed", concurrency=2, context_len=0)
