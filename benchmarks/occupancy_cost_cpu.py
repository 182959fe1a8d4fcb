"""What --enable-eldr-occupancy costs a decode step, on REAL SGLang 0.5.23 on this CPU.

Two servers of the tiny Qwen3-MoE (eldr_sglang/testing/sglang_cpu; 2 MoE layers x 8 experts,
top-2), the patched overlay, one with --enable-eldr-occupancy and one without, both writing
the CPU shim's MoE step log (eldr_sglang/testing/sglang_cpu/step_log.py). They are plain
(non-PD) servers: a decode step is the same forward on a PD decode server, and a prefill with
mooncake would only add noise. Rounds alternate between them (one server decodes at a time):
each round sends the same `--requests` concurrent greedy requests of `--max-new` tokens.

A decode step's time is the interval between the starts of two consecutive decode forwards
of the same batch (the step log's first-MoE-layer timestamps): the whole step, scheduler
included, so it covers the EMA ops in every MoE layer, the per-forward hook and the report
written at each load-snapshot publish. Reported: the median over all such intervals, per
server, their ratio on/off, and the ratio per round (each round's on median over the off
median of the same round: back to back, so slow drift of the shared machine cancels). The tiny model's step is mostly Python overhead; the EMA's few
small tensor ops per layer are a larger share of it than of a real model's step. On two shared
cores the step-to-step noise is larger than the cost, so the script also times the hooks
themselves in process (begin_step + one capture per MoE layer, the same shape) and gives that
as a share of the off server's median step.

    python benchmarks/occupancy_cost_cpu.py [--rounds 40] [--requests 4] [--max-new 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eldr_sglang.testing.pd_cluster import get_json, post  # noqa: E402
from eldr_sglang.testing.sglang_cpu.cluster import wait_ready  # noqa: E402
from eldr_sglang.testing.sglang_cpu.harness import Harness  # noqa: E402
from eldr_sglang.testing.sglang_cpu.step_log import read_steps  # noqa: E402

LAYERS = 2  # the tiny Qwen3-MoE
MAX_GAP_S = 2.0  # two decode forwards further apart than this belong to different rounds


def _round(url: str, requests: int, max_new: int, tag: int) -> None:
    def one(i: int) -> None:
        body = {"text": f"Round {tag} request {i}: the experts of a mixture route tokens to",
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
        status, _, out = post(url + "/generate", body, timeout=600)
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {out[:300]!r}")

    with cf.ThreadPoolExecutor(requests) as ex:
        list(ex.map(one, range(requests)))


def step_intervals_ms(log: Path, batch: int) -> list[list[float]]:
    """Intervals between consecutive decode forwards of `batch` rows, in ms, one list per round
    (a round's decode steps run back to back; another forward or a pause ends it)."""
    steps = read_steps(log, LAYERS)
    rounds, cur = [], []
    for a, b in zip(steps, steps[1:]):
        if a.tokens == b.tokens == batch and 0 < b.t0 - a.t0 < MAX_GAP_S:
            cur.append((b.t0 - a.t0) * 1e3)
        elif cur:
            rounds.append(cur)
            cur = []
    return rounds + ([cur] if cur else [])


def paired_ratios(off: list[list[float]], on: list[list[float]]) -> list[float]:
    """Per round, the on server's median step over the off server's (the two ran back to back)."""
    return [statistics.median(b) / statistics.median(a) for a, b in zip(off, on) if a and b]


def ema_ops_us(batch: int, reps: int = 2000) -> float:
    """The occupancy hooks' own CPU time per decode step for this model's shape, in process:
    begin_step plus one capture per MoE layer (median of 5 timed runs of `reps` steps)."""
    import torch

    from eldr_sglang.sglang_ext.occupancy import IdleEMA

    torch.set_num_threads(1)  # as the servers (OMP_NUM_THREADS=1)
    acc = IdleEMA(num_hidden_layers=LAYERS, moe_layers=list(range(LAYERS)), num_experts=8, max_rows=8192)
    ids = torch.randint(0, 8, (batch, 2), dtype=torch.int32)
    runs = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(reps):
            acc.begin_step(True, batch)
            for layer in range(LAYERS):
                acc.capture(layer, ids)
        runs.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(runs[1:])  # the first run warms up


def _summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10) if len(ms) >= 10 else [float("nan")] * 9
    return {"steps": len(ms), "median_ms": round(statistics.median(ms), 3), "p10_ms": round(q[0], 3),
            "p90_ms": round(q[8], 3)}


