"""The simulator's prediction for the real-engine CPU benchmark (benchmarks/real_cpu_tpot.py).

    python benchmarks/real_cpu_sim.py --trace WORK/loc0.9/trace.npz --centroids WORK/loc0.9/centroids.eldr \
        --calibration cal_cpu.json --model-dir WORK/models/locality-0.9-0- --workers 2 --concurrency 8,16 \
        --output-len 24 --json sim.json

or, from Python, `simulate_cell(...)` (one concurrency) / `predict(...)` (several), which return
the same dict that --json writes.

Given the trace `eldr collect` recorded on the same engine (v2 with decode routing kept for
every prompt; its model name may be unset, the model directory gives the shape), the centroid
file `eldr fit` made from it, and a CPU calibration (benchmarks/gpu_calibrate.py --device cpu
on the same machine), it simulates the benchmark's cluster with the simulator's own API, as
`eldr simulate --hardware cpu --calibration FILE --model DIR` does: 1 prefill and `workers`
decode workers on the `cpu` hardware profile, whose decode step is the calibration's
other_s(B) + sum over layers of a(B) + b(B) * d_l with d_l the distinct experts the simulated
batch touches in the trace's real routing; a closed loop of `concurrency` clients in total;
every trace request once per repeat (or `requests`, wrapping around the trace) in a shuffled order (one seed per repeat, as the benchmark
shuffles its prompt set per repeat); fixed outputs of `output_len` tokens. Like the benchmark,
each repeat drops its first `concurrency` requests as warm-up, then TPOT is pooled over the
repeats. Reported per policy: TPOT p50/p99 and their change against the best of the four load
balancers (fractions, -0.05 = 5% faster), the mean decode batch and the distinct experts per
MoE layer per step, and `expert_locality`: those distinct experts over their expectation for
randomly mixed batches of the same sizes (1 = no locality; from the simulator's metrics).

`step_terms(read_steps(...), calibration, model_dir)` checks the two terms of the calibrated step
against the decode steps the servers logged (the MoE time and the rest of each step), for the
"which term is wrong" question when prediction and measurement differ.

Nothing here is tuned: the only time constants are the calibration file's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

BALANCERS = ("random", "round_robin", "shortest_queue", "power_of_two")
POLICIES = ",".join(BALANCERS + ("eldr", "eldr/0.05", "locality/0.05"))


def _tpot(res, drop: int) -> np.ndarray:
    """Per-request TPOT (s) of one run, its first `drop` arrivals (the warm-up) left out."""
    order = np.lexsort((np.arange(len(res.arrival)), res.arrival))  # arrival, then request order
    keep = order[drop:]
    n = res.output_len[keep]
    multi = n > 1
    return ((res.finish[keep] - res.first_token[keep])[multi] / (n[multi] - 1)).astype(np.float64)


def _setup(trace, centroids, calibration, model_dir, workers):
    from eldr_sglang._core import CentroidSet
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import ExecutionModel, load_calibration
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.traces import open_trace

    for label, p in (("trace", trace), ("centroids", centroids), ("calibration", calibration), ("model dir", model_dir)):
        if not Path(p).exists():
            raise ValueError(f"{label} {p} does not exist")
    cs_workers = CentroidSet.open(str(centroids)).num_workers
    if cs_workers != workers:
        raise ValueError(f"the centroid file has {cs_workers} workers, not {workers}")
    model = get_model(str(model_dir))
    cal = load_calibration(calibration, model.name, "cpu", profile=model)
    em = ExecutionModel(model, get_hardware("cpu"), calibration=cal)
    source = open_trace(str(trace))
    replay = TraceReplay(source)
    t = replay.trace
    if (t.num_layers, t.num_experts, t.top_k) != (model.num_moe_layers, model.num_experts, model.top_k):
        raise ValueError(f"the trace's routing ({t.num_layers} layers x {t.num_experts} experts, top-{t.top_k}) is not "
                         f"the model's ({model.num_moe_layers} x {model.num_experts}, top-{model.top_k})")
    return em, source, replay


def simulate_cell(trace, centroids, calibration, model_dir, *, workers: int = 2, concurrency: int = 16,
                  output_len: int = 24, policies: str = POLICIES, repeats: int = 5, seed: int = 0,
                  requests: int | None = None, _loaded=None) -> dict:
    """Predicted per-policy TPOT at one concurrency (see the module docstring)."""
    from eldr_sglang.sim.cluster import ClusterConfig
    from eldr_sglang.sim.runner import parse_policies, run_comparison
    from eldr_sglang.workload import replay_workload

    if workers < 1 or concurrency < 1 or output_len < 2 or repeats < 1:
        raise ValueError("need workers >= 1, concurrency >= 1, output_len >= 2, repeats >= 1")
    specs = parse_policies(policies)
    em, source, replay = _loaded or _setup(trace, centroids, calibration, model_dir, workers)
    try:
        n = requests or replay.num_requests
        if n <= concurrency:
            raise ValueError(f"{n} requests per repeat; a closed loop of {concurrency} clients that drops its first "
                             f"{concurrency} as warm-up needs more (--requests)")
        cfg = ClusterConfig(num_decode=workers, num_prefill=1)
        tpot: dict[str, list] = {s.label: [] for s in specs}
        batch: dict[str, list] = {s.label: [] for s in specs}
        distinct: dict[str, list] = {s.label: [] for s in specs}
        locality: dict[str, list] = {s.label: [] for s in specs}
        for rep in range(repeats):
            wl = replay_workload(replay, requests=n, order="shuffle", output_len=output_len, arrival="closed",
                                 concurrency=concurrency, seed=seed + rep)
            pol, res = run_comparison(replay, wl, specs, em, cfg, centroids=str(centroids), seed=seed + rep,
                                      keep_results=True)
            for label, r in res.items():
                tpot[label].append(_tpot(r, concurrency))
                batch[label].append(pol[label]["mean_batch"])
                distinct[label].append(pol[label]["unique_experts_per_layer_step"])
                locality[label].append(pol[label]["expert_locality"])
    finally:
        if _loaded is None and hasattr(source, "close"):
            source.close()
    rows = {}
    for label in tpot:
        tp = np.concatenate(tpot[label])
        rows[label] = {"tpot_p50_ms": float(np.median(tp) * 1e3), "tpot_p99_ms": float(np.percentile(tp, 99) * 1e3),
                       "requests": int(tp.size), "mean_batch": float(np.mean(batch[label])),
                       "distinct_per_layer_step": float(np.mean(distinct[label])),
                       "expert_locality": float(np.mean(locality[label]))}
    bal = [p for p in BALANCERS if p in rows]
    best = min(bal, key=lambda p: rows[p]["tpot_p50_ms"]) if bal else None
    if best:
        for r in rows.values():
            r["p50_vs_best_balancer"] = r["tpot_p50_ms"] / rows[best]["tpot_p50_ms"] - 1
            r["p99_vs_best_balancer"] = r["tpot_p99_ms"] / rows[best]["tpot_p99_ms"] - 1
    return {"concurrency": concurrency, "workers": workers, "output_len": output_len, "repeats": repeats,
            "requests_per_repeat": n, "trace_requests": replay.num_requests, "best_balancer": best, "policies": rows,
            "model": em.describe()}


def predict(trace, centroids, calibration, model_dir, *, workers: int = 2, concurrencies=(8, 16), output_len: int = 24,
            policies: str = POLICIES, repeats: int = 5, seed: int = 0, requests: int | None = None) -> dict:
    """simulate_cell at each concurrency: {"cells": {str(concurrency): cell}, "inputs": {...}}."""
    loaded = _setup(trace, centroids, calibration, model_dir, workers)
    try:
        cells = {str(c): simulate_cell(trace, centroids, calibration, model_dir, workers=workers, concurrency=c,
                                       output_len=output_len, policies=policies, repeats=repeats, seed=seed,
                                       requests=requests, _loaded=loaded)
                 for c in concurrencies}
    finally:
        if hasattr(loaded[1], "close"):
            loaded[1].close()
    return {"simulated": True, "inputs": {"trace": str(trace), "centroids": str(centroids),
                                          "calibration": str(calibration), "model_dir": str(model_dir)},
            "cells": cells}


def calibrated_model(calibration, model_dir):
    """The simulator's execution model of the benchmark's model on the `cpu` profile, timed by
    the calibration file: em.moe_layer_time(B, distinct) and em._other(B)."""
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import ExecutionModel, load_calibration
    from eldr_sglang.sim.profiles import get_hardware

    model = get_model(str(model_dir))
    return ExecutionModel(model, get_hardware("cpu"),
                          calibration=load_calibration(calibration, model.name, "cpu", profile=model))


def speed_factor(steps, em) -> float:
    """How slow the machine ran during these decode steps: the median over steps of the MoE time
    measured inside the engine over the calibrated model's for the same batch and the same
    distinct experts per layer. The model accounts for the experts a batch touches, so the
    factor is the machine's own pace (shared memory bandwidth, other tenants), not the policy's;
    where the model under-prices an expert (its b is low, see step_terms) a batch with fewer
    experts gets a slightly lower factor, which counts against the locality policies."""
    r = [st.moe_s / float(np.sum(em.moe_layer_time(int(st.tokens), np.asarray(st.distinct, dtype=np.float64))))
         for st in steps]
    return float(np.median(r)) if r else float("nan")


def step_terms(steps, calibration, model_dir, min_steps: int = 5) -> dict:
    """Term by term, the calibrated cost model against decode steps measured inside a server.

    `steps`: objects with `t0` (perf_counter at the first MoE layer), `tokens` (batch size),
    `distinct` (per-layer distinct experts) and `moe_s` (time inside moe_forward_native, all
    layers), in order, e.g. eldr_sglang.testing.sglang_cpu.step_log.read_steps(path, layers).
    Per batch size B with at least `min_steps` steps it gives medians of the measured MoE time
    against the calibration's sum over layers of a(B) + b(B) * d_l for the same d_l (the
    MoE term), and of the measured rest of a step, the gap from one step's start to the next
    minus its MoE time, against other_s(B) (the non-MoE term: the engine's scheduler and Python
    work shows up here). Gaps longer than 3x their batch's median are left out as idle time."""
    em = calibrated_model(calibration, model_dir)
    steps = list(steps)
    by_b: dict[int, dict[str, list]] = {}
    for i, st in enumerate(steps):
        row = by_b.setdefault(int(st.tokens), {"moe": [], "moe_pred": [], "gap": [], "other_pred": []})
        row["moe"].append(st.moe_s)
        row["moe_pred"].append(float(np.sum(em.moe_layer_time(int(st.tokens), np.asarray(st.distinct, dtype=np.float64)))))
        if i + 1 < len(steps):
            row["gap"].append(steps[i + 1].t0 - st.t0 - st.moe_s)
    out = {}
    for b, row in sorted(by_b.items()):
        if len(row["moe"]) < min_steps:
            continue
        gaps = np.asarray(row["gap"])
        if gaps.size:
            gaps = gaps[gaps <= 3 * np.median(gaps)]
        moe, pred = float(np.median(row["moe"])), float(np.median(row["moe_pred"]))
        other = float(np.median(gaps)) if gaps.size else float("nan")
        out[b] = {"steps": len(row["moe"]), "moe_measured_ms": moe * 1e3, "moe_model_ms": pred * 1e3,
                  "moe_model_error": pred / moe - 1 if moe > 0 else float("nan"),
                  "other_measured_ms": other * 1e3, "other_model_ms": em._other(b) * 1e3,
                  "other_model_error": em._other(b) / other - 1 if other > 0 else float("nan")}
    return out


