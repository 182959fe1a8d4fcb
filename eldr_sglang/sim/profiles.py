"""Model and hardware profiles for the execution-time model.

Every architectural constant below is copied from a public specification, cited next to
it (Hugging Face `config.json` of the model, the model's technical report or card, the
GPU vendor's datasheet). Derived quantities (parameters per expert, attention parameters,
KV-cache bytes per token) are *computed* from those constants by the formulas in this
file, so they can be audited, and `ModelProfile.total_params()` is checked against the
published total parameter count in the tests.

Nothing here is tuned to any simulation result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str
    hbm_bytes: float  # capacity per GPU
    hbm_bw: float  # peak bytes/s per GPU
    bf16_flops: float  # dense (no sparsity) peak FLOP/s per GPU
    fp8_flops: float
    host_link_bw: float  # host->device bytes/s (one direction) per GPU, for expert offload
    scale_up_bw: float  # GPU<->GPU bytes/s per GPU within a node (NVLink / Infinity Fabric)
    network_bw: float  # bytes/s per GPU between nodes (KV transfer prefill -> decode)
    aliases: tuple[str, ...] = field(default_factory=tuple)


G = 1e9
T = 1e12

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

HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s; BF16 1,979 and
        # FP8 3,958 TFLOPS *with sparsity* -> 989.5 / 1,979 dense; NVLink 900 GB/s; PCIe Gen5
        # 128 GB/s (64 GB/s each way). Network: ConnectX-7 400 Gb/s per GPU = 50 GB/s.
        source="NVIDIA H100 datasheet (SXM5)",
        hbm_bytes=80 * G,
        hbm_bw=3.35 * T,
        bf16_flops=989.5 * T,
        fp8_flops=1979 * T,
        host_link_bw=64 * G,
        scale_up_bw=900 * G,
        network_bw=50 * G,
        aliases=("h100-sxm", "h100-sxm5"),
    ),
    "h200": HardwareProfile(
        name="h200",
        # NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s; compute as H100
        # SXM (BF16 989.5, FP8 1,979 dense TFLOPS); NVLink 900 GB/s; PCIe Gen5 128 GB/s.
        source="NVIDIA H200 datasheet (SXM)",
        hbm_bytes=141 * G,
        hbm_bw=4.8 * T,
        bf16_flops=989.5 * T,
        fp8_flops=1979 * T,
        host_link_bw=64 * G,
        scale_up_bw=900 * G,
        network_bw=50 * G,
        aliases=("h200-sxm",),
    ),
    "mi300x": HardwareProfile(
        name="mi300x",
        # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s; FP16/BF16 1,307.4 and FP8
        # 2,614.9 dense TFLOPS; PCIe Gen5 x16 128 GB/s (64 GB/s each way); Infinity Fabric
        # 7 links x 128 GB/s = 896 GB/s peer bandwidth. Network: 400 Gb/s NIC per GPU.
        source="AMD Instinct MI300X datasheet",
        hbm_bytes=192 * G,
        hbm_bw=5.3 * T,
        bf16_flops=1307.4 * T,
        fp8_flops=2614.9 * T,
        host_link_bw=64 * G,
        scale_up_bw=896 * G,
        network_bw=50 * G,
        aliases=("mi300", "amd-mi300x"),
    ),
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def get_model(name: str) -> ModelProfile:
    """Look up a model profile by name, Hugging Face id or alias (case-insensitive)."""
    n = _norm(name)
    for p in MODEL_PROFILES.values():
        if n in (p.name, _norm(p.hf_id)) or n in {_norm(a) for a in p.aliases}:
            return p
    # last path component of an HF id, e.g. "org/DeepSeek-V3"
    tail = n.rsplit("/", 1)[-1]
    for p in MODEL_PROFILES.values():
        if tail in (p.name, _norm(p.hf_id).rsplit("/", 1)[-1]):
            return p
    raise ValueError(f"unknown model profile {name!r}; known: {', '.join(MODEL_PROFILES)}")


def get_hardware(name: str) -> HardwareProfile:
    n = _norm(name)
    for p in HARDWARE_PROFILES.values():
        if n == p.name or n in p.aliases:
            return p
    raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(HARDWARE_PROFILES)}")
