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

    def start(self, name: str, model: Path, extra: list[str], env: dict | None = None,
              cpus: set[int] | None = None, nice: int = 0) -> cluster.Server:
        """env: variables added to the harness's environment for this server; cpus: pin it;
        nice: lower its CPU priority."""
        s = cluster.start_sglang(name, model, self.logs, {**self.env, **(env or {})}, extra, cpus=cpus, nice=nice)
        self.servers.append(self.memory.watch(s))
        return s

    def step_log(self, name: str) -> Path:
        """Where a server started with `env=harness.step_log_env(name)` writes its MoE step log."""
        return self.logs / f"{name}.steps"

    def step_log_env(self, name: str) -> dict:
        from .step_log import ENV

        return {ENV: str(self.step_log(name))}

    def start_pd(self, model: Path, decodes: int = 2, prefill_extra: list[str] = (), decode_extra: list[str] = (),
                 prefix: str = "", decode_step_log: bool = False, prefill_cpus: set[int] | None = None,
                 decode_cpus: list[set[int]] | None = None,
                 prefill_nice: int = 0, prefill_step_log: bool = False) -> tuple[cluster.Server, int, list[cluster.Server]]:
        """One prefill (mooncake over TCP, its own bootstrap port) and `decodes` decode servers,
        started at once; returns (prefill, bootstrap port, decodes) without waiting.
        decode_step_log: each decode writes its MoE step log (see step_log), and the prefill
        too with prefill_step_log (its forwards: the prompt tokens of each batch); decode_cpus[i]
        pins decode i; prefill_nice lowers the prefill's CPU priority (on a machine where it
        shares the decodes' cores, so that it steals less of their time)."""
        boot = cluster.free_port_block()
        p = self.start(f"{prefix}prefill", model, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                                   str(boot), *PD_TRANSFER, *prefill_extra], cpus=prefill_cpus,
                       nice=prefill_nice, env=self.step_log_env(f"{prefix}prefill") if prefill_step_log else None)
        ds = []
        for i in range(decodes):
            name = f"{prefix}decode{i}"
            ds.append(self.start(name, model, ["--disaggregation-mode", "decode", *PD_TRANSFER, *decode_extra],
                                 env=self.step_log_env(name) if decode_step_log else None,
                                 cpus=decode_cpus[i] if decode_cpus else None))
        return p, boot, ds

    def locality_model(self, locality: float, seed: int = 0, **shape) -> Path:
        """The constructed locality MoE (locality_model.py), built once per setting."""
        key = f"locality-{locality:g}-{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
        if key not in self._models:
            out = self.workdir / "models" / key
            cmd = [sys.executable, "-m", "eldr_sglang.testing.sglang_cpu.locality_model", str(out),
                   "--locality", str(locality), "--seed", str(seed)]
            for k, v in shape.items():
                cmd += [f"--{k.replace('_', '-')}", str(v)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=self.env)
            if p.returncode != 0:
                raise HarnessError(f"building the locality model failed:\n{p.stderr[-3000:]}")
            self._models[key] = out
        return self._models[key]

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
