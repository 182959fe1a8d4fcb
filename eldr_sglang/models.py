"""The model catalogue: one entry per MoE model shape, for synth, the simulator, the
emulator and collect.

Every architectural constant below is copied from a public specification, cited next to
it (Hugging Face `config.json` of the model, the model's technical report or card).
Derived quantities (parameters per expert, attention parameters, KV-cache bytes per token)
are *computed* from those constants by the formulas in this file, so they can be audited,
and `ModelProfile.total_params()` is checked against the published total parameter count
in the tests. Nothing here is tuned to any simulation result.

`get_model(x)` takes a catalogue name, a Hugging Face id or alias, or the path of a model
directory (or its `config.json`): a config is read into a `ModelProfile` by `from_config`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

# Bytes per parameter of the weight formats used below.
BF16 = 2.0
FP8 = 1.0
# MXFP4 (OCP Microscaling spec v1.0): 32 FP4 elements (4 bit) share one 8-bit E8M0 scale
# -> 4 + 8/32 = 4.25 bits per element.
MXFP4 = 4.25 / 8.0


@dataclass(frozen=True)
class ModelProfile:
    name: str
    hf_id: str
    source: str  # where the constants come from
    hidden_size: int
    num_layers: int  # all transformer blocks
    num_dense_layers: int  # blocks with a dense MLP instead of MoE (DeepSeek first_k_dense_replace)
    num_experts: int  # routed experts per MoE layer
    top_k: int
    num_shared_experts: int  # always-active experts per MoE layer
    moe_intermediate_size: int
    dense_intermediate_size: int  # MLP width of the dense blocks (0 if none)
    vocab_size: int
    tied_embeddings: bool
    # attention
    attention: str  # "mla" or "gqa"
    num_heads: int
    num_kv_heads: int = 0  # gqa
    head_dim: int = 0  # gqa
    q_lora_rank: int = 0  # mla (0: plain q projection)
    kv_lora_rank: int = 0  # mla
    qk_nope_head_dim: int = 0  # mla
    qk_rope_head_dim: int = 0  # mla
    v_head_dim: int = 0  # mla
    sliding_window: int = 0  # window of the sliding-window layers (0: none)
    sliding_window_layers: int = 0  # how many blocks use the window
    expert_has_bias: bool = False  # GPT-OSS experts carry biases
    # weight formats (bytes per parameter) of the published checkpoint
    expert_bytes_per_param: float = BF16
    other_bytes_per_param: float = BF16
    kv_bytes_per_elem: float = BF16  # SGLang default KV-cache dtype is the model dtype (bf16)
    published_total_params: float = 0.0  # for the consistency check
    published_active_params: float = 0.0
    aliases: tuple[str, ...] = field(default_factory=tuple)

    def shape(self) -> dict:
        """The routing shape of the model's traces: what synth, collect and `ModelSpec` need."""
        return {
            "num_layers": self.num_moe_layers, "num_experts": self.num_experts, "top_k": self.top_k,
            "hf_id": self.hf_id, "num_hidden_layers": self.num_layers,
            "first_k_dense_replace": self.num_dense_layers,
        }

    # ----- derived, by formula -----
    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def expert_params(self) -> float:
        """Parameters of one routed expert: gate, up and down projections (SwiGLU)."""
        p = 3.0 * self.hidden_size * self.moe_intermediate_size
        if self.expert_has_bias:
            p += 2 * self.moe_intermediate_size + self.hidden_size
        return p

    def expert_bytes(self) -> float:
        return self.expert_params() * self.expert_bytes_per_param

    def attention_params(self) -> float:
        """Attention projection parameters of one block."""
        h = self.hidden_size
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
            else:
                q = h * self.num_heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            return float(q + kv_a + kv_b + o)
        q = h * self.num_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * h
        return float(q + kv + o)

    def kv_elems_per_token_layer(self) -> int:
        """KV-cache elements stored per token per block (MLA keeps the compressed latent)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token over all blocks (sliding-window blocks counted in full)."""
        return self.kv_elems_per_token_layer() * self.kv_bytes_per_elem * self.num_layers

    def attn_flops_per_ctx_token(self) -> float:
        """Decode attention FLOPs per (query token, cached token, block)."""
        if self.attention == "mla":
            # absorbed MLA (as SGLang decodes): scores over the 576-wide latent, values over 512
            return 2.0 * self.num_heads * (self.kv_lora_rank + self.qk_rope_head_dim) + 2.0 * self.num_heads * self.kv_lora_rank
        return 4.0 * self.num_heads * self.head_dim

    def dense_mlp_params(self) -> float:
        return 3.0 * self.hidden_size * self.dense_intermediate_size * self.num_dense_layers

    def shared_expert_params(self) -> float:
        return self.num_shared_experts * self.expert_params() * self.num_moe_layers

    def router_params(self) -> float:
        return float(self.hidden_size * self.num_experts * self.num_moe_layers)

    def embedding_params(self) -> float:
        return float(self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2))

    def lm_head_params(self) -> float:
        return float(self.vocab_size * self.hidden_size)

    def routed_params(self) -> float:
        return self.expert_params() * self.num_experts * self.num_moe_layers

    def total_params(self) -> float:
        return (
            self.routed_params()
            + self.shared_expert_params()
            + self.attention_params() * self.num_layers
            + self.dense_mlp_params()
            + self.router_params()
            + self.embedding_params()
        )

    def active_params(self) -> float:
        return self.total_params() - self.routed_params() + self.expert_params() * self.top_k * self.num_moe_layers

    def weight_bytes(self) -> float:
        return self.routed_params() * self.expert_bytes_per_param + (
            self.total_params() - self.routed_params()
        ) * self.other_bytes_per_param

    def nonexpert_bytes_per_step(self) -> float:
        """Weights read every decode step regardless of routing: attention, dense MLPs, shared
        experts, router gates and the LM head (the input embedding is a row gather)."""
        p = (
            self.attention_params() * self.num_layers
            + self.dense_mlp_params()
            + self.shared_expert_params()
            + self.router_params()
            + self.lm_head_params()
        )
        return p * self.other_bytes_per_param if self.num_shared_experts == 0 else (
            (p - self.shared_expert_params()) * self.other_bytes_per_param
            + self.shared_expert_params() * self.expert_bytes_per_param
        )

    def nonexpert_params_per_token(self) -> float:
        return (
            self.attention_params() * self.num_layers
            + self.dense_mlp_params()
            + self.shared_expert_params()
            + self.router_params()
            + self.lm_head_params()
        )



