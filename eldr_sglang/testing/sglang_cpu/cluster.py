"""SGLang servers and the ELDR router as subprocesses on 127.0.0.1, for tests.

Each process runs in its own session (process group), so stopping it ends every child it
spawned (SGLang's scheduler and detokenizer). Each also gets SIGKILL when the test process dies
(PR_SET_PDEATHSIG), so a SIGKILLed pytest leaves no server behind: SGLang's own children already
die with their parent (sglang.srt.utils.kill_itself_when_parent_died). Readiness is /health answering 200, never a
log line: SGLang prints "ready to roll" even after a failed bind. Logs are kept so that a
failure message can quote them.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import ctypes
import urllib.request
from pathlib import Path

from .stub import HarnessError

# SGLang's CPU defaults (measured on sglang 0.5.23): the torch native attention backend, no
# CUDA graphs, a small KV pool, and no warm-up request (each costs seconds on two cores).
CPU_SERVER_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--max-total-tokens", "4096", "--skip-server-warmup", "--tp", "1", "--dtype", "bfloat16",
]


def sglang_env(overlay: Path, stub_dir: Path, repo: Path | None = None, base: dict | None = None) -> dict:
    """Environment for a server from the overlay: the CPU engine (without it the rotary
    embedding imports vllm), the libcuda stub, the overlay first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(stub_dir), env.get("LD_LIBRARY_PATH", "")] if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(overlay), str(repo or ""), env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", "1")  # several servers share two cores
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_TAKEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port_block(span: int = 40, lo: int = 10000, hi: int = 60000) -> int:
    """A port p with p..p+span-1 free now and far from the blocks this process took before:
    an SGLang server opens several ports near its own. Blocks avoid the kernel's ephemeral
    range, where outgoing connections (mooncake's among them) take ports at any moment: a
    server that binds there can find its port taken ("address already in use")."""
    eph_lo, eph_hi = _ephemeral_range()
    if lo < eph_lo and hi > eph_lo:
        hi = eph_lo - 1
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        p = rng.randrange(lo, hi - span, 10)
        if any(abs(p - q) < 2 * span for q in _TAKEN):
            continue
        if all(_free(q) for q in range(p, p + span, 3)) and _free(p + 1):
            _TAKEN.add(p)
            return p
    raise HarnessError("no free loopback port block found")


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL me when my parent dies.

    Linux only; elsewhere the process group (stop/kill below) is the only guard.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class Server:
    """One subprocess in its own process group, with its log file."""

    def __init__(self, name: str, args: list[str], url: str, log: Path, env: dict, cwd: Path | None = None,
                 cpus: set[int] | None = None, nice: int = 0):
        """cpus: pin the process (and every child it spawns) to these cores; nice: lower its
        priority by this much (inherited by its children too)."""
        self.name, self.url, self.log, self.cpus = name, url, Path(log), cpus
        self.started = time.monotonic()
        self.ready_s: float | None = None
        self._fh = open(self.log, "w")

        def setup() -> None:  # in the child, between fork and exec
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)
            if nice:
                os.nice(nice)

        self.proc = subprocess.Popen([sys.executable, *args], stdout=self._fh, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd, start_new_session=True, preexec_fn=setup)
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `grace` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.pgid):
                if self.proc.poll() is None:
                    try:
                        self.proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.2)
            if not _group_alive(self.pgid):
                break
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self._fh.close()

    def kill(self) -> None:
        """SIGKILL the group at once (a crash, for fault tests)."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def tail(self, chars: int = 4000) -> str:
        try:
            return f"--- {self.name} log ({self.log}) ---\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return f"--- {self.name}: no log at {self.log} ---"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies count as gone, and so does a process that exits between the listing and its stat
    return any(_state(pid) not in ("Z", None) for pid in _group_pids(pgid))


def _state(pid: int) -> str | None:
    """A process's state letter, None when it is gone."""
    try:
        return _stat(pid)[1]
    except (OSError, IndexError, ValueError):
        return None


def _stat(pid: int) -> tuple[int, str, int]:
    """(pgid, state, rss pages) of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as fh:
        rest = fh.read().rpartition(")")[2].split()
    return int(rest[2]), rest[0], int(rest[21])


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if _stat(int(d))[0] == pgid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def group_memory_bytes(pgids) -> tuple[int, int]:
    """(RSS, PSS) summed over every live process in the given process groups. The RSS sum
    counts shared pages (torch's libraries) once per process, so it overstates; PSS shares
    them out."""
    want, rss_total, pss_total, page = set(pgids), 0, 0, os.sysconf("SC_PAGE_SIZE")
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                g, state, rss = _stat(int(d))
            except (OSError, IndexError, ValueError):
                continue
            if g in want and state != "Z":
                rss_total += rss * page
                pss_total += _pss_bytes(int(d))
    return rss_total, pss_total


class MemorySampler:
    """Samples the memory of the registered servers' groups in a thread; keeps the peaks."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.peak, self.peak_pss, self.servers = interval, 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            live = [s.pgid for s in list(self.servers) if s.alive()]
            if live:
                rss, pss = group_memory_bytes(live)
                self.peak, self.peak_pss = max(self.peak, rss), max(self.peak_pss, pss)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def start_sglang(name: str, model: Path, log_dir: Path, env: dict, extra: list[str] = (),
                 port: int | None = None, cpus: set[int] | None = None, nice: int = 0) -> Server:
    """Start `python -m sglang.launch_server` on 127.0.0.1 (returns at once; see wait_ready)."""
    port = port or free_port_block()
    args = ["-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), *CPU_SERVER_ARGS, *extra]
    return Server(name, args, f"http://127.0.0.1:{port}", Path(log_dir) / f"{name}.log", env, cpus=cpus, nice=nice)


def wait_ready(servers: list[Server], timeout: float) -> None:
    """Wait until every server answers /health; on a death or the timeout, stop them all and
    raise with their logs."""
    pending = list(servers)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for s in list(pending):
            if not s.alive():
                logs = "\n".join(x.tail() for x in servers)
                stop_all(servers)
                raise HarnessError(f"{s.name} exited with {s.proc.returncode} before /health answered\n{logs}")
            if s.healthy():
                s.ready_s = time.monotonic() - s.started
                pending.remove(s)
        time.sleep(1.0)
    if pending:
        logs = "\n".join(x.tail() for x in pending)
        stop_all(servers)
        raise HarnessError(f"not ready after {timeout:.0f} s: {', '.join(s.name for s in pending)}\n{logs}")


def stop_all(servers) -> None:
    """Stop every server (SIGTERM all groups first, so their grace periods overlap)."""
    live = [s for s in servers if s.alive()]
    for s in live:
        try:
            os.killpg(s.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for s in servers:
        s.stop()
