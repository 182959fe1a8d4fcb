"""Load test of the PD router on loopback: an open-loop Poisson stream through the router to
emulated workers, then an audit: nothing lost, nothing duplicated, no queue slot left held.

Setup: `python -m eldr_sglang.emulate cluster` (2 prefill, 4 decode, modelled times scaled
down by --time-scale) and the router (`--disagg-router eldr`, late binding, bounded loads).
Each request has its own text, and its answer carries the decode worker's id for the
bootstrap room the router chose, so a lost or duplicated request shows up in the audit.

Reported: requests sent / answered / failed / lost / duplicated, the send rate achieved,
end-to-end latency p50/p99 (of the answered-200 and, apart, of those the admission control
refused), the router's own decision time (its route-seconds histogram), router CPU per
request, the queue slots and admission slots held once idle, the router's admission counters
(admitted / queued / rejected) and its failure counters, and the first message of each kind
of client-side error. Loopback only, bounded in count and time.

    python benchmarks/load_test.py [--rate 1000] [--requests 20000] [--json out.json]
        [--router-arg=--max-concurrent-requests=64 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import aiohttp

from eldr_sglang.testing.pd_cluster import get_json, start_cluster, start_router


def _cpu_s(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _histogram_quantiles(text: str, name: str, qs=(0.5, 0.99)) -> dict:
    """Quantiles (upper bucket bounds) of a Prometheus histogram from its text exposition."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return {}
    total = buckets[-1][1]
    return {f"p{int(q * 100)}_le_ms": next(b * 1e3 for b, c in buckets if c >= q * total) for q in qs}


async def _drive(router: str, n: int, rate: float, seed: int, timeout_s: float, connections: int) -> dict:
    rng = random.Random(seed)
    lat: list[float] = []
    lat_refused: list[float] = []
    outcome: dict[int, tuple[int, str | None]] = {}
    errors: dict[str, int] = {}
    first_error: dict[str, str] = {}

    client_wait: list[float] = []  # time a request waited in the client for a connection

    async def one(s, i):
        body = {"text": f"load {i}", "sampling_params": {"max_new_tokens": rng.randint(1, 4)},
                "emulator": {"trace_request": i % 150}}
        t0 = time.perf_counter()
        wait = [0.0]
        try:
            async with s.post(router + "/generate", json=body, trace_request_ctx={"wait": wait}) as r:
                data = await r.read()
                client_wait.append(wait[0])
                if r.status == 200:
                    rid = json.loads(data)["meta_info"]["id"]
                    lat.append(time.perf_counter() - t0)
                    outcome[i] = (200, rid)
                else:
                    outcome[i] = (r.status, None)
                    errors[f"http_{r.status}"] = errors.get(f"http_{r.status}", 0) + 1
                    first_error.setdefault(f"http_{r.status}", data[:200].decode(errors="replace"))
                    if r.status in (429, 503) and b'"overloaded"' in data:
                        lat_refused.append(time.perf_counter() - t0)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            first_error.setdefault(type(exc).__name__, f"{exc}"[:200])

    # At most `connections` open at once (0: no bound). An unbounded client on a starved CPU
    # opens connections faster than it writes on them: the router closes those that send no
    # request head within its header timeout, and the client reports 'Server disconnected'.
    # A request waiting for a connection counts that wait in its latency (the schedule stays
    # open-loop).
    conn = aiohttp.TCPConnector(limit=connections)
    tracing = aiohttp.TraceConfig()

    async def queued_start(_s, ctx, _p):
        ctx.t_queued = time.perf_counter()

    async def queued_end(_s, ctx, _p):
        ctx.trace_request_ctx["wait"][0] += time.perf_counter() - ctx.t_queued

    tracing.on_connection_queued_start.append(queued_start)
    tracing.on_connection_queued_end.append(queued_end)
    t_start = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     trace_configs=[tracing]) as s:
        tasks = []
        t_next = t_start
        for i in range(n):
            t_next += rng.expovariate(rate)
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(s, i)))
        sent_s = time.perf_counter() - t_start
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s + 30)
    rids = [rid for st, rid in outcome.values() if st == 200]
    a = np.asarray(lat) * 1e3
    b = np.asarray(lat_refused) * 1e3
    w = np.asarray(client_wait) * 1e3
    return {
        "sent": n, "answered": len(outcome), "ok": len(rids), "failed": len(outcome) - len(rids),
        "lost": n - len(outcome) - sum(v for k, v in errors.items() if not k.startswith("http_")),
        "transport_errors": {k: v for k, v in errors.items() if not k.startswith("http_")},
        "http_errors": {k: v for k, v in errors.items() if k.startswith("http_")},
        "duplicated_answers": len(rids) - len(set(rids)),
        "target_rate_rps": rate, "achieved_send_rate_rps": n / sent_s, "wall_s": time.perf_counter() - t_start,
        "latency_ms": {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())} if a.size else {},
        "refused_latency_ms": {"n": int(b.size), "p50": float(np.percentile(b, 50)), "p99": float(np.percentile(b, 99))} if b.size else {},
        "first_error": first_error,
        # included in the latencies above: the wait for a client connection (--client-connections)
        "client_connection_wait_ms": {"p50": float(np.percentile(w, 50)), "p99": float(np.percentile(w, 99)),
                                      "share_waited": float((w > 0).mean())} if w.size else {},
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="requests per second (open loop, Poisson)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--time-scale", type=float, default=0.01, help="emulated worker time scale")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request client timeout, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--client-connections", type=int, default=1000,
                    help="most connections the client opens at once (default 1000: a second's worth at 1000/s; 0: no bound, "
                    "the old client)")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="an extra router flag, e.g. --router-arg=--max-concurrent-requests=64 (repeatable)")
    return ap