MODEL_PROFILES: dict[str, ModelProfile] = {
    "deepseek-v3": ModelProfile(
        name="deepseek-v3",
        hf_id="deepseek-ai/DeepSeek-V3",
        # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json ; DeepSeek-V3 Technical
        # Report, arXiv:2412.19437 (671B total, 37B activated, FP8 e4m3 weights with 128x128
        # block scales; the released checkpoint stores linear weights in FP8).
        source="HF deepseek-ai/DeepSeek-V3 config.json; arXiv:2412.19437",
        hidden_size=7168,
        num_layers=61,
        num_dense_layers=3,  # first_k_dense_replace
        num_experts=256,  # n_routed_experts
        top_k=8,  # num_experts_per_tok
        num_shared_experts=1,  # n_shared_experts
        moe_intermediate_size=2048,
        dense_intermediate_size=18432,  # intermediate_size
        vocab_size=129280,
        tied_embeddings=False,
        attention="mla",
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        expert_bytes_per_param=FP8,
        other_bytes_per_param=FP8,
        published_total_params=671e9,
        published_active_params=37e9,
        aliases=("deepseek-ai/deepseek-v3", "deepseek-v3-0324", "deepseek-r1", "deepseek_v3"),
    ),
    "qwen3-30b-a3b": ModelProfile(
        name="qwen3-30b-a3b",
        hf_id="Qwen/Qwen3-30B-A3B",
        # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json ; Qwen3 model card
        # (30.5B total, 3.3B activated, bf16).
        source="HF Qwen/Qwen3-30B-A3B config.json and model card",
        hidden_size=2048,
        num_layers=48,
        num_dense_layers=0,
        num_experts=128,
        top_k=8,
        num_shared_experts=0,
        moe_intermediate_size=768,
        dense_intermediate_size=0,
        vocab_size=151936,
        tied_embeddings=False,
        attention="gqa",
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        published_total_params=30.5e9,
        published_active_params=3.3e9,
        aliases=("qwen/qwen3-30b-a3b", "qwen3-30b", "qwen3_moe"),
    ),
    "qwen3-235b-a22b": ModelProfile(
        name="qwen3-235b-a22b",
        hf_id="Qwen/Qwen3-235B-A22B-FP8",
        # huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (hidden 4096, 94 layers, all
        # MoE: mlp_only_layers [], decoder_sparse_step 1; 128 experts, top-8, moe_intermediate
        # 1536; 64 query / 4 KV heads of 128; vocab 151936, untied); model card: 235B total,
        # 22B activated. Weights of Qwen/Qwen3-235B-A22B-FP8 (fine-grained FP8, block 128), the
        # checkpoint that can page on one 141 GB GPU (bf16 is 470 GB).
        source="HF Qwen/Qwen3-235B-A22B config.json and model card; the -FP8 checkpoint",
        hidden_size=4096,
        num_layers=94,
        num_dense_layers=0,
        num_experts=128,
        top_k=8,
        num_shared_experts=0,
        moe_intermediate_size=1536,
        dense_intermediate_size=0,
        vocab_size=151936,
        tied_embeddings=False,
        attention="gqa",
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        expert_bytes_per_param=FP8,
        other_bytes_per_param=FP8,
        published_total_params=235e9,
        published_active_params=22e9,
        aliases=("qwen/qwen3-235b-a22b", "qwen/qwen3-235b-a22b-fp8", "qwen3-235b"),
    ),
    "mixtral-8x7b": ModelProfile(
        name="mixtral-8x7b",
        hf_id="mistralai/Mixtral-8x7B-v0.1",
        # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json ; Mixtral of
        # Experts, arXiv:2401.04088 (46.7B total, 12.9B active, bf16).
        source="HF mistralai/Mixtral-8x7B-v0.1 config.json; arXiv:2401.04088",
        hidden_size=4096,
        num_layers=32,
        num_dense_layers=0,
        num_experts=8,
        top_k=2,
        num_shared_experts=0,
        moe_intermediate_size=14336,
        dense_intermediate_size=0,
        vocab_size=32000,
        tied_embeddings=False,
        attention="gqa",
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        published_total_params=46.7e9,
        published_active_params=12.9e9,
        aliases=("mistralai/mixtral-8x7b-v0.1", "mistralai/mixtral-8x7b-instruct-v0.1", "mixtral"),
    ),
    "gpt-oss-20b": ModelProfile(
        name="gpt-oss-20b",
        hf_id="openai/gpt-oss-20b",
        # huggingface.co/openai/gpt-oss-20b/blob/main/config.json ; gpt-oss model card,
        # arXiv:2508.10925 (20.9B total, 3.6B active; MoE weights in MXFP4, the rest bf16;
        # alternating dense and 128-token sliding-window attention).
        source="HF openai/gpt-oss-20b config.json; arXiv:2508.10925",
        hidden_size=2880,
        num_layers=24,
        num_dense_layers=0,
        num_experts=32,
        top_k=4,
        num_shared_experts=0,
        moe_intermediate_size=2880,
        dense_intermediate_size=0,
        vocab_size=201088,
        tied_embeddings=False,
        attention="gqa",
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        sliding_window=128,
        sliding_window_layers=12,
        expert_has_bias=True,
        expert_bytes_per_param=MXFP4,
        other_bytes_per_param=BF16,
        published_total_params=20.9e9,
        published_active_params=3.6e9,
        aliases=("openai/gpt-oss-20b", "gptoss20b", "gpt-oss"),
    ),
    "deepseek-v2-lite": ModelProfile(
        name="deepseek-v2-lite",
        hf_id="deepseek-ai/DeepSeek-V2-Lite",
        # huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json ; DeepSeek-V2
        # report, arXiv:2405.04434 (15.7B total, 2.4B active, bf16, no q LoRA).
        source="HF deepseek-ai/DeepSeek-V2-Lite config.json; arXiv:2405.04434",
        hidden_size=2048,
        num_layers=27,
        num_dense_layers=1,
        num_experts=64,
        top_k=6,
        num_shared_experts=2,
        moe_intermediate_size=1408,
        dense_intermediate_size=10944,
        vocab_size=102400,
        tied_embeddings=False,
        attention="mla",
        num_heads=16,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        published_total_params=15.7e9,
        published_active_params=2.4e9,
        aliases=("deepseek-ai/deepseek-v2-lite", "deepseek-ai/deepseek-v2-lite-chat", "deepseek-v2-lite-chat"),
    ),
}


