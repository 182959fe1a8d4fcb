"""The simulator's paged experts against SGLang's rules (paged_experts/residency.py), by hand
and, where SGLang is installed, against its own LRUPolicy and plan_waves."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.models import get_model
from eldr_sglang.sim.cost_model import EAGER_STEP_OVERHEAD_S, ExecutionModel
from eldr_sglang.sim.paged_experts import PagedExperts
from eldr_sglang.sim.profiles import get_hardware


def _mask(E, *es):
    m = np.zeros((1, E), bool)
    m[0, list(es)] = True
    return m


def _resident(c):
    return np.nonzero(c.resident[0])[0].tolist()


def test_starts_with_experts_0_to_c_minus_1_and_evicts_the_least_recent():
    c = PagedExperts(num_layers=1, num_experts=6, capacity=2)
    assert _resident(c) == [0, 1]  # LRUPolicy: slots start holding experts 0..K-1
    loads, waves = c.access(_mask(6, 0, 1))
    assert (loads[0], waves[0]) == (0, 1)  # both resident from the start
    loads, _ = c.access(_mask(6, 2))  # recency was 0 then 1 (ascending id): 0 goes
    assert loads[0] == 1 and _resident(c) == [1, 2]
    c.access(_mask(6, 1))  # 1 is now the most recent
    c.access(_mask(6, 3))  # so 2 goes
    assert _resident(c) == [1, 3]


def test_order_inside_a_step_hits_before_page_ins():
    # resident {0, 1}; step touches 1 (hit) and 4 (page-in, evicting 0): recency then 1, 4.
    c = PagedExperts(num_layers=1, num_experts=6, capacity=2)
    c.access(_mask(6, 1, 4))
    assert _resident(c) == [1, 4]
    c.access(_mask(6, 5))  # the least recent of the step was the hit, 1
    assert _resident(c) == [4, 5]


def test_waves_page_every_missing_expert_once_and_keep_the_last_c():
    # C = 2, resident {0, 1}; the step touches 1, 3, 4, 5: ordered = [1 | 3, 4, 5] (resident
    # first), waves [1, 3], [4, 5]: page-ins 3, 4, 5 -> 3 loads, 2 waves, the last wave resident.
    c = PagedExperts(num_layers=1, num_experts=6, capacity=2)
    loads, waves = c.access(_mask(6, 1, 3, 4, 5))
    assert (int(loads[0]), int(waves[0])) == (3, 2)
    assert _resident(c) == [4, 5]
    # three waves: C = 2, touches 0..4 from resident {4, 5}: ordered [4 | 0, 1, 2, 3] ->
    # waves [4, 0], [1, 2], [3]: 4 page-ins; the last wave (3) plus the most recent of the
    # one before (2) stay.
    loads, waves = c.access(_mask(6, 0, 1, 2, 3, 4))
    assert (int(loads[0]), int(waves[0])) == (4, 3)
    assert _resident(c) == [2, 3]


def test_counters_hit_rate_page_ins_per_step_and_reuse():
    c = PagedExperts(num_layers=2, num_experts=4, capacity=2)
    t = np.zeros((2, 4), bool)
    t[0, [0, 1]] = True  # 2 hits
    t[1, [2, 3]] = True  # 2 page-ins
    c.access(t, selections=8)
    c.access(t, selections=8)  # all 4 resident now: 4 hits
    s = c.stats()
    assert s["steps"] == 2 and s["touched"] == 8 and s["page_ins"] == 2
    assert s["hit_rate"] == pytest.approx(6 / 8)
    assert s["page_ins_per_step"] == pytest.approx(1.0)
    assert s["reuse"] == pytest.approx(16 / 2)


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="1..6"):
        PagedExperts(1, 6, 0)
    with pytest.raises(ValueError, match="1..6"):
        PagedExperts(1, 6, 7)


def _sglang_residency():
    """SGLang's residency module; a failure instead of a skip under CI (as the real-SGLang tests)."""
    from _sglang_cpu import REQUIRE

    try:
        from sglang.srt.layers.moe.paged_experts import residency
    except ImportError as exc:
        if REQUIRE:
            pytest.fail(f"sglang 0.5.23 is needed to check paged experts against its source: {exc}")
        pytest.skip(f"sglang not installed: {exc}")
    return residency


class _ReferenceLRU:
    """SGLang's LRUPolicy + plan_waves restated with an OrderedDict (residency.py), so the
    real-trace check below runs without SGLang."""

    def __init__(self, E, C):
        from collections import OrderedDict

        self.C, self.res = C, OrderedDict((e, e) for e in range(C))

    def step(self, distinct):
        ordered = [e for e in distinct if e in self.res] + [e for e in distinct if e not in self.res]
        loads = 0
        for i in range(0, len(ordered), self.C):
            wave = ordered[i : i + self.C]
            for e in wave:
                if e in self.res:
                    self.res.move_to_end(e)
            for e in wave:
                if e not in self.res:
                    _, slot = self.res.popitem(last=False)
                    self.res[e] = slot
                    loads += 1
        return loads


