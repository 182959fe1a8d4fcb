"""The mixed fault run: the PD router on loopback while workers fail and the centroid file goes bad.

Setup: an emulated cluster (`python -m eldr_sglang.emulate cluster`: 2 prefill, 5 decode), one
more prefill in its own process, and the router (`--disagg-router eldr`, late binding) with
short timeouts. An open-loop client sends --requests requests at --rate req/s (70% streamed,
each with its own text) while, at fixed fractions of the run, these faults start and stay:

  1. decode 3 hangs: accepts every request, never answers (its /health stays green)
  2. decode 4 answers 500 to everything (its /health stays green)
  3. decode 1 answers /v1/loads with Infinity (it keeps serving)
  4. prefill 2 dies (SIGKILL: its port refuses connections)
  5. a FIFO replaces the centroid file (then, 2/16 of the run later, a good file again)

Audit: every request ends with a status within its timeout (0 hang past the router's
--request-timeout-secs plus 1 s plus the client's own measured loop lag); 0 lost (no answer at all) and 0 duplicated (a bootstrap
room decoded twice, from the workers' event logs); the router's in-flight counts return to
0; and for each worker fault the time from the fault to the last request routed to the
faulty worker other than the one-request probation trials (the healthy workers' share
reaches 100% within 10 s when that time is <= 10 s), from /metrics sampled every 0.25 s.

    python benchmarks/fault_run.py [--requests 5000] [--rate 200] [--json PATH] [--md PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import aiohttp

from eldr_sglang.testing.pd_cluster import Proc, free_port, get_json, metric, post, start_cluster, start_router

REQUEST_TIMEOUT = 15.0
ROUTER_FLAGS = ["--first-byte-timeout-secs", "5", "--stall-timeout-secs", "5", "--request-timeout-secs", str(REQUEST_TIMEOUT),
                "--eject-after-failures", "3", "--eject-base-secs", "5", "--eject-max-secs", "60", "--retries", "2",
                "--health-check-interval-secs", "1", "--load-monitor-interval", "0.2", "--eldr-reload-interval-ms", "100",
                "--eldr-signature-timeout-secs", "2", "--no-eldr-drift"]
TRACE_REQUESTS = 240
DECODE, PREFILL_IN_CLUSTER = 5, 2
# (fraction of the run, name, role, worker index) of each fault
FAULTS = [
    (1 / 8, "hung decode (accepts, never answers)", "decode", 3),
    (2 / 8, "decode answering 500 to everything", "decode", 4),
    (3 / 8, "bad /v1/loads (Infinity) on decode 1", "loads", 1),
    (4 / 8, "dead prefill (SIGKILL)", "prefill", 2),
    (5 / 8, "FIFO at the centroid path", "file", None),
]
FAULT_KEYS = {"hang": 0, "500": 1, "loads": 2, "prefill": 3, "fifo": 4}
RESTORE_FILE_AT = 7 / 8


def build_files(workdir: Path):
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.traces.synth import generate
    from eldr_sglang.traces import save_trace

    trace = generate(model="gpt-oss-20b", requests=TRACE_REQUESTS, seed=21, prompt_len=(16, 48), output_len=12)
    tpath, cpath = workdir / "trace.npz", workdir / "c.eldr"
    save_trace(trace, tpath)
    fit_trace(trace, workers=DECODE, tau=0.1, seed=0).write(cpath)
    return tpath, cpath


def start_prefill(tpath: Path, workdir: Path, time_scale: float) -> tuple[Proc, list]:
    port, bport = free_port(), free_port()
    proc = Proc(["-m", "eldr_sglang.emulate", "prefill", "--trace", str(tpath), "--port", str(port),
                 "--bootstrap-port", str(bport), "--time-scale", str(time_scale)], workdir / f"prefill-{port}.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "READY" in proc.tail():
            return proc, [f"http://127.0.0.1:{port}", bport]
        if proc.p.poll() is not None:
            break
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"prefill emulator did not start:\n{proc.tail()}")


def sample_metrics(text: str) -> dict:
    out = {"decode": [metric(text, "eldr_router_decode_routes_total", worker=str(k)) for k in range(DECODE)],
           "prefill": [metric(text, "eldr_router_prefill_routes_total", worker=str(k)) for k in range(PREFILL_IN_CLUSTER + 1)]}
    out["trials"] = {f"{role}{k}": metric(text, "eldr_router_probation_trials_total", role=role, worker=str(k))
                     for role, n in (("decode", DECODE), ("prefill", PREFILL_IN_CLUSTER + 1)) for k in range(n)}
    out["ejections"] = {f"{role}{k}": metric(text, "eldr_router_ejections_total", role=role, worker=str(k))
                        for role, n in (("decode", DECODE), ("prefill", PREFILL_IN_CLUSTER + 1)) for k in range(n)}
    out["loads_dropped"] = [metric(text, "eldr_router_load_reports_dropped_total", worker=str(k)) for k in range(DECODE)]
    return out


async def _get_text(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return await r.text()


async def drive(router: str, n: int, rate: float, seed: int, on_time) -> tuple[list, list]:
    """Open loop: request i is sent at t0 + i/rate whatever happened to the others."""
    rng = random.Random(seed)
    results: list = []
    samples: list = []
    lag = {"max_s": 0.0}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT + 30)) as s:
        t0 = time.monotonic()
        stop = asyncio.Event()

        async def sampler():
            while not stop.is_set():
                try:
                    text = await _get_text(s, router + "/metrics")
                    samples.append((time.monotonic() - t0, sample_metrics(text)))
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.25)

        async def one(i: int, stream: bool, tokens: int, r: int):
            body = {"text": f"fault run {seed} {i}", "stream": stream, "sampling_params": {"max_new_tokens": tokens},
                    "emulator": {"trace_request": r}}
            start = time.monotonic() - t0
            rec = {"i": i, "stream": stream, "start": start}
            try:
                async with s.post(router + "/generate", json=body) as resp:
                    data = await resp.read()
                    rec.update(status=resp.status, room=resp.headers.get("X-ELDR-Bootstrap-Room"),
                               decode=resp.headers.get("X-ELDR-Decode-Worker"), prefill=resp.headers.get("X-ELDR-Prefill-Worker"))
                    if resp.status == 200 and stream:
                        rec["complete"] = data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
                        if not rec["complete"]:
                            rec["error"] = "stream cut: " + data.rstrip().rsplit(b"\n", 1)[-1][-160:].decode(errors="replace")
                    elif resp.status == 200:
                        rec["complete"] = b'"finish_reason"' in data
                    else:
                        rec["complete"] = False
                        try:
                            rec["error"] = json.loads(data)["error"]["message"][:200]
                        except (ValueError, KeyError, TypeError):
                            rec["error"] = f"unstructured: {data[:120]!r}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                rec.update(status=None, complete=False, error=f"client: {exc.__class__.__name__}")
            rec["seconds"] = time.monotonic() - t0 - start
            results.append(rec)

        async def lag_probe():  # how late this client's own loop runs: its latencies include it
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.05)
                lag["max_s"] = max(lag["max_s"], time.monotonic() - t - 0.05)

        sampler_task = asyncio.ensure_future(sampler())
        lag_task = asyncio.ensure_future(lag_probe())
        tasks = []
        for i in range(n):
            at = t0 + i / rate
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await on_time(time.monotonic() - t0)
            tasks.append(asyncio.ensure_future(one(i, rng.random() < 0.7, rng.randint(4, 12), rng.randrange(TRACE_REQUESTS))))
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        stop.set()
        await sampler_task
        await lag_task
    return results, samples, lag["max_s"]


def last_dispatch_after(samples: list, role: str, k: int, t_fault: float) -> float:
    """Seconds from the fault to the end of the last sampling interval in which the worker
    got requests beyond its probation trials (0.0: none after the fault)."""
    key = "decode" if role == "decode" else "prefill"
    last = t_fault
    for (t_a, a), (t_b, b) in zip(samples, samples[1:]):
        if t_b <= t_fault:
            continue
        routed = b[key][k] - a[key][k]
        trials = b["trials"][f"{role}{k}"] - a["trials"][f"{role}{k}"]
        if routed > trials:
            last = t_b
    return max(0.0, last - t_fault)


def chosen_faults(keys: list[str]) -> list[tuple]:
    """The FAULTS rows the run injects, in their table order."""
    return [FAULTS[FAULT_KEYS[k]] for k in FAULT_KEYS if k in keys]


def audit(results: list, samples: list, fault_times: dict, logs: dict, router_state: dict, args) -> dict:
    n = len(results)
    ok = [r for r in results if r["status"] == 200 and r["complete"]]
    lost = [r for r in results if r["status"] is None]
    # past the router's timeout, with 1 s for the network and this client's own measured
    # scheduling lag (a loaded client reads answers late: that is not the router hanging)
    slack = 1.0 + router_state["client_lag_s"]
    hung = [r for r in results if r["seconds"] > REQUEST_TIMEOUT + slack]
    errors: dict = {}
    for r in results:
        if not (r["status"] == 200 and r["complete"]):
            key = f"{r['status']}: {r.get('error', 'stream ended with an error event')}"[:120]
            errors[key] = errors.get(key, 0) + 1
    # duplicated: a room whose KV two decode workers took, or two answers for one room
    starts: dict = {}
    for events in logs["decode"]:
        for e in events:
            if e["event"] == "decode_start":
                starts[e["room"]] = starts.get(e["room"], 0) + 1
    rooms = [int(r["room"]) for r in ok if r.get("room")]
    duplicated = sum(1 for c in starts.values() if c > 1) + (len(rooms) - len(set(rooms)))
    unserved = sum(1 for room in rooms if starts.get(room, 0) != 1)
    lat = np.array([r["seconds"] for r in results])
    faults = []
    for frac, name, role, k in chosen_faults(args.fault_keys):
        t = fault_times[name]
        row = {"fault": name, "at_s": round(t, 2)}
        if role in ("decode", "prefill"):
            final = samples[-1][1]
            row.update(worker=f"{role} {k}", ejections=int(final["ejections"][f"{role}{k}"]),
                       probation_trials=int(final["trials"][f"{role}{k}"]))
            row["last_routed_after_s"] = round(last_dispatch_after(samples, role, k, t), 2)
            row["healthy_share_100pct_within_10s"] = row["last_routed_after_s"] <= 10.0
        elif role == "loads":
            before = next((s for ts, s in reversed(samples) if ts <= t), samples[0][1])
            final = samples[-1][1]
            row.update(worker=f"decode {k}", loads_dropped=int(final["loads_dropped"][k] - before["loads_dropped"][k]),
                       other_workers_dropped=int(sum(final["loads_dropped"]) - final["loads_dropped"][k]),
                       served_after=sum(1 for r in ok if r["start"] > t and r.get("decode") == str(k)))
            row["healthy_share_100pct_within_10s"] = None  # the worker stays healthy: it keeps serving
        else:
            during = [r for r in results if t <= r["start"] < fault_times["restore"]]
            row.update(worker="centroid file", requests_during=len(during),
                       ok_during=sum(1 for r in during if r["status"] == 200 and r["complete"]),
                       rejected_as=router_state.get("fifo_error"), generation_after_restore=router_state.get("generation_restored"))
            row["healthy_share_100pct_within_10s"] = None
        faults.append(row)
    return {
        "requests": n, "rate_target": args.rate,
        "rate_achieved": round(n / max(1e-9, max(r["start"] for r in results)), 1),
        "ok": len(ok), "clear_errors": n - len(ok) - len(lost), "errors_by_kind": errors,
        "hung_past_timeout": len(hung), "lost": len(lost), "duplicated": duplicated, "ok_without_one_decode": unserved,
        "inflight_after": {"decode": router_state["decode_inflight"], "prefill": router_state["prefill_inflight"]},
        "latency_s": {"p50": round(float(np.percentile(lat, 50)), 3), "p99": round(float(np.percentile(lat, 99)), 3),
                      "max": round(float(lat.max()), 3)},
        "request_timeout_s": REQUEST_TIMEOUT, "hang_slack_s": round(slack, 3),
        "client_loop_lag_max_s": round(router_state["client_lag_s"], 3), "faults": faults,
        "retries": router_state["retries"], "timeouts": router_state["timeouts"],
        "timeline": [{"t": round(t, 2), "decode_routes": s["decode"], "prefill_routes": s["prefill"]} for t, s in samples],
    }


def render(rep: dict) -> str:
    lines = [
        "# Mixed fault run (loopback, emulated workers)", "",
        f"{rep['requests']} requests at {rep['rate_target']:g} req/s (achieved {rep['rate_achieved']:g}); "
        f"router --request-timeout-secs {rep['request_timeout_s']:g}, first byte / stall 5 s, eject after 3 failures.", "",
        "| check | result |", "|---|---|",
        f"| succeeded | {rep['ok']} |",
        f"| clear errors (a status and a message) | {rep['clear_errors']} |",
        f"| hung past the timeout (> {rep['request_timeout_s']:g} s + {rep['hang_slack_s']:g} s: 1 s + the client's "
        f"own max loop lag) | {rep['hung_past_timeout']} |",
        f"| lost (no answer) | {rep['lost']} |",
        f"| duplicated (a room decoded twice) | {rep['duplicated']} |",
        f"| in flight after the run (decode, prefill) | {rep['inflight_after']['decode']}, {rep['inflight_after']['prefill']} |",
        f"| latency p50 / p99 / max (s) | {rep['latency_s']['p50']} / {rep['latency_s']['p99']} / {rep['latency_s']['max']} |",
        f"| retries (role:cause) | {', '.join(f'{k}={v:g}' for k, v in rep['retries'].items()) or 'none'} |", "",
        "| fault | at (s) | worker | last routed to it after (s), beyond probation | healthy share 100% within 10 s | detail |",
        "|---|---|---|---|---|---|",
    ]
    for f in rep["faults"]:
        if "last_routed_after_s" in f:
            detail = f"ejections {f['ejections']}, probation trials {f['probation_trials']}"
            last, share = f["last_routed_after_s"], "yes" if f["healthy_share_100pct_within_10s"] else "NO"
        elif "loads_dropped" in f:
            detail = (f"{f['loads_dropped']} answers dropped, {f['other_workers_dropped']} for other workers; "
                      f"it served {f['served_after']} requests after")
            last, share = "-", "n/a (stays healthy)"
        else:
            detail = (f"{f['ok_during']}/{f['requests_during']} ok while it stood; rejected as: {f['rejected_as']}; "
                      f"generation after the good file: {f['generation_after_restore']}")
            last, share = "-", "n/a"
        lines.append(f"| {f['fault']} | {f['at_s']} | {f['worker']} | {last} | {share} | {detail} |")
    if rep["errors_by_kind"]:
        lines += ["", "Errors by kind:", ""] + [f"- {v} x {k}" for k, v in sorted(rep["errors_by_kind"].items(), key=lambda x: -x[1])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default=",".join(FAULT_KEYS),
                    help=f"which faults to inject, comma-separated (default all: {','.join(FAULT_KEYS)}; 'none': none)")
    ap.add_argument("--workdir", metavar="DIR", help="keep the run's files and logs here (default: a temporary directory)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--md", metavar="PATH")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= 1_000_000 or not (math.isfinite(args.rate) and 0 < args.rate <= 10_000):
        ap.error("--requests must be in [1, 1e6] and --rate in (0, 10000]")
    if not (math.isfinite(args.time_scale) and 0 < args.time_scale <= 10):
        ap.error("--time-scale must be in (0, 10]")
    args.fault_keys = [] if args.faults == "none" else args.faults.split(",")
    if any(k not in FAULT_KEYS for k in args.fault_keys):
        ap.error(f"--faults: choose from {','.join(FAULT_KEYS)} or none")
    return args


class FaultInjector:
    """Injects the chosen faults at their times into the run (the client calls `on_time`)."""

    def __init__(self, faults, duration: float, urls: dict, base: str, pproc, workdir: Path, good_file: Path,
                 live: Path, restore: bool):
        self.pending = sorted([(frac * duration, name, role, k) for frac, name, role, k in faults]
                              + ([(RESTORE_FILE_AT * duration, "restore", "restore", None)] if restore else []))
        self.urls, self.base, self.pproc = urls, base, pproc
        self.workdir, self.good_file, self.live = workdir, good_file, live
        self.fault_times: dict = {}
        self.state: dict = {}

    async def on_time(self, t: float) -> None:
        while self.pending and self.pending[0][0] <= t:
            _, name, role, k = self.pending.pop(0)
            self.fault_times[name] = t
            await self._inject(role, k)

    async def _inject(self, role: str, k) -> None:
        if role == "decode":
            await asyncio.to_thread(post, self.urls["decode"][k] + "/emulator/fault",
                                    {"mode": "hang" if k == 3 else "error500"}, 10)
        elif role == "loads":
            await asyncio.to_thread(post, self.urls["decode"][k] + "/emulator/fault", {"mode": "loads:inf"}, 10)
        elif role == "prefill":
            os.kill(self.pproc.p.pid, signal.SIGKILL)
        elif role == "file":  # a FIFO swapped in under the centroid file's name
            fifo = self.workdir / "fifo.tmp"
            os.mkfifo(fifo)
            os.replace(fifo, self.live)
        else:  # restore a good file, after reading what the router said of the FIFO
            try:
                st = await asyncio.to_thread(get_json, self.base + "/eldr/status", 60.0)
                self.state["fifo_error"] = st["last_reload_error"]
            except OSError as exc:  # a starved machine: say so, keep going
                self.state["fifo_error"] = f"(status not read: {exc})"
            tmp_good = self.workdir / "good.tmp"
            shutil.copy(self.good_file, tmp_good)
            os.replace(tmp_good, self.live)


def router_state_after(base: str, settle_s: float = 30.0) -> dict:
    """In-flight counts once the router has settled (or after settle_s), the centroid
    generation, every (role, cause) retry it counted and its upstream timeouts."""
    deadline = time.monotonic() + settle_s
    while True:
        st = get_json(base + "/eldr/status", 60.0)
        if (not any(st["decode_inflight"]) and not any(st["prefill_inflight"])) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    state = dict(decode_inflight=st["decode_inflight"], prefill_inflight=st["prefill_inflight"],
                 generation_restored=st["centroid_generation"], retries={})
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("eldr_router_retries_total{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            cause = line.split('cause="', 1)[1].split('"', 1)[0]
            state["retries"][f"{role}:{cause}"] = float(line.rsplit(" ", 1)[1])
    state["timeouts"] = {phase: metric(text, "eldr_router_upstream_timeouts_total", phase=phase)
                         for phase in ("first_byte", "stall", "total")}
    return state


def run(args, workdir: Path) -> dict:
    """Start the cluster and the router, drive the load while injecting the faults, audit."""
    faults = chosen_faults(args.fault_keys)
    duration = args.requests / args.rate
    tpath, cpath = build_files(workdir)
    live = workdir / "live.eldr"
    shutil.copy(cpath, live)
    procs = []
    try:
        cproc, urls = start_cluster(tpath, workdir, prefill=PREFILL_IN_CLUSTER, decode=DECODE, time_scale=args.time_scale)
        procs.append(cproc)
        pproc, purl = start_prefill(tpath, workdir, args.time_scale)
        procs.append(pproc)
        urls = {"prefill": [*urls["prefill"], purl], "decode": urls["decode"]}
        rproc, base = start_router(urls, workdir, ["--disagg-router", "eldr", "--eldr-centroids", str(live), *ROUTER_FLAGS])
        procs.append(rproc)
        inj = FaultInjector(faults, duration, urls, base, pproc, workdir, cpath, live, "fifo" in args.fault_keys)
        print(f"fault run: {args.requests} requests at {args.rate:g} req/s (~{duration:.0f} s)...", file=sys.stderr)
        results, samples, client_lag = asyncio.run(drive(base, args.requests, args.rate, args.seed, inj.on_time))
        state = {**inj.state, "client_lag_s": client_lag, **router_state_after(base)}
        logs = {"decode": [get_json(u + "/emulator/log") for u in urls["decode"]]}
        return audit(results, samples, inj.fault_times, logs, state, args)
    finally:
        for p in reversed(procs):
            p.stop()


def passed(rep: dict) -> bool:
    return (rep["hung_past_timeout"] == 0 and rep["lost"] == 0 and rep["duplicated"] == 0
            and not any(rep["inflight_after"]["decode"]) and not any(rep["inflight_after"]["prefill"])
            and all(f["healthy_share_100pct_within_10s"] in (True, None) for f in rep["faults"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eldr-fault-run-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rep = run(args, workdir)
    table = render(rep)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(table + f"\nCommand: `python benchmarks/fault_run.py --requests {args.requests} "
                                 f"--rate {args.rate:g}`\n")
    ok = passed(rep)
    print("PASS" if ok else "FAIL: see the table", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
