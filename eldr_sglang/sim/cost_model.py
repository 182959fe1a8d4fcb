"""Execution-time model: a roofline over the bytes and FLOPs of one decode step or prefill.

Decode step on one decode worker (a TP group of `tp` GPUs, weights sharded evenly):

    t = overhead
      + max(nonexpert_bytes / BW, 2 * B * nonexpert_params / F)          dense + attention weights
      + max(kv_bytes_read / BW,   attention FLOPs / F)                      attention over the KV cache
      + sum over MoE layers l of max(d_l * expert_bytes / BW,             distinct experts touched
                                     2 * B * top_k * expert_params / F)     by the batch this step

where BW = tp * hbm_bw * bw_efficiency and F = tp * peak FLOP/s * flops_efficiency, d_l the
distinct experts that the batch's tokens select at MoE layer l in this step (from real
routing), and overhead = step_overhead_s + per-layer TP all-reduce latency.

Optional expert offload, modelled on SGLang's paged experts (`--enable-paged-experts
--paged-experts-num-resident C`; sim/paged_experts.py has the rules and their sources): one
GPU per decode worker; each MoE layer keeps C experts resident (LRU) and a step that touches
more than C runs in ceil(d_l / C) waves. The step then adds

      + sum over MoE layers l of page_ins_l * expert_bytes / host_link_bw   (PCIe, not overlapped)
      + sum over MoE layers l of (waves_l - 1) * moe_layer_fixed_s          (one fused-MoE launch per wave)
      + eager_step_overhead_s - step_overhead_s   when batch x top_k > C   (no decode CUDA graph)

where expert_bytes is one expert's weights in the checkpoint's format (models.py: bf16 2 B,
FP8 1 B, MXFP4 4.25 bits per parameter, scales included; DeepSeek-V3's FP8 128x128 block
scales add 4 B per 16384 parameters, under 0.03%, left out) and host_link_bw one direction of
the GPU's PCIe link (profiles.py).

Each MoE layer also pays `moe_layer_fixed_s` (gating, top-k, permute/align, padded tiles),
independent of the distinct experts; 0 in the default model (the pure roofline), see
`paper_fixed_cost_s` for the value the ELDR paper's measurement implies.

Expert parallelism (`ep > 1`): routed experts are placed in contiguous blocks on `ep` ranks
(SGLang's default EP placement); a layer's expert time is the slowest rank's distinct experts
over that rank's bandwidth, plus a dispatch + combine all-to-all of the batch's hidden states
over the scale-up link (NVLink). Without EP, experts are sharded evenly over the TP ranks.

KV cache: MLA keeps one latent per token that every TP rank needs, so under plain TP it is
replicated (each rank stores and reads all of it); GQA KV heads split over min(tp, kv heads).

A GPU calibration file (benchmarks/gpu_calibrate.py --out FILE) replaces the roofline expert
time by the measured t(B, d) = a(B) + b(B) * d of one MoE layer (see `load_calibration`).
A calibration that also measured the non-MoE work of a decode step, `other_s(B)` (the CPU mode,
gpu_calibrate.py --device cpu), replaces overhead + dense + attention as well: a decode step is

    t = other_s(B) + sum over MoE layers l of (a(B) + b(B) * d_l)

every term measured and linearly interpolated in B (held constant beyond the measured batches);
other_s is measured at one KV context (the file's `context_tokens`), not scaled with it. Prefill
of n tokens is then estimated from the same measurement, as one batch of n tokens (held at the
largest measured batch beyond it): other_s(n) + sum over layers of a(n) + b(n) * d_l, with d_l
the distinct experts the prompt's recorded routing touched (the simulator passes them), or
E * touched(n), the uniform-routing expectation, without them.

Constants marked ASSUMPTION are not from a datasheet; they scale all policies alike and
are exposed as parameters. They were set before any policy comparison and are never fitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from eldr_sglang.models import FP8, ModelProfile
from eldr_sglang.sim.profiles import HardwareProfile

# ASSUMPTION: fraction of peak HBM bandwidth that streaming weight reads achieve.
DEFAULT_BW_EFFICIENCY = 0.8
# ASSUMPTION: fraction of peak tensor FLOP/s reached by decode GEMMs and prefill.
DEFAULT_FLOPS_EFFICIENCY = 0.5
# ASSUMPTION: per-step scheduler / launch overhead (CUDA graphs on, overlap scheduler).
DEFAULT_STEP_OVERHEAD_S = 0.5e-3
# ASSUMPTION: latency of one small-message all-reduce inside a node (NCCL over NVLink).
DEFAULT_ALLREDUCE_LATENCY_S = 10e-6
# ASSUMPTION: fraction of free HBM given to the KV cache (SGLang --mem-fraction-static-like).
DEFAULT_MEM_FRACTION = 0.85
# ASSUMPTION: step overhead of a decode step that runs without a CUDA graph. SGLang's paged
# experts captures decode graphs only up to C // top_k requests (paged_experts/method.py
# `_cap_decode_capture_batch_sizes`); larger batches run eagerly. The same 2 ms the
# sensitivity band uses for stacks without CUDA graphs (LARGE_STEP_OVERHEAD_S below).
EAGER_STEP_OVERHEAD_S = 2.0e-3

# ELDR paper measurement: going from 16 to 128 active experts makes the MoE layer 4.7x slower.
PAPER_MOE_16_TO_128_SLOWDOWN = 4.7
# NVLink 4 (H100/H200 SXM datasheets: "NVLink 900 GB/s" per GPU, the bidirectional total of
# 18 links x 50 GB/s) -> 450 GB/s each way; an all-to-all sends and receives at once, so one
# direction's bandwidth bounds it. HardwareProfile.scale_up_bw holds the bidirectional figure.
SCALE_UP_DIRECTIONS = 2
# Bytes per hidden-state element moved by EP dispatch/combine: bf16 (SGLang's default
# all-to-all; DeepEP can dispatch FP8, which would halve the dispatch half).
A2A_BYTES_PER_ELEM = 2.0


def min_tp(model: ModelProfile, hw: HardwareProfile, mem_fraction: float = DEFAULT_MEM_FRACTION) -> int:
    """Smallest power-of-two TP degree whose HBM holds the weights with room for KV cache."""
    tp = 1
    while model.weight_bytes() > 0.8 * mem_fraction * tp * hw.hbm_bytes and tp < 64:
        tp *= 2
    return tp


@dataclass
class StepBreakdown:
    overhead: float
    dense: float
    attention: float
    moe: float
    offload: float
    total: float


@dataclass
class ExecutionModel:
    model: ModelProfile
    hardware: HardwareProfile
    tp: int = 0  # 0: smallest that fits (min_tp)
    bw_efficiency: float = DEFAULT_BW_EFFICIENCY
    flops_efficiency: float = DEFAULT_FLOPS_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    allreduce_latency_s: float = DEFAULT_ALLREDUCE_LATENCY_S
    mem_fraction: float = DEFAULT_MEM_FRACTION
    offload_cache_experts: int = 0  # C > 0: SGLang paged experts, C resident per MoE layer (one GPU)
    eager_step_overhead_s: float = EAGER_STEP_OVERHEAD_S  # paged steps beyond the captured graphs
    moe_layer_fixed_s: float = 0.0  # per-MoE-layer fixed cost (gating, top-k, permute, padding)
    ep: int = 1  # expert-parallel ranks (1: experts sharded over TP; else must divide tp and E)
    calibration: dict | None = None  # {batch: (a_s, b_s)} or {batch: (a_s, b_s, other_s)} from a calibration file
    _c: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.offload_cache_experts and self.tp > 1:
            # paged_experts/method.py check_paged_experts_compat: "--tp-size must be 1 (single GPU only)"
            raise ValueError("paged experts (--offload-experts) run on a single GPU: tp must be 1")
        if self.tp <= 0:
            self.tp = 1 if self.offload_cache_experts else min_tp(self.model, self.hardware, self.mem_fraction)
        m, hw, tp = self.model, self.hardware, self.tp
        for name in ("bw_efficiency", "flops_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {v}")
        if self.offload_cache_experts < 0 or self.offload_cache_experts > m.num_experts:
            raise ValueError(f"offload cache must hold 0..{m.num_experts} experts, got {self.offload_cache_experts}")
        if 0 < self.offload_cache_experts < m.top_k:
            # check_paged_experts_compat: "--paged-experts-num-resident must be at least the router's top-k"
            raise ValueError(f"paged experts need C >= top_k = {m.top_k} resident experts, got {self.offload_cache_experts}")
        if not (self.moe_layer_fixed_s >= 0 and math.isfinite(self.moe_layer_fixed_s)):
            raise ValueError(f"moe_layer_fixed_s must be finite and >= 0, got {self.moe_layer_fixed_s}")
        if self.ep < 1 or tp % self.ep or m.num_experts % self.ep:
            raise ValueError(f"ep must divide tp={tp} and the {m.num_experts} experts, got ep={self.ep}")
        if self.ep > 1 and self.offload_cache_experts:
            raise ValueError("expert offload and expert parallelism cannot be combined")
        if self.calibration is not None:
            self.calibration = _check_calibration(self.calibration)
        if hw.calibrated_only and not self.measured_step:
            raise ValueError(f"hardware profile {hw.name!r} has no roofline constants: it needs a calibration with the "
                             "non-MoE step time other_s (benchmarks/gpu_calibrate.py --device cpu; --calibration FILE)")
        if hw.calibrated_only and (tp != 1 or self.ep != 1 or self.offload_cache_experts):
            raise ValueError(f"hardware profile {hw.name!r}: one calibrated worker per model copy (tp 1, no EP, no offload)")
        bw = tp * hw.hbm_bw * self.bw_efficiency
        fp8 = m.expert_bytes_per_param <= FP8
        peak = hw.fp8_flops if fp8 else hw.bf16_flops  # MXFP4 / bf16 run on bf16 tensor cores
        fl = tp * peak * self.flops_efficiency
        comm = 0.0 if tp == 1 else 2 * m.num_layers * self.allreduce_latency_s
        kv_full = m.num_layers - m.sliding_window_layers
        # ranks over which the KV cache is split: MLA's latent is shared by all heads, so plain
        # TP replicates it; GQA splits KV heads (replicated beyond tp > num_kv_heads)
        kv_shards = 1 if m.attention == "mla" else max(1, min(tp, m.num_kv_heads))
        gpu_bw = hw.hbm_bw * self.bw_efficiency
        self._c = dict(
            bw=bw,
            kv_bw=kv_shards * gpu_bw,
            kv_shards=kv_shards,
            ep_expert_t=m.expert_bytes() / gpu_bw,  # one expert read by its own rank
            ep_flops=peak * self.flops_efficiency,
            a2a_t_per_tok=(2 * m.top_k * m.hidden_size * A2A_BYTES_PER_ELEM * (self.ep - 1) / self.ep
                           / (hw.scale_up_bw / SCALE_UP_DIRECTIONS)) if self.ep > 1 else 0.0,
            a2a_latency=2 * self.allreduce_latency_s if self.ep > 1 else 0.0,
            flops=fl,
            overhead=self.step_overhead_s + comm,
            dense_bytes_t=m.nonexpert_bytes_per_step() / bw,
            dense_flops_per_tok=2.0 * m.nonexpert_params_per_token(),
            kv_elem_bytes=m.kv_elems_per_token_layer() * m.kv_bytes_per_elem,
            kv_full_layers=kv_full,
            kv_sw_layers=m.sliding_window_layers,
            attn_flops=m.attn_flops_per_ctx_token(),
            expert_t=m.expert_bytes() / bw,
            expert_flops_per_tok=2.0 * m.top_k * m.expert_params(),
            host_t=m.expert_bytes() / hw.host_link_bw,  # one expert page-in (paged experts: tp = 1)
            active_flops_per_tok=2.0 * m.active_params(),
        )

    # ---------------- capacity ----------------
    def kv_capacity_tokens(self) -> int:
        """KV tokens one decode worker can hold: free HBM after weights, times mem_fraction."""
        m, hw = self.model, self.hardware
        weights = m.weight_bytes()
        if self.offload_cache_experts:
            weights -= m.routed_params() * m.expert_bytes_per_param * (1 - self.offload_cache_experts / m.num_experts)
        # every rank holds weights / tp; the KV cache is split over kv_shards ranks only
        free = (self.tp * hw.hbm_bytes * self.mem_fraction - weights) * self._c["kv_shards"] / self.tp
        if free <= 0:
            raise ValueError(
                f"{m.name} weights ({weights / 1e9:.0f} GB) do not fit in tp={self.tp} x {hw.name} "
                f"({self.tp * hw.hbm_bytes / 1e9:.0f} GB); raise --tp"
            )
        return int(free // m.kv_bytes_per_token())

    @property
    def measured_step(self) -> bool:
        """True when the calibration measured the non-MoE step time too (other_s)."""
        return self.calibration is not None and all(len(v) == 3 for v in self.calibration.values())

    def _other(self, batch_size: int) -> float:
        bs = np.array(sorted(self.calibration))
        return float(np.interp(batch_size, bs, [self.calibration[x][2] for x in bs]))

    # ---------------- decode ----------------
    def _fixed_terms(self, batch_size: int, kv_tokens: int) -> tuple[float, float, float]:
        if self.measured_step:  # measured: other_s carries norms, projections, attention, LM head
            return 0.0, self._other(batch_size), 0.0
        c = self._c
        b = max(int(batch_size), 0)
        dense = max(c["dense_bytes_t"], b * c["dense_flops_per_tok"] / c["flops"])
        sw_tokens = min(kv_tokens, b * self.model.sliding_window) if c["kv_sw_layers"] else 0
        kv_layer_tokens = c["kv_full_layers"] * kv_tokens + c["kv_sw_layers"] * sw_tokens
        attn = max(
            kv_layer_tokens * c["kv_elem_bytes"] / c["kv_bw"],
            kv_layer_tokens * c["attn_flops"] / c["flops"],
        )
        return c["overhead"], dense, attn

    def moe_layer_time(self, batch_size: int, distinct: np.ndarray | float) -> np.ndarray | float:
        """Time of the routed-expert part of MoE layers with `distinct` experts touched.

        Without EP `distinct` is per layer ([L] or a scalar). With EP it is per layer and rank
        ([L, ep], or [L] / a scalar meaning the busiest rank's count): the slowest rank sets
        the pace, and the dispatch + combine all-to-all is added."""
        c = self._c
        d = np.asarray(distinct, dtype=np.float64)
        if self.calibration is not None:
            a, b = self._calibrated(batch_size)
            if self.ep > 1 and d.ndim == 2:
                d = d.max(axis=1)
            return self.moe_layer_fixed_s + a + b * d
        if self.ep > 1:
            if d.ndim == 2:
                d = d.max(axis=1)
            compute = batch_size * c["expert_flops_per_tok"] / self.ep / c["ep_flops"]
            a2a = c["a2a_latency"] + batch_size * c["a2a_t_per_tok"]
            return self.moe_layer_fixed_s + np.maximum(d * c["ep_expert_t"], compute) + a2a
        return self.moe_layer_fixed_s + np.maximum(d * c["expert_t"], batch_size * c["expert_flops_per_tok"] / c["flops"])

    def _calibrated(self, batch_size: int) -> tuple[float, float]:
        """(a, b) of the measured fit at this batch, linearly interpolated between measured
        batches and held constant beyond them."""
        bs = np.array(sorted(self.calibration))
        a = np.interp(batch_size, bs, [self.calibration[x][0] for x in bs])
        b = np.interp(batch_size, bs, [self.calibration[x][1] for x in bs])
        return float(a), float(b)

    def ep_rank_of_expert(self) -> np.ndarray:
        """[E] EP rank holding each expert: contiguous blocks of E/ep."""
        E = self.model.num_experts
        return np.arange(E) // (E // self.ep)

    def _paged_terms(self, batch_size: int, misses, waves) -> float:
        """Paged experts: page-ins over the host link, one fused-MoE launch per extra wave,
        and the eager step overhead beyond the captured decode graphs (module docstring)."""
        if misses is None:
            return 0.0
        t = float(np.sum(misses)) * self._c["host_t"]
        if waves is not None:
            t += float(np.sum(np.asarray(waves) - 1)) * self.moe_layer_fixed_s
        if self.offload_cache_experts and batch_size * self.model.top_k > self.offload_cache_experts:
            t += max(0.0, self.eager_step_overhead_s - self.step_overhead_s)
        return t

    def decode_step_time(self, batch_size: int, kv_tokens: int, distinct_experts: np.ndarray, misses: np.ndarray | None = None,
                         waves: np.ndarray | None = None) -> float:
        """Seconds of one decode step of `batch_size` tokens over `kv_tokens` cached tokens,
        with distinct_experts[l] experts touched at MoE layer l. `misses[l]` (paged experts)
        are the experts paged in over the host link, `waves[l]` the waves layer l ran in."""
        if batch_size <= 0:
            return 0.0
        d = np.asarray(distinct_experts)
        L = self.model.num_moe_layers
        if d.shape != (L,) and not (self.ep > 1 and d.shape == (L, self.ep)):
            want = f"({L},)" + (f" or ({L}, {self.ep})" if self.ep > 1 else "")
            raise ValueError(f"distinct_experts must have shape {want}, got {d.shape}")
        ov, dense, attn = self._fixed_terms(batch_size, kv_tokens)
        moe = float(np.sum(self.moe_layer_time(batch_size, d)))
        return ov + dense + attn + moe + self._paged_terms(batch_size, misses, waves)

    def breakdown(self, batch_size: int, kv_tokens: int, distinct_experts: np.ndarray, misses: np.ndarray | None = None,
                  waves: np.ndarray | None = None) -> StepBreakdown:
        ov, dense, attn = self._fixed_terms(batch_size, kv_tokens)
        moe = float(np.sum(self.moe_layer_time(batch_size, np.asarray(distinct_experts))))
        off = self._paged_terms(batch_size, misses, waves)
        return StepBreakdown(ov, dense, attn, moe, off, ov + dense + attn + moe + off)

    def request_cost_ratio(self, batch: int = 16, context: int = 1024) -> float:
        """The locality balancer's request cost r = b / (c L) for this model (its
        --eldr-request-cost, the simulator's `locality/F:rc=R`): the step time one more request
        adds (b: its KV reads, its share of compute, the per-request work of a measured step),
        over what one more distinct expert in every MoE layer adds (c L), at a batch of `batch`
        requests of `context` cached tokens each, half of its possible experts touched."""
        L, m = self.model.num_moe_layers, self.model
        d = np.full(L, float(max(1, min(m.num_experts, batch * m.top_k) // 2)))
        kv = batch * context
        base = self.decode_step_time(batch, kv, d)
        per_request = self.decode_step_time(batch + 1, kv + context, d) - base
        per_expert_all_layers = self.decode_step_time(batch, kv, d + 1) - base
        if not per_expert_all_layers > 0:
            raise ValueError(f"one more distinct expert costs nothing at batch {batch}: the step is compute-bound, "
                             "so no request cost ratio exists there")
        return max(0.0, per_request) / per_expert_all_layers

    # ---------------- prefill ----------------
    def prefill_time(self, num_tokens: int, distinct_experts: np.ndarray | None = None) -> float:
        """Seconds to prefill `num_tokens` prompt tokens on one prefill worker (same TP group
        shape): compute roofline of the active parameters plus causal attention, or reading
        all weights once, whichever is larger, plus the fixed overhead. With a measured step
        (other_s), the calibration's other_s(n) + sum over layers of a(n) + b(n) * d_l, d_l the
        prompt's distinct experts per layer when given (the simulator passes the recorded
        routing), else the uniform-routing expectation."""
        if num_tokens <= 0:
            return 0.0
        c, m = self._c, self.model
        n = float(num_tokens)
        if self.measured_step:  # estimated from the decode calibration (see the module docstring)
            if distinct_experts is None:
                distinct_experts = np.full(m.num_moe_layers, m.num_experts * (1.0 - (1.0 - m.top_k / m.num_experts) ** n))
            return self._other(num_tokens) + float(np.sum(self.moe_layer_time(num_tokens, np.asarray(distinct_experts))))
        attn_flops = c["attn_flops"] * m.num_layers * n * (n + 1) / 2.0
        compute = (n * c["active_flops_per_tok"] + attn_flops) / c["flops"]
        # expected fraction of experts a prompt of n tokens touches (uniform-routing bound)
        touched = 1.0 - (1.0 - m.top_k / m.num_experts) ** n
        weights = c["dense_bytes_t"] + m.num_moe_layers * m.num_experts * touched * c["expert_t"]
        return c["overhead"] + max(compute, weights)

    def kv_transfer_time(self, num_tokens: int) -> float:
        """Seconds to move a prompt's KV cache from the prefill to the decode group."""
        # each of the kv_shards rank pairs moves its share in parallel (a replicated MLA cache
        # moves in full to every rank)
        return num_tokens * self.model.kv_bytes_per_token() / (self._c["kv_shards"] * self.hardware.network_bw)

    # ---------------- paper check ----------------
    def moe_slowdown(self, lo: int = 16, hi: int = 128, batch_size: int | None = None) -> float:
        """Predicted ratio of MoE-layer time with `hi` vs `lo` distinct experts (same batch)."""
        m = self.model
        hi = min(hi, m.num_experts)
        b = batch_size if batch_size is not None else max(1, math.ceil(hi / m.top_k))
        shared = m.num_shared_experts * self._c["expert_t"]
        t_lo = float(np.max(self.moe_layer_time(b, lo))) + shared
        t_hi = float(np.max(self.moe_layer_time(b, hi))) + shared
        return t_hi / t_lo

    def paper_fixed_cost_s(self, lo: int = 16, hi: int = 128, ratio: float = PAPER_MOE_16_TO_128_SLOWDOWN) -> float:
        """The per-MoE-layer fixed cost F that makes this model reproduce the paper's measured
        16 -> 128 slowdown. With v(d) the variable time (experts + shared expert) at the same
        batch, (F + v(hi)) / (F + v(lo)) = ratio solves in closed form to
        F = (v(hi) - ratio * v(lo)) / (ratio - 1). It is taken from the paper's measurement,
        not fitted to any policy; 0 when the model already predicts <= ratio."""
        if ratio <= 1:
            raise ValueError(f"ratio must exceed 1, got {ratio}")
        fixed = self.moe_layer_fixed_s
        try:
            self.moe_layer_fixed_s = 0.0
            m = self.model
            hi = min(hi, m.num_experts)
            b = max(1, math.ceil(hi / m.top_k))
            shared = m.num_shared_experts * self._c["expert_t"]
            v_lo = float(np.max(self.moe_layer_time(b, lo))) + shared
            v_hi = float(np.max(self.moe_layer_time(b, hi))) + shared
        finally:
            self.moe_layer_fixed_s = fixed
        return max(0.0, (v_hi - ratio * v_lo) / (ratio - 1.0))

    def describe(self) -> dict:
        m, hw = self.model, self.hardware
        return {
            "model": m.name,
            "hardware": hw.name,
            "tp": self.tp,
            "expert_mb": round(m.expert_bytes() / 1e6, 2),
            "nonexpert_gb_per_step": round(m.nonexpert_bytes_per_step() / 1e9, 3),
            "kv_bytes_per_token": m.kv_bytes_per_token(),
            "kv_capacity_tokens": self.kv_capacity_tokens(),
            "bw_efficiency": self.bw_efficiency,
            "flops_efficiency": self.flops_efficiency,
            "step_overhead_ms": round(self._c["overhead"] * 1e3, 3),
            "moe_layer_fixed_us": round(self.moe_layer_fixed_s * 1e6, 3),
            "ep": self.ep,
            "kv_replicated_over_tp": self._c["kv_shards"] < self.tp,
            "calibrated": self.calibration is not None,
            "calibrated_step": self.measured_step,
            "offload_cache_experts": self.offload_cache_experts,
            **({"paged_experts": {"expert_bytes": m.expert_bytes(), "host_link_gb_s": hw.host_link_bw / 1e9,
                                  "page_in_us": round(self._c["host_t"] * 1e6, 3),
                                  "eager_step_overhead_ms": self.eager_step_overhead_s * 1e3}}
               if self.offload_cache_experts else {}),
        }


