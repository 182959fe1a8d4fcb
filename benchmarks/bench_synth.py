"""Time the synthetic generator on the issue's target workload.

    python benchmarks/bench_synth.py [--requests 10000] [--model deepseek-v3]

Default: 10k DeepSeek-V3-shaped requests with prompts of 128..512 tokens and 512 output
tokens (about 8.3M token rows, 3.9 GB of uint8 ids). Writes benchmarks/results/synth_speed.json.
The machine is shared, so the figure is indicative; `cpu_s` is the process CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from eldr_sglang.traces.synth import generate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "synth_speed.json"))
    args = ap.parse_args(argv)
    t0, c0 = time.perf_counter(), time.process_time()
    tr = generate(args.model, requests=args.requests, seed=0, prompt_len=(128, 512), output_len=args.output_len)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    res = {
        "model": args.model, "requests": args.requests, "token_rows": int(tr.expert_ids.shape[0]),
        "ids_bytes": int(tr.expert_ids.nbytes), "dtype": str(tr.expert_ids.dtype),
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