def test_matches_the_reference_lru_on_real_gptoss_routing(gptoss_trace):
    from eldr_sglang.sim.replay import TraceReplay, touched_mask

    rp = TraceReplay(gptoss_trace)
    L, E = rp.num_layers, rp.num_experts
    C = 8
    ours = PagedExperts(L, E, C)
    refs = [_ReferenceLRU(E, C) for _ in range(L)]
    rng = np.random.default_rng(0)
    reqs = rng.choice(len(rp.dec_start), size=6, replace=False)
    for t in range(300):  # a batch of 6 requests stepping through their decode rows
        rows = rp.dec_start[reqs] + t % rp.dec_len[reqs]
        touched = touched_mask(rp.expert_ids[rows], E)
        loads, waves = ours.access(touched)
        want = [refs[l].step(np.nonzero(touched[l])[0].tolist()) for l in range(L)]
        assert loads.tolist() == want
        assert waves.tolist() == [max(1, -(-int(d) // C)) for d in touched.sum(axis=1)]
    assert [sorted(r.res) for r in refs] == [np.nonzero(ours.resident[l])[0].tolist() for l in range(L)]


def test_matches_sglang_lru_policy_and_plan_waves():
    residency = _sglang_residency()
    rng = np.random.default_rng(3)
    E, C = 16, 5
    ours = PagedExperts(1, E, C)
    pol = residency.LRUPolicy(C)
    for _ in range(400):
        n = int(rng.integers(1, 13))
        touched = np.unique(rng.choice(E, size=n, p=np.r_[np.full(6, 0.12), np.full(E - 6, 0.28 / (E - 6))]))
        waves = residency.plan_waves(pol, sorted(touched.tolist()))
        loads, w = ours.access(_mask(E, *touched))
        assert int(loads[0]) == sum(len(x.loads) for x in waves)
        assert int(w[0]) == len(waves)
        assert _resident(ours) == sorted(pol.resident)
        # recency order too: SGLang's OrderedDict, least recent first
        assert [int(e) for e in np.argsort(ours.stamp[0])[-C:]] == list(pol.resident)


def test_page_in_cost_is_expert_bytes_over_one_pcie_direction():
    m = get_model("qwen3-30b-a3b")  # bf16 experts: 3 x 2048 x 768 x 2 B = 9.44 MB
    assert m.expert_bytes() == 3 * 2048 * 768 * 2
    em = ExecutionModel(m, get_hardware("l40s"), offload_cache_experts=32)
    assert em.tp == 1
    L = m.num_moe_layers
    d = np.full(L, 8)
    t0 = em.decode_step_time(4, 1000, d, np.zeros(L), np.ones(L))
    t1 = em.decode_step_time(4, 1000, d, np.ones(L), np.ones(L))
    assert t1 - t0 == pytest.approx(L * m.expert_bytes() / 32e9, rel=1e-9)  # PCIe Gen4 x16: 32 GB/s a way
    # a batch past C // top_k runs without a decode CUDA graph
    t_graph = em.decode_step_time(4, 1000, d, np.zeros(L), np.ones(L))
    t_eager = em.decode_step_time(5, 1000, d, np.zeros(L), np.ones(L))
    assert t_eager - t_graph >= EAGER_STEP_OVERHEAD_S - em.step_overhead_s - 1e-12


def test_extra_waves_pay_the_per_layer_fixed_cost():
    m = get_model("qwen3-30b-a3b")
    em = ExecutionModel(m, get_hardware("l40s"), offload_cache_experts=16, moe_layer_fixed_s=1e-5)
    L = m.num_moe_layers
    d = np.full(L, 20)
    one = em.decode_step_time(8, 1000, d, np.zeros(L), np.ones(L))
    two = em.decode_step_time(8, 1000, d, np.zeros(L), np.full(L, 2))
    assert two - one == pytest.approx(L * 1e-5, rel=1e-9)


def test_paged_mode_is_single_gpu_and_needs_top_k_slots():
    m = get_model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="single GPU"):
        ExecutionModel(m, get_hardware("h100"), tp=2, offload_cache_experts=16)
    with pytest.raises(ValueError, match="top_k"):
        ExecutionModel(m, get_hardware("h100"), offload_cache_experts=4)
    # the resident experts free memory for KV cache
    small = ExecutionModel(m, get_hardware("l40s"), offload_cache_experts=16)
    big = ExecutionModel(m, get_hardware("l40s"), offload_cache_experts=64)
    assert small.kv_capacity_tokens() > big.kv_capacity_tokens()
