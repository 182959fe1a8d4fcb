"""The one model catalogue: names, Hugging Face ids and config.json files give the same shapes
to synth, collect and the simulator."""

from __future__ import annotations

import json

import pytest

from eldr_sglang import models
from eldr_sglang.traces import synth
from eldr_sglang.models import MODEL_PROFILES, from_config, get_model, model_shape
from eldr_sglang.traces.sglang_responses import ModelSpec


def _hf_config(p) -> dict:
    """A config.json with the key names each family's Hugging Face config uses, from the catalogue's constants."""
    cfg = {"_name_or_path": p.hf_id, "hidden_size": p.hidden_size, "num_hidden_layers": p.num_layers,
           "num_experts_per_tok": p.top_k, "vocab_size": p.vocab_size, "tie_word_embeddings": p.tied_embeddings,
           "num_attention_heads": p.num_heads, "torch_dtype": "bfloat16"}
    if p.attention == "mla":  # DeepSeek
        cfg.update(n_routed_experts=p.num_experts, first_k_dense_replace=p.num_dense_layers,
                   n_shared_experts=p.num_shared_experts, moe_intermediate_size=p.moe_intermediate_size,
                   intermediate_size=p.dense_intermediate_size, q_lora_rank=p.q_lora_rank or None,
                   kv_lora_rank=p.kv_lora_rank, qk_nope_head_dim=p.qk_nope_head_dim,
                   qk_rope_head_dim=p.qk_rope_head_dim, v_head_dim=p.v_head_dim)
        if p.expert_bytes_per_param == models.FP8:
            cfg["quantization_config"] = {"quant_method": "fp8"}
    elif p.name.startswith("qwen3"):
        cfg.update(num_experts=p.num_experts, moe_intermediate_size=p.moe_intermediate_size,
                   num_key_value_heads=p.num_kv_heads, head_dim=p.head_dim)
        if p.expert_bytes_per_param == models.FP8:  # Qwen3-235B-A22B-FP8
            cfg["quantization_config"] = {"quant_method": "fp8"}
    else:  # Mixtral, GPT-OSS
        cfg.update(num_local_experts=p.num_experts, intermediate_size=p.moe_intermediate_size,
                   num_key_value_heads=p.num_kv_heads, head_dim=p.head_dim)
        if p.name == "gpt-oss-20b":
            cfg.update(model_type="gpt_oss", sliding_window=p.sliding_window, quantization_config={"quant_method": "mxfp4"},
                       layer_types=["sliding_attention", "full_attention"] * (p.num_layers // 2))
    return cfg


@pytest.mark.parametrize("name", list(MODEL_PROFILES))
def test_a_model_directory_reads_back_as_its_catalogue_entry(tmp_path, name):
    p = MODEL_PROFILES[name]
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(p)))
    got = get_model(tmp_path)  # the directory, as `--model /path/to/model` passes it
    assert got.shape() == p.shape()
    assert got.total_params() == pytest.approx(p.total_params(), rel=1e-9)
    assert got.weight_bytes() == pytest.approx(p.weight_bytes(), rel=1e-9)
    assert got.kv_bytes_per_token() == pytest.approx(p.kv_bytes_per_token(), rel=1e-9)
    assert from_config(tmp_path / "config.json").shape() == p.shape()
    assert model_shape(str(tmp_path)) == p.shape()


def test_synth_collect_and_simulator_read_one_catalogue():
    assert synth.MODEL_SHAPES is models.MODEL_SHAPES
    for name, p in MODEL_PROFILES.items():
        shape = model_shape(p.hf_id)  # an HF id works wherever a name does
        assert shape == synth.model_shape(name) == p.shape()
        assert shape["num_layers"] == p.num_moe_layers
        spec = ModelSpec.preset(p.hf_id)
        assert (spec.num_hidden_layers, spec.top_k, spec.num_experts) == (p.num_layers, p.top_k, p.num_experts)
    assert get_model("mistralai/Mixtral-8x7B-Instruct-v0.1").hf_id == "mistralai/Mixtral-8x7B-v0.1"


@pytest.mark.parametrize("cfg, msg", [
    ("{not json", "cannot read the model config"),
    ("[1, 2]", "must be a JSON object"),
    ('{"num_hidden_layers": 4, "hidden_size": 8}', "no n_routed_experts or num_local_experts or num_experts"),
    ('{"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 9}', "top-k"),
    ('{"num_hidden_layers": -1, "num_experts": 8, "num_experts_per_tok": 2}', "num_hidden_layers must be an integer"),
])
def test_a_bad_config_is_one_clear_error(tmp_path, cfg, msg):
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match=msg):
        get_model(tmp_path)


def test_a_directory_without_config_and_an_empty_name_are_refused(tmp_path):
    with pytest.raises(ValueError, match="without a config.json"):
        get_model(tmp_path)
    with pytest.raises(ValueError, match="non-empty string"):
        get_model("")


def test_an_unknown_name_lists_what_is_known():
    with pytest.raises(ValueError, match="unknown model profile 'llama-2-7b'.*deepseek-v3.*config.json"):
        model_shape("llama-2-7b")