def _check_calibration(cal: dict) -> dict:
    out = {}
    for b, ab in cal.items():
        try:
            vals = tuple(float(x) for x in ab)
        except (TypeError, ValueError):
            vals = ()
        if len(vals) not in (2, 3) or int(b) < 1 or not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"calibration entry batch {b}: need batch >= 1 and finite a, b (, other) >= 0, got {ab}")
        out[int(b)] = vals
    if not out:
        raise ValueError("the calibration holds no batch sizes")
    if len({len(v) for v in out.values()}) > 1:
        raise ValueError("the calibration has the non-MoE step time other_s at some batch sizes only")
    return out


# entry field -> ModelProfile attribute: the shape a calibration entry was measured at
_SHAPE_FIELDS = (("hidden", "hidden_size"), ("intermediate_per_rank", "moe_intermediate_size"), ("experts", "num_experts"),
                 ("top_k", "top_k"), ("layers", "num_layers"), ("heads", "num_heads"), ("kv_heads", "num_kv_heads"),
                 ("head_dim", "head_dim"), ("vocab", "vocab_size"))


def _same_shape(entry: dict, profile: ModelProfile) -> bool:
    """Every shape field the entry records equals the profile's (and it records the MoE's)."""
    if any(f not in entry for f in ("hidden", "intermediate_per_rank", "experts", "top_k")):
        return False
    return all(entry[f] == getattr(profile, attr) for f, attr in _SHAPE_FIELDS if f in entry)


