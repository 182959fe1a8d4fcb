"""Metrics of one simulation run: TPOT, TTFT, ITL, throughput, distinct experts per MoE
layer per decode step, expert reuse and per-worker load.

- TPOT of a request = (last token time - first token time) / (output tokens - 1), as
  sglang.benchmark.serving computes it; requests with one output token have none.
- ITL: every decode step gives each request in the batch one token, `step_dt` after its
  previous one, so the ITL distribution is the step durations weighted by batch size.
- Expert locality = sum over steps of distinct experts / the same for random mixing (each
  step's tokens drawn independently from the trace's routing marginals, same batch size):
  1.0 means no better than random batching, lower means batches share experts. Unlike raw
  distinct experts per step it is not lowered by merely running smaller batches.
- Expert reuse ratio = sum over steps and MoE layers of (batch x top_k) / distinct experts:
  how many token-expert selections each loaded expert serves on average.
- Paged experts (expert-offload mode, sim/paged_experts.py), per decode worker and pooled:
  hit rate = touched experts already resident / touched experts; page-ins per step (all MoE
  layers); reuse = token-expert selections served per page-in (per expert load).
"""

from __future__ import annotations

import numpy as np

from eldr_sglang.sim.cluster import SimResult


def _stats(x: np.ndarray) -> dict:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99))}


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    if values.size == 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order].astype(np.float64)
    cw = np.cumsum(w)
    return float(v[np.searchsorted(cw, q / 100.0 * cw[-1], side="left").clip(0, len(v) - 1)])


def compute_metrics(res: SimResult, warmup_frac: float = 0.0) -> dict:
    """Summary dict of one run (times in ms). `warmup_frac` drops that fraction of the
    earliest-arriving requests from the latency statistics (all tokens still count for
    throughput and experts)."""
    N = len(res.finish)
    n_out = res.output_len
    multi = n_out > 1
    tpot = np.full(N, np.nan)
    tpot[multi] = (res.finish[multi] - res.first_token[multi]) / (n_out[multi] - 1)
    ttft = res.first_token - res.arrival
    e2e = res.finish - res.arrival
    keep = np.ones(N, bool)
    if warmup_frac > 0:
        cut = np.quantile(res.arrival, warmup_frac)
        keep = res.arrival >= cut
    span = float(np.nanmax(res.finish) - np.nanmin(res.arrival)) if N else 0.0
    tokens = int(n_out.sum())
    batch = res.step_batch.astype(np.float64)
    k = res.extra["top_k"]
    steps = len(res.step_dt)
    L = len(res.distinct_layer_sum)
    dsum = float(res.distinct_layer_sum.sum())
    itl = res.step_dt
    K = res.config.num_decode
    per_worker = []
    for w in range(K):
        sel = res.step_worker == w
        busy = float(res.step_dt[sel].sum())
        per_worker.append(
            {
                "requests": int(np.sum(res.worker == w)),
                "tokens": int(batch[sel].sum()),
                "steps": int(sel.sum()),
                "mean_batch": float(batch[sel].mean()) if sel.any() else 0.0,
                "busy_frac": busy / span if span > 0 else 0.0,
                "mean_distinct": float(np.average(res.step_distinct[sel])) if sel.any() else 0.0,
            }
        )
    req_counts = np.array([p["requests"] for p in per_worker], dtype=np.float64)
    return {
        "requests": N,
        "completed": int(np.sum(res.completions == 1)),
        "output_tokens": tokens,
        "duration_s": span,
        "tpot_ms": {k_: v * 1e3 for k_, v in _stats(tpot[keep]).items()},
        "ttft_ms": {k_: v * 1e3 for k_, v in _stats(ttft[keep]).items()},
        "e2e_ms": {k_: v * 1e3 for k_, v in _stats(e2e[keep]).items()},
        "itl_ms": {
            "mean": float(np.average(itl, weights=batch)) * 1e3 if steps else float("nan"),
            "p50": _weighted_percentile(itl, batch, 50) * 1e3,
            "p99": _weighted_percentile(itl, batch, 99) * 1e3,
        },
        "throughput_tok_s": tokens / span if span > 0 else float("nan"),
        "decode_steps": steps,
        "mean_batch": float(batch.mean()) if steps else 0.0,
        "unique_experts_per_layer_step": dsum / (steps * L) if steps else float("nan"),
        "unique_experts_per_layer": (res.distinct_layer_sum / steps).tolist() if steps else [],
        "expert_locality": float(res.step_distinct.astype(np.float64).sum() / res.step_null_distinct.astype(np.float64).sum())
        if steps else float("nan"),
        "expert_reuse_ratio": float(batch.sum() * k * L / dsum) if dsum else float("nan"),
        "load_imbalance": float(req_counts.max() / req_counts.mean()) if req_counts.mean() > 0 else float("nan"),
        "per_worker": per_worker,
        "offload_misses": res.offload_misses,
        **({"paged": paged_summary(res.extra["paged"])} if "paged" in res.extra else {}),
        "sim_wall_s": res.wall_s,
    }


def paged_summary(workers: list[dict]) -> dict:
    """Pooled and per-worker paged-experts counters (hit rate, page-ins per step, reuse)."""
    tot = {k: sum(w[k] for w in workers) for k in ("steps", "touched", "page_ins", "selections")}
    return {
        "hit_rate": 1.0 - tot["page_ins"] / tot["touched"] if tot["touched"] else float("nan"),
        "page_ins_per_step": tot["page_ins"] / tot["steps"] if tot["steps"] else float("nan"),
        "reuse": tot["selections"] / tot["page_ins"] if tot["page_ins"] else float("nan"),
        "per_worker": [{k: w[k] for k in ("hit_rate", "page_ins_per_step", "reuse", "steps")} for w in workers],
    }
