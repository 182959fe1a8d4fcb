"""Execution-time model: profiles match public totals, monotonicity, offload cache."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.sim.cost_model import ExecutionModel, min_tp
from eldr_sglang.models import MODEL_PROFILES, get_model
from eldr_sglang.sim.profiles import HARDWARE_PROFILES, get_hardware


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
@pytest.mark.parametrize("hname", [h for h, p in HARDWARE_PROFILES.items() if not p.calibrated_only])
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


def test_offload_misses_cost_host_link_time():
    em = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h100"), tp=1, offload_cache_experts=4)
    L = em.model.num_moe_layers
    d = np.full(L, 4)
    t0 = em.decode_step_time(8, 1000, d, np.zeros(L))
    t1 = em.decode_step_time(8, 1000, d, np.ones(L))
    assert t1 - t0 == pytest.approx(L * em.model.expert_bytes() / em.hardware.host_link_bw, rel=1e-9)
    # paged experts free HBM for KV cache (on the one GPU SGLang's paged experts allow)
    full = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h200"), tp=1)
    part = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h200"), tp=1, offload_cache_experts=4)
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


def test_mla_kv_is_replicated_under_tp():
    # DeepSeek-V3 on 8xH200: each rank keeps the whole 576-wide latent (plain TP)
    em = ExecutionModel(get_model("deepseek-v3"), get_hardware("h200"))
    m, hw = em.model, em.hardware
    per_gpu_free = hw.hbm_bytes * em.mem_fraction - m.weight_bytes() / em.tp
    assert em.kv_capacity_tokens() == int(per_gpu_free // m.kv_bytes_per_token())
    L = m.num_moe_layers
    d = np.full(L, 8)
    # attention reads come at one GPU's bandwidth, not tp GPUs'
    extra = em.decode_step_time(1, 1_000_000, d) - em.decode_step_time(1, 0, d)
    reads = 1_000_000 * m.kv_bytes_per_token() / (hw.hbm_bw * em.bw_efficiency)
    assert extra == pytest.approx(reads, rel=1e-6)
    # GQA with tp <= kv heads still splits
    q = ExecutionModel(get_model("qwen3-30b-a3b"), get_hardware("h100"), tp=4)
    assert q.describe()["kv_replicated_over_tp"] is False


def test_paper_fixed_cost_reproduces_the_measured_slowdown():
    from eldr_sglang.sim.cost_model import PAPER_MOE_16_TO_128_SLOWDOWN, paper_fixed_cost, sensitivity_model

    base = ExecutionModel(get_model("deepseek-v3"), get_hardware("h200"))
    f = base.paper_fixed_cost_s()
    assert f > 0 and f == paper_fixed_cost()
    fixed = ExecutionModel(get_model("deepseek-v3"), get_hardware("h200"), moe_layer_fixed_s=f)
    assert fixed.moe_slowdown(16, 128) == pytest.approx(PAPER_MOE_16_TO_128_SLOWDOWN, rel=1e-9)
    # the fixed cost adds the same time to every step whatever the experts
    L = base.model.num_moe_layers
    for d in (8, 40):
        diff = fixed.decode_step_time(16, 1000, np.full(L, d)) - base.decode_step_time(16, 1000, np.full(L, d))
        assert diff == pytest.approx(L * f, rel=1e-9)
    over = sensitivity_model("paper-fixed+overhead", base.model, base.hardware)
    assert over.step_overhead_s > base.step_overhead_s and over.moe_layer_fixed_s == f
    with pytest.raises(ValueError, match="unknown cost-model variant"):
        sensitivity_model("optimistic", base.model, base.hardware)


def test_expert_parallel_slowest_rank_sets_the_pace():
    m, hw = get_model("deepseek-v3"), get_hardware("h200")
    em = ExecutionModel(m, hw, ep=8)
    L = m.num_moe_layers
    even = np.full((L, 8), 4)
    skew = even.copy()
    skew[:, 0] = 12  # same busiest rank as below, fewer experts elsewhere
    skew[:, 1:] = 0
    assert em.decode_step_time(32, 1000, skew) > em.decode_step_time(32, 1000, even)
    only_busiest = np.zeros((L, 8), int)
    only_busiest[:, 3] = 12
    assert em.decode_step_time(32, 1000, skew) == pytest.approx(em.decode_step_time(32, 1000, only_busiest))
    # the all-to-all grows with the batch and uses one direction of NVLink
    a2a = lambda b: float(em.moe_layer_time(b, 1))  # one expert per rank: memory-bound at these batches
    per_tok = 2 * m.top_k * m.hidden_size * 2.0 * 7 / 8 / (hw.scale_up_bw / 2)
    assert a2a(64) - a2a(32) == pytest.approx(32 * per_tok, rel=1e-6)
    with pytest.raises(ValueError, match="ep must divide"):
        ExecutionModel(m, hw, ep=3)
    assert list(np.bincount(em.ep_rank_of_expert())) == [32] * 8


def test_calibration_file_replaces_the_roofline(tmp_path):
    import json

    from eldr_sglang.sim.cost_model import load_calibration

    f = tmp_path / "cal.json"
    entries = [{"model": "gpt-oss-20b", "hardware": "h100", "batch": b, "a_s": 10e-6, "b_s": 2e-6 * (1 + b / 64)} for b in (8, 64)]
    f.write_text(json.dumps({"format": "eldr-moe-calibration/1", "entries": entries}))
    cal = load_calibration(f, "gpt-oss-20b", "h100")
    em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"), calibration=cal)
    assert float(em.moe_layer_time(8, 10)) == pytest.approx(10e-6 + 10 * 2e-6 * (1 + 8 / 64))
    assert float(em.moe_layer_time(36, 10)) == pytest.approx(10e-6 + 10 * 2e-6 * (1 + 36 / 64))  # interpolated
    with pytest.raises(ValueError, match="no calibration for model"):
        load_calibration(f, "deepseek-v3")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not an eldr-moe-calibration"):
        load_calibration(bad, "gpt-oss-20b")


def _qwen_locality_dir(tmp_path, name="locality-0.9-0-"):
    """A model directory shaped like the real-engine CPU benchmark's constructed Qwen3-MoE."""
    import json

    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 512, "moe_intermediate_size": 1536, "intermediate_size": 1536,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 2048, "torch_dtype": "bfloat16"}))
    return d


