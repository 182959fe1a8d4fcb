"""SGLang's own benchmark client through the ELDR router in front of REAL SGLang on this CPU.

The sibling of serving_emulated.sh with real servers: a tiny Qwen3-MoE (seeded random
weights, eldr_sglang/testing/sglang_cpu) served by one patched prefill and two decode
servers of sglang 0.5.23 in PD mode (mooncake over TCP), started once; for each policy a
fresh router, then `python -m sglang.benchmark.serving --pd-separated` (a small run). The
centroids come from `eldr collect` on a non-PD server of the same model, then `eldr fit`.

What this shows: the real client, router and patched servers working together under load on
every policy, and the router's overhead on a two-core CPU. It does NOT show ELDR's decode
speed-up: a 1.5 MB model on a CPU has no expert-weight traffic to save, so throughput
differences between policies here are noise and queueing, not locality.

    python benchmarks/serving_cpu_sglang.py [--num-prompts 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from eldr_sglang.testing.sglang_cpu.cluster import wait_ready  # noqa: E402
from eldr_sglang.testing.sglang_cpu.harness import Harness  # noqa: E402

POLICIES = ["eldr", "random", "round_robin", "shortest_queue"]
RESULT_LINE = re.compile(r"^[A-Z][\w ()/]*:\s+[-\d.]+\s*$")  # "Mean TPOT (ms):   33.77"
KEYS = ["completed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
        "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--json", metavar="PATH", help="write the per-policy results as JSON")
    ap.add_argument("--keep", metavar="DIR", help="work directory (default: a temporary one, removed)")
    a = ap.parse_args()
    policies = a.policies.split(",")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.keep or tmp)
        h = Harness(work)
        rows: dict[str, dict] = {}
        t_start = time.monotonic()
        try:
            model = h.model("qwen3_moe")
            # centroids: a trace collected from a non-PD server of the same model
            ref = h.start("bench-reference", model, ["--enable-return-routed-experts"])
            wait_ready([ref], 900)
            data = work / "prompts.jsonl"
            topics = ["code", "math", "weather", "travel", "cooking", "music"]
            data.write_text("".join(json.dumps({"prompt": f"Question {i} about {topics[i % 6]}: tell me about {topics[i % 6]}.",
                                                "domain": topics[i % 6]}) + "\n" for i in range(48)))
            _run([sys.executable, "-m", "eldr_sglang", "collect", str(data), "--url", ref.url, "--out", str(work / "t.npz"),
                  "--num-hidden-layers", "2", "--top-k", "2", "--num-experts", "8", "--max-new-tokens", "4",
                  "--ignore-eos", "--no-progress"])
            h.stop([ref])
            _run([sys.executable, "-m", "eldr_sglang", "fit", str(work / "t.npz"), "--workers", "2", "--layers", "all",
                  "--out", str(work / "c.eldr"), "--quiet"])

            prefill, boot, decodes = h.start_pd(model, 2, prefill_extra=["--enable-eldr-signature",
                                                                         "--enable-eldr-late-binding"])
            wait_ready([prefill, *decodes], 900)
            startup = {s.name: round(s.ready_s or 0) for s in h.servers}
            for policy in policies:
                extra = ["--eldr-centroids", str(work / "c.eldr"), "--no-eldr-drift"] if policy == "eldr" else []
                router = h.start_router(f"router-{policy}", [(prefill.url, boot)], [d.url for d in decodes],
                                        ["--disagg-router", policy, *extra, "--request-timeout-secs", "600",
                                         "--eldr-signature-timeout-secs", "60", "--log-level", "warning"])
                try:
                    wait_ready([router], 120)
                    out = work / f"{policy}.jsonl"
                    log = _run([sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
                                "--base-url", router.url, "--pd-separated", "--model", str(model), "--tokenizer", str(model),
                                "--dataset-name", "random-ids", "--random-input-len", str(a.input_len),
                                "--random-output-len", str(a.output_len), "--random-range-ratio", "0.5",
                                "--num-prompts", str(a.num_prompts), "--request-rate", a.request_rate,
                                "--max-concurrency", str(a.max_concurrency), "--seed", "1", "--disable-tqdm",
                                "--warmup-requests", "1", "--flush-cache", "--output-file", str(out)], env=h.env)
                    res = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()][-1]
                    rows[policy] = {k: res.get(k) for k in KEYS}
                    rows[policy]["bench_lines"] = [ln.rstrip() for ln in log.splitlines() if RESULT_LINE.match(ln)]
                finally:
                    h.stop([router])
            peak = h.memory.peak / 2**30
        finally:
            h.close()

    print(f"{'policy':<16}{'done':>6}{'req/s':>8}{'out tok/s':>10}{'TTFT mean':>11}{'TPOT mean':>11}{'TPOT p99':>10}"
          f"{'ITL mean':>10}{'E2E mean':>10}")
    for p, r in rows.items():
        print(f"{p:<16}{r['completed']:>6}{r['request_throughput']:>8.2f}{r['output_throughput']:>10.1f}"
              f"{r['mean_ttft_ms']:>11.1f}{r['mean_tpot_ms']:>11.1f}{r['p99_tpot_ms']:>10.1f}{r['mean_itl_ms']:>10.1f}"
              f"{r['mean_e2e_latency_ms']:>10.1f}")
    base = rows.get("round_robin")
    if base and "eldr" in rows:
        print(f"eldr / round_robin: TPOT mean {rows['eldr']['mean_tpot_ms'] / base['mean_tpot_ms']:.2f}x, "
              f"out tok/s {rows['eldr']['output_throughput'] / base['output_throughput']:.2f}x "
              "(tiny CPU model: no locality to gain; see the docstring)")
    print(f"server start-up (s): {startup}; peak RSS sum of the servers {peak:.2f} GiB; "
          f"total {time.monotonic() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"config": vars(a), "startup_s": startup, "peak_rss_gib": peak,
                                            "policies": rows}, indent=2))
    return 0


def _run(cmd, env=None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout + p.stderr


if __name__ == "__main__":
    sys.exit(main())