def norm_name(name: str) -> str:
    """A model or hardware name as the lookups compare it: trimmed, lower case, '-' for '_'."""
    return name.strip().lower().replace("_", "-")


def _config_path(path: str | os.PathLike) -> Path | None:
    """The config.json that `path` names (the file, or a model directory holding one), else None."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p / "config.json" if (p / "config.json").is_file() else None
    return p if p.is_file() else None


def _bytes_per_param(cfg: dict) -> tuple[float, float]:
    """(experts, everything else) bytes per parameter of the checkpoint the config describes."""
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    if method == "fp8":
        return FP8, FP8
    if method == "mxfp4":  # gpt-oss: MoE weights in MXFP4, the rest in the model dtype
        return MXFP4, BF16
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    b = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(dtype, BF16)
    return b, b


def from_config(path: str | os.PathLike) -> ModelProfile:
    """A ModelProfile read from a Hugging Face `config.json` (or the model directory holding it).

    Reads the DeepSeek (n_routed_experts, MLA), Qwen-MoE (num_experts), Mixtral and GPT-OSS
    (num_local_experts) key names; a config without experts or top-k is an error naming the key."""
    cfg_path = _config_path(path)
    if cfg_path is None:
        raise ValueError(f"{path}: no config.json there")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{cfg_path}: cannot read the model config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: a model config must be a JSON object")
    if isinstance(cfg.get("text_config"), dict):  # multimodal configs nest the language model's
        cfg = {**cfg, **cfg["text_config"]}

    def get(*keys, default=None, kind=int):
        for k in keys:
            if cfg.get(k) is not None:
                v = cfg[k]
                if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 1 << 20):
                    raise ValueError(f"{cfg_path}: {k} must be an integer in 0..2^20, got {v!r}")
                return v
        if default is None:
            raise ValueError(f"{cfg_path}: no {' or '.join(keys)}; not an MoE model config")
        return default

    num_layers = get("num_hidden_layers", "num_layers")
    num_experts = get("n_routed_experts", "num_local_experts", "num_experts")
    top_k = get("num_experts_per_tok", "num_experts_per_token", "experts_per_token")
    if not 1 <= top_k <= num_experts or num_layers < 1:
        raise ValueError(f"{cfg_path}: need 1 <= top-k ({top_k}) <= experts ({num_experts}) and layers >= 1")
    dense = get("first_k_dense_replace", default=0)
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    layer_types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    window_layers = sum(t == "sliding_attention" for t in layer_types)
    expert_b, other_b = _bytes_per_param(cfg)
    mla = bool(cfg.get("kv_lora_rank"))
    attn = dict(attention="mla", q_lora_rank=get("q_lora_rank", default=0), kv_lora_rank=get("kv_lora_rank"),
                qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
                v_head_dim=get("v_head_dim")) if mla else dict(
        attention="gqa", num_kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=hidden // max(heads, 1)))
    name = str(cfg.get("_name_or_path") or cfg_path.parent.name)
    return ModelProfile(
        name=norm_name(name.rsplit("/", 1)[-1]), hf_id=name, source=f"config {cfg_path}",
        hidden_size=hidden, num_layers=num_layers, num_dense_layers=dense, num_experts=num_experts, top_k=top_k,
        num_shared_experts=get("n_shared_experts", "num_shared_experts", default=0),
        moe_intermediate_size=get("moe_intermediate_size", "intermediate_size"),
        dense_intermediate_size=get("intermediate_size", default=0) if dense else 0,
        vocab_size=get("vocab_size"), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_heads=heads, sliding_window=get("sliding_window", default=0) if window_layers else 0,
        sliding_window_layers=window_layers, expert_has_bias=cfg.get("model_type") == "gpt_oss",
        expert_bytes_per_param=expert_b, other_bytes_per_param=other_b, kv_bytes_per_elem=BF16, **attn,
    )


def get_model(name: str | os.PathLike) -> ModelProfile:
    """A model by catalogue name, Hugging Face id or alias (case-insensitive), or by the path
    of a model directory or its config.json (read with `from_config`)."""
    if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
        raise ValueError(f"a model must be named by a non-empty string, got {name!r}")
    if _config_path(name) is not None:
        return from_config(name)
    n = norm_name(str(name))
    for p in MODEL_PROFILES.values():
        if n in (p.name, norm_name(p.hf_id)) or n in {norm_name(a) for a in p.aliases}:
            return p
    # last path component of an HF id, e.g. "org/DeepSeek-V3"
    tail = n.rsplit("/", 1)[-1]
    for p in MODEL_PROFILES.values():
        if tail in (p.name, norm_name(p.hf_id).rsplit("/", 1)[-1]):
            return p
    if Path(name).expanduser().is_dir():
        raise ValueError(f"{name}: a directory without a config.json; give a model directory or a catalogue name")
    raise ValueError(f"unknown model profile {str(name)!r}; known: {', '.join(MODEL_PROFILES)}, "
                     "a Hugging Face id of one of them, or a model directory with a config.json")


# The routing shapes of the catalogue (synth's and collect's view of it).
MODEL_SHAPES: dict[str, dict] = {name: p.shape() for name, p in MODEL_PROFILES.items()}


def model_shape(model: str | os.PathLike) -> dict:
    """The routing shape (see `ModelProfile.shape`) of any model `get_model` accepts."""
    return get_model(model).shape()
