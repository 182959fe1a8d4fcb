"""Tiny MoE model directories for real SGLang on a CPU: seeded random weights, an offline tokenizer.

Seeded random weights (not --load-format dummy, which fills every layer alike) make the
layers route differently, so signatures carry information. The tokenizer is a byte-level
BPE trained on a few sentences with the `tokenizers` library; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024  # the model's vocabulary
TOKENIZER_VOCAB = 600  # trained merges; plain "<tN>" tokens fill the rest, so every id has text

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts in each layer.",
    "Prefill computes the key value cache; decode generates one token at a time.",
    "A router sends each request to the decode worker whose experts are already warm.",
    "Numbers like 1, 2, 3, 42 and 1024 appear in code, math and tables.",
    "def add(a, b):\n    return a + b\n",
    "Bonjour, comment allez-vous? Guten Tag! Hola, que tal?",
    "The weather today is sunny with a light breeze from the west.",
    "Please summarise the following paragraph in one sentence.",
    "SGLang serves large language models with prefill and decode disaggregation.",
]

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3's own architecture, shrunk. CPU constraints (measured on sglang 0.5.23):
# SGLang's CPU rope supports DeepSeek's yarn only, so rope_scaling is DeepSeek-V3's own;
# the torch_native attention backend needs kv_lora_rank == qk_nope_head_dim.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "q_lora_rank": 96,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1},
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "torch_dtype": "bfloat16",
}

ARCHS = {"qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}


def _tokenizer(out: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    # random weights sample any id: give each one visible text, so texts compare token for token
    fast.add_tokens([f"<t{i}>" for i in range(len(fast), vocab)])
    assert len(fast) == vocab, len(fast)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path, arch: str = "qwen3_moe", seed: int = 0) -> Path:
    """Write config.json, model.safetensors (seeded random bf16 weights) and a tokenizer to out."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r} (one of {', '.join(ARCHS)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(ARCHS[arch], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # a visible correction bias, so grouped top-k is exercised
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    # keep exactly the config we mean (save_pretrained adds defaults; the arch list matters)
    saved = json.loads((out / "config.json").read_text())
    saved.update(ARCHS[arch])
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    return out


if __name__ == "__main__":  # built in a subprocess by tests, so torch stays out of the test process
    import argparse

    ap = argparse.ArgumentParser(description="write a tiny MoE model directory (test-only)")
    ap.add_argument("out")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3_moe")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(build_model(Path(a.out), a.arch, a.seed))
