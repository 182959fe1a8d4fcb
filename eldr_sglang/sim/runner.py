"""Run several policies over one workload and collect their metrics (used by `eldr
simulate`, `eldr demo` and the benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from eldr_sglang import _core
from eldr_sglang.sim.cluster import ClusterConfig, SimResult, simulate
from eldr_sglang.sim.cost_model import PAPER_MOE_16_TO_128_SLOWDOWN, ExecutionModel
from eldr_sglang.sim.metrics import compute_metrics
from eldr_sglang.defaults import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_TAU
from eldr_sglang.sim.policies import BOUNDED, eldr_signatures, make_policy
from eldr_sglang.sim.replay import TraceReplay
from eldr_sglang.workload import Workload


@dataclass(frozen=True)
class PolicySpec:
    label: str  # name shown in reports, e.g. "eldr", "eldr@0.2" or "eldr/0.05"
    policy: str
    tau: float | None = None
    load_factor: float | None = None  # ELDR with bounded loads; None = the paper's rule
    # bounds, not policies: "perfect" = every layer of every step touches top_k experts (routing
    # by shortest queue); "clairvoyant" = ELDR with signatures from the decode rows
    bound: str | None = None
    # the locality cost's per-request term r (`locality/0.05:rc=0.4`); None = without it
    request_cost: float | None = None


BOUNDS = {"perfect_overlap": "perfect", "clairvoyant": "clairvoyant"}


def parse_policies(text: str, tau: float | None = None, load_factor: float | None = None) -> list[PolicySpec]:
    """'random,shortest_queue,eldr,eldr@0.3,eldr/0.05,locality/0.05,oracle,default' -> specs.

    eldr@T sets tau=T; eldr/F (or eldr@T/F, locality/F) sets the bounded-load factor F (a
    worker is a candidate only below ceil((1+F) x (total+1) / K)); `tau` and `load_factor` are
    the defaults for a plain `eldr`. `default` is the router's default (eldr_sglang.defaults).
    Two bounds may be listed too: `perfect_overlap` and `clairvoyant[@T][/F]` (ELDR fed the
    decode-time routing it cannot know). A locality label (`locality`, `locality/F`, `paged`,
    `paged/F`, `default`) may end in `:rc=R`, the cost's per-request term (R >= 0, distinct
    experts per layer; rust/core/src/policies/locality.rs). The labels are the router's grammar,
    parsed and bounded by the core (`_core.parse_policy_label`); `oracle`, `default` and the
    bounds are the simulator's words around it."""
    specs = []
    for raw in text.split(","):
        label = raw.strip()
        if not label:
            continue
        specs.append(_spec(label, tau, load_factor))
    if not specs:
        raise ValueError("no policies given")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policy listed twice: {text!r}")
    return specs


def _spec(label: str, tau: float | None, load_factor: float | None) -> PolicySpec:
    if label == "perfect_overlap":
        return PolicySpec("perfect_overlap", "shortest_queue", bound="perfect")
    if label == "oracle":
        return PolicySpec("oracle", "oracle", tau)
    bound = None
    text = label
    if label == "default" or label.startswith("default:"):
        text = DEFAULT_POLICY + (f"/{DEFAULT_LOAD_FACTOR:g}" if DEFAULT_LOAD_FACTOR is not None else "") + label[len("default"):]
        label = text
        tau = DEFAULT_TAU if tau is None else tau
    elif label.startswith("clairvoyant"):
        bound = "clairvoyant"
        text = "eldr" + label[len("clairvoyant"):]
    try:
        name, t, lf_given, lf, rc = _core.parse_policy_label(text)
    except ValueError as exc:
        raise ValueError(f"policy {label!r}: {exc}") from None
    plain = label == name
    return PolicySpec(label if not plain else name, name, tau if t is None else t,
                      (lf if lf_given else load_factor) if name in BOUNDED else None, bound=bound, request_cost=rc)


def run_comparison(
    replay: TraceReplay,
    workload: Workload,
    specs: list[PolicySpec],
    model: ExecutionModel,
    config: ClusterConfig,
    *,
    centroids: str | None = None,
    seed: int = 0,
    progress: bool = False,
    keep_results: bool = False,
    signatures: tuple[np.ndarray, np.ndarray] | None = None,
    warmup_frac: float = 0.0,
    clairvoyant: tuple[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[dict[str, dict], dict[str, SimResult]]:
    """Simulate each policy on the same workload. Domain labels are read from the trace only
    for the oracle, and only here. `clairvoyant` = (centroid file fitted on decode-row
    signatures, those signatures) for the clairvoyant bound; without it the bound signs the
    decode rows against the prompt-fitted `centroids`."""
    out: dict[str, dict] = {}
    results: dict[str, SimResult] = {}
    dec_sigs = None
    for spec in specs:
        labels = None
        if spec.policy == "oracle":
            labels = replay.trace.domain
            if labels is None:
                raise ValueError("the oracle policy needs domain labels, and the trace has none")
        if spec.policy == "eldr" and signatures is None:
            if centroids is None:
                raise ValueError("policy eldr needs a centroid file (--centroids)")
            signatures = eldr_signatures(replay, centroids)
        sigs = signatures if spec.policy == "eldr" else None
        cpath = centroids
        if spec.bound == "clairvoyant" and clairvoyant is not None:
            cpath, sigs = clairvoyant
        elif spec.bound == "clairvoyant":
            if dec_sigs is None:
                from eldr_sglang._core import CentroidSet

                dec_sigs = replay.decode_signatures(CentroidSet.open(str(centroids)).spec())
            sigs = dec_sigs
        pol = make_policy(
            spec.policy, config.num_decode, replay=replay, centroids=cpath, tau=spec.tau,
            seed=seed, labels=labels, signatures=sigs, load_factor=spec.load_factor,
            paged_experts=getattr(model, "offload_cache_experts", 0) or None, request_cost=spec.request_cost,
        )
        cfg = replace(config, perfect_overlap=True) if spec.bound == "perfect" else config
        res = simulate(replay, workload, pol, model, cfg, progress=progress, progress_desc=spec.label)
        res.policy = spec.label
        out[spec.label] = compute_metrics(res, warmup_frac=warmup_frac)
        if keep_results:
            results[spec.label] = res
    return out, results


def paper_check(model: ExecutionModel) -> str:
    """The model's prediction beside the ELDR paper's measurement (16 -> 128 active experts
    makes the MoE layer 4.7x slower)."""
    m = model.model
    if m.num_experts < 128:
        return (
            f"paper check: {m.name} has {m.num_experts} experts per layer (< 128); the paper's "
            f"16->128 measurement ({PAPER_MOE_16_TO_128_SLOWDOWN}x) does not apply"
        )
    r = model.moe_slowdown(16, 128)
    return (
        f"paper check: MoE layer time, 16 -> 128 distinct experts: model {r:.2f}x slower "
        f"(pure bandwidth roofline), ELDR paper measured {PAPER_MOE_16_TO_128_SLOWDOWN}x"
        + (" -> the model overstates the per-expert cost, so it overstates locality gains"
           if r > PAPER_MOE_16_TO_128_SLOWDOWN * 1.1 else "")
    )
