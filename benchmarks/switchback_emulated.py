"""A switchback experiment where the answer is known: emulated PD workers (decode step times
from the simulator's cost model on the trace's real decode routing), two arms alternating in
seeded random order, analysed by `eldr experiment report` (eldr_sglang.experiment).

For each trace (a strong-locality one and the uniform control) one emulated cluster serves
every block; each block starts a router on its arm (so the previous arm's requests have all
drained: the warm-up dropped is the queue filling again), drives closed-loop streaming
clients for --block-s seconds, and records every request's client-measured TPOT with its
block, arm and start time. Requests take trace requests in the trace's order, so both arms
see the same domain mix.

    python benchmarks/switchback_emulated.py --blocks-per-arm 6 --block-s 30 \\
        --out benchmarks/results/switchback_emulated

writes OUT.json ({"locality": {...}, "uniform": {...}}, each with diff_p50, ci_low, ci_high
as fractions of arm 1 vs arm 2, and blocks), OUT.md, and the per-request records
OUT_<trace>.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def _drive(base: str, seconds: float, concurrency: int, next_request, output_len: int) -> list[dict]:
    import aiohttp

    t_block = time.perf_counter()
    out: list[dict] = []

    async def client(s):
        while time.perf_counter() - t_block < seconds:
            r = next_request()
            body = {"text": f"request {r}", "stream": True, "sampling_params": {"max_new_tokens": output_len},
                    "emulator": {"trace_request": r}}
            t0 = time.perf_counter()
            stamps = []
            try:
                async with s.post(base + "/generate", json=body) as resp:
                    if resp.status != 200:
                        await resp.read()
                        continue
                    async for line in resp.content:
                        if line.startswith(b"data:") and b"[DONE]" not in line:
                            stamps.append(time.perf_counter())
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            if len(stamps) >= 2:
                out.append({"t_s": t0 - t_block, "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                            "ttft_s": stamps[0] - t0})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=seconds + 120)) as s:
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
    return out


def run_trace(kind: str, args, workdir: Path) -> tuple[list[dict], dict]:
    from eldr_sglang import experiment as X
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.testing.pd_cluster import start_cluster, start_router
    from eldr_sglang.traces import save_trace
    from eldr_sglang.traces.synth import generate

    trace = generate(model="gpt-oss-20b", requests=args.requests, seed=args.seed, domains=args.domains,
                     uniform=(kind == "uniform"), output_len=args.output_len, prompt_len=(64, 256))
    tpath, cpath = workdir / f"{kind}.npz", workdir / f"{kind}.eldr"
    save_trace(trace, tpath)
    fit_trace(trace, workers=args.decode, tau=0.1, seed=0).write(cpath)
    arms = args.arms.split(",")
    order = arms * args.blocks_per_arm
    random.Random(args.seed).shuffle(order)
    cluster, urls = start_cluster(tpath, workdir, prefill=args.prefill, decode=args.decode, time_scale=args.time_scale)
    counter = iter(range(10**9))
    records: list[dict] = []
    try:
        for b, arm in enumerate(order):
            policy = arm.split("/")[0]
            extra = ["--eldr-centroids", str(cpath)] if policy in ("eldr", "locality") else []
            if "/" in arm:
                extra += ["--eldr-load-factor", arm.split("/")[1]]
            router, base = start_router(urls, workdir, ["--disagg-router", policy, "--no-eldr-drift", *extra])
            try:
                got = asyncio.run(_drive(base, args.block_s, args.concurrency,
                                         lambda: next(counter) % trace.num_requests, args.output_len))
            finally:
                router.stop()
            for r in got:
                records.append({"block": b, "arm": arm, **r})
            print(f"{kind} block {b} {arm}: {len(got)} requests", flush=True)
    finally:
        cluster.stop()
    blocks, short = X.blocks_from_requests(records, args.warmup_s, min_requests=5)
    res = X.report(blocks, (arms[0], arms[1]))
    res["blocks_left_out"] = short
    return records, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="locality/0.05,round_robin", help="arm 1,arm 2 (default locality/0.05,round_robin)")
    ap.add_argument("--traces", default="locality,uniform", help="which traces: locality, uniform or both")
    ap.add_argument("--blocks-per-arm", type=int, default=6)
    ap.add_argument("--block-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--domains", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "switchback_emulated"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    import tempfile

    out = Path(args.out)
    results = {"arms": args.arms.split(","), "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for kind in args.traces.split(","):
            records, res = run_trace(kind, args, workdir)
            Path(f"{out}_{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            results[kind] = {k: res[k] for k in ("diff_p50", "ci_low", "ci_high", "blocks", "p50", "mean", "blocks_needed",
                                                  "per_block", "blocks_left_out")}
    Path(f"{out}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Switchback on emulated workers: {args.arms.replace(',', ' vs ')}", "",
             f"{args.blocks_per_arm} blocks per arm of {args.block_s:g} s, first {args.warmup_s:g} s of each dropped, "
             f"{args.concurrency} closed-loop streaming clients, {args.prefill} prefill + {args.decode} decode emulated "
             f"workers (time scale {args.time_scale:g}).", "",
             "| trace | blocks | TPOT p50 change | 95% CI | TPOT mean change | 95% CI |", "|---|---|---|---|---|---|"]
    for kind in args.traces.split(","):
        r = results[kind]
        lines.append(f"| {kind} | {r['blocks']} | {r['diff_p50']:+.2%} | {r['ci_low']:+.2%} .. {r['ci_high']:+.2%} | "
                     f"{r['mean']['diff']:+.2%} | {r['mean']['ci_low']:+.2%} .. {r['mean']['ci_high']:+.2%} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
