"""A shared host CPU: decode workers whose steps slow each other down.

On a small CPU cluster (the real-SGLang tests: two decode servers pinned one per core) a decode
step also costs CPU outside the pinned scheduler (the server's tokenizer and detokenizer, the
router and the clients handle its output), and that work shares the cores the decode servers
run on. Measured on real SGLang 0.5.23 (benchmarks/engine_dynamics.py, its tables in
benchmarks/results/sim_vs_engine.md): a server's step at batch 4 lasts 67-79 ms while the other
server is idle, 90-99 ms while the other runs batch 4 and 117-120 ms while it runs batch 1 (fast
steps, many per second). Which process takes the time was not measured; the model below only
prices it by the other workers' step rate, and prices the stalls (steps over twice the model,
over a third of the servers' time) by the same rate.

The model, fitted on a balancer's engine steps by `fit_shared_host` and applied to every policy
alike:

    step = line(batch, distinct) / (1 - steal_s * other workers' steps per second)
           * scatter                          (the normal steps' measured/modelled, i.i.d.)
           + stall                            (Poisson in the step's time, hazard and excess
                                               by the other workers' step rate)

A GPU cluster's workers have their own host cores: its profiles carry no SharedHost, and the
simulator's steps stay the deterministic line.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

STALL_FACTOR = 2.0  # a step over this many times the model is a stall
MIN_FREE = 0.05  # the scheduler keeps at least this share of its core (guards the division)
MIN_STALLS_PER_BIN = 30  # fewer stalls in a rate bin: its excess comes from all bins pooled


@dataclass(frozen=True)
class SharedHost:
    steal_s: float  # CPU seconds one step of another decode worker takes from this one's core
    window_s: float  # the other workers' step rate is counted over this window (seconds)
    scatter: tuple[float, ...]  # quantiles of measured/modelled for the steps that do not stall
    rate_edges: tuple[float, ...]  # other workers' step rate bins (steps/s), ascending, from 0
    hazard_per_s: tuple[float, ...]  # stalls per second of modelled step time, per rate bin
    excess_s: tuple[tuple[float, ...], ...]  # quantiles of a stall's excess (s), per rate bin

    def __post_init__(self):
        bins = len(self.rate_edges)
        if not (self.steal_s >= 0 and self.window_s > 0 and bins >= 1 and self.rate_edges[0] == 0
                and len(self.hazard_per_s) == bins and len(self.excess_s) == bins and len(self.scatter) >= 2
                and all(b > a for a, b in zip(self.rate_edges, self.rate_edges[1:]))
                and all(h >= 0 for h in self.hazard_per_s) and all(len(q) >= 2 for q in self.excess_s)):
            raise ValueError("shared host: steal_s >= 0, window_s > 0, rate_edges ascending from 0, and one hazard "
                             "and one excess quantile list per rate bin")

    def to_dict(self) -> dict:
        return {"steal_s": self.steal_s, "window_s": self.window_s, "scatter": list(self.scatter),
                "rate_edges": list(self.rate_edges), "hazard_per_s": list(self.hazard_per_s),
                "excess_s": [list(q) for q in self.excess_s]}

    @classmethod
    def from_dict(cls, d: dict) -> SharedHost:
        try:
            return cls(float(d["steal_s"]), float(d["window_s"]), tuple(map(float, d["scatter"])),
                       tuple(map(float, d["rate_edges"])), tuple(map(float, d["hazard_per_s"])),
                       tuple(tuple(map(float, q)) for q in d["excess_s"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"shared host: missing or malformed field ({exc})") from None


def _draw(q: np.ndarray, grid: np.ndarray, u: float) -> float:
    """Inverse-CDF draw from quantiles `q` at probabilities `grid`."""
    return float(np.interp(u, grid, q))


class HostClock:
    """One simulation's shared host: the recent step starts of every worker and a seeded draw."""

    def __init__(self, host: SharedHost, workers: int, seed: int = 0):
        self.host = host
        self.starts: list[deque] = [deque() for _ in range(workers)]
        self.rng = np.random.default_rng(seed)
        # arrays once, not per step (this runs on the simulator's step loop)
        self.scatter = np.asarray(host.scatter)
        self.scatter_grid = np.linspace(0.0, 1.0, self.scatter.size)
        self.excess = [np.asarray(q) for q in host.excess_s]
        self.excess_grid = [np.linspace(0.0, 1.0, q.size) for q in self.excess]

    def other_rate(self, wi: int, now: float) -> float:
        """Steps per second the other workers started over the last window."""
        n = 0
        for j, d in enumerate(self.starts):
            while d and d[0] <= now - self.host.window_s:
                d.popleft()
            if j != wi:
                n += len(d)
        return n / self.host.window_s

    def step(self, wi: int, now: float, line_s: float) -> float:
        """The step worker `wi` starts now, whose line (own work alone) is `line_s`."""
        h = self.host
        r = self.other_rate(wi, now)
        dt = line_s / max(1.0 - h.steal_s * r, MIN_FREE) * _draw(self.scatter, self.scatter_grid, self.rng.random())
        k = bisect.bisect_right(h.rate_edges, r) - 1
        if self.rng.random() < -math.expm1(-h.hazard_per_s[k] * dt):
            dt += _draw(self.excess[k], self.excess_grid[k], self.rng.random())
        self.starts[wi].append(now)
        return dt


