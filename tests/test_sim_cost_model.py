"""Execution-time model: profiles match public totals, monotonicity, offload cache."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.sim.cost_model import ExecutionModel, ExpertCache, min_tp
from eldr_sglang.sim.profiles import HARDWARE_PROFILES, MODEL_PROFILES, get_hardware, get_model


@pytest.mark.parametrize("name", list(MODEL_PROFILES))
def test_profile_totals_match_published(name):
    m = MODEL_PROFILES[name]
    # computed from config.json constants; must land within 1% of the published total
    assert m.total_params() == pytest.approx(m.published_total_params, rel=0.01)
    # published "active" counts leave the input embedding out for some models
    act = m.active_params()
    assert m.published_active_params * 0.97 <= act <= m.published_active_params * 1.2


def test_profile_lookup_by_hf_id_and_alias():
    assert get_model("deepseek-ai/DeepSeek-V3").name == "deepseek-v3"
    assert get_model("openai/gpt-oss-20b").name == "gpt-oss-20b"
    assert get_model("Qwen/Qwen3-30B-A3B").name == "qwen3-30b-a3b"
    assert get_model("mistralai/Mixtral-8x7B-Instruct-v0.1").name == "mixtral-8x7b"
    assert get_hardware("H200").name == "h200"
    with pytest.raises(ValueError, match="unknown model profile"):
        get_model("llama-2-7b")


def test_mla_kv_bytes():
    # DeepSeek-V3 MLA caches kv_lora_rank + rope dims = 576 bf16 values per token per block
    assert get_model("deepseek-v3").kv_bytes_per_token() == 576 * 2 * 61


@pytest.mark.parametrize("mname", list(MODEL_PROFILES))
@pytest.mark.parametrize("hname", list(HARDWARE_PROFILES))
def test_step_time_monotone_in_distinct_experts(mname, hname):
    em = ExecutionModel(MODEL_PROFILES[mname], HARDWARE_PROFILES[hname])
    L, E, k = em.model.num_moe_layers, em.model.num_experts, em.model.top_k
    for batch in (1, 8, 64):
        lo = min(k, E)
        hi = min(batch * k, E)
        times = [em.decode_step_time(batch, 4096 * batch, np.full(L, d)) for d in range(lo, hi + 1)]
        assert np.all(np.diff(times) >= 0)
        # one more distinct expert in one layer never makes a step faster
        base = np.full(L, lo)
        bumped = base.copy()
        bumped[L // 2] = min(hi, lo + 1)
        assert em.decode_step_time(batch, 4096, bumped) >= em.decode_step_time(batch, 4096, base)
    # in the memory-bound regime (small batch) more experts is strictly slower
    t1 = em.decode_step_time(1, 1024, np.full(L, min(k, E)))
    t2 = em.decode_step_time(4, 1024, np.full(L, min(4 * k, E)))
    if min(4 * k, E) > k:
        assert t2 > t1


def test_step_time_grows_with_kv_and_prefill_with_tokens():
    em = ExecutionModel(get_model("qwen3-30b-a3b"), get_hardware("h100"))
    d = np.full(em.model.num_moe_layers, 40)
    assert em.decode_step_time(16, 200_000, d) > em.decode_step_time(16, 10_000, d)
    ts = [em.prefill_time(n) for n in (1, 16, 256, 4096, 16384)]
    assert np.all(np.diff(ts) > 0)
    assert em.decode_step_time(0, 0, d) == 0.0


def test_step_time_rejects_wrong_layer_count():
    em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"))
    with pytest.raises(ValueError, match="shape"):
        em.decode_step_time(4, 100, np.ones(7))


def test_tp_defaults_to_fewest_gpus_that_hold_the_weights():
    ds = get_model("deepseek-v3")
    assert min_tp(ds, get_hardware("h200")) == 8  # 671 GB of FP8 weights
    assert min_tp(get_model("gpt-oss-20b"), get_hardware("h100")) == 1
    em = ExecutionModel(ds, get_hardware("h200"))
    assert em.kv_capacity_tokens() > 0
    with pytest.raises(ValueError, match="do not fit"):
        ExecutionModel(ds, get_hardware("h100"), tp=1).kv_capacity_tokens()


def test_moe_slowdown_prediction_is_printed_not_fitted():
    em = ExecutionModel(get_model("deepseek-v3"), get_hardware("h200"))
    r = em.moe_slowdown(16, 128)
    # a pure bandwidth roofline: between 1x and the 8x byte ratio
    assert 1.0 < r <= 128 / 16
    from eldr_sglang.sim.runner import paper_check

    line = paper_check(em)
    assert f"{r:.2f}x" in line and "4.7x" in line


def test_expert_cache_lru():
    c = ExpertCache(num_layers=1, num_experts=6, capacity=2)
    def touch(*es):
        m = np.zeros((1, 6), bool)
        m[0, list(es)] = True
        return int(c.access(m)[0])
    assert touch(0, 1) == 2  # cold
    assert touch(0, 1) == 0  # both cached
    assert touch(0) == 0  # 0 is now the most recently used
    assert touch(2) == 1  # evicts the least recently used: 1
    assert c.cached[0].tolist() == [True, False, True, False, False, False]
    assert touch(0, 2) == 0
    assert touch(1) == 1
    assert touch(3, 4, 5) == 3  # more than fits: all miss, two stay
    assert c.cached.sum() == 2


def test_offload_misses_cost_host_link_time():
    em = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h100"), tp=1, offload_cache_experts=4)
    L = em.model.num_moe_layers
    d = np.full(L, 4)
    t0 = em.decode_step_time(8, 1000, d, np.zeros(L))
    t1 = em.decode_step_time(8, 1000, d, np.ones(L))
    assert t1 - t0 == pytest.approx(L * em.model.expert_bytes() / em.hardware.host_link_bw, rel=1e-9)
    # offloaded experts free HBM for KV cache
    full = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h100"), tp=2)
    part = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h100"), tp=2, offload_cache_experts=4)
    assert part.kv_capacity_tokens() > full.kv_capacity_tokens()


def test_decode_step_time_by_hand():
    """One configuration worked out from the datasheet numbers, term by term."""
    m, hw = get_model("gpt-oss-20b"), get_hardware("h100")
    em = ExecutionModel(m, hw, tp=1)
    bw = 3.35e12 * 0.8
    d = np.full(24, 4)
    # batch 1, no KV: overhead + non-expert weights + 24 layers x 4 experts, all memory-bound
    expect = 0.5e-3 + m.nonexpert_bytes_per_step() / bw + 24 * 4 * m.expert_bytes() / bw
    assert em.decode_step_time(1, 0, d) == pytest.approx(expect, rel=1e-12)
    # 1000 cached tokens: 12 full-attention layers read all, 12 sliding-window layers read 128
    kv = (12 * 1000 + 12 * 128) * 2 * 8 * 64 * 2
    assert em.decode_step_time(1, 1000, d) - em.decode_step_time(1, 0, d) == pytest.approx(kv / bw, rel=1e-9)
    # MXFP4 expert: 24.88M params x 4.25 bits
    assert m.expert_bytes() == pytest.approx((3 * 2880 * 2880 + 2 * 2880 + 2880) * 4.25 / 8)