def table(result: dict) -> list[str]:
    lines = []
    for c, cell in result["cells"].items():
        lines += [f"simulated, concurrency {c}, {cell['workers']} decode workers, {cell['repeats']} repeats; "
                  f"best balancer: {cell['best_balancer']}",
                  "| policy | TPOT p50 (ms) | TPOT p99 (ms) | p50 vs best LB | p99 vs best LB | batch | distinct/layer/step |",
                  "|---|---|---|---|---|---|---|"]
        for p, r in cell["policies"].items():
            ch = (f"{r['p50_vs_best_balancer']:+.1%} | {r['p99_vs_best_balancer']:+.1%}"
                  if "p50_vs_best_balancer" in r else "- | -")
            lines.append(f"| {p} | {r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} | {ch} | {r['mean_batch']:.2f} | "
                         f"{r['distinct_per_layer_step']:.2f} |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="trace from `eldr collect` on the same engine (v2, decode routing kept)")
    ap.add_argument("--centroids", required=True, help="centroid file from `eldr fit` on that trace")
    ap.add_argument("--calibration", required=True, help="benchmarks/gpu_calibrate.py --device cpu output (with other_s)")
    ap.add_argument("--model-dir", required=True, help="the constructed model's directory (its config.json)")
    ap.add_argument("--workers", type=int, default=2, help="decode workers (default 2)")
    ap.add_argument("--concurrency", default="8,16", help="closed-loop clients in total, a comma list (default 8,16)")
    ap.add_argument("--output-len", type=int, default=24, help="output tokens per request (default 24)")
    ap.add_argument("--policies", default=POLICIES, help=f"comma list (default {POLICIES})")
    ap.add_argument("--repeats", type=int, default=5, help="shuffled passes over the trace, one seed each (default 5)")
    ap.add_argument("--requests", type=int, default=0, help="requests per repeat (default: the trace's; more wrap "
                                                            "around it, as the benchmark's --num-prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here (refuses to overwrite)")
    a = ap.parse_args(argv)
    try:
        concs = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error("--concurrency takes a comma list of integers")
    if a.json and Path(a.json).exists():
        ap.error(f"{a.json} exists; move it away first (nothing is overwritten)")
    try:
        result = predict(a.trace, a.centroids, a.calibration, a.model_dir, workers=a.workers, concurrencies=concs,
                         output_len=a.output_len, policies=a.policies, repeats=a.repeats, seed=a.seed,
                         requests=a.requests or None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(table(result)))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
