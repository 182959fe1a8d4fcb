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
from eldr_sglang.sim.policies import BOUNDED, LOCALITY, POLICY_NAMES, eldr_signatures, make_policy
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
    experts per layer; rust/core/src/policies/locality.rs)."""
    specs = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        name, rc = _request_cost(name)
        t, lf = tau, load_factor
        bound = None
        if name == "default":
            name = DEFAULT_POLICY + (f"/{DEFAULT_LOAD_FACTOR:g}" if DEFAULT_LOAD_FACTOR is not None else "")
            raw = name + (raw.strip()[raw.strip().index(":"):] if rc is not None else "")
            t = DEFAULT_TAU if tau is None else tau
        if name == "perfect_overlap":
            specs.append(PolicySpec("perfect_overlap", "shortest_queue", bound="perfect"))
            continue
        if name.startswith("clairvoyant"):
            bound = "clairvoyant"
            name = "eldr" + name[len("clairvoyant"):]
        if "/" in name:
            name, _, fv = name.partition("/")
            try:
                lf = float(fv)
            except ValueError:
                raise ValueError(f"bad load factor in policy {raw!r}: use eldr/0.05") from None
            if not (lf >= 0 and np.isfinite(lf)):
                raise ValueError(f"load factor must be finite and >= 0 in {raw!r}")
            if name.partition("@")[0] not in BOUNDED:
                raise ValueError(f"only {' and '.join(BOUNDED)} take /load_factor, got {raw!r}")
        if "@" in name:
            name, _, tv = name.partition("@")
            try:
                t = float(tv)
            except ValueError:
                raise ValueError(f"bad tau in policy {raw!r}: use eldr@0.1") from None
            if not (np.isfinite(t) and 0 <= t <= _core.MAX_TAU):  # the core's bound, the router's too
                raise ValueError(f"tau must be finite and in [0, {_core.MAX_TAU:g}] in {raw!r}")
            if name != "eldr":
                raise ValueError(f"only eldr takes @tau, got {raw!r}")
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        if rc is not None and (name not in LOCALITY or bound is not None):
            raise ValueError(f"only {' and '.join(LOCALITY)} take :rc=R (the locality cost's per-request term), got {raw.strip()!r}")
        label = raw.strip() if ("@" in raw or "/" in raw or rc is not None) else name
        if bound == "clairvoyant":
            label = raw.strip()
        specs.append(PolicySpec(label, name, t, lf if name in BOUNDED else None, bound=bound, request_cost=rc))
    if not specs:
        raise ValueError("no policies given")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policy listed twice: {text!r}")
    return specs


def _request_cost(label: str) -> tuple[str, float | None]:
    """'locality/0.05:rc=0.4' -> ('locality/0.05', 0.4); a label without ':' -> (label, None)."""
    name, colon, opt = label.partition(":")
    if not colon:
        return label, None
    key, eq, value = opt.partition("=")
    if key.strip() != "rc" or not eq:
        raise ValueError(f"bad option {opt!r} in policy {label!r}: use locality/0.05:rc=0.4")
    try:
        r = float(value)
    except ValueError:
        raise ValueError(f"bad request cost in policy {label!r}: use locality/0.05:rc=0.4") from None
    if not (np.isfinite(r) and r >= 0):
        raise ValueError(f"the request cost must be finite and >= 0 in {label!r}")
    return name.strip(), r


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