def main(argv=None) -> int:
    import os

    ap = _parser()
    args = ap.parse_args(argv)
    if args.requests < 1 or args.rate <= 0:
        ap.error("--requests and --rate must be positive")
    if args.client_connections < 0:
        ap.error("--client-connections must be >= 0")
    load_before, res = _run(args)
    res["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "load_avg_before": list(load_before),
                      "load_avg_after": list(os.getloadavg()),
                      "note": "client, router and emulated workers share these CPUs (and this machine with other work)"}
    res["router_args"] = args.router_arg
    res["client_connections"] = args.client_connections
    held = _print_report(args, res, load_before)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if (res["lost"] == 0 and res["duplicated_answers"] == 0 and held == 0) else 1


def _run(args) -> tuple[tuple, dict]:
    """Start the emulated cluster and the router on loopback, drive the load through them and
    audit the router once idle. Returns (the load average before, the results)."""
    import os
    import resource

    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.traces.synth import generate
    from eldr_sglang.traces import save_trace

    with tempfile.TemporaryDirectory(prefix="eldr-load-") as tmp:
        tmp = Path(tmp)
        trace = generate(model="gpt-oss-20b", requests=150, seed=1, prompt_len=(16, 48), output_len=8)
        save_trace(trace, tmp / "t.npz")
        fit_trace(trace, workers=4, seed=0).write(tmp / "c.eldr")
        cluster, urls = start_cluster(tmp / "t.npz", tmp, time_scale=args.time_scale)
        router, base = start_router(urls, tmp, ["--disagg-router", "eldr", "--eldr-centroids", str(tmp / "c.eldr"),
                                                "--no-explain-headers", "--log-level", "warning", *args.router_arg])
        load_before = os.getloadavg()
        try:
            c0, w0 = _cpu_s(router.p.pid), _cpu_s(cluster.p.pid)
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            res = asyncio.run(_drive(base, args.requests, args.rate, args.seed, args.timeout, args.client_connections))
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = _cpu_s(router.p.pid) - c0
            # where the CPU went: the client (this process) and the emulated workers share it
            res["cpu_s"] = {"router": cpu, "workers": _cpu_s(cluster.p.pid) - w0,
                            "client": (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)}
            res.update(_idle_audit(base, cpu, args.requests))
        finally:
            router.stop()
            cluster.stop()
    return load_before, res


