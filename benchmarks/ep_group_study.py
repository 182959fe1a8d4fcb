"""What a decode worker is at scale: K = 2, 3, 4 decode groups, each one expert-parallel
instance of EP ranks (SGLang's large-EP PD deployment), in the simulator's EP mode under the
strict protocol, at DeepSeek-V3's shape.

Runs `eldr simulate --protocol strict --ep EP --tp EP --workers K` on one synthetic
domain-skewed DeepSeek-V3 trace for every (K, EP) and prints a markdown table: the best load
balancer's TPOT, the change of the bounded ELDR router and the locality balancer against it
(median over the protocol's cells, and the worst cell), the distinct experts per layer per step
and the expert locality at the protocol's heavier closed-loop load, and the perfect-overlap
bound. EP must divide DeepSeek-V3's 256 routed experts (the simulator places contiguous blocks
of E/EP experts per rank, no redundant experts), so EP72 (which the LMSYS deployment reaches
with 32 redundant experts) is not modelled; 32 and 64 bracket it.

    python benchmarks/ep_group_study.py --out benchmarks/results/ep_group_study
    python benchmarks/ep_group_study.py --out DIR --summarise-only   # table from DIR's JSONs

About 2.5 CPU-minutes per (K, EP) with 3000 requests of 32 output tokens and one split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BALANCERS = ("random", "round_robin", "shortest_queue", "power_of_two")
ROUTERS = ("eldr/0.05", "locality/0.05")


def run(out: Path, trace: Path, ks, eps, requests: int, output_len: int, seed: int) -> None:
    if not trace.exists():
        trace.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "eldr_sglang", "synth", "--model", "deepseek-v3", "--requests", str(requests),
                        "--output-len", str(output_len), "--seed", str(seed), "--jobs", "1", "--out", str(trace),
                        "--no-progress"], check=True, cwd=REPO)
    for ep in eps:
        for k in ks:
            js = out / f"k{k}_ep{ep}.json"
            if js.exists():
                continue
            subprocess.run([sys.executable, "-m", "eldr_sglang", "simulate", "--trace", str(trace), "--protocol", "strict",
                            "--splits", "1", "--ep", str(ep), "--tp", str(ep), "--workers", str(k), "--no-progress",
                            "--json", str(js)], check=True, cwd=REPO)


def summarise(out: Path, ks, eps) -> str:
    lines = ["| K | EP | best LB TPOT p50 (ms) | eldr/0.05 p50 / p99 | locality/0.05 p50 / p99 | worst cell p50 (locality) "
             "| group batch (closed@32) | distinct experts per layer-step, SQ -> locality | expert locality, locality/0.05 "
             "| perfect-overlap bound p50 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for ep in eps:
        for k in ks:
            js = out / f"k{k}_ep{ep}.json"
            if not js.exists():
                lines.append(f"| {k} | {ep} | not run | | | | | | | |")
                continue
            recs = json.loads(js.read_text())["records"]
            d = {p: ([], []) for p in (*ROUTERS, "perfect_overlap")}
            base = []
            for rec in recs:
                pol = rec["policies"]
                # against the best load balancer of the cell, metric by metric (as `eldr simulate`)
                b50 = min(pol[p]["tpot_ms"]["p50"] for p in BALANCERS)
                b99 = min(pol[p]["tpot_ms"]["p99"] for p in BALANCERS)
                base.append(b50)
                for p in d:
                    t = pol[p]["tpot_ms"]
                    d[p][0].append(100 * (t["p50"] / b50 - 1))
                    d[p][1].append(100 * (t["p99"] / b99 - 1))
            heavy = [r for r in recs if r["cell"].startswith("shuffle,closed@32")] or recs[:1]
            pol = heavy[0]["policies"]
            med = statistics.median

            def pair(p):
                return f"{med(d[p][0]):+.1f}% / {med(d[p][1]):+.1f}%"

            lines.append(
                f"| {k} | {ep} | {med(base):.2f} | {pair('eldr/0.05')} | {pair('locality/0.05')} "
                f"| {max(d['locality/0.05'][0]):+.1f}% | {pol['shortest_queue']['mean_batch']:.1f} "
                f"| {pol['shortest_queue']['unique_experts_per_layer_step']:.1f} -> "
                f"{pol['locality/0.05']['unique_experts_per_layer_step']:.1f} "
                f"| {pol['locality/0.05']['expert_locality']:.3f} | {med(d['perfect_overlap'][0]):+.1f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSONs and study.md")
    ap.add_argument("--trace", type=Path, default=Path(tempfile.gettempdir()) / "eldr_ep_group_study" / "dsv3_synth.npz",
                    help="the synthetic trace (about 150 MB; made when absent, kept out of the repository)")
    ap.add_argument("--workers", default="2,3,4", help="K values (decode groups)")
    ap.add_argument("--ep", default="32,64", help="EP sizes of a decode group (each must divide 256)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--summarise-only", action="store_true")
    a = ap.parse_args()
    ks = [int(x) for x in a.workers.split(",")]
    eps = [int(x) for x in a.ep.split(",")]
    bad = [e for e in eps if 256 % e]
    if bad:
        ap.error(f"EP {bad} does not divide DeepSeek-V3's 256 routed experts (the simulator has no redundant experts)")
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.summarise_only:
        run(a.out, a.trace, ks, eps, a.requests, a.output_len, a.seed)
    table = summarise(a.out, ks, eps)
    (a.out / "study.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