def load_calibration(path, model: str, hardware: str | None = None, profile: ModelProfile | None = None) -> dict:
    """Read {batch: (a_s, b_s)} for `model` from a calibration file written by
    benchmarks/gpu_calibrate.py (JSON: {"format": "eldr-moe-calibration/1", "entries": [{"model",
    "hardware", "batch", "a_s", "b_s", ...}]}); {batch: (a_s, b_s, other_s)} when the entries
    also hold the non-MoE step time `other_s` (the CPU mode). Entries for other models are
    ignored; with `profile`, entries of another name but the profile's exact shape (every shape
    field they record: hidden, expert width, experts, top-k, and for CPU entries layers, heads,
    KV heads, head dim, vocab) are taken when none carries the name (a model directory's name is
    not the calibration's). A file without the model is an error, never a silent fallback to
    the roofline."""
    import json
    from pathlib import Path

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read calibration file {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != "eldr-moe-calibration/1":
        raise ValueError(f"{path} is not an eldr-moe-calibration/1 file")
    entries = [e for e in doc.get("entries", []) if isinstance(e, dict)
               and (hardware is None or hardware.lower() in str(e.get("hardware", "")).lower())]
    chosen = [e for e in entries if e.get("model") == model]
    if not chosen and profile is not None:
        chosen = [e for e in entries if _same_shape(e, profile)]
    cal = {}
    try:
        for e in chosen:
            cal[int(e["batch"])] = (float(e["a_s"]), float(e["b_s"])) + ((float(e["other_s"]),) if "other_s" in e else ())
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: a malformed calibration entry ({type(exc).__name__}: {exc})") from None
    if not cal:
        have = sorted({(e.get("model"), e.get("hardware")) for e in doc.get("entries", [])})
        raise ValueError(f"{path} has no calibration for model {model!r}" + (f" on {hardware}" if hardware else "") + f"; it has {have}")
    return _check_calibration(cal)


# ---------------- the sensitivity band ----------------
# Until a GPU calibration exists, studies report three execution models. The fixed cost is
# solved (paper_fixed_cost_s) on the paper's setting, DeepSeek-V3 on one 8-GPU H200 node,
# and then applied, as seconds per MoE layer, to every model: it stands for kernel-launch-
# like work (gating, top-k, align) that does not scale with the expert size.
PAPER_REFERENCE = ("deepseek-v3", "h200")
# ASSUMPTION (sensitivity only): a step overhead 4x the default 0.5 ms, for stacks without
# CUDA graphs or an overlapped scheduler; it dilutes every routing gain.
LARGE_STEP_OVERHEAD_S = 2.0e-3
SENSITIVITY_VARIANTS = ("default", "paper-fixed", "paper-fixed+overhead")


def paper_fixed_cost() -> float:
    """Seconds per MoE layer that reproduce the paper's 4.7x on its reference setting."""
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.profiles import get_hardware

    m, hw = PAPER_REFERENCE
    return ExecutionModel(get_model(m), get_hardware(hw)).paper_fixed_cost_s()


def sensitivity_model(variant: str, model: ModelProfile, hardware: HardwareProfile, **kw) -> ExecutionModel:
    """One member of the sensitivity band (SENSITIVITY_VARIANTS)."""
    if variant == "default":
        return ExecutionModel(model, hardware, **kw)
    if variant == "paper-fixed":
        return ExecutionModel(model, hardware, moe_layer_fixed_s=paper_fixed_cost(), **kw)
    if variant == "paper-fixed+overhead":
        return ExecutionModel(model, hardware, moe_layer_fixed_s=paper_fixed_cost(), step_overhead_s=LARGE_STEP_OVERHEAD_S, **kw)
    raise ValueError(f"unknown cost-model variant {variant!r}; choose from {', '.join(SENSITIVITY_VARIANTS)}")