def _idle_audit(base: str, router_cpu_s: float, requests: int) -> dict:
    """Once the router is idle (30 s at most): its decision times, CPU per request, the slots
    still held, its admission settings and failure counters, and who is routable."""
    import urllib.request

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = get_json(base + "/eldr/status")
        adm = st.get("admission") or {}
        if not any(st["decode_inflight"]) and not any(st["prefill_inflight"]) and not adm.get("in_flight") \
                and not adm.get("waiting"):
            break
        time.sleep(0.2)
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {
        "router_decision_time": _histogram_quantiles(text, "eldr_router_route_seconds"),
        "router_cpu_ms_per_request": 1e3 * router_cpu_s / requests,
        "slots_held_when_idle": {"decode": st["decode_inflight"], "prefill": st["prefill_inflight"],
                                 "admission": adm.get("in_flight", 0), "admission_queue": adm.get("waiting", 0)},
        "admission": {k: adm.get(k) for k in ("limit", "queue_size", "queue_timeout_s")} if adm else None,
        "router_failure_counters": _failure_counters(text),
        "routable_when_idle": {"decode": st["decode_healthy"], "prefill": st["prefill_healthy"]},
    }


def _print_report(args, res: dict, load_before) -> int:
    """Print the results' table and notes; returns the slots held once idle (0 when clean)."""
    import os

    lat = res["latency_ms"]
    print(f"load test: {res['sent']} requests at {args.rate:g}/s target ({res['achieved_send_rate_rps']:.0f}/s sent), "
          f"wall {res['wall_s']:.1f} s, {os.cpu_count()} CPUs shared by client, router and workers")
    print(f"{'answered':>10}{'ok':>8}{'failed':>8}{'lost':>6}{'dup':>5}{'lat p50 ms':>12}{'lat p99 ms':>12}"
          f"{'route p50<=':>13}{'route p99<=':>13}{'router CPU ms/req':>19}{'slots held':>12}")
    rd = res["router_decision_time"]
    sh = res["slots_held_when_idle"]
    held = sum(sh["decode"]) + sum(sh["prefill"]) + sh["admission"] + sh["admission_queue"]
    print(f"{res['answered']:>10}{res['ok']:>8}{res['failed']:>8}{res['lost']:>6}{res['duplicated_answers']:>5}"
          f"{lat.get('p50', float('nan')):>12.1f}{lat.get('p99', float('nan')):>12.1f}"
          f"{rd.get('p50_le_ms', float('nan')):>13.3f}{rd.get('p99_le_ms', float('nan')):>13.3f}"
          f"{res['router_cpu_ms_per_request']:>19.2f}{held:>12d}")
    cs = res["cpu_s"]
    print(f"CPU seconds during the run: router {cs['router']:.1f}, emulated workers {cs['workers']:.1f}, "
          f"client {cs['client']:.1f} (wall {res['wall_s']:.1f} s, {os.cpu_count()} CPUs)")
    if res["client_connection_wait_ms"]:
        cw = res["client_connection_wait_ms"]
        print(f"of which waiting for a client connection (--client-connections {args.client_connections}): "
              f"p50 {cw['p50']:.1f} ms, p99 {cw['p99']:.1f} ms, {100 * cw['share_waited']:.0f}% of requests waited")
    if res["refused_latency_ms"]:
        rl = res["refused_latency_ms"]
        print(f"refused by admission control: {rl['n']} (answer latency p50 {rl['p50']:.1f} ms, p99 {rl['p99']:.1f} ms)")
    if res["transport_errors"] or res["http_errors"]:
        print(f"errors: {res['transport_errors']} {res['http_errors']}")
        for kind, msg in res["first_error"].items():
            print(f"  first {kind}: {msg}")
    print(f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{' '.join(f'{x:.2f}' for x in res['machine']['load_avg_after'])}; routable when idle: {res['routable_when_idle']}")
    for name, value in res["router_failure_counters"].items():  # why the router failed requests
        print(f"  {name} {value:g}")
    return held


# The router's own account of failures: worker errors, retries, ejections and timeouts.
_FAILURE_METRICS = ("eldr_router_worker_errors_total", "eldr_router_retries_total", "eldr_router_retries_refused_total",
                    "eldr_router_ejections_total", "eldr_router_upstream_timeouts_total", "eldr_router_admission_",
                    "eldr_router_panic_routes_total", "eldr_router_overload_timeouts_total",
                    "eldr_router_client_disconnects_total", "eldr_router_requests_total",
                    "eldr_router_client_connection_errors_total")


def _failure_counters(metrics_text: str) -> dict:
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(_FAILURE_METRICS):
            name, _, value = line.rpartition(" ")
            if float(value) > 0:
                out[name] = float(value)
    return out


if __name__ == "__main__":
    sys.exit(main())
