"""Latency the ELDR PD router adds per request, against a direct connection, on loopback.

Setup: emulated prefill and decode workers with (nearly) zero modelled time, so what is
measured is protocol and proxy cost, and the router (`--disagg-router eldr`, late binding).
Two clients send the same open-loop Poisson stream (default 500 req/s):

- direct: the client speaks the PD protocol itself (what the router does, minus the hop):
  POST the prefill (streamed), wait for its signature event, POST the decode with the same
  bootstrap room, read the answer;
- router: the client POSTs /generate to the router.

Phases alternate (direct, router, direct, ...) so drift in machine load hits both. Reported:
p50/p99/mean end-to-end latency of each, and the difference router - direct (the added
latency; target p99 <= 2 ms). Loopback only, bounded run.

    python benchmarks/bench_router_overhead.py [--rate 500] [--requests 3000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

import aiohttp

from eldr_sglang.testing import loadgen
from eldr_sglang.testing.pd_cluster import start_cluster, start_router


async def _phase(send, n: int, rate: float, rng: random.Random) -> list[float]:
    ph = await loadgen.run_phase(send, n, rate, rng)
    if ph.errors:
        raise RuntimeError(f"{ph.errors} of {ph.sent} requests failed; the first: {ph.first_error}")
    return ph.latencies_s


async def _run(args, urls, router, router_pid) -> dict:
    prefill, bport = urls["prefill"][0]
    decode = urls["decode"][0]
    rng = random.Random(args.seed)
    conn = aiohttp.TCPConnector(limit=0)
    res = {"direct": [], "router": []}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        warm = max(50, args.requests // 20)
        await _phase(lambda b: loadgen.direct_late(s, prefill, bport, decode, b), warm, args.rate, rng)
        await _phase(lambda b: loadgen.via_router(s, router, b), warm, args.rate, rng)
        per = args.requests // args.rounds
        cpu = 0.0
        for _ in range(args.rounds):
            res["direct"] += await _phase(lambda b: loadgen.direct_late(s, prefill, bport, decode, b), per, args.rate, rng)
            c0 = loadgen.cpu_seconds(router_pid)
            res["router"] += await _phase(lambda b: loadgen.via_router(s, router, b), per, args.rate, rng)
            cpu += loadgen.cpu_seconds(router_pid) - c0
    d, r = loadgen.latency_stats(res["direct"]), loadgen.latency_stats(res["router"])
    added = {k: r[k] - d[k] for k in ("p50_ms", "p99_ms", "mean_ms")}
    return {"rate_rps": args.rate, "requests_per_mode": per * args.rounds, "direct": d, "router": r, "added": added,
            "router_cpu_ms_per_request": 1e3 * cpu / (per * args.rounds),
            "target_p99_added_ms": 2.0, "meets_target": added["p99_ms"] <= 2.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=500.0, help="requests per second (open loop, Poisson); 0: sequential")
    ap.add_argument("--requests", type=int, default=3000, help="measured requests per mode")
    ap.add_argument("--rounds", type=int, default=5, help="alternating direct/router phases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = ap.parse_args(argv)
    if not 0 <= args.rate <= 5000 or not 0 < args.requests <= 100000:
        ap.error("--rate must lie in [0, 5000] and --requests in (0, 100000]")
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.traces.synth import generate
    from eldr_sglang.traces import save_trace

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trace = generate(model="gpt-oss-20b", requests=50, seed=1, prompt_len=(32, 64), output_len=8)
        save_trace(trace, tmp / "t.npz")
        fit_trace(trace, workers=1).write(tmp / "c.eldr")
        cluster, urls = start_cluster(tmp / "t.npz", tmp, prefill=1, decode=1, time_scale=1e-9)
        router_proc = None
        try:
            router_proc, router = start_router(urls, tmp, ["--disagg-router", "eldr", "--eldr-centroids", str(tmp / "c.eldr"),
                                                           "--load-monitor-interval", "1", "--log-level", "warning"])
            try:
                import uvloop

                uvloop.install()
            except ImportError:
                pass
            out = asyncio.run(_run(args, urls, router, router_proc.p.pid))
        finally:
            if router_proc:
                router_proc.stop()
            cluster.stop()
    mode = f"{out['rate_rps']:.0f} req/s open loop" if out["rate_rps"] > 0 else "sequential (one request at a time)"
    print(f"router overhead on loopback, {mode}, {out['requests_per_mode']} requests per mode")
    print(f"{'':8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for k in ("direct", "router", "added"):
        s = out[k]
        print(f"{k:8} {s['p50_ms']:8.3f} {s['p99_ms']:8.3f} {s['mean_ms']:8.3f}")
    print(f"router CPU per request: {out['router_cpu_ms_per_request']:.3f} ms (user+system, all its threads)")
    print(f"target: added p99 <= 2 ms -> {'met' if out['meets_target'] else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
