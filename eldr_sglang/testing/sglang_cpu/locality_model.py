"""A CONSTRUCTED Qwen3-MoE with domain locality by construction, for real SGLang on a CPU.

It exists to show ELDR's mechanism end to end on this machine (collect -> fit -> route ->
decode -> TPOT), not DeepSeek-V3's gain: SGLang's CPU MoE path without AMX kernels
(`moe_forward_native`, layers/moe/fused_moe_native.py) runs one F.linear pair per expert that
has tokens, so a decode step's MoE time grows with the distinct experts its batch touches, as
HBM reads do on a GPU. Nothing here is trained; every weight is built from a seed.

The construction (H = hidden size, D = domains, E experts per layer, top-k):

- **Tokens.** Ids below `FIRST_DOMAIN_TOKEN` are the tokenizer's BPE pieces and specials; the
  rest, plain "<tN>" tokens, are split into D contiguous, disjoint domain ranges.
- **Embeddings.** e_t = one-hot(domain(t)) on the first D dims + a random unit vector r_t on the
  other H - D dims (nearly orthogonal across tokens). Attention's o_proj and the experts'
  down_proj are small (`RESIDUAL_SCALE`), so the residual stream stays close to e_t at every
  layer and routing is decided by the token's domain and its own r_t.
- **Gates.** Layer l gives each domain its own E/D experts through a per-layer random
  permutation (so layers do not route alike): gate row e = c_l * one-hot(dom_l(e)) + a random
  row on the r dims. After the RMSNorm a token's logit is beta * [e is its domain's] + a
  unit-variance per-(token, layer, expert) term, so `locality` sets beta: the share of top-k
  picks on the domain's own experts is 1/D + locality * (1 - 1/D) (Monte-Carlo solved at build
  time; 0 is the uniform control, where gates ignore domains entirely).
- **LM head.** Row t' = A * one-hot(domain(t')) + B * r_prev(t'), where prev inverts a random
  cycle over each domain's tokens: greedy decoding walks that cycle, so it stays inside the
  prompt's domain and visits different tokens (and so different expert sets) at every step.
  Rows of non-domain tokens are 0, so EOS and the BPE pieces never win.

`domain_prompt(domain, n, rng)` gives prompt text for a domain ("<t612><t655>..."), which the
tokenizer maps to exactly those ids. The geometry is written into the model directory as
`eldr_locality.json` (domains, ranges, the per-layer expert ownership, the solved beta), so
benchmarks and tests can score what the engine does against what was built.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .model import TOKENIZER_VOCAB

FIRST_DOMAIN_TOKEN = TOKENIZER_VOCAB  # ids below are BPE pieces and specials (see model.py)
RESIDUAL_SCALE = 0.02  # o_proj / down_proj gain: the residual stays close to the embedding
LM_DOMAIN_GAIN = 4.0  # A: keeps greedy decoding inside the prompt's domain
LM_NEXT_GAIN = 8.0  # B: picks the next token of the domain's cycle
GEOMETRY_FILE = "eldr_locality.json"


@dataclass(frozen=True)
class LocalityModelSpec:
    """Shape and locality of the constructed model. The defaults are sized from measurements
    on this 2-core CPU (docs/real-cpu-tpot.md): bf16 experts of 4.7 MB (hidden 512,
    intermediate 1536) cost about 0.75 ms each per decode step in moe_forward_native, so the
    MoE dominates a step; 4 layers x 32 experts keep a server near 0.6 GB of weights."""

    locality: float = 0.9  # share of top-k picks on own experts above chance (0 = uniform)
    domains: int = 4
    hidden: int = 512
    moe_intermediate: int = 1536
    layers: int = 4
    experts: int = 32
    top_k: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    vocab: int = 2048
    seed: int = 0

    def check(self) -> None:
        if not 0.0 <= self.locality < 1.0:
            raise ValueError(f"locality must be in [0, 1), got {self.locality}")
        if self.domains < 1 or self.experts % self.domains:
            raise ValueError(f"experts ({self.experts}) must split evenly over domains ({self.domains})")
        if not 1 <= self.top_k <= self.experts // self.domains:
            raise ValueError(f"top_k must be in 1..experts/domains = {self.experts // self.domains}")
        if self.hidden <= self.domains + 16:
            raise ValueError("hidden must exceed domains + 16 (room for the per-token directions)")
        if (self.vocab - FIRST_DOMAIN_TOKEN) // self.domains < 8:
            raise ValueError(f"vocab {self.vocab} leaves fewer than 8 tokens per domain")

    @property
    def tokens_per_domain(self) -> int:
        return (self.vocab - FIRST_DOMAIN_TOKEN) // self.domains

    def domain_range(self, d: int) -> tuple[int, int]:
        lo = FIRST_DOMAIN_TOKEN + d * self.tokens_per_domain
        return lo, lo + self.tokens_per_domain


@dataclass
class Geometry:
    """What the builder made, saved beside the weights (GEOMETRY_FILE)."""

    spec: dict
    own_share_target: float
    beta: float  # the own-expert logit bonus, in units of the per-token noise
    domain_ranges: list  # [lo, hi) per domain
    owner: list = field(default_factory=list)  # owner[l][e] = the domain that owns expert e at layer l


def own_share(beta: float, experts: int, own: int, top_k: int, rng: np.random.Generator, n: int = 20000) -> float:
    """Expected share of top-k picks on `own` experts whose logits get +beta over unit noise."""
    z = rng.standard_normal((n, experts))
    z[:, :own] += beta
    top = np.argpartition(-z, top_k - 1, axis=1)[:, :top_k]
    return float((top < own).mean())


def solve_beta(target: float, experts: int, own: int, top_k: int, seed: int = 0) -> float:
    """The bonus that puts `target` of the top-k picks on the own experts (bisection)."""
    chance = own / experts
    if target <= chance + 1e-12:
        return 0.0
    lo, hi = 0.0, 12.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if own_share(mid, experts, own, top_k, np.random.default_rng(seed)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def build_weights(spec: LocalityModelSpec):
    """(state dict of torch bf16 tensors in the Hugging Face Qwen3-MoE checkpoint naming, Geometry)."""
    import torch

    spec.check()
    g = torch.Generator().manual_seed(spec.seed)
    H, D, E, V, L = spec.hidden, spec.domains, spec.experts, spec.vocab, spec.layers
    own = E // D
    target = 1.0 / D + spec.locality * (1.0 - 1.0 / D)
    beta = solve_beta(target, E, own, spec.top_k, seed=spec.seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * scale

    # embeddings: domain one-hot + a unit random direction on the other dims
    r = randn(V, H - D)
    r /= r.norm(dim=1, keepdim=True)
    dom = torch.full((V,), -1, dtype=torch.long)
    ranges = []
    for d in range(D):
        lo, hi = spec.domain_range(d)
        dom[lo:hi] = d
        ranges.append([lo, hi])
    emb = torch.zeros(V, H)
    emb[:, D:] = r
    emb[dom >= 0, :D] = torch.nn.functional.one_hot(dom[dom >= 0], D).float()
    # after RMSNorm (weight 1) a domain token's vector is e_t * kappa with kappa = sqrt(H / |e_t|^2)
    kappa = math.sqrt(H / 2.0)

    sd: dict = {"model.embed_tokens.weight": emb}
    owner = []
    nh, nkv, hd, inter = spec.heads, spec.kv_heads, spec.head_dim, spec.moe_intermediate
    for layer in range(L):
        p = f"model.layers.{layer}."
        perm = torch.randperm(E, generator=g)
        own_of = torch.empty(E, dtype=torch.long)
        own_of[perm] = torch.arange(E) // own  # expert perm[j] belongs to domain j // own
        owner.append(own_of.tolist())
        gate = torch.zeros(E, H)
        gate[:, D:] = randn(E, H - D) / kappa  # unit-variance noise per (token, expert)
        gate[torch.arange(E), own_of] = beta / kappa  # + beta on the owner domain's tokens
        sd[p + "mlp.gate.weight"] = gate
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            sd[q + "gate_proj.weight"] = randn(inter, H, scale=1 / math.sqrt(H))
            sd[q + "up_proj.weight"] = randn(inter, H, scale=1 / math.sqrt(H))
            sd[q + "down_proj.weight"] = randn(H, inter, scale=RESIDUAL_SCALE / math.sqrt(inter))
        sd[p + "self_attn.q_proj.weight"] = randn(nh * hd, H, scale=1 / math.sqrt(H))
        sd[p + "self_attn.k_proj.weight"] = randn(nkv * hd, H, scale=1 / math.sqrt(H))
        sd[p + "self_attn.v_proj.weight"] = randn(nkv * hd, H, scale=1 / math.sqrt(H))
        sd[p + "self_attn.o_proj.weight"] = randn(H, nh * hd, scale=RESIDUAL_SCALE / math.sqrt(nh * hd))
        sd[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        sd[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        sd[p + "input_layernorm.weight"] = torch.ones(H)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H)
    sd["model.norm.weight"] = torch.ones(H)

    # LM head: stay in the domain (A), step along the domain's random cycle (B)
    lm = torch.zeros(V, H)
    for d in range(D):
        lo, hi = ranges[d]
        cycle = torch.randperm(hi - lo, generator=g) + lo  # t -> next(t) along this order
        prev = torch.roll(cycle, 1)  # prev[i] precedes cycle[i]
        lm[cycle, d] = LM_DOMAIN_GAIN
        lm[cycle, D:] = LM_NEXT_GAIN * r[prev]
    sd["lm_head.weight"] = lm
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    geo = Geometry(spec=asdict(spec), own_share_target=target, beta=beta, domain_ranges=ranges, owner=owner)
    return sd, geo


def config_dict(spec: LocalityModelSpec) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.moe_intermediate,
        "moe_intermediate_size": spec.moe_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "num_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def build_locality_model(out: Path, spec: LocalityModelSpec = LocalityModelSpec()) -> Path:
    """Write config.json, model.safetensors, a tokenizer and eldr_locality.json to out (new dir)."""
    from safetensors.torch import save_file

    from .model import _tokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; build the model into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    sd, geo = build_weights(spec)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_dict(spec), indent=1))
    _tokenizer(out, vocab=spec.vocab)
    (out / GEOMETRY_FILE).write_text(json.dumps(asdict(geo)))
    return out


def load_geometry(model_dir: Path) -> Geometry:
    return Geometry(**json.loads((Path(model_dir) / GEOMETRY_FILE).read_text()))


def domain_prompt(geo: Geometry, domain: int, n_tokens: int, rng: np.random.Generator) -> str:
    """Prompt text of n_tokens random tokens of one domain ("<t612><t655>...")."""
    lo, hi = geo.domain_ranges[domain]
    return "".join(f"<t{int(t)}>" for t in rng.integers(lo, hi, n_tokens))


def domain_of_token(geo: Geometry, token: int) -> int:
    for d, (lo, hi) in enumerate(geo.domain_ranges):
        if lo <= token < hi:
            return d
    return -1


if __name__ == "__main__":  # built in a subprocess by tests and benchmarks (torch stays out of them)
    import argparse

    ap = argparse.ArgumentParser(description="write the constructed locality MoE model directory (test-only)")
    ap.add_argument("out")
    ap.add_argument("--locality", type=float, default=LocalityModelSpec.locality)
    ap.add_argument("--layers", type=int, default=LocalityModelSpec.layers)
    ap.add_argument("--experts", type=int, default=LocalityModelSpec.experts)
    ap.add_argument("--top-k", type=int, default=LocalityModelSpec.top_k)
    ap.add_argument("--hidden", type=int, default=LocalityModelSpec.hidden)
    ap.add_argument("--moe-intermediate", type=int, default=LocalityModelSpec.moe_intermediate)
    ap.add_argument("--domains", type=int, default=LocalityModelSpec.domains)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    s = LocalityModelSpec(locality=a.locality, layers=a.layers, experts=a.experts, top_k=a.top_k, hidden=a.hidden,
                          moe_intermediate=a.moe_intermediate, domains=a.domains, seed=a.seed)
    try:
        s.check()
        print(build_locality_model(Path(a.out), s))
    except (ValueError, FileExistsError) as exc:
        raise SystemExit(f"error: {exc}") from None
