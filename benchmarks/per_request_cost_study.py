"""Should the locality balancer price the per-request part of a step? Today's default
(`locality/0.05`) against the same rule with the request cost r = b / (c L) of each profile
(`locality/0.05:rc=R`, the router's --eldr-request-cost R), under the strict protocol's
split/fit/evaluate runs (eldr_sglang/sim/protocol.py), simulated (issue 34 item 4).

    python benchmarks/per_request_cost_study.py --json out.json --md out.md

Workloads: the real GPT-OSS-20B trace on H100 (../shared/traces/gptoss20b.npz) and the
synthetic domain-skewed DeepSeek-V3 on 8xH200 TP (the calibrated generator), K = 8, the
default cost model, closed loop at 8 and 32 clients per worker, fixed outputs, trace and
shuffled order, 1 split. r comes from the profile's cost model
(`ExecutionModel.request_cost_ratio` at a batch of 16 and the workload's mean context), one
ratio per profile, never from the results. Not here: the CPU engine's setting (its recorded
trace is v2, prompt counts, which the protocol's per-token replay cannot take; the engine fit,
benchmarks/results/engine_step_fit_cpu.json, has no per-request term once its shared host CPU
is modelled, so its r is 0). The rule that picks the default is
fixed in advance (issue 34): fewest runs losing to the best load balancer on p50 or p99 TPOT,
ties broken by the median p50 change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("ELDR_SHARED_TRACES", ROOT.parent / "shared" / "traces"))
BALANCERS = "random,round_robin,shortest_queue,power_of_two"
TODAY = "locality/0.05:rc=0"  # the rule without the term (before it became the default)


def _synth():
    from eldr_sglang.sim.protocol import FIXED_OUTPUT_LEN
    from eldr_sglang.traces.synth import generate

    return generate(model="deepseek-v3", requests=1200, domains=8, seed=0, prompt_len=(64, 256),
                    output_len=FIXED_OUTPUT_LEN)


def workloads(full: bool = False) -> list[dict]:
    from eldr_sglang.sim.protocol import Cell, strict_cells

    cells = strict_cells() if full else [Cell(o, "closed", float(c), "fixed") for o in ("shuffle", "trace") for c in (8, 32)]
    w = []
    real = SHARED / "gptoss20b.npz"
    if real.exists():
        from eldr_sglang.traces import load_trace

        w.append(dict(name="gptoss20b-real", make=lambda: load_trace(real), hardware="h100", K=8, cells=cells,
                      batch=16))
    else:
        print(f"skipping the real trace: {real} not found", file=sys.stderr)
    w.append(dict(name="deepseek-v3-synth", make=_synth, hardware="h200", K=8, cells=cells, batch=16))
    return w


def execution_models(w: dict, trace, full: bool) -> dict:
    """{cost-model variant: ExecutionModel}: the default alone, or the whole sensitivity band."""
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import SENSITIVITY_VARIANTS, sensitivity_model
    from eldr_sglang.sim.profiles import get_hardware

    model, hw = get_model(trace.model), get_hardware(w["hardware"])
    return {v: sensitivity_model(v, model, hw) for v in (SENSITIVITY_VARIANTS if full else ("default",))}


def run_workload(w: dict, seed: int, requests: int | None, log, full: bool = False, fixed_r: float | None = None) -> dict:
    from eldr_sglang.sim.protocol import FIXED_OUTPUT_LEN, STRICT_MIN_REQUESTS, random_splits, run_protocol

    t0 = time.perf_counter()
    trace = w["make"]()
    models = execution_models(w, trace, full)
    em = models["default"]  # r: one ratio per profile, from its default cost model
    prompt = float(np.mean(trace.prefill_len))
    ratio = em.request_cost_ratio(batch=w["batch"], context=int(prompt + FIXED_OUTPUT_LEN / 2)) if fixed_r is None else fixed_r
    rc_label = f"{TODAY}:rc={ratio:.4g}"
    policies = f"{BALANCERS},{TODAY},{rc_label}"
    log(f"== {w['name']}: r = {ratio:.4g} ({rc_label})")
    recs = run_protocol(trace, models, w["K"], w["cells"], random_splits(trace.num_requests, 2 if full else 1, seed),
                        policies=policies, bounds=False, requests=requests or STRICT_MIN_REQUESTS, seed=seed)
    return {"name": w["name"], "request_cost": ratio, "label": rc_label, "K": w["K"], "records": recs,
            "model": em.describe(), "runtime_s": round(time.perf_counter() - t0, 1)}


def score(docs: list[dict]) -> list[dict]:
    """The rule fixed in advance, over every run of every workload."""
    from eldr_sglang.sim.protocol import versus_best

    rows = []
    for cand in ("today", "request_cost"):
        ds = [versus_best(r["policies"], TODAY if cand == "today" else d["label"]) for d in docs for r in d["records"]]
        rows.append({"candidate": cand, "runs": len(ds),
                     "runs_losing": sum(x["tpot_p50"] > 0 or x["tpot_p99"] > 0 for x in ds),
                     "median_p50": float(np.median([x["tpot_p50"] for x in ds])),
                     "median_p99": float(np.median([x["tpot_p99"] for x in ds]))})
    return sorted(rows, key=lambda r: (r["runs_losing"], r["median_p50"]))


def table(docs: list[dict], rows: list[dict]) -> list[str]:
    from eldr_sglang.sim.protocol import versus_best

    lines = ["| workload | r | split | cost model | cell | today p50 | today p99 | with r p50 | with r p99 | best balancer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for d in docs:
        for r in d["records"]:
            a, b = versus_best(r["policies"], TODAY), versus_best(r["policies"], d["label"])
            lines.append(f"| {d['name']} | {d['request_cost']:.3g} | {r['split']} | {r['variant']} | {r['cell']} | {a['tpot_p50']:+.1f}% | "
                         f"{a['tpot_p99']:+.1f}% | {b['tpot_p50']:+.1f}% | {b['tpot_p99']:+.1f}% | {a['best_lb_p50']} |")
    lines += ["", "Changes are against the best load balancer of each run (negative: faster).", "",
              "| candidate | runs losing on p50 or p99 | runs | median p50 | median p99 |", "|---|---|---|---|---|"]
    lines += [f"| {r['candidate']} | {r['runs_losing']} | {r['runs']} | {r['median_p50']:+.2f}% | {r['median_p99']:+.2f}% |"
              for r in rows]
    lines += ["", f"The rule picks: **{rows[0]['candidate']}**."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: the strict protocol's minimum)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full", action="store_true",
                    help="the whole strict protocol: 2 splits, every cell (open loop and recorded outputs too), the "
                         "three cost models of the sensitivity band (default: 1 split, 4 closed-loop cells, default model)")
    ap.add_argument("--request-cost", type=float, default=None, metavar="R",
                    help="one r for every workload (a router default) instead of each profile's own")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--md", metavar="PATH")
    a = ap.parse_args(argv)
    for p in (a.json, a.md):
        if p and Path(p).exists():
            ap.error(f"{p} exists; move it away first (nothing is overwritten)")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        docs = [run_workload(w, a.seed, a.requests or None, log, a.full, a.request_cost) for w in workloads(a.full)]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = score(docs)
    lines = table(docs, rows)
    print("\n".join(lines))
    from eldr_sglang import io_safe

    if a.json:
        io_safe.write_json({"workloads": docs, "score": rows, "chosen": rows[0]["candidate"], "full": a.full, "fixed_request_cost": a.request_cost,
                            "runtime_s": round(time.perf_counter() - t0, 1)}, a.json, indent=1)
    if a.md:
        io_safe.write_text(a.md, "\n".join(lines) + "\n", what="--md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
