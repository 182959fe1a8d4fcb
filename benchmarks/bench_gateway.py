"""Our PD router against the SGLang gateway (sglang-router==0.3.2), side by side in one run.

Every router fronts the same emulated workers (2 prefill, 4 decode, modelled time ~0, one
process), so what differs is the router. Measured for each, in interleaved repeats (each repeat
runs every level for every router, in an order rotated per repeat, so drifting machine load
hits all of them alike):

- the latency it adds over a client speaking the PD protocol itself (sequential requests;
  against the direct client with the same flow: early binding for the gateway and our
  balancers, late binding for eldr and locality);
- its CPU per request: user + system time of the router's process tree from /proc during its
  own phases, divided by the requests sent (the headline is the median over repeats at
  --cpu-rate);
- the highest offered rate it holds on a ladder of open-loop Poisson rates (sequential, then
  100 req/s steps up to 800, then 1000, 1200, 1500, 2000): no errors and p99 < 50 ms in a
  majority of the repeats, and every lower level held too. Within a repeat a router that failed
  a level is not run at the higher ones, except at --cpu-rate, which every router runs in every
  repeat. The table also gives, per level, in how many repeats each router held it.

On a small machine the router, the emulated workers and the load client compete for the same
cores, and a held rate then measures the scheduler more than the router. So by default (with
2 or more CPUs) every router alike runs pinned to the last CPU, and the harness (this client
and the emulated workers) to the others (--router-cpus); the emulated workers hand the KV over
in-process (`emulate cluster --kv-in-process`) instead of one more HTTP exchange per request.
The harness's own CPU per request (client + workers, from /proc) is reported for every router:
where rate x harness CPU per request nears the harness's CPUs, the level measures the harness,
not the router, and the direct clients (no router at all) show that ceiling.

The gateway is installed from PyPI into a private virtualenv under --cache-dir (reused when it
is there). It tries to download a tokenizer from the Hugging Face hub at start-up and ignores
HF_HUB_OFFLINE, so it runs with HTTP(S)_PROXY pointing at a closed loopback port (its
refused attempts are counted in the JSON) and its metrics bound to 127.0.0.1: all traffic stays
on loopback. Our router runs its one data plane (the Rust request path); results from before
the Python data plane was retired hold a column per plane (benchmarks/results/bench_gateway.md).

    nice -n 10 python benchmarks/bench_gateway.py --json benchmarks/results/bench_gateway.json
    python benchmarks/bench_gateway.py --quick --no-gateway   # a fast check of our router only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from eldr_sglang.testing import loadgen
from eldr_sglang.testing.pd_cluster import Proc, free_port, make_trace_files, start_cluster, start_router

GATEWAY_PACKAGE = "sglang-router"
GATEWAY_VERSION = "0.3.2"
LEVELS = (0, 100, 200, 300, 400, 500, 600, 700, 800, 1000, 1200, 1500, 2000)  # req/s; 0 = sequential
P99_LIMIT_MS = 50.0
OUR_POLICIES = ("random", "eldr", "locality")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eldr-bench"


class GatewayUnavailable(RuntimeError):
    """sglang-router could not be installed or started here; the message says why."""


# ----------------------------------------------------------------------------- the gateway


def ensure_gateway(cache_dir: Path) -> Path:
    """The python of a private virtualenv holding sglang-router==0.3.2 (created on first use)."""
    venv = cache_dir / f"{GATEWAY_PACKAGE}-{GATEWAY_VERSION}"
    py = venv / "bin" / "python"
    probe = f"import importlib.metadata as m, sglang_router; assert m.version('{GATEWAY_PACKAGE}') == '{GATEWAY_VERSION}'"
    if py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True, timeout=120).returncode == 0:
        return py
    print(f"installing {GATEWAY_PACKAGE}=={GATEWAY_VERSION} into {venv} (once) ...", flush=True)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(py), "-m", "pip", "install", "-q", f"{GATEWAY_PACKAGE}=={GATEWAY_VERSION}"]]
    for cmd in steps:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GatewayUnavailable(f"{' '.join(cmd)} failed: {exc}") from None
        if r.returncode != 0:
            raise GatewayUnavailable(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
    if subprocess.run([str(py), "-c", probe], capture_output=True, timeout=120).returncode != 0:
        raise GatewayUnavailable(f"{GATEWAY_PACKAGE}=={GATEWAY_VERSION} installed into {venv} but does not import")
    return py


def _closed_port() -> socket.socket:
    """A loopback port that refuses connections (bound, never listening), held for the run."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def start_gateway(py: Path, urls: dict, tmp: Path, proxy_port: int, cpus: set[int] | None = None) -> tuple[Proc, str]:
    port, metrics_port = free_port(), free_port()
    cmd = ["-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "random", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--log-level", "warn"]
    for url, bport in urls["prefill"]:
        cmd += ["--prefill", url, str(bport)]
    for url in urls["decode"]:
        cmd += ["--decode", url]
    proxy = f"http://127.0.0.1:{proxy_port}"
    env = {"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy, "ALL_PROXY": proxy,
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1"}
    proc = Proc(cmd, tmp / f"gateway-{port}.log", python=str(py), env=env, cpus=cpus)
    return proc, f"http://127.0.0.1:{port}"


def hub_attempts(log: Path) -> int:
    """How many tokenizer downloads the gateway tried (each refused by the closed proxy port)."""
    try:
        return log.read_text(errors="replace").count("Failed to download tokenizer")
    except OSError:
        return 0


# ----------------------------------------------------------------------------- our router


# ----------------------------------------------------------------------------- targets


@dataclass
class Target:
    name: str
    kind: str  # 'direct' | 'gateway' | 'ours'
    flow: str  # 'early' | 'late'
    policy: str | None = None
    proc: Proc | None = None
    url: str | None = None
    phases: dict = field(default_factory=dict)  # level -> [per-repeat stats]

    @property
    def pid(self) -> int | None:
        return self.proc.p.pid if self.proc is not None else None


def build_targets(gateway: bool, policies=OUR_POLICIES) -> list[Target]:
    t = [Target("direct (early bind)", "direct", "early"), Target("direct (late bind)", "direct", "late")]
    if gateway:
        t.append(Target(f"gateway {GATEWAY_VERSION} random", "gateway", "early", policy="random"))
    for pol in policies:
        t.append(Target(f"ours {pol}", "ours", "late" if pol in ("eldr", "locality") else "early", policy=pol))
    return t


def our_args(t: Target, centroids: Path) -> list[str]:
    args = ["--disagg-router", t.policy, "--prefill-policy", "random", "--log-level", "warning"]
    if t.policy in ("eldr", "locality"):
        args += ["--eldr-centroids", str(centroids)]
    return args


def wait_serving(url: str, proc: Proc, timeout: float = 90.0) -> None:
    """Until a /generate through the router succeeds (the gateway registers its workers after it
    starts answering /health)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            break
        req = urllib.request.Request(url + "/generate", data=b'{"text": "ready?", "sampling_params": {"max_new_tokens": 1}}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not serve a request ({last}):\n{proc.tail()}")


def sender(t: Target, s: aiohttp.ClientSession, urls: dict, rng: random.Random):
    if t.kind != "direct":
        return lambda body: loadgen.via_router(s, t.url, body)
    fn = loadgen.direct_early if t.flow == "early" else loadgen.direct_late

    def send(body):  # a random prefill and decode, as the routers' random policies pick
        prefill, bport = rng.choice(urls["prefill"])
        return fn(s, prefill, bport, rng.choice(urls["decode"]), body)

    return send


def phase_ok(st: dict) -> bool:
    return st["errors"] == 0 and st["p99_ms"] is not None and st["p99_ms"] < P99_LIMIT_MS and (
        st["rate_rps"] == 0 or st["achieved_rate_rps"] >= 0.9 * st["rate_rps"])


def split_cpus(spec: str) -> tuple[set[int] | None, set[int] | None]:
    """(router CPUs, harness CPUs) for --router-cpus: 'auto' pins the routers to the last CPU this
    process may use and the harness to the rest (no pinning with fewer than 2); 'off': none; else
    a comma-separated list for the routers, the rest for the harness."""
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "off" or (spec == "auto" and len(allowed) < 2):
        return None, None
    router = {allowed[-1]} if spec == "auto" else {int(x) for x in spec.split(",")}
    harness = set(allowed) - router
    if not router <= set(allowed) or not harness:
        raise ValueError(f"--router-cpus {spec}: must be a proper subset of this process's CPUs {allowed}")
    return router, harness


async def sweep(targets: list[Target], urls: dict, args, harness_pid: int) -> list[float]:
    """Every repeat: every level, every target (order rotated per repeat). Returns the 1-min load
    average sampled after each phase."""
    rng = random.Random(args.seed)
    load = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
        for t in targets:  # warm-up: connections, caches, the first reload
            await loadgen.run_phase(sender(t, s, urls, rng), args.warmup, 100.0, rng)
        for rep in range(args.repeats):
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            failed: set[str] = set()
            for level in args.levels:
                for t in order:
                    if t.name in failed and level > args.cpu_rate:  # the CPU level always runs
                        t.phases.setdefault(level, []).append({"skipped": "failed a lower level in this repeat"})
                        continue
                    n = args.sequential_requests if level == 0 else max(20, int(level * args.phase_secs))
                    c0 = loadgen.cpu_seconds(t.pid) if t.pid else None
                    h0 = loadgen.cpu_seconds(harness_pid) + time.process_time()
                    ph = await loadgen.run_phase(sender(t, s, urls, rng), n, float(level), rng,
                                                 request_timeout_s=args.request_timeout, phase_timeout_s=args.phase_timeout)
                    h1 = loadgen.cpu_seconds(harness_pid) + time.process_time()
                    st = ph.stats()
                    st["harness_cpu_ms_per_request"] = 1e3 * (h1 - h0) / max(1, ph.sent)
                    st["latencies_ms"] = [x * 1e3 for x in ph.latencies_s] if level == 0 else None
                    if c0 is not None:
                        st["cpu_ms_per_request"] = 1e3 * (loadgen.cpu_seconds(t.pid) - c0) / max(1, ph.sent)
                    st["held"] = phase_ok(st)
                    t.phases.setdefault(level, []).append(st)
                    if not st["held"]:
                        failed.add(t.name)
                    load.append(os.getloadavg()[0])
                    await asyncio.sleep(args.pause)  # let the previous phase's stragglers settle
            print(f"repeat {rep + 1}/{args.repeats} done (load average {os.getloadavg()[0]:.2f})", flush=True)
    return load


# ----------------------------------------------------------------------------- summary


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(t: Target, direct: dict[str, Target], levels, cpu_rate: float) -> dict:
    seq = [x for x in t.phases.get(0, []) if "latencies_ms" in x]
    pooled = loadgen.latency_stats([v / 1e3 for x in seq for v in (x["latencies_ms"] or [])])
    out = {"kind": t.kind, "flow": t.flow, "policy": t.policy, "sequential": pooled}
    if t.kind != "direct":
        base = summarize_seq(direct[t.flow])
        out["added_p50_ms"] = pooled["p50_ms"] - base["p50_ms"] if pooled["n"] and base["n"] else None
        out["added_p99_ms"] = pooled["p99_ms"] - base["p99_ms"] if pooled["n"] and base["n"] else None
        out["cpu_ms_per_request_by_rate"] = {
            str(lv): _median([x.get("cpu_ms_per_request") for x in t.phases.get(lv, []) if "skipped" not in x])
            for lv in levels}
        out["cpu_ms_per_request"] = out["cpu_ms_per_request_by_rate"].get(str(int(cpu_rate)))
        out["cpu_cap_rps"] = 1e3 / out["cpu_ms_per_request"] if out["cpu_ms_per_request"] else None
    out["harness_cpu_ms_per_request_by_rate"] = {
        str(lv): _median([x.get("harness_cpu_ms_per_request") for x in t.phases.get(lv, []) if "skipped" not in x])
        for lv in levels}
    out["held_repeats_by_rate"] = {str(lv): [sum(bool(x.get("held")) for x in t.phases.get(lv, [])),
                                             len(t.phases.get(lv, []))] for lv in levels}
    held = None
    for lv in levels:
        runs = t.phases.get(lv, [])
        if not runs or 2 * sum(bool(x.get("held")) for x in runs) <= len(runs):
            break
        held = lv
    out["held_rate_rps"] = held  # None: not even sequential; 0: sequential only
    out["phases"] = {str(lv): [{k: v for k, v in x.items() if k != "latencies_ms"} for x in t.phases.get(lv, [])]
                     for lv in levels}
    return out


def summarize_seq(t: Target) -> dict:
    return loadgen.latency_stats([v / 1e3 for x in t.phases.get(0, []) if "latencies_ms" in x
                                  for v in (x["latencies_ms"] or [])])


def ratio(a, b):
    return a / b if a is not None and b else None


def cpu_ratios(res: dict) -> dict:
    """Our eldr router's CPU per request over the gateway's (random), and over our own random."""
    tg = res["targets"]
    gw = next((v for v in tg.values() if v["kind"] == "gateway"), None)
    ours = {v["policy"]: v for v in tg.values() if v["kind"] == "ours"}
    eldr = ours.get("eldr", {}).get("cpu_ms_per_request")
    return {
        "cpu_ratio_eldr_vs_gateway": ratio(eldr, gw and gw["cpu_ms_per_request"]),
        "cpu_ratio_eldr_vs_our_random": ratio(eldr, ours.get("random", {}).get("cpu_ms_per_request")),
    }


def held_goal(res: dict) -> dict:
    """The issue's second goal: our eldr router holds at least the gateway's highest rate."""
    tg = res["targets"]
    gw = next((v for v in tg.values() if v["kind"] == "gateway"), None)
    eldr = next((v for v in tg.values() if v["kind"] == "ours" and v["policy"] == "eldr"), None)
    if gw is None or eldr is None:
        return {"held_rate_eldr_rps": eldr and eldr["held_rate_rps"], "held_rate_gateway_rps": None,
                "eldr_holds_gateway_rate": None}
    e, g = eldr["held_rate_rps"], gw["held_rate_rps"]
    return {"held_rate_eldr_rps": e, "held_rate_gateway_rps": g,
            "eldr_holds_gateway_rate": g is None or (e is not None and e >= g)}


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def table(res: dict) -> str:
    cpu_rate = res["config"]["cpu_rate_rps"]
    lines = [
        f"router vs a direct client on loopback, emulated workers 2P+4D, {res['config']['repeats']} interleaved repeats; "
        f"load average {res['machine']['loadavg_min']:.2f}-{res['machine']['loadavg_max']:.2f} "
        f"(median {res['machine']['loadavg_median']:.2f}) on {res['machine']['cpus']} CPUs; {res['config']['pinning']}",
        f"{'router':28} {'flow':5} {'seq p50':>8} {'seq p99':>8} {'+p50':>7} {'+p99':>7} "
        f"{'CPU ms/req':>10} {'@seq':>6} {'harness':>7} {'held req/s':>10} {'CPU cap':>8}",
    ]
    for name, v in res["targets"].items():
        s = v["sequential"]
        held = v["held_rate_rps"]
        held_s = "none" if held is None else ("seq" if held == 0 else str(held))
        cpu_seq = v.get("cpu_ms_per_request_by_rate", {}).get("0")
        harness = v.get("harness_cpu_ms_per_request_by_rate", {}).get(str(int(cpu_rate)))
        lines.append(f"{name:28} {v['flow']:5} {_f(s['p50_ms']):>8} {_f(s['p99_ms']):>8} {_f(v.get('added_p50_ms')):>7} "
                     f"{_f(v.get('added_p99_ms')):>7} {_f(v.get('cpu_ms_per_request')):>10} {_f(cpu_seq):>6} "
                     f"{_f(harness):>7} {held_s:>10} {_f(v.get('cpu_cap_rps'), '{:.0f}'):>8}")
    lines.append(f"ms; +p50/+p99: added over the direct client with the same flow (sequential); CPU ms/req: router "
                 f"process tree, median over repeats at {cpu_rate:g} req/s (@seq: sequential); harness: CPU ms per "
                 f"request of the load client + emulated workers at {cpu_rate:g} req/s; held: highest level "
                 f"with p99 < {P99_LIMIT_MS:g} ms and no errors in most repeats; CPU cap: 1000 / CPU ms/req, the "
                 f"rate at which the router would fill one CPU (an extrapolation, not a measured rate)")
    rates = [lv for lv in res["config"]["levels_rps"] if lv > 0]
    lines.append("")
    lines.append("repeats held (p99 < 50 ms, no errors) / run, by offered req/s ('-': not run, a lower level failed)")
    lines.append(f"{'router':28} " + " ".join(f"{lv:>5}" for lv in rates))
    for name, v in res["targets"].items():
        cells = []
        for lv in rates:
            ok, n = v["held_repeats_by_rate"][str(lv)]
            ran = sum(1 for x in v["phases"][str(lv)] if "skipped" not in x)
            cells.append(f"{ok}/{ran}" if ran else "-")
        lines.append(f"{name:28} " + " ".join(f"{c:>5}" for c in cells))
    lines.append("")
    r = res["cpu_ratio_eldr_vs_gateway"]
    lines.append(f"cpu_ratio_eldr_vs_gateway: {_f(r, '{:.2f}')}; eldr vs our random: "
                 f"{_f(res['cpu_ratio_eldr_vs_our_random'], '{:.2f}')}")
    rate = lambda x: "none" if x is None else ("seq" if x == 0 else f"{x} req/s")  # noqa: E731
    lines.append(f"held: ours eldr {rate(res['held_rate_eldr_rps'])}, gateway {rate(res['held_rate_gateway_rps'])}; "
                 f"eldr holds the gateway's rate: {res['eldr_holds_gateway_rate']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the whole sweep (default 5)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)),
                    help="offered rates in req/s, 0 = sequential (default %(default)s)")
    ap.add_argument("--phase-secs", type=float, default=2.5, help="length of one open-loop phase (default 2.5)")
    ap.add_argument("--sequential-requests", type=int, default=300, help="requests of one sequential phase (default 300)")
    ap.add_argument("--warmup", type=int, default=200, help="warm-up requests per router at 100 req/s (default 200)")
    ap.add_argument("--cpu-rate", type=float, default=300.0,
                    help="the level whose CPU per request is the headline and the ratios' (default 300)")
    ap.add_argument("--policies", default=",".join(OUR_POLICIES), help="our decode policies to run (default %(default)s)")
    ap.add_argument("--request-timeout", type=float, default=20.0, help="one request's limit in seconds (default 20)")
    ap.add_argument("--phase-timeout", type=float, default=60.0, help="one phase's limit in seconds (default 60)")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between phases (default 0.5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-cpus", default="auto",
                    help="CPUs every router runs on, the harness (client + emulated workers) on the rest: 'auto' "
                    "(the last CPU, with 2 or more), 'off', or a list such as 1 (default auto)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where the gateway's virtualenv lives (default {DEFAULT_CACHE})")
    ap.add_argument("--no-gateway", action="store_true", help="measure our router only (no install)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run: 1 repeat, levels 0,100, small phases")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON (e.g. benchmarks/results/bench_gateway.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.levels, args.phase_secs = 1, "0,100", 1.0
        args.sequential_requests, args.warmup, args.cpu_rate = 60, 30, 100.0
    try:
        args.levels = sorted({int(x) for x in args.levels.split(",")})
    except ValueError:
        ap.error(f"--levels: expected comma-separated integers, got {args.levels!r}")
    if not args.levels or args.levels[0] < 0 or args.levels[-1] > 5000:
        ap.error("--levels must lie in [0, 5000]")
    if int(args.cpu_rate) not in args.levels:
        ap.error(f"--cpu-rate {args.cpu_rate:g} must be one of --levels {args.levels}")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = sorted(set(args.policies) - set(OUR_POLICIES))
    if bad or not args.policies:
        ap.error(f"--policies: unknown {bad}; choose from {', '.join(OUR_POLICIES)}")
    for name in ("repeats", "sequential_requests", "warmup"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("phase_secs", "request_timeout", "phase_timeout"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    try:
        args.router_cpu_set, args.harness_cpu_set = split_cpus(args.router_cpus)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def run(args) -> dict:
    gateway_py, gateway_info = None, {"skipped": "--no-gateway"}
    if not args.no_gateway:
        gateway_py = ensure_gateway(args.cache_dir)  # GatewayUnavailable: main reports it
        gateway_info = {"package": f"{GATEWAY_PACKAGE}=={GATEWAY_VERSION}", "python": str(gateway_py)}
    targets = build_targets(gateway_py is not None, args.policies)
    load0 = os.getloadavg()
    router_cpus, harness_cpus = args.router_cpu_set, args.harness_cpu_set
    if harness_cpus:  # this process, and the emulated workers it starts below, run on the harness CPUs
        os.sched_setaffinity(0, harness_cpus)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        tmp = Path(tmp)
        _, tpath, cpath = make_trace_files(tmp, requests=50, seed=1, workers=4)
        cluster, urls = start_cluster(tpath, tmp, prefill=2, decode=4, time_scale=1e-9, extra=["--kv-in-process"])
        closed = _closed_port()
        try:
            for t in targets:
                if t.kind == "gateway":
                    t.proc, t.url = start_gateway(gateway_py, urls, tmp, closed.getsockname()[1], cpus=router_cpus)
                elif t.kind == "ours":
                    t.proc, t.url = start_router(urls, tmp, our_args(t, cpath), cpus=router_cpus)
            for t in targets:
                if t.proc is not None:
                    wait_serving(t.url, t.proc)
            try:
                import uvloop

                uvloop.install()
            except ImportError:
                pass
            load = asyncio.run(sweep(targets, urls, args, cluster.p.pid))
            gw = next((t for t in targets if t.kind == "gateway"), None)
            if gw is not None:
                gateway_info["hub_downloads_refused"] = hub_attempts(gw.proc.log)
        finally:
            for t in targets:
                if t.proc is not None:
                    t.proc.stop()
            cluster.stop()
            closed.close()
    direct = {t.flow: t for t in targets if t.kind == "direct"}
    res = {
        "what": "benchmarks/bench_gateway.py: our PD router vs the SGLang gateway (sglang-router 0.3.2, random), "
                "same emulated workers (2 prefill + 4 decode, ~0 modelled time), loopback, interleaved repeats",
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                    "loadavg_min": min(load), "loadavg_median": statistics.median(load), "loadavg_max": max(load)},
        "config": {"repeats": args.repeats, "levels_rps": args.levels, "phase_secs": args.phase_secs,
                   "sequential_requests": args.sequential_requests, "cpu_rate_rps": args.cpu_rate,
                   "p99_limit_ms": P99_LIMIT_MS, "quick": args.quick, "seed": args.seed,
                   "router_cpus": sorted(router_cpus) if router_cpus else None,
                   "harness_cpus": sorted(harness_cpus) if harness_cpus else None,
                   "pinning": (f"routers pinned to CPU {','.join(map(str, sorted(router_cpus)))}, client + workers to "
                               f"{','.join(map(str, sorted(harness_cpus)))}") if router_cpus else "no CPU pinning",
                   "kv_in_process": True},
        "gateway": gateway_info,
        "targets": {t.name: summarize(t, direct, args.levels, args.cpu_rate) for t in targets},
    }
    res.update(cpu_ratios(res))
    res.update(held_goal(res))
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except GatewayUnavailable as exc:
        print(f"bench_gateway: the gateway ({GATEWAY_PACKAGE}=={GATEWAY_VERSION}) is not available here: {exc}\n"
              "Run with --no-gateway to measure our router alone.", file=sys.stderr)
        return 2
    print(table(res))
    if args.json:
        from eldr_sglang.io_safe import write_json

        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
