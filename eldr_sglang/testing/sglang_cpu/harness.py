"""One place that prepares everything a real-SGLang CPU test needs (test-only).

`Harness(workdir)` builds the libcuda stub, the patched overlay (CPU shim + ELDR series) and
the server environment, checks that sgl_kernel and mooncake load, and builds tiny models on
demand. Servers started through it are watched by one memory sampler (peak RSS of their
process groups) and stopped by `stop_all()` / `close()`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from . import cluster
from .overlay import build_overlay
from .prereq import check_prerequisites
from .stub import HarnessError, build_libcuda_stub

REPO = Path(__file__).resolve().parents[3]

PD_TRANSFER = ["--disaggregation-transfer-backend", "mooncake_tcp"]


class Harness:
    def __init__(self, workdir: Path, stub_cache: Path | None = None):
        self.workdir = Path(workdir)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        stub = build_libcuda_stub(stub_cache or self.workdir)
        self.overlay = build_overlay(self.workdir / "overlay", cpu_shim=True, eldr=True)
        self.env = cluster.sglang_env(self.overlay, stub, repo=REPO)
        check_prerequisites(self.env)
        self.memory = cluster.MemorySampler()
        self.servers: list[cluster.Server] = []
        self._models: dict[str, Path] = {}

    def model(self, arch: str, seed: int = 0) -> Path:
        key = f"{arch}-{seed}"
        if key not in self._models:
            out = self.workdir / "models" / key
            p = subprocess.run([sys.executable, "-m", "eldr_sglang.testing.sglang_cpu.model", str(out), "--arch", arch,
                                "--seed", str(seed)], capture_output=True, text=True, timeout=600, env=self.env)
            if p.returncode != 0:
                raise HarnessError(f"building the tiny {arch} model failed:\n{p.stderr[-3000:]}")
            self._models[key] = out
        return self._models[key]

    def start(self, name: str, model: Path, extra: list[str]) -> cluster.Server:
        s = cluster.start_sglang(name, model, self.logs, self.env, extra)
        self.servers.append(self.memory.watch(s))
        return s

    def start_pd(self, model: Path, decodes: int = 2, prefill_extra: list[str] = (), decode_extra: list[str] = (),
                 prefix: str = "") -> tuple[cluster.Server, int, list[cluster.Server]]:
        """One prefill (mooncake over TCP, its own bootstrap port) and `decodes` decode servers,
        started at once; returns (prefill, bootstrap port, decodes) without waiting."""
        boot = cluster.free_port_block()
        p = self.start(f"{prefix}prefill", model, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                                   str(boot), *PD_TRANSFER, *prefill_extra])
        ds = [self.start(f"{prefix}decode{i}", model, ["--disaggregation-mode", "decode", *PD_TRANSFER, *decode_extra])
              for i in range(decodes)]
        return p, boot, ds

    def start_router(self, name: str, prefill: list[tuple[str, int]], decode: list[str], args: list[str]) -> cluster.Server:
        port = cluster.free_port_block(span=2)
        cmd = ["-m", "eldr_sglang.launch_router", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
        for url, boot in prefill:
            cmd += ["--prefill", url, str(boot)]
        for url in decode:
            cmd += ["--decode", url]
        r = cluster.Server(name, cmd + list(args), f"http://127.0.0.1:{port}", self.logs / f"{name}.log", self.env,
                           cwd=REPO)
        self.servers.append(r)
        return r

    def stop(self, servers) -> None:
        cluster.stop_all(servers)

    def close(self) -> None:
        cluster.stop_all(self.servers)
        self.memory.close()
