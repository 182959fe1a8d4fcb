"""Simulator speed: 10k requests x 512 output tokens, K=8 decode workers, DeepSeek-V3 shape.

    python benchmarks/bench_sim.py [--requests 10000] [--output-len 512] [--json out.json]

The synthetic DeepSeek-V3 trace holds --trace-requests requests with their full 512 decode
tokens recorded; the 10k simulated requests replay them in order, wrapping around. Times
are wall-clock of `simulate()` alone (trace generation and the fit are reported apart).
Target: <= 60 s per policy on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from eldr_sglang.offline.fit import fit_trace
from eldr_sglang.sim.cluster import ClusterConfig, simulate
from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.sim.metrics import compute_metrics
from eldr_sglang.sim.policies import eldr_signatures, make_policy
from eldr_sglang.models import get_model
from eldr_sglang.sim.profiles import get_hardware
from eldr_sglang.sim.replay import TraceReplay
from eldr_sglang.workload import replay_workload
from eldr_sglang.traces.synth import generate

TARGET_S = 60.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--trace-requests", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--policies", default="shortest_queue,eldr")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--md", help="write a markdown table here")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    trace = generate(model="deepseek-v3", requests=args.trace_requests, seed=0, prompt_len=(64, 256), output_len=args.output_len)
    gen_s = time.perf_counter() - t0
    K = args.workers
    replay = TraceReplay(trace)
    em = ExecutionModel(get_model(trace.model), get_hardware("h200"))
    wl = replay_workload(replay, requests=args.requests, output_len=args.output_len, arrival="closed", concurrency=args.concurrency)
    assert not wl.cycled
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cpath = os.path.join(tmp, "c.eldr")
        t0 = time.perf_counter()
        fit_trace(trace, workers=K, seed=0).write(cpath)
        fit_s = time.perf_counter() - t0
        sigs = None
        for name in args.policies.split(","):
            if name == "eldr" and sigs is None:
                sigs = eldr_signatures(replay, cpath)
            pol = make_policy(name, K, replay=replay, centroids=cpath, signatures=sigs if name == "eldr" else None)
            t0 = time.perf_counter()
            res = simulate(replay, wl, pol, em, ClusterConfig(num_decode=K))
            wall = time.perf_counter() - t0
            m = compute_metrics(res)
            assert m["completed"] == args.requests
            rows.append({
                "policy": name, "requests": args.requests, "output_tokens": m["output_tokens"],
                "decode_steps": m["decode_steps"], "mean_batch": round(m["mean_batch"], 1), "sim_wall_s": round(wall, 2),
                "sim_tokens_per_s": round(m["output_tokens"] / wall), "target_s": TARGET_S, "within_target": wall <= TARGET_S,
                "tpot_p50_ms": round(m["tpot_ms"]["p50"], 3),
            })
    env = {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
           "trace_generate_s": round(gen_s, 2), "fit_s": round(fit_s, 2), "trace_requests": args.trace_requests,
           "workers": K, "concurrency": args.concurrency, "model": "deepseek-v3 (58 MoE layers x 256 experts, top-8)"}
    head = ["policy", "requests", "output_tokens", "decode_steps", "mean_batch", "sim_wall_s", "sim_tokens_per_s", "within_target"]
    w = [max(len(h), *(len(str(r[h])) for r in rows)) for h in head]
    print("  ".join(h.ljust(x) for h, x in zip(head, w)))
    for r in rows:
        print("  ".join(str(r[h]).ljust(x) for h, x in zip(head, w)))
    print(f"(trace generation {gen_s:.1f} s, fit {fit_s:.1f} s, {os.cpu_count()} CPUs visible; target <= {TARGET_S:.0f} s per policy)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "env": env}, indent=2) + "\n")
    if args.md:
        cmd = "python benchmarks/bench_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)
        md = [f"# Simulator speed\n\nCommand: `{cmd.strip()}`\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
        md.append(f"\nDeepSeek-V3 shape (58 MoE layers x 256 experts, top-8), K={K}, closed loop at {args.concurrency} clients, "
                  f"{os.cpu_count()} CPUs shared with other jobs; trace generation {gen_s:.1f} s and fit {fit_s:.1f} s not included. "
                  f"Target: <= {TARGET_S:.0f} s per policy.\n")
        Path(args.md).write_text("\n".join(md))
    return 0 if all(r["within_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