def run(a, work: Path) -> dict:
    ops_us = ema_ops_us(a.requests)
    h = Harness(work)
    try:
        model = h.model("qwen3_moe")
        servers = {name: h.start(f"occ-{name}", model, ["--random-seed", "0", *extra], env=h.step_log_env(f"occ-{name}"))
                   for name, extra in (("off", []), ("on", ["--enable-eldr-occupancy"]))}
        wait_ready(list(servers.values()), 900)
        probe = get_json(servers["on"].url + "/v1/loads?include=core,eldr", timeout=30)
        if "eldr_occupancy" not in probe:
            raise RuntimeError(f"the --enable-eldr-occupancy server does not report occupancy: {probe}")
        t0 = time.monotonic()
        for r in range(a.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                _round(servers[name].url, a.requests, a.max_new, r)
        seconds = time.monotonic() - t0
        per_round = {name: step_intervals_ms(h.step_log(f"occ-{name}"), a.requests) for name in servers}
    finally:
        h.close()
    rows = {name: _summary([x for r in rounds for x in r]) for name, rounds in per_round.items()}
    ratio = rows["on"]["median_ms"] / rows["off"]["median_ms"]
    pairs = paired_ratios(per_round["off"], per_round["on"])
    if len(per_round["off"]) != a.rounds or len(per_round["on"]) != a.rounds:
        raise RuntimeError(f"expected {a.rounds} rounds of decode steps per server, found "
                           f"{len(per_round['off'])} and {len(per_round['on'])}")
    q = statistics.quantiles(pairs, n=4) if len(pairs) >= 4 else [float("nan")] * 3
    return {"machine": f"{os.cpu_count()} cores shared with other work (nice'd runs)", "model": "tiny Qwen3-MoE, "
            "2 MoE layers x 8 experts, top-2", "rounds": a.rounds, "requests": a.requests, "max_new": a.max_new,
            "off": rows["off"], "on": rows["on"], "ratio_on_off": round(ratio, 4),
            "cost_pct": round((ratio - 1) * 100, 2), "paired_ratio_median": round(statistics.median(pairs), 4),
            "paired_ratio_p25": round(q[0], 4), "paired_ratio_p75": round(q[2], 4), "ema_ops_us_per_step": round(ops_us, 1),
            "ema_ops_pct_of_off_median": round(ops_us / 1e3 / rows["off"]["median_ms"] * 100, 2),
            "seconds": round(seconds, 1)}


def table(res: dict) -> str:
    lines = [f"decode step time, {res['model']}, {res['machine']}",
             f"{res['rounds']} alternating rounds of {res['requests']} requests x {res['max_new']} tokens", "",
             f"{'occupancy':<10} {'steps':>6} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8}"]
    for name in ("off", "on"):
        r = res[name]
        lines.append(f"{name:<10} {r['steps']:>6} {r['median_ms']:>10.3f} {r['p10_ms']:>8.3f} {r['p90_ms']:>8.3f}")
    lines.append(f"ratio on/off of the medians: {res['ratio_on_off']:.4f} ({res['cost_pct']:+.2f} %)")
    lines.append(f"per round (back-to-back pairs), ratio on/off: median {res['paired_ratio_median']:.4f}, "
                 f"p25 {res['paired_ratio_p25']:.4f}, p75 {res['paired_ratio_p75']:.4f}")
    lines.append(f"the hooks' own CPU time (in process, same shape): {res['ema_ops_us_per_step']:.1f} us per decode "
                 f"step = {res['ema_ops_pct_of_off_median']:.2f} % of the off median step")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="alternating rounds (each: one round per server)")
    ap.add_argument("--requests", type=int, default=4, help="concurrent requests per round (the decode batch)")
    ap.add_argument("--max-new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    ap.add_argument("--keep", metavar="DIR", help="work directory (default: a temporary one, removed)")
    a = ap.parse_args()
    if a.rounds < 1 or a.requests < 1 or a.max_new < 2:
        print("error: --rounds and --requests must be >= 1 and --max-new >= 2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        try:
            res = run(a, Path(a.keep or tmp))
        except Exception as exc:  # a server that did not start, a failed request: one line
            print(f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
            return 1
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
