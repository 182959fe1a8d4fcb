"""Helpers for the loopback end-to-end tests and benchmarks: an emulated PD cluster and the router, as
subprocesses on 127.0.0.1, always stopped by the fixture that started them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eldr_sglang.testing.sglang_cpu.cluster import _free  # one loopback port check for both harnesses

# the directory holding the eldr_sglang package (the repository in an editable install):
# the subprocesses run from it and import the same package as the test
REPO = Path(__file__).resolve().parents[2]


def free_base_port(prefill: int, decode: int, lo: int = 20000, hi: int = 45000) -> int:
    """A base port whose cluster layout (base+i, base+10+j, base+100+i) is free right now."""
    import random

    rng = random.Random(os.getpid() ^ int(time.time() * 1000))
    for _ in range(200):
        base = rng.randrange(lo, hi, 200)
        ports = [base + i for i in range(prefill)] + [base + 10 + j for j in range(decode)]
        ports += [base + 100 + i for i in range(prefill)]
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free loopback port range found")


def make_trace_files(workdir: Path, requests: int, seed: int, workers: int):
    """A small synthetic GPT-OSS-shaped trace and its centroid file: (trace, trace path, centroids path)."""
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.traces.synth import generate
    from eldr_sglang.traces import save_trace

    trace = generate(model="gpt-oss-20b", requests=requests, seed=seed, prompt_len=(16, 48), output_len=24)
    tpath, cpath = workdir / "trace.npz", workdir / "c.eldr"
    save_trace(trace, tpath)
    fit_trace(trace, workers=workers, tau=0.1, seed=0).write(cpath)
    return trace, tpath, cpath


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Proc:
    """`python args...` with its output in `log` (python: this interpreter unless given, e.g. the
    private virtualenv of a peer router; env: extra environment variables; cpus: the CPUs it and
    every thread it starts may run on, set before exec so a runtime's worker threads inherit it)."""

    def __init__(self, args: list[str], log: Path, python: str | None = None, env: dict | None = None,
                 cpus: set[int] | None = None):
        self.log = log
        self.fh = open(log, "w")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.p = subprocess.Popen([python or sys.executable, *args], stdout=self.fh, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**_env(), **(env or {})}, preexec_fn=pin)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)
        self.fh.close()

    def tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return ""


def start_cluster(trace: Path, tmp: Path, prefill: int = 2, decode: int = 4, time_scale: float = 0.05,
                  extra: list[str] | None = None, timeout: float = 60.0) -> tuple[Proc, dict]:
    base = free_base_port(prefill, decode)
    log = tmp / f"cluster-{base}.log"
    proc = Proc(["-m", "eldr_sglang.emulate", "cluster", "--trace", str(trace), "--prefill", str(prefill),
                 "--decode", str(decode), "--base-port", str(base), "--time-scale", str(time_scale),
                 *(extra or [])], log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("READY "):
                return proc, json.loads(line[6:])
        if proc.p.poll() is not None:
            break
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"emulated cluster did not start:\n{proc.tail()}")


def start_router(urls: dict, tmp: Path, args: list[str], timeout: float = 60.0,
                 cpus: set[int] | None = None) -> tuple[Proc, str]:
    port = free_port()
    cmd = ["-m", "eldr_sglang.launch_router", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    for url, bport in urls["prefill"]:
        cmd += ["--prefill", url, str(bport)]
    for url in urls["decode"]:
        cmd += ["--decode", url]
    proc = Proc(cmd + args, tmp / f"router-{port}.log", cpus=cpus)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            break
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"router did not start:\n{proc.tail()}")


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Headers(dict):
    """Response headers whose names compare case-insensitively (RFC 9110), whichever case the
    server wrote them in (aiohttp keeps the handler's case, hyper sends lower case)."""

    def __init__(self, items):
        super().__init__((k.lower(), v) for k, v in items)

    def __getitem__(self, k: str):
        return super().__getitem__(k.lower())

    def get(self, k: str, default=None):
        return super().get(k.lower(), default)

    def __contains__(self, k: object) -> bool:
        return isinstance(k, str) and super().__contains__(k.lower())


def post(url: str, body, timeout: float = 30.0, headers: dict | None = None) -> tuple[int, Headers, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, Headers(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        return e.code, Headers(e.headers.items()), e.read()


async def stream_trace_request(session, base: str, r: int, output_len: int) -> dict:
    """One streamed /generate of the emulator's trace request `r` through `session` (aiohttp):
    {"status", and for a 200 "headers", "t0" and "stamps", each data event's perf_counter};
    a connection failure or timeout is status 0 with its "error"."""
    import asyncio

    import aiohttp

    body = {"text": f"request {r}", "stream": True, "sampling_params": {"max_new_tokens": output_len},
            "emulator": {"trace_request": r}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        async with session.post(base + "/generate", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return {"status": resp.status}
            async for line in resp.content:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    stamps.append(time.perf_counter())
            return {"status": 200, "headers": resp.headers, "t0": t0, "stamps": stamps}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"status": 0, "error": type(exc).__name__}


def tpot_of(stamps: list[float]) -> float | None:
    """Mean time between a stream's tokens (None for fewer than two)."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) >= 2 else None


def metric(text: str, name: str, **labels) -> float:
    """Sum of a Prometheus sample's values whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head != name and not head.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