def _cpu_calibration(tmp_path, other=True):
    import json

    entries = []
    for b in (1, 4, 16):
        e = {"model": "qwen3-moe-locality", "hardware": "cpu: Test CPU, 1 thread", "batch": b, "a_s": 1e-3 * b,
             "b_s": 0.7e-3, "hidden": 512, "intermediate_per_rank": 1536, "experts": 32, "top_k": 4, "layers": 4,
             "heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 2048}
        if other:
            e["other_s"] = 2e-3 + 0.1e-3 * b
        entries.append(e)
    f = tmp_path / ("cal_cpu.json" if other else "cal_cpu_moe_only.json")
    f.write_text(json.dumps({"format": "eldr-moe-calibration/1", "device": "cpu", "entries": entries}))
    return f


def test_a_calibration_with_other_s_is_the_whole_decode_step(tmp_path):
    from eldr_sglang.sim.cost_model import load_calibration

    model = get_model(_qwen_locality_dir(tmp_path))
    f = _cpu_calibration(tmp_path)
    # the directory's name is not the calibration's: the exact shape selects the entries
    with pytest.raises(ValueError, match="no calibration for model"):
        load_calibration(f, model.name, "cpu")
    cal = load_calibration(f, model.name, "cpu", profile=model)
    assert cal[4] == pytest.approx((4e-3, 0.7e-3, 2.4e-3))
    em = ExecutionModel(model, get_hardware("cpu"), calibration=cal)
    assert em.tp == 1 and em.measured_step
    d = np.array([4, 9, 12, 20])
    # other_s(B) + sum_l a(B) + b(B) d_l, at a measured batch and interpolated between two
    assert em.decode_step_time(4, 4 * 48, d) == pytest.approx(2.4e-3 + 4 * 4e-3 + 0.7e-3 * d.sum())
    assert em.decode_step_time(10, 10 * 48, d) == pytest.approx(3.0e-3 + 4 * 10e-3 + 0.7e-3 * d.sum())
    # measured at one context: the KV length does not enter
    assert em.decode_step_time(4, 1, d) == em.decode_step_time(4, 10_000, d)
    br = em.breakdown(4, 100, d)
    assert br.overhead == 0 and br.attention == 0 and br.dense == pytest.approx(2.4e-3) and br.total == pytest.approx(
        em.decode_step_time(4, 100, d))
    # prefill of 24 tokens: other_s(24) (held at B=16) + 4 layers at the uniform-routing touched experts
    touched = 32 * (1 - (1 - 4 / 32) ** 24)
    assert em.prefill_time(24) == pytest.approx(3.6e-3 + 4 * (16e-3 + 0.7e-3 * touched))
    assert em.kv_transfer_time(24) == 0.0 and em.kv_capacity_tokens() > 1_000_000
    assert em.describe()["calibrated_step"] is True


def test_without_other_s_the_calibration_changes_only_the_expert_time(tmp_path):
    from eldr_sglang.sim.cost_model import load_calibration

    model = get_model(_qwen_locality_dir(tmp_path))
    cal = load_calibration(_cpu_calibration(tmp_path, other=False), model.name, None, profile=model)
    em = ExecutionModel(model, get_hardware("h100"), calibration=cal)
    ref = ExecutionModel(model, get_hardware("h100"))
    d = np.array([4, 9, 12, 20])
    assert not em.measured_step
    assert em._fixed_terms(4, 200) == ref._fixed_terms(4, 200)  # overhead, dense, attention: the roofline's
    assert em.decode_step_time(4, 200, d) == pytest.approx(sum(ref._fixed_terms(4, 200)) + 4 * 4e-3 + 0.7e-3 * d.sum())


def test_the_cpu_profile_refuses_to_run_uncalibrated(tmp_path):
    from eldr_sglang.sim.cost_model import load_calibration

    model = get_model(_qwen_locality_dir(tmp_path))
    with pytest.raises(ValueError, match="needs a calibration with the non-MoE step time"):
        ExecutionModel(model, get_hardware("cpu"))
    moe_only = load_calibration(_cpu_calibration(tmp_path, other=False), model.name, "cpu", profile=model)
    with pytest.raises(ValueError, match="needs a calibration with the non-MoE step time"):
        ExecutionModel(model, get_hardware("cpu"), calibration=moe_only)
    full = load_calibration(_cpu_calibration(tmp_path), model.name, "cpu", profile=model)
    with pytest.raises(ValueError, match="tp 1"):
        ExecutionModel(model, get_hardware("cpu"), calibration=full, tp=2)
    with pytest.raises(ValueError, match="some batch sizes only"):
        ExecutionModel(model, get_hardware("cpu"), calibration={1: (1e-3, 1e-4, 1e-3), 4: (1e-3, 1e-4)})


def test_shape_matching_needs_every_recorded_field(tmp_path):
    import dataclasses

    from eldr_sglang.sim.cost_model import load_calibration

    model = get_model(_qwen_locality_dir(tmp_path))
    other_vocab = dataclasses.replace(model, vocab_size=4096)
    with pytest.raises(ValueError, match="no calibration for model"):
        load_calibration(_cpu_calibration(tmp_path), model.name, "cpu", profile=other_vocab)
