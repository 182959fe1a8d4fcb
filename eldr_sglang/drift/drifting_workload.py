"""Drift in the simulator: a workload whose domain mix shifts, and adaptive ELDR.

- `drifting_trace(...)` builds a synthetic trace (eldr_sglang.traces.synth.generate, one routing
  model for all phases) whose requests come in phases, each phase drawing its requests from
  its own set of domains (domain labels are used here only to *compose* the workload; the
  policies never see them). A separate calibration set comes from the first phase's domains.
- `AdaptivePolicy` is an ELDR policy for `eldr_sglang.sim.cluster.simulate` that feeds every
  decision to a RefitController (DriftMonitor + SignatureReservoir) and swaps the refitted
  centroid file in by the Router's hot reload. The refit runs synchronously in wall time
  (the simulation is paused), and the new file becomes active `activation_delay` routed
  requests later, standing in for the seconds a background refit takes in a real router.
  The controller's clock is the routed-request count, so cooldown and schedule are in
  requests and the run is deterministic.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from eldr_sglang.drift.refit import RefitController


def drifting_trace(
    phases: list[tuple[list[int], int]],
    *,
    calibration: int,
    model: str = "gpt-oss-20b",
    domains: int = 8,
    seed: int = 0,
    prompt_len=(64, 256),
    output_len: int = 128,
    **gen_kw,
):
    """phases: [(domains of the phase, requests), ...]. Returns (trace, calib_idx, phase_of):
    trace requests are the calibration set (`calibration` requests from phase 0's domains)
    followed by the phases in order; `phase_of[r]` is -1 for calibration requests."""
    from eldr_sglang.traces.synth import generate

    if not phases:
        raise ValueError("give at least one phase")
    for doms, n in phases:
        if not doms or min(doms) < 0 or max(doms) >= domains or n < 1:
            raise ValueError(f"bad phase {doms!r}, {n}: domains must lie in 0..{domains - 1} and n >= 1")
    need = np.zeros(domains)
    for i, (doms, n) in enumerate(phases):
        extra = calibration if i == 0 else 0
        for d in doms:
            need[d] += (n + extra) / len(doms)
    # domains are drawn with equal weights; generate enough that every phase finds its requests
    total = int(np.ceil(need.max() * domains * 1.3)) + 64
    t = generate(model=model, requests=total, domains=domains, seed=seed, prompt_len=prompt_len,
                 output_len=output_len, domain_weights=[1.0] * domains, **gen_kw)
    code = np.array([int(str(x).replace("domain", "")) for x in t.domain])
    used = np.zeros(t.num_requests, bool)

    def take(doms, n):
        cand = np.flatnonzero(np.isin(code, doms) & ~used)
        if len(cand) < n:
            raise ValueError(f"not enough requests of domains {doms}: {len(cand)} < {n}")
        pick = cand[:n]  # in trace order: domain bursts stay bursts
        used[pick] = True
        return pick

    parts = [take(phases[0][0], calibration)]
    phase_of = [np.full(calibration, -1)]
    for i, (doms, n) in enumerate(phases):
        parts.append(take(doms, n))
        phase_of.append(np.full(n, i))
    order = np.concatenate(parts)
    sub = t.subset(order)
    return sub, np.arange(calibration), np.concatenate(phase_of)


class AdaptivePolicy:
    """ELDR through the Rust Router with drift-triggered and/or periodic refits."""

    uses_labels = False

    def __init__(
        self,
        name: str,
        num_workers: int,
        centroids: str,
        signatures: tuple[np.ndarray, np.ndarray],
        workdir: str,
        *,
        tau: float | None = None,
        load_factor: float | None = None,
        on_drift: bool = True,
        interval: int | None = None,
        cooldown: int = 500,
        activation_delay: int = 64,
        seed: int = 0,
        reservoir_kw: dict | None = None,
        monitor_kw: dict | None = None,
    ):
        from eldr_sglang import _core

        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, f"{name}.eldr")
        shutil.copyfile(centroids, self.path)  # the refits replace this copy, not the input
        self.name = name
        self.router = _core.Router(policy="eldr", num_workers=num_workers, centroids=self.path, tau=tau, seed=seed,
                                   reload_interval_ms=0)  # reloads only when this policy says so
        if load_factor is not None:
            self.router.load_factor = load_factor
        self.sig, self.valid = signatures
        self.count = 0
        self.controller = RefitController(
            self.path, router=None, on_drift=on_drift, interval_s=interval, cooldown_s=cooldown,
            executor="inline", seed=seed, clock=lambda: float(self.count),
            reservoir_kw=reservoir_kw, monitor_kw=monitor_kw,
        )
        self.activation_delay = int(activation_delay)
        self._activate_at: int | None = None
        self.events: list[dict] = []  # refits: route index triggered, activated, reason, summary
        self.generation_of: list[int] = []
        self.d_star: list[float] = []

    def route(self, trace_r: int) -> int:
        if self._activate_at is not None and self.count >= self._activate_at:
            self.router.reload()
            self._activate_at = None
            self.events[-1]["activated_at"] = self.count
        ok = self.valid is None or bool(self.valid[trace_r])
        sig = self.sig[trace_r] if ok else None
        dec = self.router.route_signature(sig, explain=True)
        self.count += 1
        self.generation_of.append(int(dec.generation))
        self.d_star.append(float(dec.d_star) if dec.d_star is not None else float("nan"))
        before = self.controller.refits
        fired = self.controller.observe(dec, sig)
        if fired is not None:
            st = self.controller.status()
            entry = {"triggered_at": self.count, "reason": fired, "ok": bool(st["last_ok"]), "error": st["last_error"]}
            if self.controller.refits > before:
                r = self.controller.last.get("result", {})
                entry.update(signatures=r.get("n_signatures"), mean_similarity=r.get("mean_centroid_similarity"),
                             seconds=r.get("seconds"))
                self._activate_at = self.count + self.activation_delay
            self.events.append(entry)
        return int(dec.worker)

    def acquire(self, worker: int, tokens: int):
        return self.router.acquire(worker, tokens)

    def loads(self) -> list[int]:
        return list(self.router.loads())