def _model(p, batch, distinct, rate):
    fixed, per_request, per_expert, steal = p
    return (fixed + per_request * batch + per_expert * distinct) / np.maximum(1.0 - steal * rate, MIN_FREE)


def fit_shared_host(batch, sum_distinct, other_rate, interval, *, bins: int = 6, window_s: float = 1.0,
                    max_iter: int = 50) -> tuple[dict, SharedHost, dict]:
    """Fit the line and the shared host on one balancer's engine steps.

    Least squares of `line / (1 - steal * other_rate)` on the steps that do not stall, a stall
    being a step over STALL_FACTOR x the model; the split is iterated to a fixed point. Then,
    per bin of the other workers' step rate (`bins` bins of equal step counts): the stall
    hazard per second of modelled time and the stall excess quantiles. Returns (line,
    SharedHost, diagnostics); line = {fixed_s, per_request_s, per_expert_s, steps}."""
    from scipy.optimize import least_squares

    B, D, R, y = (np.asarray(v, float) for v in (batch, sum_distinct, other_rate, interval))
    if not (B.size == D.size == R.size == y.size) or B.size < 50:
        raise ValueError(f"fit_shared_host needs at least 50 steps of equal-length arrays (got {B.size})")
    keep = np.ones(y.size, bool)
    p = np.array([0.015, 0.003, 0.0008, 0.005])
    for it in range(max_iter):
        p = least_squares(lambda q: _model(q, B[keep], D[keep], R[keep]) - y[keep], p,
                          bounds=([0.0] * 4, [1.0, 1.0, 1.0, 1.0 / max(float(R.max()), 1.0)])).x
        m = _model(p, B, D, R)
        new = y <= STALL_FACTOR * m
        if (new == keep).all():
            break
        keep = new
    stall = ~keep
    edges = np.unique(np.quantile(R, np.linspace(0, 1, bins + 1))[:-1])
    edges[0] = 0.0
    k = np.searchsorted(edges, R, side="right") - 1
    grid = np.linspace(0, 1, 101)
    pooled = np.quantile((y - m)[stall], grid) if stall.any() else np.zeros(2)
    hazard, excess = [], []
    for b in range(edges.size):
        inb = k == b
        hazard.append(float(stall[inb].sum() / max(m[inb].sum(), 1e-12)))
        own = (y - m)[inb & stall]
        excess.append(tuple(np.quantile(own, grid)) if own.size >= MIN_STALLS_PER_BIN else tuple(pooled))
    host = SharedHost(float(p[3]), window_s, tuple(np.quantile(y[keep] / m[keep], np.linspace(0, 1, 201))),
                      tuple(map(float, edges)), tuple(hazard), tuple(excess))
    line = {"fixed_s": float(p[0]), "per_request_s": float(p[1]), "per_expert_s": float(p[2]), "steps": int(keep.sum())}
    diag = {"iterations": it + 1, "stall_share_of_steps": float(stall.mean()),
            "stall_share_of_time": float((y - m)[stall].sum() / y.sum())}
    return line, host, diag


def predict(line: dict, host: SharedHost | None, batch, sum_distinct, other_rate) -> np.ndarray:
    """The model's step time without its random parts (scatter, stalls): for step errors."""
    steal = host.steal_s if host is not None else 0.0
    p = (line["fixed_s"], line["per_request_s"], line["per_expert_s"], steal)
    return _model(p, np.asarray(batch, float), np.asarray(sum_distinct, float), np.asarray(other_rate, float))


def load_shared_host(path) -> SharedHost | None:
    """The `host` section of a calibration file (benchmarks/sim_vs_engine.py writes one for a
    CPU engine); None when the file has none."""
    import json
    from pathlib import Path

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the calibration ({exc})") from None
    if not isinstance(doc, dict) or "host" not in doc:
        return None
    if not isinstance(doc["host"], dict):
        raise ValueError(f"{path}: 'host' must be an object")
    try:
        return SharedHost.from_dict(doc["host"])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
